"""Test helpers for the weight-sync layer: an in-process server (AsyncEngine + FastAPI app on
uvicorn in a thread) and greedy-generation helpers. Not a test module."""

from __future__ import annotations

import contextlib
import os
import socket
import textwrap
import threading
import time

import httpx
import torch

from rlserve.server.launch import (  # noqa: F401 (free_port, free_ports, reserved_port: re-exported for the tests)
    StartClock, bound_socket, free_port, free_ports, reserved_port, tree_cpu_seconds)


@contextlib.contextmanager
def listening_port(answer):
    """A loopback port (yielded) whose listener thread calls ``answer(conn)`` on each connection it takes (a
    fake trainer's store address: one that closes at once, never answers, answers other bytes). Each taken
    connection is closed on exit (``answer`` may have closed it already)."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(16)
    taken = []

    def serve():
        while True:
            try:
                conn = ls.accept()[0]
            except OSError:  # closed: the test is over
                return
            taken.append(conn)
            answer(conn)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield ls.getsockname()[1]
    finally:
        ls.close()
        for conn in taken:
            conn.close()


class InProcessServer:
    """``AsyncEngine`` + the real app (``build_app``) served by uvicorn on a thread.

    Args:
        model: tiny model directory.
        transfer_config: ``--weight-transfer-config``.
        staging: ``--weight-staging``.
        check_finite: ``--weight-check-finite``.
        engine_mode: ``AsyncEngine``'s (default: its own, the engine-core process).
        warm_templates: start the chat-template / constraint workers with the server, as
            ``rlserve serve`` does, and return once they are warm (:meth:`wait_templates_warm`);
            else (the suite's default, ``RLSERVE_TEMPLATE_WORKERS_AT_START=0`` in
            ``tests/conftest.py``) they start at their first use.
        engine_kwargs: extra ``EngineConfig`` fields.
    """

    def __init__(self, model: str, transfer_config: dict | None = None, staging: str = "none",
                 admin_key: str | None = None, engine_mode: str | None = None, check_finite: bool = True,
                 warm_templates: bool = False, **engine_kwargs):
        from rlserve.config import EngineConfig
        from rlserve.engine.front.async_engine import AsyncEngine
        from rlserve.server.app import build_app
        from rlserve.server.state import ServerSettings

        kw = dict(device="cpu", dtype="float32", load_format="dummy", max_model_len=128, max_num_seqs=16,
                  kv_cache_bytes=16 << 20, seed=0)
        kw.update(engine_kwargs)
        self.config = EngineConfig(model=model, **kw)
        self.aengine = AsyncEngine(self.config, engine_mode=engine_mode)
        # bound here, listened on by uvicorn: the port is never free between its choice and the
        # listen (a free_port() could be taken meanwhile, e.g. by a gloo pair's bind)
        self._sock = bound_socket()
        self.port = self._sock.getsockname()[1]
        settings = ServerSettings(model=model, served_model_names=[model], host="127.0.0.1", port=self.port,
                                  admin_key=admin_key, weight_transfer_config=transfer_config or {"backend": "gloo"},
                                  weight_staging=staging, weight_check_finite=check_finite)
        self.app = build_app(self.aengine, settings)
        self.manager = self.app.state.rlserve.weight_manager
        self.url = f"http://127.0.0.1:{self.port}"
        import uvicorn

        self._server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        key, before = "RLSERVE_TEMPLATE_WORKERS_AT_START", os.environ.get("RLSERVE_TEMPLATE_WORKERS_AT_START")
        if warm_templates:
            os.environ[key] = "1"  # read by the app's start-up, which has run once /health answers
        try:
            self._thread.start()
            self._wait_started()
        except BaseException:  # nothing left running: the engine-core process, the app's workers
            self.close()
            raise
        finally:
            if warm_templates and before is None:
                del os.environ[key]
            elif warm_templates:
                os.environ[key] = before
        if warm_templates:
            pool = self.app.state.rlserve._templates
            #: (idle workers, warming workers) when /health first answered 200
            self.templates_at_health = (pool._idle.qsize(), pool.warming) if pool else None
            self.wait_templates_warm()

    def _wait_started(self, timeout_s: float = 120.0) -> None:
        """Wait until ``/health`` answers 200: :func:`rlserve.server.launch.wait_healthy`'s rule
        (:class:`~rlserve.server.launch.StartClock`: past ``timeout_s`` it waits on while this
        process's tree is starved of CPU, counting only the CPU used since the wait began). A
        dead server fails at once: its uvicorn thread ended (a port it could not bind), or its
        engine died.

        Raises:
            RuntimeError: dead, or not healthy when the clock says the start failed."""
        base = tree_cpu_seconds(os.getpid()) or 0.0

        def cpu_since(pid: int) -> float | None:
            now = tree_cpu_seconds(pid)
            return None if now is None else now - base

        clock = StartClock(os.getpid(), timeout_s, cpu=cpu_since)
        while True:
            if not self._thread.is_alive():
                raise RuntimeError("in-process server: its uvicorn thread ended before /health answered (its log "
                                   "is above: a socket it could not listen on?)")
            if not self.aengine.is_alive():
                raise RuntimeError(f"in-process server: its engine is not running: {self.aengine.dead_reason()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            why = clock.expired()
            if why is not None:
                raise RuntimeError(f"in-process server was not healthy {why}")
            time.sleep(0.05)

    def wait_templates_warm(self, timeout_s: float = 300.0) -> None:
        """Wait until the server's chat-template / constraint workers are all warm and idle
        (:mod:`rlserve.server.template_pool`): a test's first constrained request then does not
        wait for a worker's start (importing torch + xgrammar: seconds of CPU, far more on a busy
        machine). ``timeout_s`` only catches a hang. Raises AssertionError after it."""
        pool = self.app.state.rlserve._templates
        assert pool, "the server made no template workers"
        wait_pool_warm(pool, timeout_s)

    def close(self):
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()  # (uvicorn closes it on a normal exit; not if its start failed)
        self.app.state.rlserve.close()
        self.aengine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def wait_pool_warm(pool, timeout_s: float = 300.0) -> None:
    """Wait until every worker of ``pool`` (a :class:`~rlserve.server.template_pool.TemplateWorkers`)
    is warm and idle; AssertionError after ``timeout_s`` (a hang bound)."""
    deadline = time.monotonic() + timeout_s
    while pool._idle.qsize() < pool.size or pool.warming:
        assert time.monotonic() < deadline, f"template workers not warm after {timeout_s} s: " \
                                            f"{pool._idle.qsize()} idle, {pool.warming} warming"
        time.sleep(0.02)


def wait_for_state(url: str, state: str, timeout_s: float = 60.0) -> None:
    """Poll the server's ``GET /weight_info`` every 20 ms until its ``state`` is ``state``
    (``"init"``, ``"update"``, ``"uninitialized"``, ...).

    Raises:
        AssertionError: not reached within ``timeout_s`` seconds (the last state seen is named).
    """
    deadline = time.monotonic() + timeout_s
    while (now := httpx.get(url + "/weight_info", timeout=timeout_s).json()["state"]) != state:
        assert time.monotonic() < deadline, f"weight_info state {now!r}, not {state!r}, after {timeout_s} s"
        time.sleep(0.02)


def wait_buckets_done(url: str, k: int, timeout_s: float = 300.0) -> dict:
    """Poll ``GET /weight_info`` until the open update's ``session.buckets_done`` (buckets loaded or
    staged on every server worker) is at least ``k``; returns that ``/weight_info``. A bucket the
    trainer sent is not yet a loaded one: a test that needs "bucket k-1 landed" (before it aborts
    the update, say) waits on this state, never on a sleep (a loaded machine receives late).

    Raises:
        AssertionError: not reached within ``timeout_s`` (a hang bound, not a speed limit; the last
            ``/weight_info`` is named)."""
    deadline = time.monotonic() + timeout_s
    while ((info := httpx.get(url + "/weight_info", timeout=60).json()).get("session") or {}).get("buckets_done",
                                                                                                    0) < k:
        assert time.monotonic() < deadline, f"buckets_done not {k} after {timeout_s} s: {info}"
        time.sleep(0.01)
    return info


def load_hf(path, scale=0.3, seed=0):
    """The trainer's model: the tiny checkpoint at ``path`` plus ``scale`` x N(0, 1) noise drawn
    from ``seed`` (tiny random models otherwise repeat one token greedily, which would make output
    comparisons weak). float32, eval mode."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return hf


def complete(url: str, prompt: str, max_tokens: int = 8, **kw) -> dict:
    """Greedy ``/v1/completions``; returns the JSON (choices[0].text, weight_version, ...)."""
    r = httpx.post(url + "/v1/completions", json={"model": kw.pop("model", None) or "m", "prompt": prompt,
                                                 "max_tokens": max_tokens, "temperature": 0, **kw}, timeout=60)
    return r


def hf_greedy_ids(hf_model, tokenizer, prompt: str, max_tokens: int) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf_model.generate(ids, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens,
                                pad_token_id=tokenizer.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


_KILL_TRAINER = textwrap.dedent("""
    import os, signal, sys, time, torch
    sys.path.insert(0, {root!r})
    from transformers import AutoModelForCausalLM
    {setup}
    from rlserve.transfer import (GlooTrainerInitInfo, HTTPWeightSyncClient, IPCTrainerInitInfo, ModuleSource,
                                  NCCLTrainerInitInfo, WeightTransferTrainerFactory)
    from rlserve.transfer.backends.group import TransferGroup
    KILL_AT = {kill_at!r}
    hf = AutoModelForCausalLM.from_pretrained({path!r}, dtype={dtype}).to({device!r})
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_({scale!r})

    def die():
        print(f"KILLING {{KILL_AT}} {{time.time():.6f}}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def wait_first_bucket_done(url):
        # /weight_info's session.buckets_done: bucket 0 loaded / staged on every server worker
        import httpx
        t0, deadline = time.time(), time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                info = httpx.get(url + "/weight_info", timeout=10).json()
            except httpx.HTTPError:
                info = {{}}
            last = info.get("last_update") or {{}}
            if (info.get("session") or {{}}).get("buckets_done", 0) or \
                    (last.get("time", 0) >= t0 and last.get("buckets_done", 0)):  # (failed since, after one)
                return
            time.sleep(0.01)
        print("NOT KILLED: the server never reported bucket 0 loaded", flush=True)
        sys.exit(3)

    # broadcasts of the update: 0 the layout header, 1 bucket 0, 2 bucket 1, ...
    works = []
    real_broadcast = TransferGroup.broadcast
    def broadcast(self, tensor, src):
        if (KILL_AT, len(works)) in (("first_bucket", 1), ("between_buckets", 2)):
            for w in works:
                w.wait()   # the server has what came before: it now waits for the next bucket
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # (NCCL: wait() only orders the stream)
            if KILL_AT == "first_bucket":
                time.sleep(0.3)
            else:  # sent is not loaded: the server may abort a receive whose bytes it has not read
                wait_first_bucket_done({url!r})
            die()
        w = real_broadcast(self, tensor, src)
        works.append(w)
        return w
    TransferGroup.broadcast = broadcast

    client = HTTPWeightSyncClient({url!r})
    for route in ("start_weight_update", "update_weights"):
        real = getattr(client, route)
        def call(*a, _real=real, _route=route, **k):
            out = _real(*a, **k)
            # (ipc packed: one update_weights call per bucket, so "after_update" is after the first)
            if (KILL_AT, _route) in (("after_start", "start_weight_update"), ("after_update", "update_weights")):
                time.sleep(0.3)
                die()
            return out
        setattr(client, route, call)
    eng = WeightTransferTrainerFactory.trainer_init(init_info={init_info}, client=client, source=ModuleSource(hf))
    eng.send_weights()
    print("NOT KILLED", flush=True)
""")

#: Where :func:`kill_trainer_script` SIGKILLs the trainer (the server's view): ``after_start``
#: (start_weight_update answered, update_weights never sent), ``first_bucket`` (the layout
#: header arrived, the server waits inside the first bucket's receive), ``between_buckets``
#: (bucket 0 arrived and was loaded / staged -- the trainer waits until ``/weight_info`` says so --,
#: the server waits for bucket 1), ``after_update``
#: (update_weights answered, finish_weight_update never sent).
KILL_POINTS = ("after_start", "first_bucket", "between_buckets", "after_update")


_INIT_INFOS = {
    "gloo": "GlooTrainerInitInfo(master_port={port}, world_size=2, timeout_s={timeout_s}, "
            "packed_buffer_size_bytes={bucket_bytes})",
    "nccl": "NCCLTrainerInitInfo(master_port={port}, world_size=2, device={device!r}, timeout_s={timeout_s}, "
            "packed_buffer_size_bytes={bucket_bytes})",
    "ipc": "IPCTrainerInitInfo(packed=True, device={device!r}, timeout_s={timeout_s}, "
           "packed_buffer_size_bytes={bucket_bytes})",
}


def kill_trainer_script(root: str, path: str, url: str, port: int, timeout_s: float, scale: float = 1.0,
                        kill_at: str = "between_buckets", backend: str = "gloo", device: str = "cpu",
                        dtype: str = "float32", setup: str = "", bucket_bytes: int = 16 << 10) -> str:
    """Python source of a trainer that loads ``path`` (weights multiplied by ``scale``; ``dtype``
    on ``device``), starts a packed sync to ``url`` in ``bucket_bytes`` buckets over ``backend`` ("gloo",
    "nccl" or "ipc": one ``update_weights`` call per bucket) and SIGKILLs itself at ``kill_at``
    (one of :data:`KILL_POINTS`), printing ``KILLING <point> <time.time()>`` just before.
    ``setup``: a line run first (e.g. ``tests.gpu.nccl_over_gloo.install()``)."""
    if kill_at not in KILL_POINTS:
        raise ValueError(f"kill_at must be one of {KILL_POINTS}")
    init_info = _INIT_INFOS[backend].format(port=port, device=device, timeout_s=timeout_s,
                                            bucket_bytes=int(bucket_bytes))
    return _KILL_TRAINER.format(root=root, path=path, url=url, scale=scale, kill_at=kill_at, setup=setup,
                                device=device, dtype=f"torch.{dtype}", init_info=init_info)


def killed_at(stdout: str) -> float:
    """The ``time.time()`` a :func:`kill_trainer_script` trainer printed just before its SIGKILL."""
    for line in stdout.splitlines():
        if line.startswith("KILLING "):
            return float(line.split()[2])
    raise AssertionError(f"the trainer was not killed: {stdout[-2000:]}")


def greedy_continuation(model, prompt_ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens from an HF model by full forwards (no EOS handling: the servers in
    these tests run with ``ignore_eos``)."""
    ids = torch.tensor([prompt_ids])
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def wrong_second_bucket_sum(monkeypatch) -> list[int]:
    """Make the trainer's checksum of its second packed bucket (sent after the data) wrong by 1;
    returns the list of packed bucket sizes, filled as the trainer packs."""
    import rlserve.transfer.sdk.sender as sender

    real, calls = sender.pack_checksummed, []

    def wrong_second_sum(buf, bucket, tensors):
        packed, got = real(buf, bucket, tensors)
        calls.append(bucket.nbytes)
        return packed, got + (1 if len(calls) == 2 else 0)

    monkeypatch.setattr(sender, "pack_checksummed", wrong_second_sum)
    return calls


def run_script(argv: list[str], timeout_s: float, cwd: str | None = None):
    """``subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)`` whose bound
    is :class:`rlserve.server.launch.StartClock`'s: past ``timeout_s`` it goes on while a busy
    machine only starves the script's processes of CPU (an FSDP trainer's two ranks import torch
    and transformers: tens of CPU seconds, minutes of wall time at load 40-60 on 2 cores), and
    ends a spin or a stall. The script runs in a process group of its own, killed whole at the
    bound. Returns a ``CompletedProcess``; raises AssertionError (with the output's tails) at
    the bound."""
    import signal
    import subprocess
    import tempfile

    from rlserve.server.launch import StartClock

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(argv, stdout=out, stderr=err, text=True, cwd=cwd, start_new_session=True)
        clock = StartClock(p.pid, timeout_s)
        try:
            while p.poll() is None:
                why = clock.expired()
                if why is not None:
                    out.seek(0)
                    err.seek(0)
                    raise AssertionError(f"{argv[-1]} did not finish {why}: {out.read()[-2000:]} {err.read()[-3000:]}")
                time.sleep(0.1)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, p.returncode, out.read(), err.read())
