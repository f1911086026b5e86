"""Keeping the garbage collector's full collections short in long-running processes (the API
server, the engine-core process), as vLLM does (``freeze_gc_heap`` in its API server and engine
core).

After start-up a process holds torch's, transformers' and the app's objects: about a million
container objects that never die. CPython's generation-2 collection traverses all of them, and
under streaming load (every step allocates outputs, chunks and lists that live a few steps) one
ran every second or so: 250-940 ms each in the API process, 9.3 s of 18 s of a 256-client
streaming run (``benchmarks/api_stream_load.py`` on the 2-core CPU machine), each a gap in every
stream and in every step of the engine-core process. :func:`freeze_startup_heap` moves what is
alive after start-up into the permanent generation (``gc.freeze``), which collections skip; what
the serving loop allocates is still collected as before.

What the serving loop keeps alive is still traversed by every full collection: at 256 streams the
API process holds 50-100k container objects (each stream's request, generators, tasks, protocol
and output state), and with CPython's default thresholds ``(700, 10, 10)`` a full collection ran
every ~0.7 s, 90-130 ms each on the loaded CPU machine (the issue-37 harness with a ``gc.callbacks``
probe), a gap in every stream each time: at a chunk every 10-20 ms per stream that is several
percent of all inter-token gaps, i.e. the p99. After freezing, the third threshold is raised to
:data:`FULL_COLLECTION_EVERY` (full collections that much rarer, each no longer: young objects are
still collected by generations 0 and 1 as before; only reference cycles that live long enough to
reach generation 2 wait longer to be freed).

The first threshold (net container allocations between two generation-0 collections) is raised to
:data:`YOUNG_COLLECTION_EVERY` too: most of what a step allocates (outputs, chunk dicts, token-id
lists) dies by reference count within the step, so at 700 a collection traversed objects that were
about to be freed anyway, ~500 times a second at 256 streams (0.23-0.33 ms each, issue 37's APIPROF
profile, BENCHMARKS.md H29). ``benchmarks/api_output_step.py`` (256 streams, 16 steps, valgrind
instruction counts of its timed loop, 2-core Xeon, session 22): 287.8 / 287.8 M instructions at
(700, 10, 100), 248.1 / 247.9 M at 10,000 and 247.9 M at 50,000: **0.86x**, flat beyond 10,000. A
generation-0 collection then finds at most 10,000 young containers (a few ms, once every several
steps)."""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time

logger = logging.getLogger(__name__)

#: generation-1 collections between two full collections once the start-up heap is frozen
#: (CPython's default: 10); see the module docstring
FULL_COLLECTION_EVERY = 100
#: net container allocations between two generation-0 collections once the start-up heap is frozen
#: (CPython's default: 700); see the module docstring
YOUNG_COLLECTION_EVERY = 10_000


def freeze_startup_heap(what: str) -> int:
    """Collect once, then ``gc.freeze()`` everything alive (``what``: the process, for the log).
    Call once start-up is done (model, tokenizer, app built), just before serving. Also raises
    the young and full-collection thresholds to at least :data:`YOUNG_COLLECTION_EVERY` and
    :data:`FULL_COLLECTION_EVERY`. Returns the number of objects frozen (``gc.get_freeze_count()``)."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    g0, g1, g2 = gc.get_threshold()
    if g0 > 0:  # 0: collection disabled by the user (gc.set_threshold(0)); leave it so
        gc.set_threshold(max(g0, YOUNG_COLLECTION_EVERY), g1, max(g2, FULL_COLLECTION_EVERY))
    n = gc.get_freeze_count()
    logger.debug("%s: %d start-up objects frozen out of garbage collection (%.0f ms)", what, n,
                 1e3 * (time.perf_counter() - t0))
    return n


_OFF_LOCK = threading.Lock()
_off = [0, False]  # stretches in flight (any thread), whether collections were on before the first


@contextlib.contextmanager
def no_collections_while_importing():
    """The garbage collector off for a stretch of start-up imports, back to what it was once the last
    stretch in flight ends (stretches may overlap on several threads: the API process imports its app,
    the generation defaults and the tokenizer beside each other).

    Importing torch, transformers and the engine (or the API's app and tokenizer) allocates several
    hundred thousand objects that all live, so the ~670 collections it triggers (5 of them full) find
    next to nothing to free: with them off, the prestarted engine core's imports took 2.76-2.84 s of
    CPU instead of 3.12-3.23 s, the API process's 3.31-3.37 s instead of 3.73-3.83 s (4 and 3 pairs,
    interleaved, the 2-core CPU machine, 2026-12-07; BENCHMARKS.md, start-up). Only imports: the engine's
    start after them (model build, KV sizing) runs with collections on, so no tensor held by a reference
    cycle outlives its use there."""
    with _OFF_LOCK:
        if _off[0] == 0:
            _off[1] = gc.isenabled()
            gc.disable()
        _off[0] += 1
    try:
        yield
    finally:
        with _OFF_LOCK:
            _off[0] -= 1
            if _off[0] == 0 and _off[1]:
                gc.enable()
