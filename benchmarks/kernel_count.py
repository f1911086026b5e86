"""Kernels a decoder layer launches in one decode step, counted on the CPU (no GPU): the CUDA code path of
the Llama-family forward (fused Triton kernels on, run by Triton's interpreter) on a tiny Qwen3 shape, with
and without the small-batch GEMM (``RLSERVE_DECODE_GEMM_ROWS``, :mod:`rlserve.layers.gemm_rows_kernels`)
and the batch-1 GEMV (``RLSERVE_DECODE_GEMV``).

What counts as a kernel: every Triton launch (by kernel name), and every ATen op that is not a view or an
allocation (on a GPU each is one kernel; ``mm`` / ``addmm`` are cuBLAS GEMMs). A layer's count is the
difference between a 4-layer and a 2-layer model's step, halved, so the embedding, the final norm and the
logits drop out. What the CPU cannot show: the extra reduce kernel cuBLAS launches where it splits K
(on an H100, 72 in a Qwen3-8B batch-1 step: 2 a layer, BENCHMARKS.md D2) -- the small-batch GEMM reduces
its split in the same launch, so each of its GEMMs is one kernel wherever cuBLAS's is one or two.

Usage (seconds on the 2-core CPU):
    python benchmarks/kernel_count.py --batch 1,4,16 [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ATen ops that launch nothing on a GPU (views, metadata, allocations)
NO_KERNEL = {"view", "_unsafe_view", "slice", "split", "split_with_sizes", "t", "transpose", "as_strided",
             "expand", "unsqueeze", "squeeze", "select", "detach", "alias", "permute", "empty", "empty_strided",
             "empty_like", "reshape", "unbind", "narrow", "lift_fresh", "_to_copy_meta", "is_same_size",
             "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "_local_scalar_dense"}


class Counter(TorchDispatchMode):
    """Counts ATen ops outside Triton launches (inside one, the interpreter's own tensor work is not
    a kernel) and Triton launches by kernel name."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if self.depth == 0 and name not in NO_KERNEL:
            self.counts[f"aten::{name}"] += 1
        return func(*args, **(kwargs or {}))


def _patch_triton_launches(counter: Counter):
    """Wrap the interpreter's launch so every Triton kernel launch is counted (and its inner work not)."""
    from triton.runtime import interpreter

    run = interpreter.InterpretedFunction.run

    def counted(self, *a, **kw):
        if counter.depth == 0:
            counter.counts[f"triton::{self.fn.__name__}"] += 1
        counter.depth += 1
        try:
            return run(self, *a, **kw)
        finally:
            counter.depth -= 1

    interpreter.InterpretedFunction.run = counted
    from rlserve.layers.linear import UnquantizedLinearMethod

    apply = UnquantizedLinearMethod.apply

    def gemm(self, layer, x, bias=None):
        counter.counts["cuBLAS::gemm (linear module)"] += 1
        counter.depth += 1
        try:
            return apply(self, layer, x, bias)
        finally:
            counter.depth -= 1

    UnquantizedLinearMethod.apply = gemm


def tiny_qwen3(root: str, layers: int) -> str:
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"])
    path = os.path.join(root, f"qwen3-{layers}l")
    cfg.save_pretrained(path)
    return path


def build(path: str, max_b: int, ctx: int = 16):
    from rlserve import LLM

    per_seq = -(-(ctx + 1) // 16)
    return LLM(path, dtype="float32", device="cpu", load_format="dummy", skip_tokenizer_init=True,
               max_model_len=ctx + 16, max_num_seqs=max_b, block_size=16, num_kv_blocks=max_b * per_seq + 2,
               enable_prefix_caching=False, extra={"attention_backend": "triton"})  # the CUDA default


def step_counts(llm, B: int, counter: Counter, ctx: int = 16) -> collections.Counter:
    """The kernels of one decode forward (graphs off) of ``B`` sequences of ``ctx`` tokens."""
    from rlserve.engine.worker.model_runner import StepInput

    per_seq = -(-(ctx + 1) // 16)
    runner = llm.engine.executor.runner
    step = StepInput(input_ids=[1] * B, positions=[ctx - 1] * B, query_lens=[1] * B, seq_lens=[ctx] * B,
                     block_tables=[list(range(i * per_seq, (i + 1) * per_seq)) for i in range(B)],
                     logits_indices=list(range(B)), is_prefill=False)
    runner.execute(step)  # warm: nothing first-time in the count
    counter.counts.clear()
    with counter:
        runner.execute(step)
    return collections.Counter(counter.counts)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,4,16")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from rlserve.layers import fused_ops, gemv

    fused_ops.set_fused_kernels(True, on_cpu=True)  # the CUDA path's kernels, through the interpreter
    counter = Counter()
    _patch_triton_launches(counter)
    modes = {"cuBLAS (GEMV off)": (False, 0), "GEMV b1 + cuBLAS (old default)": (True, 0),
             "GEMV b1 + GEMM 2..64 (new)": (True, 64)}
    out = []
    batches = [int(b) for b in args.batch.split(",")]
    with tempfile.TemporaryDirectory() as root:
        llms = {n: build(tiny_qwen3(root, n), max(batches)) for n in (2, 4)}
        for B in batches:
            for label, (on, rows) in modes.items():
                gemv.set_enabled(on)  # decided per call: no CUDA graphs on the CPU
                gemv.set_rows(rows)
                c2, c4 = (step_counts(llms[n], B, counter) for n in (2, 4))
                layer = {k: (c4[k] - c2[k]) / 2 for k in set(c4) | set(c2) if c4[k] != c2[k]}
                row = {"batch": B, "mode": label, "kernels_per_layer": sum(layer.values()),
                       "per_layer": dict(sorted(layer.items()))}
                out.append(row)
                print(f"B={B:3d} {label:32s} {row['kernels_per_layer']:5.1f} a layer: "
                      + ", ".join(f"{k.split('::')[1]} {v:g}" for k, v in row["per_layer"].items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return {"rows": out}


if __name__ == "__main__":
    main()
