"""A trainer process that dies at a chosen phase of a weight update (not a test module).

:func:`spawn_killed_trainer` starts a real trainer process (forked from a preloaded
``forkserver``, so no import cost per process) that initialises a gloo transfer group with the
server, starts one update of deterministic random weights and dies at ``phase``:

============================  =====================================================================
``before_header``             SIGKILL right before the first broadcast (the SDK's layout header;
                              TRL: the first tensor, after its ``/update_named_param/`` answered)
``first_bucket``              the first bucket / tensor is cut in half on the wire (see below)
``between_buckets``           SIGKILL once the server reports the first bucket / tensor loaded
                              (``/weight_info``), before the second one is broadcast (TRL: before
                              the second ``/update_named_param/``)
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

Real NCCL cannot be cut: there the process is SIGKILLed right after the message was queued on
the GPU (it may be on the wire). ipc has no group: the phases are its HTTP data calls
(:func:`_ipc_hooks`).

The parent learns the phase was reached from a pipe message sent right before the process dies.
"""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing as mp
import os
import signal
import time

import torch

PHASES = ("before_header", "first_bucket", "between_buckets", "last_bucket", "checksums", "finish")

_PAGE = mmap.PAGESIZE
_CTX = None


def _context():
    """A ``forkserver`` context whose server imported torch and the transfer SDK once."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "rlserve.transfer", "rlserve.transfer.sdk.trl", "tests.kill_trainer"])
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


def random_weights(meta: list[tuple[str, str, list[int]]], seed: int,
                   device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """Deterministic tensors for ``meta`` (``(name, dtype name, shape)``): 0.05 x N(0, 1)."""
    from rlserve.transfer.wire.protocol import dtype_from_name

    g = torch.Generator().manual_seed(seed)
    return [(n, (0.05 * torch.randn(list(s), generator=g)).to(dtype_from_name(d)).to(device)) for n, d, s in meta]


def trainer_init_info(backend: str, packed: bool, bucket_bytes: int, timeout_s: float, device: str = "cpu",
                      port: int | None = None):
    """The SDK's ``*TrainerInitInfo`` for ``backend`` ("gloo", "nccl" on ``device``, "ipc")."""
    from rlserve.transfer import GlooTrainerInitInfo, IPCTrainerInitInfo, NCCLTrainerInitInfo

    if backend == "ipc":
        return IPCTrainerInitInfo(timeout_s=timeout_s, packed=packed, packed_buffer_size_bytes=bucket_bytes)
    kw = dict(master_port=port or 0, world_size=2, timeout_s=timeout_s, packed=packed,
              packed_buffer_size_bytes=bucket_bytes)
    if backend == "nccl":
        return NCCLTrainerInitInfo(device=device, **kw)
    return GlooTrainerInitInfo(**kw)


def _die(conn, what: str) -> None:
    conn.send(what)
    conn.close()
    os.kill(os.getpid(), signal.SIGKILL)


def _die_once_loaded(conn, spec: dict) -> None:
    """``between_buckets``: SIGKILL once the server reports the first bucket / tensor loaded (or
    staged) on every worker (``/weight_info``'s ``session.buckets_done``). A sent bucket is not
    a loaded one: on a loaded machine the server could notice the death (its liveness watch)
    and abort the receive before it had read the bucket already in its socket, and nothing
    was written (an honest "unchanged" where the cell means "a bucket landed, then the
    trainer died"; the sleep matrix's level-2 failure of 2026-12-06). The server loads a
    received bucket without waiting for the next one, so this wait ends; after 60 s the
    process dies reporting that it never did (the parent's AssertionError)."""
    import httpx

    t0, deadline = time.time(), time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            info = httpx.get(spec["url"] + "/weight_info", timeout=10).json()
        except httpx.HTTPError:
            info = {}
        last = info.get("last_update") or {}
        # (or the update failed meanwhile -- a receive timeout -- after it had loaded one)
        if (info.get("session") or {}).get("buckets_done", 0) >= 1 or \
                (last.get("time", 0) >= t0 and last.get("buckets_done", 0) >= 1):
            _die(conn, spec["phase"])
        time.sleep(0.01)
    _die(conn, "error: the server never reported the first bucket loaded")


def _group_hooks(conn, spec: dict, at: int | None) -> None:
    """gloo / NCCL: act at the trainer's broadcast number ``at`` (see the module docstring).
    ``spec["cut"]``: cut the message in half (gloo's TCP transport, also under the one-GPU NCCL
    emulation); without it (real NCCL) the process is SIGKILLed right after issuing it."""
    from rlserve.transfer.backends.group import TransferGroup

    phase = spec["phase"]
    calls: list = []
    keep: list = []
    real = TransferGroup.broadcast

    def broadcast(self, tensor, src):
        i = len(calls)
        if src == self.rank and i == at:
            if phase in ("before_header", "between_buckets"):
                for w in calls:
                    self.wait(w, what="an earlier broadcast")  # handed to the transport: it arrives
                if phase == "between_buckets":
                    _die_once_loaded(conn, spec)
                _die(conn, phase)
            if not spec["cut"]:
                real(self, tensor, src)  # queued on the GPU: NCCL may be sending it when we die
                _die(conn, phase)
            cut, m = half_readable(tensor)
            keep.append(m)
            conn.send(phase)
            w = real(self, cut, src)  # gloo's I/O thread aborts the process at the cut
            try:
                w.wait()
            finally:
                os.kill(os.getpid(), signal.SIGKILL)
        w = real(self, tensor, src)
        if src == self.rank:
            calls.append(w)
        return w

    TransferGroup.broadcast = broadcast


def _ipc_hooks(conn, spec: dict, at: int | None) -> None:
    """ipc: act at the trainer's data call number ``at`` (``update_weights`` per packed bucket,
    or the one ``sync_weights``): before it (``before_header``, ``between_buckets``), while it
    runs (``first_bucket`` / ``last_bucket``: sent, then SIGKILL without waiting for the
    answer: the server may be mapping, copying or done), or -- ``checksums`` -- with the last
    call's checksum off by one (packed: the announced bucket sum; per tensor: the trainer's
    device sums), the trainer dying after the refusal."""
    import threading

    from rlserve.transfer.sdk.trainer import HTTPWeightSyncClient

    phase = spec["phase"]
    calls: list = []

    def wrap(real):
        def call(self, info, *a, **k):
            i = len(calls)
            calls.append(i)
            if i == at:
                if phase in ("before_header", "between_buckets"):
                    _die(conn, phase)
                if phase in ("first_bucket", "last_bucket"):
                    done = threading.Event()

                    def send():
                        try:
                            real(self, info, *a, **k)
                        except BaseException:  # noqa: BLE001 - we are about to die anyway
                            pass
                        finally:
                            done.set()

                    threading.Thread(target=send, daemon=True).start()
                    probe = HTTPWeightSyncClient(spec["url"], timeout_s=10)
                    deadline = time.monotonic() + 30
                    while not done.is_set() and time.monotonic() < deadline:  # the server took the call
                        if probe.weight_info().get("state") in ("update", "finish"):
                            break
                    _die(conn, phase)
                if phase == "checksums" and info.get("checksums"):
                    info = {**info, "checksums": [*info["checksums"][:-1], info["checksums"][-1] + 1]}
                if phase == "checksums":
                    try:
                        return real(self, info, *a, **k)
                    finally:
                        _die(conn, phase)
            return real(self, info, *a, **k)
        return call

    for name in ("update_weights", "sync_weights"):
        setattr(HTTPWeightSyncClient, name, wrap(getattr(HTTPWeightSyncClient, name)))
    if phase == "checksums":  # per-tensor handles: the sums the server reads from the trainer's GPU
        from rlserve.transfer.multi_tensor import MultiTensorSum

        real_run = MultiTensorSum.run

        def run(self, *a, **k):
            out = real_run(self, *a, **k)
            res = k.get("out", out)
            if res is not None:
                res[-1:] += 1
            return out
        MultiTensorSum.run = run


def _child(conn, spec: dict) -> None:
    """The trainer process body (see the module docstring and :func:`spawn_killed_trainer`).
    Reports ``"error: ..."`` through ``conn`` when the phase was never reached."""
    from rlserve.transfer.sdk.trainer import HTTPWeightSyncClient

    torch.set_num_threads(1)
    if spec.get("setup"):
        exec(spec["setup"], {})  # e.g. tests.gpu.nccl_over_gloo.install()
    phase, backend, sdk = spec["phase"], spec["backend"], spec["protocol"] == "sdk"
    named = random_weights(spec["meta"], spec["seed"], spec["device"])
    sizes = [t.numel() * t.element_size() for _n, t in named]
    if spec["packed"] and sdk:
        from rlserve.transfer.wire.packing import plan_buckets

        plan = plan_buckets([n for n, _t in named], [t.dtype for _n, t in named], [t.shape for _n, t in named],
                            spec["bucket_bytes"])
        n_data = sum(1 for b in plan if b.nbytes)
    elif backend == "ipc":
        n_data = 1  # per-tensor handles: the one sync_weights call
    else:
        n_data = sum(1 for s in sizes if s)
    if backend == "ipc":
        at = {"before_header": 0, "first_bucket": 0, "between_buckets": 1, "last_bucket": n_data - 1,
              "checksums": n_data - 1}.get(phase)
        _ipc_hooks(conn, spec, at)
    elif not sdk and phase == "between_buckets":
        # TRL: between two tensors is before the second /update_named_param/ (the first tensor's
        # broadcast completed: the client waits for each one)
        real_named, named_calls = HTTPWeightSyncClient.update_named_param, []

        def update_named_param(self, *a, **k):
            named_calls.append(1)
            if len(named_calls) == 2:
                _die_once_loaded(conn, spec)
            return real_named(self, *a, **k)
        HTTPWeightSyncClient.update_named_param = update_named_param
    else:
        first = 1 if sdk else 0  # the SDK's broadcast 0 is the layout header
        at = {"before_header": 0, "first_bucket": first, "between_buckets": first + 1,
              "last_bucket": first + n_data - 1, "checksums": first + n_data}.get(phase)
        _group_hooks(conn, spec, at)
    if phase == "finish":
        attr = "finish_weight_update" if sdk else "reset_prefix_cache"
        setattr(HTTPWeightSyncClient, attr, lambda self, *a, **k: _die(conn, phase))
    try:
        if sdk:
            from rlserve.transfer import TensorListSource, WeightTransferTrainerFactory

            eng = WeightTransferTrainerFactory.trainer_init(
                init_info=trainer_init_info(backend, spec["packed"], spec["bucket_bytes"], spec["timeout_s"],
                                            spec["device"], spec["port"]),
                client=HTTPWeightSyncClient(spec["url"], timeout_s=60), source=TensorListSource(named))
            eng.send_weights()
        else:
            from rlserve.transfer.sdk.trl import TRLWeightSyncClient

            c = TRLWeightSyncClient(spec["url"], group_port=spec["port"], backend=backend,
                                    device=None if backend == "gloo" else spec["device"], timeout_s=spec["timeout_s"])
            c.init_communicator()
            for n, t in named:
                c.update_named_param(n, t)
            c.reset_prefix_cache()
        conn.send(f"error: the update ended before phase {phase!r}")
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(f"error: {type(e).__name__}: {e}")
    conn.close()


def spawn_killed_trainer(url: str, port: int, timeout_s: float, protocol: str, phase: str, meta: list,
                         seed: int, packed: bool = True, bucket_bytes: int = 64 << 10, wait_s: float = 120.0,
                         backend: str = "gloo", device: str = "cpu", setup: str = "",
                         times: dict | None = None) -> str:
    """Run a trainer process that dies at ``phase`` (module docstring) and wait for it to end.

    Args:
        url: the server. port: the group's TCPStore port (the trainer hosts it; TRL: the server's
            worker 0 does); 0: the SDK's pick, bound before the server is told (TRL: a free port,
            another if the server finds it taken), as the tests pass it.
        protocol: ``"sdk"`` (start / update / finish, :class:`WeightTransferTrainerFactory`) or
            ``"trl"`` (:class:`~rlserve.transfer.sdk.trl.TRLWeightSyncClient`).
        meta: ``(name, dtype name, shape)`` of every tensor, in order (the server's checkpoint).
        seed: the weights' seed (:func:`random_weights`).
        packed / bucket_bytes: the SDK's ``init_info`` (TRL sends per tensor).
        backend / device: "gloo" (CPU), "nccl" or "ipc" with the trainer's tensors on ``device``.
        setup: Python run first in the trainer process (e.g. the one-GPU NCCL emulation's
            ``install()``, :mod:`tests.gpu.nccl_over_gloo`); a message is cut in half (not
            just SIGKILLed after it was issued) on gloo and whenever ``setup`` is given.
        times: when given, ``times["killed"]`` is set to the ``time.time()`` at which the
            trainer's last message (sent right before its SIGKILL) arrived.
    Returns:
        ``phase`` once the process died there.
    Raises:
        AssertionError: the process ended without reaching ``phase`` (its message), or did not
            end within ``wait_s``.
    """
    ctx = _context()
    parent, child = ctx.Pipe(duplex=False)
    spec = dict(url=url, port=port, timeout_s=timeout_s, protocol=protocol, phase=phase, meta=meta, seed=seed,
                packed=packed, bucket_bytes=bucket_bytes, backend=backend, device=device, setup=setup,
                cut=backend == "gloo" or bool(setup))
    p = ctx.Process(target=_child, args=(child, spec), daemon=True)
    p.start()
    child.close()
    msg = None
    try:
        if parent.poll(wait_s):
            msg = parent.recv()
            if times is not None:
                times["killed"] = time.time()
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
