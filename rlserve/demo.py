"""The main job as a library: serve dummy weights, sync the real ones from a trainer, check.

``rlserve demo`` (:mod:`rlserve.cli.demo`), the scripts in ``examples/`` and ``tests/test_demo.py``
are built from the pieces here:

1. :class:`DemoServer` starts ``python -m rlserve serve MODEL --load-format dummy
   --weight-transfer-config '{"backend": ...}'`` in its own session (process group), waits for
   ``/health`` (bounded; fails at once if the process exits) and kills the whole group on
   :meth:`~DemoServer.stop` (SIGTERM, then SIGKILL after a bounded wait). On Linux the server
   also gets SIGTERM if this process dies (``PR_SET_PDEATHSIG``).
2. :func:`complete` generates greedily over ``/v1/completions`` (token ids included).
3. :func:`load_trainer_model` loads the real weights with ``AutoModelForCausalLM.from_pretrained``.
4. :func:`sync_weights` runs the trainer SDK: ``trainer_init`` → ``/pause`` → ``send_weights`` →
   ``/resume``, timing each step.
5. :func:`trainer_greedy` runs the trainer model's own ``generate`` (``do_sample=False``) from the
   server's prompt token ids, and :func:`compare_completions` lists the prompts that differ.

:func:`run_demo` strings them together on whatever the machine has (:func:`choose_layout`):
gloo on CPU, CUDA IPC on one GPU, NCCL on two or more.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from rlserve.progress import progress as progress_line
from rlserve.server.launch import free_port, spawn_server, stop_group, wait_healthy

PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
DEFAULT_MAX_TOKENS = 32

#: Set in the environment of every process of a multi-GPU run (server included): NVLink
#: multicast (NVLS) and symmetric-memory multicast are off, as the device machines need.
NCCL_SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_MISMATCH = 3

BACKENDS = ("auto", "gloo", "ipc", "nccl")


class DemoError(RuntimeError):
    """A step of the demo failed (the message says which and why)."""


class ServerStartError(DemoError):
    """The server exited or did not become healthy in time (the message has its log's tail)."""


def log(msg: str) -> None:
    print(msg, flush=True)


# ============================================================================ layout
@dataclass
class Layout:
    """Where the server and the trainer run.

    Attributes:
        backend: ``gloo`` | ``ipc`` | ``nccl``.
        server_device: ``cpu`` or ``cuda``.
        server_device_ids: GPUs of the server (``--device-ids``), ``None`` on CPU.
        trainer_device: ``cpu`` or ``cuda:N``.
        dtype: the server's ``--dtype`` and the trainer model's dtype.
        tensor_parallel_size: the server's TP.
    """

    backend: str
    server_device: str
    server_device_ids: list[int] | None
    trainer_device: str
    dtype: str
    tensor_parallel_size: int = 1

    def describe(self) -> str:
        srv = "CPU" if self.server_device == "cpu" else f"GPU {','.join(map(str, self.server_device_ids or []))}"
        trn = "CPU" if self.trainer_device == "cpu" else f"GPU {self.trainer_device.split(':')[-1]}"
        tp = f", TP={self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else ""
        return f"backend {self.backend}: server on {srv}{tp}, trainer on {trn}, {self.dtype}"


def cuda_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA install means "no GPU" here
        return 0


def choose_layout(backend: str = "auto", tensor_parallel_size: int = 1, num_gpus: int | None = None,
                  dtype: str | None = None) -> Layout:
    """Pick the data plane and the devices.

    ``auto``: gloo without GPUs; NCCL when there is a GPU for the trainer beside the server's
    ``tensor_parallel_size`` GPUs (two or more GPUs); CUDA IPC otherwise (the trainer shares
    GPU 0 with the server). ``gloo`` always runs server and trainer on the CPU. The server takes
    GPUs ``0..TP-1``; an NCCL trainer takes the last GPU. ``dtype``: float32 on CPU, bfloat16 on
    GPU unless given. Raises :class:`DemoError` for a layout the machine cannot hold.
    """
    tp = int(tensor_parallel_size)
    if tp < 1:
        raise DemoError(f"--tensor-parallel-size must be >= 1, got {tp}")
    if backend not in BACKENDS:
        raise DemoError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    n = cuda_device_count() if num_gpus is None else int(num_gpus)
    if backend == "auto":
        backend = "gloo" if n == 0 else ("nccl" if n >= 2 and n >= tp + 1 else "ipc")
    if backend == "gloo":
        return Layout("gloo", "cpu", None, "cpu", dtype or "float32", tp)
    if n == 0:
        raise DemoError(f"backend {backend} needs a CUDA GPU and this machine has none (use gloo)")
    if tp > n:
        raise DemoError(f"TP={tp} needs {tp} GPUs; this machine has {n}")
    server_ids = list(range(tp))
    if backend == "ipc":
        return Layout("ipc", "cuda", server_ids, "cuda:0", dtype or "bfloat16", tp)
    if n < tp + 1:
        raise DemoError(f"nccl puts the trainer on its own GPU (NCCL refuses two ranks on one GPU): TP={tp} "
                        f"needs {tp + 1} GPUs, this machine has {n}; use --backend ipc")
    return Layout("nccl", "cuda", server_ids, f"cuda:{n - 1}", dtype or "bfloat16", tp)


# ============================================================================ server
def serve_command(model: str, layout: Layout, port: int, host: str = "127.0.0.1",
                  quantization: str | None = None, extra_args: Sequence[str] = ()) -> list[str]:
    """The ``python -m rlserve serve`` command line of a demo server (dummy weights, weight sync on)."""
    cmd = [sys.executable, "-m", "rlserve", "serve", model, "--host", host, "--port", str(port),
           "--load-format", "dummy", "--weight-transfer-config", json.dumps({"backend": layout.backend}),
           "--dtype", layout.dtype, "--device", layout.server_device, "--disable-access-log"]
    if layout.server_device_ids:
        cmd += ["--device-ids", ",".join(map(str, layout.server_device_ids))]
    if layout.tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(layout.tensor_parallel_size)]
    if quantization:
        cmd += ["--quantization", quantization]
    return cmd + list(extra_args)


class DemoServer:
    """An ``rlserve serve`` subprocess in its own session, killed as a group.

    Args:
        cmd: the command line (:func:`serve_command`).
        url: the base URL it will answer on (``http://127.0.0.1:PORT``).
        env: extra environment variables.
        log_path: file for the server's stdout+stderr; ``"-"`` = this terminal; ``None`` = a
            new file ``rlserve-demo-server-*.log`` in the temporary directory (kept: its path is
            printed, and its tail is part of every error).
        startup_timeout_s: bound on the wait for ``/health``.
    """

    def __init__(self, cmd: list[str], url: str, env: dict | None = None, log_path: str | None = None,
                 startup_timeout_s: float = 600.0):
        self.cmd = list(cmd)
        self.url = url.rstrip("/")
        self.env = dict(os.environ, **(env or {}))
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.startup_timeout_s = float(startup_timeout_s)
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="rlserve-demo-server-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._log_file = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def log_tail(self, n_chars: int = 4000) -> str:
        if self.log_path == "-":
            return "(server output went to the terminal above)"
        try:
            with open(self.log_path, errors="replace") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - n_chars))
                return f.read()
        except OSError:
            return ""

    def start(self) -> "DemoServer":
        """Spawn the process (returns at once; :meth:`wait_healthy` waits)."""
        self.proc, self._log_file = spawn_server(self.cmd, None if self.log_path == "-" else self.log_path, self.env)
        return self

    def wait_healthy(self, poll_s: float = 0.25) -> float:
        """Block until ``GET /health`` answers 200; return the seconds waited. Raises
        :class:`ServerStartError` as soon as the process exits, or after ``startup_timeout_s``."""
        assert self.proc is not None, "start() first"
        return wait_healthy(self.proc, self.url, self.startup_timeout_s, self.log_tail, poll_s=poll_s,
                            what=f"the server (log {self.log_path})", error=ServerStartError)

    def stop(self, grace_s: float = 15.0) -> int | None:
        """Stop the server and everything in its process group (TP workers included):
        SIGTERM, SIGKILL after ``grace_s``. Idempotent; returns the exit status."""
        rc = stop_group(self.proc, grace_s)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return rc

    def __enter__(self) -> "DemoServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


@contextlib.contextmanager
def exit_on_signals(signals: Sequence[int] = (signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into ``SystemExit(128 + signum)`` while inside (SIGINT already raises
    ``KeyboardInterrupt``), so ``finally`` blocks (server shutdown) run. Main thread only;
    elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        raise SystemExit(128 + signum)

    old = {}
    for s in signals:
        with contextlib.suppress(ValueError, OSError):
            old[s] = signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in old.items():
            with contextlib.suppress(ValueError, OSError):
                signal.signal(s, h)


# ============================================================================ generation
@dataclass
class Completion:
    prompt: str
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None = None
    weight_version: str | None = None


def complete(base_url: str, prompts: Sequence[str], max_tokens: int = DEFAULT_MAX_TOKENS,
             model: str | None = None, api_key: str | None = None, timeout_s: float = 600.0,
             progress: str | None = None) -> list[Completion]:
    """Greedy completions (``temperature=0``) of every prompt, in one ``/v1/completions`` request;
    with ``progress`` (the line's label) streamed, with a tqdm line of the tokens done."""
    import requests

    body: dict[str, Any] = {"prompt": list(prompts), "max_tokens": int(max_tokens), "temperature": 0.0,
                            "return_token_ids": True}
    if model:
        body["model"] = model
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = f"{base_url.rstrip('/')}/v1/completions"
    if progress is None:
        r = requests.post(url, json=body, headers=headers, timeout=(10, timeout_s))
        if r.status_code != 200:
            raise DemoError(f"/v1/completions -> HTTP {r.status_code}: {r.text[:1000]}")
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    else:
        choices = _complete_streamed(url, dict(body, stream=True), headers, timeout_s, len(prompts) * int(max_tokens),
                                     progress)
    if len(choices) != len(prompts):
        raise DemoError(f"/v1/completions returned {len(choices)} choices for {len(prompts)} prompts")
    return [Completion(p, c["text"], list(c["token_ids"]), list(c["prompt_token_ids"]), c.get("finish_reason"),
                       c.get("weight_version")) for p, c in zip(prompts, choices)]


def _complete_streamed(url: str, body: dict, headers: dict, timeout_s: float, total: int, label: str) -> list[dict]:
    """A streamed ``/v1/completions``: the choices assembled from their chunks, in index order."""
    import requests

    merged: dict[int, dict] = {}
    with progress_line(label, total=total, unit="tok") as bar, \
            requests.post(url, json=body, headers=headers, timeout=(10, timeout_s), stream=True) as r:
        if r.status_code != 200:
            raise DemoError(f"/v1/completions -> HTTP {r.status_code}: {r.text[:1000]}")
        for line in r.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise DemoError(f"/v1/completions stream failed: {obj['error']}")
            for c in obj["choices"]:
                m = merged.setdefault(c["index"], {"index": c["index"], "text": "", "token_ids": [],
                                                   "prompt_token_ids": [], "finish_reason": None})
                m["text"] += c["text"]
                m["token_ids"] += c.get("token_ids") or []
                m["prompt_token_ids"] = c.get("prompt_token_ids") or m["prompt_token_ids"]
                m["finish_reason"] = c["finish_reason"] or m["finish_reason"]
                m["weight_version"] = c.get("weight_version")
                bar.update(len(c.get("token_ids") or []))
    return [merged[i] for i in sorted(merged)]


# ============================================================================ trainer
def torch_dtype(name: str):
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise DemoError(f"unknown dtype {name!r}")
    return dt


def load_trainer_model(model_path: str, device: str = "cpu", dtype: str = "float32"):
    """The trainer's model: ``AutoModelForCausalLM.from_pretrained`` on ``device`` in ``dtype``, eval mode."""
    import transformers
    from transformers import AutoModelForCausalLM

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    if str(device).startswith("cpu"):
        # the trainer's generate shares the machine with the server as an engine would: the
        # same thread rule (one core left to the others; torch's default of one thread per
        # core measured 508 s for the 4 x 32-token reference generate on the loaded 2-core
        # CI machine, where the server itself took 35-45 s per 4 x 32 tokens)
        from rlserve.engine.cpu_threads import configure_engine_threads

        configure_engine_threads()
    model = AutoModelForCausalLM.from_pretrained(model_path, **{key: torch_dtype(dtype)})
    return model.to(device).eval()


def eos_token_ids(model) -> set[int]:
    """EOS ids as ``generate`` uses them (generation config, else the model config)."""
    ids: set[int] = set()
    for cfg in (getattr(model, "generation_config", None), model.config):
        e = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if e is not None:
            ids.update([e] if isinstance(e, int) else list(e))
            break
    return ids


def trainer_greedy(model, prompt_token_ids: Sequence[Sequence[int]], max_new_tokens: int,
                   progress: str | None = None) -> list[list[int]]:
    """The trainer model's own greedy ``generate`` (``do_sample=False``), one prompt at a time,
    from the given token ids; each result ends after its first EOS token (kept, as the server
    keeps it) or after ``max_new_tokens``. ``progress``: the label of a tqdm line of tokens."""
    import torch
    from transformers import GenerationConfig

    eos = sorted(eos_token_ids(model))
    pad = eos[0] if eos else 0
    gc = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=int(max_new_tokens),
                          eos_token_id=eos or None, pad_token_id=pad)
    from transformers.generation.streamers import BaseStreamer

    class _Count(BaseStreamer):  # generate() puts the prompt first, then one token per step
        def __init__(self, bar):
            self.bar, self.prompt_seen = bar, False

        def put(self, value):
            if self.prompt_seen:
                self.bar.update(1)
            self.prompt_seen = True

        def end(self):
            pass

    device = next(model.parameters()).device
    out: list[list[int]] = []
    with torch.inference_mode(), progress_line(progress, total=len(prompt_token_ids) * int(max_new_tokens),
                                               unit="tok", enabled=progress is not None) as bar:
        for ids in prompt_token_ids:
            x = torch.tensor([list(ids)], dtype=torch.long, device=device)
            y = model.generate(x, attention_mask=torch.ones_like(x), generation_config=gc,
                               streamer=_Count(bar) if progress is not None else None)
            gen = y[0, x.shape[1]:].tolist()
            for i, t in enumerate(gen):
                if t in eos:
                    gen = gen[: i + 1]
                    break
            out.append(gen)
    return out


@dataclass
class SyncReport:
    """Timings of one weight sync (seconds) and what moved. ``kind``: "cold" (the first sync of a
    transfer group: includes ``trainer_init`` and the server laying out its receive buffers) or
    "warm" (a later sync on the same group: what every training step pays)."""

    backend: str
    init_s: float
    pause_s: float
    send_s: float
    resume_s: float
    bytes: int
    buckets: int
    transfer_s: float | None
    weight_version: str | None
    stats: dict = field(default_factory=dict)
    kind: str = "cold"

    @property
    def sync_s(self) -> float:
        """pause + send + resume: how long generation was stopped."""
        return self.pause_s + self.send_s + self.resume_s

    @property
    def gbps(self) -> float:
        return self.bytes / self.send_s / 1e9 if self.send_s > 0 else 0.0

    def lines(self) -> list[str]:
        xfer = ""
        if self.transfer_s:
            xfer = f" (data plane {self.transfer_s:.2f}s, {self.bytes / self.transfer_s / 1e9:.2f} GB/s)"
        what = ("cold: the group's first sync, with trainer_init" if self.kind == "cold"
                else "warm: a later sync on the same group, as every training step")
        init = f"init {self.init_s:.2f}s | " if self.kind == "cold" else ""
        return [
            f"[sync] {self.kind} sync ({what}): {self.backend}, {self.bytes / 1e6:.1f} MB in {self.buckets} "
            f"bucket(s), weight version -> {self.weight_version}",
            f"[sync]   {init}pause {self.pause_s:.2f}s | send_weights {self.send_s:.2f}s{xfer} | "
            f"resume {self.resume_s:.2f}s",
            f"[sync]   {self.kind} sync time {self.sync_s:.2f}s (generation paused), {self.gbps:.2f} GB/s end to end",
        ]


def make_init_info(layout: Layout, world_size: int, **kw):
    """The trainer init info of ``layout.backend`` (trainer = rank 0, rendezvous on 127.0.0.1)."""
    from rlserve.transfer import GlooTrainerInitInfo, IPCTrainerInitInfo, NCCLTrainerInitInfo

    if layout.backend == "gloo":
        return GlooTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(), world_size=world_size, **kw)
    if layout.backend == "nccl":
        return NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(), world_size=world_size,
                                   device=layout.trainer_device, **kw)
    if layout.backend == "ipc":
        return IPCTrainerInitInfo(world_size=world_size, device=layout.trainer_device, **kw)
    raise DemoError(f"unknown backend {layout.backend!r}")


def default_trainer_init(client, model, layout: Layout):
    """``WeightTransferTrainerFactory.trainer_init`` with :func:`make_init_info`'s init info."""
    from rlserve.transfer import ModuleSource, WeightTransferTrainerFactory

    return WeightTransferTrainerFactory.trainer_init(
        init_info=make_init_info(layout, client.get_world_size() + 1),
        client=client,
        source=ModuleSource(model),
    )


#: ``trainer_init(client, model, layout) -> trainer engine``: how a script opens its end.
TrainerInit = Callable[[Any, Any, Layout], Any]


def sync_weights(base_url: str, model, layout: Layout, admin_key: str | None = None,
                 pause_mode: str = "abort", trainer_init: TrainerInit | None = None, warm_syncs: int = 1,
                 progress: bool = False) -> list[SyncReport]:
    """Push ``model``'s weights through the trainer SDK: ``trainer_init`` (the handshake; default
    :func:`default_trainer_init`), then ``1 + warm_syncs`` times pause generation, ``send_weights``,
    resume; then leave the transfer group. Returns the reports, the cold one first.
    ``progress``: a tqdm line with the elapsed time while each sync runs."""
    import torch

    from rlserve.transfer import HTTPWeightSyncClient

    client = HTTPWeightSyncClient(base_url, admin_key=admin_key)
    if layout.trainer_device.startswith("cuda"):
        torch.cuda.set_device(torch.device(layout.trainer_device))
    reports: list[SyncReport] = []
    cold_bar = contextlib.ExitStack()  # one line for trainer_init + the first send_weights
    cold_bar.enter_context(progress_line("[sync] cold: trainer_init + send_weights", enabled=progress))
    t0 = time.perf_counter()
    try:
        engine = (trainer_init or default_trainer_init)(client, model, layout)
    except BaseException:
        cold_bar.close()
        raise
    init_s = time.perf_counter() - t0
    try:
        for i in range(1 + max(0, int(warm_syncs))):
            kind = "cold" if i == 0 else "warm"
            with (progress_line("[sync] warm: send_weights", enabled=progress) if i > 0
                  else contextlib.nullcontext()):
                t1 = time.perf_counter()
                client.pause(mode=pause_mode)
                t2 = time.perf_counter()
                try:
                    fin = engine.send_weights()
                except BaseException:
                    with contextlib.suppress(Exception):  # never leave the server paused; keep the first error
                        client.resume()
                    raise
                t3 = time.perf_counter()
                client.resume()
                t4 = time.perf_counter()
            cold_bar.close()  # idempotent
            st = dict(engine.last_stats)
            reports.append(SyncReport(layout.backend, init_s if i == 0 else 0.0, t2 - t1, t3 - t2, t4 - t3,
                                      int(st.get("bytes") or 0), int(st.get("buckets") or 0), st.get("seconds"),
                                      fin.get("weight_version"), st, kind=kind))
    except BaseException:
        cold_bar.close()
        with contextlib.suppress(Exception):
            engine._teardown()  # the server is about to go too: do not wait on its shutdown route
        raise
    engine.shutdown()
    return reports


# ============================================================================ checking + printing
@dataclass
class Mismatch:
    """A server completion that differs from the trainer's greedy ids. ``gap`` (set by
    :func:`measure_gaps`): at the first difference, the trainer's logit of its own token minus its
    logit of the server's token, in nats; a small gap is a near tie that 16-bit rounding can flip."""

    index: int
    prompt: str
    server_ids: list[int]
    reference_ids: list[int]
    gap: float | None = None

    def near_tie(self, tolerance: float) -> bool:
        """``|gap| <= tolerance`` with ``tolerance > 0`` (0 = exact: never a tie)."""
        return tolerance > 0 and self.gap is not None and abs(self.gap) <= tolerance

    @property
    def first_difference(self) -> int:
        for i, (a, b) in enumerate(zip(self.server_ids, self.reference_ids)):
            if a != b:
                return i
        return min(len(self.server_ids), len(self.reference_ids))


def compare_completions(completions: Sequence[Completion], reference: Sequence[Sequence[int]]) -> list[Mismatch]:
    """The completions whose token ids differ from the trainer's greedy ids (empty: all equal)."""
    if len(completions) != len(reference):
        raise ValueError(f"{len(completions)} completions but {len(reference)} reference outputs")
    return [Mismatch(i, c.prompt, list(c.token_ids), list(r))
            for i, (c, r) in enumerate(zip(completions, reference)) if list(c.token_ids) != list(r)]


def measure_gaps(model, completions: Sequence[Completion], mismatches: Sequence[Mismatch]) -> None:
    """Set each mismatch's ``gap``: one trainer forward over the prompt + the common prefix."""
    import torch

    device = next(model.parameters()).device
    with torch.inference_mode():
        for m in mismatches:
            k = m.first_difference
            if k >= len(m.server_ids) or k >= len(m.reference_ids):
                m.gap = float("inf")  # one side ended early (cannot be a near tie)
                continue
            ids = list(completions[m.index].prompt_token_ids) + list(m.server_ids[:k])
            logits = model(torch.tensor([ids], dtype=torch.long, device=device)).logits[0, -1].float()
            m.gap = float(logits[m.reference_ids[k]] - logits[m.server_ids[k]])


def default_tie_tolerance(dtype: str) -> float:
    """0 (exact) in float32; 0.5 nats in 16-bit dtypes, where server and Hugging Face kernels
    round differently and a near tie between two tokens can go either way."""
    return 0.0 if dtype == "float32" else 0.5


def describe_mismatches(mismatches: Sequence[Mismatch], decode: Callable[[list[int]], str] | None = None) -> str:
    lines = []
    for m in mismatches:
        k = m.first_difference
        gap = f"; trainer logit gap there {m.gap:.3f}" if m.gap is not None else ""
        lines.append(f"  [{m.index}] {m.prompt!r}: first difference at generated token {k} "
                     f"(server {m.server_ids[k:k + 1]}, trainer {m.reference_ids[k:k + 1]}{gap})")
        if decode is not None:
            lines.append(f"      server : {decode(m.server_ids)!r}")
            lines.append(f"      trainer: {decode(m.reference_ids)!r}")
    return "\n".join(lines)


def _clip(s: str, width: int) -> str:
    s = repr(s)[1:-1]
    return s if len(s) <= width else s[: max(0, width - 1)] + "…"


def format_table(prompts: Sequence[str], before: Sequence[Completion] | None, after: Sequence[Completion],
                 matches: Sequence[bool | str] | None = None, width: int | None = None) -> str:
    """A before/after table (texts clipped to the terminal width), then the full texts after the sync."""
    width = width or shutil.get_terminal_size((120, 24)).columns
    width = max(80, min(width, 200))
    pw = max(len("prompt"), min(max(len(repr(p)) - 2 for p in prompts), 38))
    mark_w = len(" | = trainer") if matches is not None else 0
    cols = 2 if before is not None else 1
    tw = max(12, (width - pw - mark_w - 3 * cols) // cols)
    head = [f"{'prompt':<{pw}}"]
    if before is not None:
        head.append(f"{'before sync (dummy weights)':<{tw}}")
    head.append(f"{'after sync (trainer weights)':<{tw}}")
    if matches is not None:
        head.append("= trainer")
    sep = " | "
    rows = [sep.join(head), "-" * min(width, len(sep.join(head)) + 2)]
    for i, p in enumerate(prompts):
        cells = [f"{_clip(p, pw):<{pw}}"]
        if before is not None:
            cells.append(f"{_clip(before[i].text, tw):<{tw}}")
        cells.append(f"{_clip(after[i].text, tw):<{tw}}")
        if matches is not None:
            m = matches[i]
            cells.append(m if isinstance(m, str) else ("yes" if m else "NO"))
        rows.append(sep.join(cells))
    rows.append("")
    rows.append("after the sync, in full:")
    for i, p in enumerate(prompts):
        rows.append(textwrap.fill(f"{p!r} -> {after[i].text!r}", width=width, subsequent_indent="    "))
    return "\n".join(rows)


def add_demo_arguments(ap, backend: bool = True, only: Sequence[str] | None = None) -> None:
    """The flags of ``rlserve demo`` (shared with the ``examples/`` scripts, which fix the backend:
    ``backend=False``). ``only``: the destinations to add (default: all); see :func:`demo_options`."""
    def add(dest: str, *flags, **kw):
        if only is None or dest in only:
            ap.add_argument(*flags, dest=dest, **kw)

    add("model", "--model", default="default",
        help="a local Hugging Face model directory, or 'default' (SmolLM2-135M-Instruct, fetched and cached on "
             "first use)")
    if backend:
        add("backend", "--backend", default="auto", choices=BACKENDS,
            help="weight-sync data plane (auto: gloo without GPUs, nccl with a spare GPU for the trainer, else ipc)")
    add("port", "--port", type=int, default=0, help="server port (0 = a free one)")
    add("max_tokens", "--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="tokens per completion")
    add("tensor_parallel_size", "--tensor-parallel-size", "-tp", type=int, default=1,
        help="the server's TP (GPUs 0..TP-1)")
    add("quantization", "--quantization", "-q", default=None, choices=["fp8"],
        help="server-side online quantization (completions may then differ from the trainer's; default: none)")
    add("dtype", "--dtype", default=None, choices=["float32", "bfloat16", "float16"],
        help="server and trainer dtype (default: float32 on CPU, bfloat16 on GPU)")
    add("prompts", "--prompt", action="append", default=None,
        help=f"a prompt (repeatable; default: the {len(PROMPTS)} prompts of vLLM's RLHF example)")
    add("server_args", "--server-args", default="",
        help="extra `rlserve serve` flags, one string, e.g. \"--enforce-eager --max-num-seqs 8\"")
    add("server_log", "--server-log", default=None,
        help="file for the server's output, kept ('-' = this terminal; default: a new "
             "rlserve-demo-server-*.log in the temporary directory)")
    add("startup_timeout", "--startup-timeout", type=float, default=600.0,
        help="seconds to wait for the server's /health")
    add("allow_mismatch", "--allow-mismatch", action="store_true",
        help="report completions that differ from the trainer's, but exit 0")
    add("tie_tolerance", "--tie-tolerance", type=float, default=None,
        help="a completion may first differ from the trainer's where the trainer's two candidate tokens are "
             "within this many nats (default: 0 = exact in float32, 0.5 in 16-bit dtypes)")
    add("cache_dir", "--cache-dir", default=None, help="cache root of the default model (see `rlserve download`)")
    add("no_progress", "--no-progress", action="store_true", help="no progress lines (stderr)")


def demo_options(args, **overrides) -> "DemoOptions":
    """:class:`DemoOptions` from flags added by :func:`add_demo_arguments` (missing ones keep their
    defaults), then ``overrides``.

    Raises:
        DemoError: a bad value (``--max-tokens`` < 1).
    """
    import shlex as _shlex

    a = vars(args)
    kw: dict[str, Any] = {}
    for dest in ("model", "backend", "port", "max_tokens", "tensor_parallel_size", "quantization", "dtype",
                 "server_log", "allow_mismatch", "tie_tolerance", "cache_dir"):
        if dest in a:
            kw[dest] = a[dest]
    if "server_args" in a:
        kw["server_args"] = _shlex.split(a["server_args"])
    if "startup_timeout" in a:
        kw["startup_timeout_s"] = a["startup_timeout"]
    if a.get("prompts"):
        kw["prompts"] = list(a["prompts"])
    if "no_progress" in a:
        kw["progress"] = not a["no_progress"]
    kw.update(overrides)
    if kw.get("max_tokens", DEFAULT_MAX_TOKENS) < 1:
        raise DemoError("--max-tokens must be >= 1")
    return DemoOptions(**kw)


def example_parser(doc: str | None, demo_flags: bool = True):
    """The command line of the ``examples/rlhf_*.py`` scripts: ``rlserve demo``'s flags that apply
    to a script with a fixed backend (all but ``--backend``; with ``demo_flags=False`` only
    ``--model``, ``--port`` and ``--max-tokens``)."""
    from rlserve.cli._help import HelpFormatter
    import argparse

    ap = argparse.ArgumentParser(description=(doc or "").strip().split("\n\n")[0], formatter_class=HelpFormatter)
    add_demo_arguments(ap, backend=False, only=None if demo_flags else ("model", "port", "max_tokens"))
    return ap


# ============================================================================ the whole demo
@dataclass
class DemoOptions:
    """What ``rlserve demo`` takes (see its ``--help``)."""

    model: str = "default"
    backend: str = "auto"
    port: int = 0
    max_tokens: int = DEFAULT_MAX_TOKENS
    tensor_parallel_size: int = 1
    quantization: str | None = None
    dtype: str | None = None
    prompts: list[str] = field(default_factory=lambda: list(PROMPTS))
    server_args: list[str] = field(default_factory=list)
    server_log: str | None = None
    startup_timeout_s: float = 600.0
    allow_mismatch: bool = False
    tie_tolerance: float | None = None  # None: default_tie_tolerance(dtype)
    cache_dir: str | None = None
    num_gpus: int | None = None  # None: ask torch
    trainer_init: TrainerInit | None = None  # None: default_trainer_init
    warm_syncs: int = 1  # syncs after the first (cold) one, on the same group
    progress: bool = True  # tqdm lines (stderr) for every phase longer than a moment


@dataclass
class DemoResult:
    exit_code: int
    layout: Layout | None = None
    before: list[Completion] | None = None
    after: list[Completion] | None = None
    reference: list[list[int]] | None = None
    mismatches: list[Mismatch] = field(default_factory=list)
    sync: SyncReport | None = None  # the cold (first) sync
    warm_sync: SyncReport | None = None  # the warm one after it (same group)
    server_pid: int | None = None
    timings: dict = field(default_factory=dict)
    error: str | None = None


def run_demo(opts: DemoOptions) -> DemoResult:
    """Run the whole scenario; print as it goes; never leaves the server running.

    Exit codes: 0 all completions equal the trainer's; 3 some differ (0 with ``allow_mismatch``);
    1 a step failed. ``KeyboardInterrupt`` / ``SystemExit`` (SIGTERM) propagate after cleanup.
    """
    res = DemoResult(EXIT_ERROR)
    t_all = time.perf_counter()
    server: DemoServer | None = None
    try:
        with exit_on_signals():
            res.layout = layout = choose_layout(opts.backend, opts.tensor_parallel_size, opts.num_gpus, opts.dtype)
            from rlserve.download import resolve_model

            t = time.perf_counter()
            model_path = resolve_model(opts.model, cache_dir=opts.cache_dir)
            res.timings["model"] = time.perf_counter() - t
            log(f"[demo] model {model_path}")
            log(f"[demo] {layout.describe()}")

            port = opts.port or free_port()
            env = dict(NCCL_SAFE_ENV) if layout.server_device == "cuda" else {}
            cmd = serve_command(model_path, layout, port, quantization=opts.quantization, extra_args=opts.server_args)
            server = DemoServer(cmd, f"http://127.0.0.1:{port}", env=env, log_path=opts.server_log,
                                startup_timeout_s=opts.startup_timeout_s)
            t = time.perf_counter()
            server.start()
            res.server_pid = server.pid
            log(f"[server] {shlex.join(cmd[1:])}")
            log(f"[server] pid {server.pid}, log: {server.log_path}")

            # the trainer loads the real weights while the server boots
            log(f"[trainer] loading {model_path} with transformers ({layout.dtype}, {layout.trainer_device})")
            t_tr = time.perf_counter()
            if layout.trainer_device.startswith("cuda"):
                os.environ.update(NCCL_SAFE_ENV)
            with progress_line("[trainer] loading the model", enabled=opts.progress):
                model = load_trainer_model(model_path, layout.trainer_device, layout.dtype)
            res.timings["trainer_load"] = time.perf_counter() - t_tr

            with progress_line("[server] starting (loading the model, warming up)", enabled=opts.progress):
                server.wait_healthy()
            res.timings["server_start"] = time.perf_counter() - t
            log(f"[server] ready at {server.url} after {res.timings['server_start']:.1f}s")

            log(f"[generate] {len(opts.prompts)} prompts x {opts.max_tokens} tokens, greedy, dummy weights")
            t = time.perf_counter()
            res.before = complete(server.url, opts.prompts, opts.max_tokens, model=model_path,
                                  progress="[generate] before sync" if opts.progress else None)
            res.timings["generate_before"] = time.perf_counter() - t

            log("[sync] trainer_init -> pause -> send_weights -> resume, then a warm sync on the same group"
                if opts.warm_syncs else "[sync] trainer_init -> pause -> send_weights -> resume")
            syncs = sync_weights(server.url, model, layout, trainer_init=opts.trainer_init,
                                 warm_syncs=opts.warm_syncs, progress=opts.progress)
            res.sync, res.warm_sync = syncs[0], (syncs[-1] if len(syncs) > 1 else None)
            for rep in [res.sync] + ([res.warm_sync] if res.warm_sync else []):
                for line in rep.lines():
                    log(line)

            log(f"[generate] {len(opts.prompts)} prompts x {opts.max_tokens} tokens, greedy, trainer weights")
            t = time.perf_counter()
            res.after = complete(server.url, opts.prompts, opts.max_tokens, model=model_path,
                                 progress="[generate] after sync" if opts.progress else None)
            res.timings["generate_after"] = time.perf_counter() - t

            log(f"[trainer] greedy generate of the same {len(opts.prompts)} prompts (the reference)")
            t = time.perf_counter()
            res.reference = trainer_greedy(model, [c.prompt_token_ids for c in res.after], opts.max_tokens,
                                           progress="[trainer] generate" if opts.progress else None)
            res.timings["trainer_generate"] = time.perf_counter() - t
            res.mismatches = compare_completions(res.after, res.reference)
            measure_gaps(model, res.after, res.mismatches)
            tol = default_tie_tolerance(layout.dtype) if opts.tie_tolerance is None else opts.tie_tolerance
            ties = [m for m in res.mismatches if m.near_tie(tol)]
            real = [m for m in res.mismatches if not m.near_tie(tol)]

            marks: list[bool | str] = [True] * len(opts.prompts)
            for m in res.mismatches:
                marks[m.index] = "near tie" if m.near_tie(tol) else False
            log("")
            log(format_table(opts.prompts, res.before, res.after, marks))
            log("")
            res.timings["total"] = time.perf_counter() - t_all
            log("[demo] times: " + ", ".join(f"{k} {v:.1f}s" for k, v in res.timings.items()))
            if res.mismatches:
                decode = _decoder(model_path)
                log(f"[demo] {len(res.mismatches)} of {len(opts.prompts)} server completions differ from the "
                    f"trainer's greedy generate:\n{describe_mismatches(res.mismatches, decode)}")
                if ties:
                    log(f"[demo] {len(ties)} of them first differ at a near tie (trainer logit gap <= {tol} nats, "
                        f"within {layout.dtype} rounding); --tie-tolerance 0 makes them count")
                if real:
                    log(f"[demo] MISMATCH: {len(real)} completion(s) differ beyond rounding"
                        + (" (--allow-mismatch: exit 0)" if opts.allow_mismatch else ""))
                res.exit_code = EXIT_OK if (opts.allow_mismatch or not real) else EXIT_MISMATCH
            else:
                log(f"[demo] OK: all {len(opts.prompts)} server completions equal the trainer's greedy "
                    "generate, token for token")
                res.exit_code = EXIT_OK
            if res.mismatches and not real:
                log(f"[demo] OK within {layout.dtype} rounding: {len(opts.prompts) - len(ties)} of "
                    f"{len(opts.prompts)} equal token for token, {len(ties)} first differ at a near tie")
    except DemoError as e:
        res.error = str(e)
        log(f"[demo] error: {e}")
    except Exception as e:  # noqa: BLE001 - any failing step ends the demo with a message, not a hang
        res.error = f"{type(e).__name__}: {e}"
        log(f"[demo] error: {res.error}")
        if server is not None and server.log_path != "-":
            log(f"[demo] server log ({server.log_path}) ends with:\n{server.log_tail(2000)}")
    finally:
        if server is not None:
            log("[server] shutting down")
            server.stop()
            if server.log_path != "-":
                log(f"[server] its log is kept at {server.log_path}")
    return res


def _decoder(model_path: str) -> Callable[[list[int]], str] | None:
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
        return lambda ids: tok.decode(ids)
    except Exception:  # noqa: BLE001 - decoding is only for the message
        return None
