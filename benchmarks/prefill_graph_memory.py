"""What the piecewise prefill CUDA graphs hold on the device, measured, against the reservation the KV
sizing makes for them (:func:`rlserve.engine.worker.prefill_graphs.reserve_bytes`, an upper bound
computed from the tensors): an engine of a ``benchmarks/model_shapes.py`` shape (random weights) built
with the graphs off, then the graphs of ``--buckets`` built and captured; the growth of
``torch.cuda.memory_reserved`` / ``memory_allocated`` across that is what they hold. Prints one JSON
line. On the CPU (``--device cpu``, a dry run) the pieces are emulated: nothing is measured there.

    python benchmarks/prefill_graph_memory.py --shape qwen3-0.6b --buckets 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b", help="a benchmarks/model_shapes.py shape, or 'tiny'")
    ap.add_argument("--buckets", default="1", help="RLSERVE_PREFILL_CUDA_GRAPHS's syntax (1: 256..8192)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    from rlserve import LLM
    from rlserve.engine.worker import prefill_graphs as pg

    dev = torch.device(args.device)
    with tempfile.TemporaryDirectory() as root:
        if args.shape == "tiny":
            from prefill_step import _tiny

            path = _tiny(root)
        else:
            from model_shapes import save_shape

            path = save_shape(args.shape, root)
        llm = LLM(path, dtype=args.dtype if dev.type == "cuda" else "float32", device=args.device,
                  load_format="dummy", skip_tokenizer_init=True, max_model_len=2048, block_size=16, num_kv_blocks=256,
                  max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
                  extra={"cuda_graph_sizes": [8], "prefill_cuda_graph_sizes": "0"})  # (not at the warm-up: below)
        runner = llm.engine.executor.runner
        runner.config.extra["prefill_cuda_graph_sizes"] = args.buckets
        if dev.type != "cuda":
            runner.config.extra["prefill_cuda_graphs_emulate"] = True
        estimate = pg.reserve_bytes(runner)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()  # (the capture gives its warm runs' blocks back: count from a clean cache)
            r0, a0 = torch.cuda.memory_reserved(dev), torch.cuda.memory_allocated(dev)
        runner._prefill_graphs_off = None
        ok = runner._prefill_graphs_ready()
        row = {"shape": args.shape, "device": str(dev), "buckets": runner.prefill_graphs.sizes if ok else None,
               "why_off": runner._prefill_graphs_off, "reserve_mib": round(estimate / 2**20, 1)}
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            row["reserved_growth_mib"] = round((torch.cuda.memory_reserved(dev) - r0) / 2**20, 1)
            row["allocated_growth_mib"] = round((torch.cuda.memory_allocated(dev) - a0) / 2**20, 1)
            row["card"] = torch.cuda.get_device_name(dev)
        print(json.dumps(row), flush=True)
        return row


if __name__ == "__main__":
    main()
