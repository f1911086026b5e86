"""``rlserve demo``: dummy weights -> gibberish; trainer syncs the real weights -> the trainer's own text.

The logic lives in :mod:`rlserve.demo` (shared with ``examples/``); this module only parses flags.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from rlserve.cli._help import HelpFormatter


def register(subparsers) -> None:
    from rlserve.demo import BACKENDS, DEFAULT_MAX_TOKENS, PROMPTS

    p = subparsers.add_parser(
        "demo", help="the RL weight-sync story end to end: dummy weights, sync from a trainer, check",
        description="Start `rlserve serve MODEL --load-format dummy --weight-transfer-config ...` (random "
                    "weights), generate greedily (gibberish), load the real weights in a Hugging Face trainer "
                    "model, pause, push them through the trainer SDK, resume, generate again, and check that "
                    "every completion equals the trainer model's own greedy generate (exit status 3 if not). "
                    "Backend by machine: gloo on CPU, CUDA IPC on one GPU, NCCL on two or more.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model", default="default",
                   help="a local Hugging Face model directory, or 'default' (SmolLM2-135M-Instruct, fetched and "
                        "cached on first use)")
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="weight-sync data plane (auto: gloo without GPUs, nccl with a spare GPU for the trainer, "
                        "else ipc)")
    p.add_argument("--port", type=int, default=0, help="server port (0 = a free one)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="tokens per completion")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="the server's TP (GPUs 0..TP-1)")
    p.add_argument("--quantization", "-q", default=None, choices=["fp8"],
                   help="server-side online quantization (completions may then differ from the trainer's)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="server and trainer dtype (default: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--prompt", action="append", dest="prompts", default=None,
                   help=f"a prompt (repeatable; default: the {len(PROMPTS)} prompts of vLLM's RLHF example)")
    p.add_argument("--server-args", default="",
                   help="extra `rlserve serve` flags, one string, e.g. \"--enforce-eager --max-num-seqs 8\"")
    p.add_argument("--server-log", default=None,
                   help="file for the server's output ('-' = this terminal; default: a temporary file)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for the server's /health")
    p.add_argument("--allow-mismatch", action="store_true",
                   help="report completions that differ from the trainer's, but exit 0")
    p.add_argument("--tie-tolerance", type=float, default=None,
                   help="a completion may first differ from the trainer's where the trainer's two candidate "
                        "tokens are within this many nats (default: 0 = exact in float32, 0.5 in 16-bit dtypes)")
    p.add_argument("--cache-dir", default=None, help="cache root of the default model (see `rlserve download`)")
    p.set_defaults(func=run)


def run(args) -> int:
    from rlserve.demo import DemoOptions, run_demo

    if args.max_tokens < 1:
        print("rlserve demo: error: --max-tokens must be >= 1", file=sys.stderr)
        return 2
    opts = DemoOptions(
        model=args.model, backend=args.backend, port=args.port, max_tokens=args.max_tokens,
        tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization, dtype=args.dtype,
        server_args=shlex.split(args.server_args), server_log=args.server_log,
        startup_timeout_s=args.startup_timeout, allow_mismatch=args.allow_mismatch, cache_dir=args.cache_dir,
        tie_tolerance=args.tie_tolerance,
    )
    if args.prompts:
        opts.prompts = list(args.prompts)
    return run_demo(opts).exit_code
