"""The NCCL data plane's code on one GPU: build the transfer group's ``"nccl"`` backend as a
``ProcessGroupGloo``.

NCCL refuses two ranks on one GPU, so a one-GPU machine cannot run the trainer and the server
over NCCL. gloo's broadcast and all-reduce take CUDA tensors (staged through host memory on a
side stream that waits for the current one), so with this patch everything above the backend
runs as it does over NCCL: CUDA bucket buffers, sends ordered on the stream, sums queued on
the GPU and compared once per update, staged receives, teardown. What it cannot show is NCCL
itself: its asynchronous completion (gloo's ``work.wait()`` blocks the host until the data has
landed, which only hides ordering bugs that NCCL would expose) and its error handling.

A dead trainer: NCCL's ``TransferGroup.order`` only orders the stream and returns, and the host
waits at the end of the receive with the deadline and abort checks (``wait_stream``), so the
liveness watch's abort ends the receive; gloo's ``work.wait()`` would block the host instead,
where no abort reaches it, until gloo itself notices the dead peer (it does not always: issue 25)
or its timeout (``timeout_s + 60``) passes. :func:`install` therefore makes ``order`` wait the
way ``wait`` does (polled, with the deadline and the abort checks): the receive ends on the
abort, as on NCCL. NCCL's own end-of-receive path (``order`` returning at once, then
``wait_stream``) is not exercised here.

Use: :func:`install` in the trainer's process (or ``monkeypatch``), and
:data:`SERVER_LAUNCHER` as ``ServerProcess(..., launcher=SERVER_LAUNCHER)`` for the server.

The server's transfer group is built in its engine-core process (``python -m
rlserve.engine.core.core_proc``, one per replica, started by the API process since issue 17), not in
the API process the launcher starts: :func:`install` therefore also exports
``RLSERVE_ENGINE_CORE_INIT`` (:data:`CORE_INIT`) and puts this checkout on ``PYTHONPATH``, so
every process started from a patched one patches itself before it builds its engine. Without
that the trainer built gloo while the server's core built real NCCL on the same store: neither
rendezvous could complete, and the trainer's sync failed when gloo's connect gave up after
its timeout (``timeout_s + 60`` = 90 s: "TCPStore waitForInput ... timed out after 90000ms", both
gloo-cuda kill-matrix configurations on an H200, 2026-12-02).
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gloo_for_nccl(real):
    """A ``new_backend`` that builds gloo where ``real`` would build NCCL."""

    def new_backend(backend, store, rank, world_size, timeout, nccl_async_error_handling=None, **kw):
        # keyword arguments the real one takes (gloo_address=...) pass through: without them the
        # transfer group's call raised TypeError (seen on an H200, 2026-12-02: both gloo-cuda
        # kill-matrix cells failed before reporting)
        return real("gloo" if backend == "nccl" else backend, store, rank, world_size, timeout, **kw)

    new_backend.gloo_for_nccl = True
    return new_backend


#: ``RLSERVE_ENGINE_CORE_INIT`` value that runs :func:`install` in an engine-core process.
CORE_INIT = "tests.gpu.nccl_over_gloo:install"


def _polled_order(self, work, what: str = "broadcast") -> None:
    """``TransferGroup.order`` under the emulation: :meth:`TransferGroup.wait` (polls the work
    with the deadline and the abort checks, then ``work.wait()`` for its error and the CUDA
    stream ordering). Raises what ``wait`` raises."""
    self.wait(work, what=what)


def install() -> None:
    """Patch :mod:`rlserve.transfer.backends.group` in this process (``new_backend`` builds gloo
    for "nccl"; ``TransferGroup.order`` is :func:`_polled_order`) and in every process it
    starts afterwards (idempotent): sets ``RLSERVE_ENGINE_CORE_INIT`` to :data:`CORE_INIT` and
    prepends this checkout to ``PYTHONPATH`` in ``os.environ``.

    Raises:
        RuntimeError: ``RLSERVE_ENGINE_CORE_INIT`` already names another hook (one would be lost).
    """
    import rlserve.transfer.backends.group as group

    prev = os.environ.get("RLSERVE_ENGINE_CORE_INIT")
    if prev not in (None, "", CORE_INIT):
        raise RuntimeError(f"RLSERVE_ENGINE_CORE_INIT is {prev!r}: the NCCL-over-gloo emulation needs {CORE_INIT!r}")
    group.TransferGroup.order = _polled_order
    if not getattr(group.new_backend, "gloo_for_nccl", False):
        group.new_backend = gloo_for_nccl(group.new_backend)
        print(f"[nccl-over-gloo] installed in process {os.getpid()}", file=sys.stderr, flush=True)
    os.environ["RLSERVE_ENGINE_CORE_INIT"] = CORE_INIT
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if ROOT not in path:
        os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *path])


def installed(_core=None) -> bool:
    """Whether :func:`install` patched this process (an engine call: ``AsyncEngine.call_engines``
    passes the core, ignored)."""
    import rlserve.transfer.backends.group as group

    return bool(getattr(group.new_backend, "gloo_for_nccl", False)) and group.TransferGroup.order is _polled_order


#: Interpreter arguments that start ``rlserve serve`` with :func:`install` applied first (in the
#: API process, and through ``RLSERVE_ENGINE_CORE_INIT`` in its engine-core processes).
SERVER_LAUNCHER = ("-c", f"import sys; sys.path.insert(0, {ROOT!r}); "
                         "from tests.gpu.nccl_over_gloo import install; install(); "
                         "from rlserve.cli import main; sys.exit(main(sys.argv[1:]))")
