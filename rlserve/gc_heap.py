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
the serving loop allocates is still collected as before."""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_startup_heap(what: str) -> int:
    """Collect once, then ``gc.freeze()`` everything alive (``what``: the process, for the log).
    Call once start-up is done (model, tokenizer, app built), just before serving. Returns the
    number of objects frozen (``gc.get_freeze_count()``)."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    logger.debug("%s: %d start-up objects frozen out of garbage collection (%.0f ms)", what, n,
                 1e3 * (time.perf_counter() - t0))
    return n
