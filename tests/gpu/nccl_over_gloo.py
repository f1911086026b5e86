"""The NCCL data plane's code on one GPU: build the transfer group's ``"nccl"`` backend as a
``ProcessGroupGloo``.

NCCL refuses two ranks on one GPU, so a one-GPU machine cannot run the trainer and the server
over NCCL. gloo's broadcast and all-reduce take CUDA tensors (staged through host memory on a
side stream that waits for the current one), so with this patch everything above the backend
runs as it does over NCCL: CUDA bucket buffers, sends ordered on the stream, sums queued on
the GPU and compared once per update, staged receives, teardown. What it cannot show is NCCL
itself: its asynchronous completion (gloo's ``work.wait()`` blocks the host until the data has
landed, which only hides ordering bugs that NCCL would expose) and its error handling.

Use: :func:`install` in the trainer's process (or ``monkeypatch``), and
:data:`SERVER_LAUNCHER` as ``ServerProcess(..., launcher=SERVER_LAUNCHER)`` for the server.
"""

from __future__ import annotations

import os

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


def install() -> None:
    """Patch :mod:`rlserve.transfer.backends.group` in this process (idempotent)."""
    import rlserve.transfer.backends.group as group

    if not getattr(group.new_backend, "gloo_for_nccl", False):
        group.new_backend = gloo_for_nccl(group.new_backend)


#: Interpreter arguments that start ``rlserve serve`` with :func:`install` applied first.
SERVER_LAUNCHER = ("-c", f"import sys; sys.path.insert(0, {ROOT!r}); "
                         "from tests.gpu.nccl_over_gloo import install; install(); "
                         "from rlserve.cli import main; sys.exit(main(sys.argv[1:]))")
