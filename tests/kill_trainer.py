"""A trainer process that dies at a chosen phase of a weight update (not a test module).

:func:`spawn_killed_trainer` starts a real trainer process (forked from a preloaded
``forkserver``, so no import cost per process) that initialises a gloo transfer group with the
server, starts one update of deterministic random weights and dies at ``phase``:

============================  =====================================================================
``before_header``             SIGKILL right before the first broadcast (the SDK's layout header;
                              TRL: the first tensor, after its ``/update_named_param/`` answered)
``first_bucket``              the first bucket / tensor is cut in half on the wire (see below)
``between_buckets``           SIGKILL after the first bucket / tensor was handed to the kernel,
                              before the second one is broadcast
``last_bucket``               the last bucket / tensor is cut in half on the wire
``checksums``                 the bucket checksums sent after the data (packed gloo) are cut in half
``finish``                    SIGKILL once every byte was received (``update_weights`` answered),
                              before ``/finish_weight_update`` (TRL: ``/reset_prefix_cache/``)
============================  =====================================================================

Cutting a message in half, deterministically: the broadcast is given a buffer of the same size
whose first half holds the real bytes and whose second half is an ``mprotect(PROT_NONE)`` page
range. gloo's ``writev`` copies the readable part into the socket and then fails with
``EFAULT``; gloo's I/O thread throws and the process aborts. The server has then received the
first half of the message (minus gloo's preamble) and nothing more, however fast or slow the
machine is: a bucket partly received, as when a trainer is SIGKILLed while a large bucket is on
the wire.

The parent learns the phase was reached from a pipe message sent right before the process dies.
"""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing as mp
import os
import signal

import torch

PHASES = ("before_header", "first_bucket", "between_buckets", "last_bucket", "checksums", "finish")

_PAGE = mmap.PAGESIZE
_CTX = None


def _context():
    """A ``forkserver`` context whose server imported torch and the transfer SDK once."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "rlserve.transfer", "rlserve.transfer.trl", "tests.kill_trainer"])
    return _CTX


def half_readable(src: torch.Tensor) -> tuple[torch.Tensor, mmap.mmap]:
    """A ``uint8`` tensor of ``src``'s size whose first ``nbytes // 2`` bytes are ``src``'s and
    whose rest lies on ``PROT_NONE`` pages: a send of it stops with ``EFAULT`` half way. Returns
    the tensor and the mapping that owns it (keep both alive)."""
    data = src.contiguous().view(torch.uint8).reshape(-1).cpu()
    n = data.numel()
    half = n // 2
    lead = (-half) % _PAGE  # the readable part ends on a page boundary
    size = lead + half + ((n - half + _PAGE - 1) // _PAGE) * _PAGE
    size = max(size, 2 * _PAGE)
    m = mmap.mmap(-1, size, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    whole = torch.frombuffer(m, dtype=torch.uint8)
    t = whole[lead: lead + n]
    t[:half].copy_(data[:half])
    libc = ctypes.CDLL(None, use_errno=True)
    addr = whole.data_ptr() + lead + half
    if libc.mprotect(ctypes.c_void_p(addr), ctypes.c_size_t(size - lead - half), 0) != 0:
        raise OSError(ctypes.get_errno(), "mprotect failed")
    return t, m


def random_weights(meta: list[tuple[str, str, list[int]]], seed: int) -> list[tuple[str, torch.Tensor]]:
    """Deterministic tensors for ``meta`` (``(name, dtype name, shape)``): 0.05 x N(0, 1)."""
    from rlserve.transfer.protocol import dtype_from_name

    g = torch.Generator().manual_seed(seed)
    return [(n, (0.05 * torch.randn(list(s), generator=g)).to(dtype_from_name(d))) for n, d, s in meta]


def _die(conn, what: str) -> None:
    conn.send(what)
    conn.close()
    os.kill(os.getpid(), signal.SIGKILL)


def _child(conn, url: str, port: int, timeout_s: float, protocol: str, phase: str, meta: list, seed: int,
           packed: bool, bucket_bytes: int) -> None:
    """The trainer process body (see the module docstring). Reports ``"error: ..."`` through
    ``conn`` when the phase was never reached (the update ended first)."""
    from rlserve.transfer.group import TransferGroup
    from rlserve.transfer.trainer import HTTPWeightSyncClient

    torch.set_num_threads(1)
    named = random_weights(meta, seed)
    sdk = protocol == "sdk"
    sizes = [t.numel() * t.element_size() for _n, t in named]
    if packed and sdk:
        from rlserve.transfer.packing import plan_buckets

        plan = plan_buckets([n for n, _t in named], [t.dtype for _n, t in named], [t.shape for _n, t in named],
                            bucket_bytes)
        n_data = sum(1 for b in plan if b.nbytes)
    else:
        n_data = sum(1 for s in sizes if s)
    first = 1 if sdk else 0  # the SDK's broadcast 0 is the layout header
    at = {"before_header": 0, "first_bucket": first, "between_buckets": first + 1,
          "last_bucket": first + n_data - 1, "checksums": first + n_data}.get(phase)
    calls: list = []
    keep: list = []
    real_broadcast = TransferGroup.broadcast

    def broadcast(self, tensor, src):
        i = len(calls)
        if src == self.rank and i == at:
            if phase in ("before_header",) or (phase == "between_buckets"):
                for w in calls:
                    self.wait(w, what="an earlier broadcast")  # handed to the kernel: it arrives
                _die(conn, phase)
            cut, m = half_readable(tensor)
            keep.append(m)
            conn.send(phase)
            w = real_broadcast(self, cut, src)  # gloo's I/O thread aborts the process at the cut
            try:
                w.wait()
            finally:
                os.kill(os.getpid(), signal.SIGKILL)
        w = real_broadcast(self, tensor, src)
        if src == self.rank:
            calls.append(w)
        return w

    TransferGroup.broadcast = broadcast
    if phase == "finish":
        attr = "finish_weight_update" if sdk else "reset_prefix_cache"
        setattr(HTTPWeightSyncClient, attr, lambda self, *a, **k: _die(conn, phase))
    try:
        if sdk:
            from rlserve.transfer import GlooTrainerInitInfo, TensorListSource, WeightTransferTrainerFactory

            eng = WeightTransferTrainerFactory.trainer_init(
                init_info=GlooTrainerInitInfo(master_port=port, world_size=2, timeout_s=timeout_s, packed=packed,
                                              packed_buffer_size_bytes=bucket_bytes),
                client=HTTPWeightSyncClient(url, timeout_s=60), source=TensorListSource(named))
            eng.send_weights()
        else:
            from rlserve.transfer.trl import TRLWeightSyncClient

            c = TRLWeightSyncClient(url, group_port=port, timeout_s=timeout_s)
            c.init_communicator()
            for n, t in named:
                c.update_named_param(n, t)
            c.reset_prefix_cache()
        conn.send(f"error: the update ended before phase {phase!r}")
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(f"error: {type(e).__name__}: {e}")
    conn.close()


def spawn_killed_trainer(url: str, port: int, timeout_s: float, protocol: str, phase: str, meta: list,
                         seed: int, packed: bool = True, bucket_bytes: int = 64 << 10, wait_s: float = 120.0) -> str:
    """Run a trainer process that dies at ``phase`` (module docstring) and wait for it to end.

    Args:
        url: the server. port: a free port for the group's TCPStore (the trainer hosts it;
            TRL: the server's worker 0 does).
        protocol: ``"sdk"`` (start / update / finish, :class:`WeightTransferTrainerFactory`) or
            ``"trl"`` (:class:`~rlserve.transfer.trl.TRLWeightSyncClient`).
        meta: ``(name, dtype name, shape)`` of every tensor, in order (the server's checkpoint).
        seed: the weights' seed (:func:`random_weights`).
        packed / bucket_bytes: the SDK's ``init_info`` (TRL sends per tensor).
    Returns:
        ``phase`` once the process died there.
    Raises:
        AssertionError: the process ended without reaching ``phase`` (its message), or did not
            end within ``wait_s``.
    """
    ctx = _context()
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(child, url, port, timeout_s, protocol, phase, meta, seed, packed,
                                         bucket_bytes), daemon=True)
    p.start()
    child.close()
    msg = None
    try:
        if parent.poll(wait_s):
            msg = parent.recv()
    except EOFError:
        msg = None
    p.join(wait_s)
    if p.is_alive():
        p.kill()
        p.join(10)
        raise AssertionError(f"the trainer did not die at {phase!r} within {wait_s} s (said {msg!r})")
    if msg != phase:
        raise AssertionError(f"the trainer never reached {phase!r}: {msg!r} (exit code {p.exitcode})")
    return msg
