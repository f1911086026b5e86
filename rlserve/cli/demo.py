"""``rlserve demo``: dummy weights -> gibberish; trainer syncs the real weights -> the trainer's own text.

The logic lives in :mod:`rlserve.demo` (shared with ``examples/``); this module only parses flags.
"""

from __future__ import annotations

import sys

from rlserve.cli._help import HelpFormatter


def register(subparsers) -> None:
    from rlserve.demo import add_demo_arguments

    p = subparsers.add_parser(
        "demo", help="the RL weight-sync story end to end: dummy weights, sync from a trainer, check",
        description="Start `rlserve serve MODEL --load-format dummy --weight-transfer-config ...` (random "
                    "weights), generate greedily (gibberish), load the real weights in a Hugging Face trainer "
                    "model, pause, push them through the trainer SDK, resume, generate again, and check that "
                    "every completion equals the trainer model's own greedy generate (exit status 3 if not). "
                    "Backend by machine: gloo on CPU, CUDA IPC on one GPU, NCCL on two or more.",
        formatter_class=HelpFormatter,
    )
    add_demo_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    """Exit status 2 with one line for a setting the machine cannot run (``--backend nccl`` / ``ipc``
    without GPUs, a TP larger than the GPUs) or a ``--model`` that is no local model directory nor
    the default model's name (as ``rlserve serve``), before anything starts; else :func:`run_demo`'s."""
    from rlserve.default_model import UnknownModelError
    from rlserve.demo import DemoError, choose_layout, demo_options, run_demo
    from rlserve.download import check_model_arg

    try:
        opts = demo_options(args)
        choose_layout(opts.backend, opts.tensor_parallel_size, opts.num_gpus, opts.dtype)
        check_model_arg(opts.model)
    except (DemoError, UnknownModelError) as e:
        print(f"rlserve demo: error: {e}", file=sys.stderr)
        return 2
    return run_demo(opts).exit_code
