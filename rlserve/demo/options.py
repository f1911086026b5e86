"""``rlserve demo``'s flags (shared with the ``examples/`` scripts) and :class:`DemoOptions`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from rlserve.cli._arg_types import non_negative_number, port, positive_int, positive_seconds, shell_words
from rlserve.demo.common import BACKENDS, DEFAULT_MAX_TOKENS, PROMPTS, DemoError
from rlserve.demo.trainer import TrainerInit


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
    add("port", "--port", type=port, default=0, help="server port (0 = a free one)")
    add("max_tokens", "--max-tokens", type=positive_int, default=DEFAULT_MAX_TOKENS, help="tokens per completion")
    add("tensor_parallel_size", "--tensor-parallel-size", "-tp", type=positive_int, default=1,
        help="the server's TP (GPUs 0..TP-1)")
    add("quantization", "--quantization", "-q", default=None, choices=["fp8"],
        help="server-side online quantization (completions may then differ from the trainer's; default: none)")
    add("dtype", "--dtype", default=None, choices=["float32", "bfloat16", "float16"],
        help="server and trainer dtype (default: float32 on CPU, bfloat16 on GPU)")
    add("prompts", "--prompt", action="append", default=None,
        help=f"a prompt (repeatable; default: the {len(PROMPTS)} prompts of vLLM's RLHF example)")
    add("server_args", "--server-args", type=shell_words, default="",
        help="extra `rlserve serve` flags, one string, e.g. \"--enforce-eager --max-num-seqs 8\"")
    add("server_log", "--server-log", default=None,
        help="file for the server's output, kept ('-' = this terminal; default: a new "
             "rlserve-demo-server-*.log in the temporary directory)")
    add("startup_timeout", "--startup-timeout", type=positive_seconds, default=600.0,
        help="seconds to wait for the server's /health (longer while a busy machine starves the "
             "server of CPU: up to 10x)")
    add("allow_mismatch", "--allow-mismatch", action="store_true",
        help="report completions that differ from the trainer's, but exit 0")
    add("tie_tolerance", "--tie-tolerance", type=non_negative_number, default=None,
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


