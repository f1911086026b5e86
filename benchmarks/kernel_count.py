"""Kernels a decoder layer launches in one decode step, counted on the CPU (no GPU): the CUDA code path of
the Llama-family forward (fused Triton kernels on, run by Triton's interpreter) on a tiny Qwen3 shape, with
and without the small-batch GEMM (``RLSERVE_DECODE_GEMM_ROWS``, :mod:`rlserve.layers.gemm_rows_kernels`; its
norm / SiLU-and-mul prologues as their own kernels, the default, or folded in: ``RLSERVE_DECODE_GEMM_ROWS_FOLD=1``)
and the batch-1 GEMV (``RLSERVE_DECODE_GEMV``).

What counts as a kernel: every Triton launch (by kernel name), and every ATen op that is not a view or an
allocation (on a GPU each is one kernel; ``mm`` / ``addmm`` are cuBLAS GEMMs). A layer's count is the
difference between a 4-layer and a 2-layer model's step, halved, so the embedding, the final norm and the
logits drop out. What the CPU cannot show: the extra reduce kernel cuBLAS launches where it splits K
(on an H100, 72 in a Qwen3-8B batch-1 step: 2 a layer, BENCHMARKS.md D2) -- the small-batch GEMM reduces
its split in the same launch, so each of its GEMMs is one kernel wherever cuBLAS's is one or two.

``--prefill N[,N...]``: instead, the kernels a layer launches in an eager prefill step of ``N`` prompt tokens
(one prompt; ``--mixed D``: with ``D`` decode rows first, as ``--mixed-prefill-decode`` schedules them), and
per layer the host syncs (:data:`SYNC_OPS`: ``item()`` / ``bool()`` / ``int()`` of a tensor, ``nonzero``, a
boolean-mask index, ``tolist()`` / ``cpu()`` / ``numpy()`` -- on the interpreter path every tensor is a CPU
tensor, so a sync is counted where the CUDA path would wait for the GPU) and the Python function calls the
rlserve package makes (a steady proxy for the step's host cost; Triton's launcher and the interpreter not
included). The step-constant work is counted once per step (a 4-layer minus 2-layer difference cancels it):
``per_step`` reports the 2-layer step's total for the embedding / metadata / LM head share.

Usage (seconds on the 2-core CPU):
    python benchmarks/kernel_count.py --batch 1,4,16 [--json out.json]
    python benchmarks/kernel_count.py --prefill 16,64 --mixed 4
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
# ATen ops after which the host has the device's answer (on a GPU: a wait for the stream)
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "equal"}
# Tensor methods that read values on the host (not ATen ops on a CPU tensor, so patched)
SYNC_METHODS = ("tolist", "cpu", "numpy")


class Counter(TorchDispatchMode):
    """Counts ATen ops outside Triton launches (inside one, the interpreter's own tensor work is not
    a kernel) and Triton launches by kernel name."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.depth = 0
        self.active = False

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if self.depth == 0:
            if name in SYNC_OPS or (name == "index" and _bool_index(args)):
                self.counts[f"sync::{name}"] += 1
            if name not in NO_KERNEL:
                self.counts[f"aten::{name}"] += 1
        return func(*args, **(kwargs or {}))


def _bool_index(args) -> bool:
    """An ``aten::index`` with a boolean mask (its output size is read on the host)."""
    idx = args[1] if len(args) > 1 else ()
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in idx or ())


def _patch_sync_methods(counter: Counter) -> None:
    """Count :data:`SYNC_METHODS` calls made while ``counter`` is active (outside Triton launches)."""
    for meth in SYNC_METHODS:
        orig = getattr(torch.Tensor, meth)

        def wrapped(self, *a, _orig=orig, _name=meth, **kw):
            if counter.active and counter.depth == 0:
                counter.counts[f"sync::{_name}"] += 1
            return _orig(self, *a, **kw)

        setattr(torch.Tensor, meth, wrapped)


class PyCalls:
    """``sys.setprofile`` counter of Python function calls in rlserve's files while active (calls inside
    a Triton launch or a counted GEMM excluded: ``counter.depth``)."""

    def __init__(self, counter: Counter):
        self.counter = counter
        self.n = 0

    def _prof(self, frame, event, arg):
        if event == "call" and self.counter.depth == 0 and "/rlserve/" in frame.f_code.co_filename:
            self.n += 1

    def __enter__(self):
        self.n = 0
        sys.setprofile(self._prof)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


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


def build(path: str, max_b: int, ctx: int = 16, prompt: int = 0):
    """An engine on the CPU with the CUDA path's attention backend, for ``max_b`` sequences of ``ctx``
    tokens and one prompt of ``prompt`` tokens."""
    from rlserve import LLM

    per_seq = -(-(ctx + 1) // 16)
    return LLM(path, dtype="float32", device="cpu", load_format="dummy", skip_tokenizer_init=True,
               max_model_len=max(ctx, prompt) + 16, max_num_seqs=max_b + 1, block_size=16,
               num_kv_blocks=max_b * per_seq + -(-prompt // 16) + 2, max_num_batched_tokens=max(prompt + max_b, 256),
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


def prefill_counts(llm, n: int, decodes: int, counter: Counter, ctx: int = 16) -> collections.Counter:
    """The kernels and host syncs of one eager prefill forward of an ``n``-token prompt after ``decodes``
    decode rows (context ``ctx``), and ``pycalls``: rlserve's Python function calls in it."""
    from rlserve.engine.worker.model_runner import StepInput

    per_seq = -(-(ctx + 1) // 16)
    d = decodes
    step = StepInput(input_ids=[1] * (d + n), positions=[ctx - 1] * d + list(range(n)),
                     query_lens=[1] * d + [n], seq_lens=[ctx] * d + [n],
                     block_tables=[list(range(i * per_seq, (i + 1) * per_seq)) for i in range(d)]
                     + [list(range(d * per_seq, d * per_seq + -(-n // 16)))],
                     logits_indices=list(range(d)) + [d + n - 1], is_prefill=True)
    runner = llm.engine.executor.runner
    runner.execute(step)  # warm: nothing first-time in the count
    counter.counts.clear()
    with counter, PyCalls(counter) as calls:
        runner.execute(step)
    out = collections.Counter(counter.counts)
    out["pycalls"] = calls.n
    return out


def main_prefill(args) -> dict:
    """``--prefill``: per layer and per step, kernels, host syncs and Python calls of prefill steps."""
    from rlserve.layers import fused_ops

    fused_ops.set_fused_kernels(True, on_cpu=True)
    counter = Counter()
    _patch_triton_launches(counter)
    _patch_sync_methods(counter)
    sizes = [int(x) for x in args.prefill.split(",")]
    out = []
    with tempfile.TemporaryDirectory() as root:
        llms = {n: build(tiny_qwen3(root, n), max(args.mixed, 1), prompt=max(sizes)) for n in (2, 4)}
        for n in sizes:
            for d in sorted({0, args.mixed}):
                c2, c4 = (prefill_counts(llms[k], n, d, counter) for k in (2, 4))
                layer = {k: (c4[k] - c2[k]) / 2 for k in set(c4) | set(c2) if c4[k] != c2[k]}
                step = {k: c2[k] - 2 * layer.get(k, 0) for k in c2 if c2[k] - 2 * layer.get(k, 0)}
                kern = {k: v for k, v in layer.items() if not k.startswith("sync::") and k != "pycalls"}
                row = {"prefill_tokens": n, "decode_rows": d, "kernels_per_layer": sum(kern.values()),
                       "syncs_per_layer": sum(v for k, v in layer.items() if k.startswith("sync::")),
                       "pycalls_per_layer": layer.get("pycalls", 0), "per_layer": dict(sorted(layer.items())),
                       "per_step_outside_layers": dict(sorted(step.items()))}
                out.append(row)
                print(f"prefill {n:5d} + {d:3d} decode rows: {row['kernels_per_layer']:5.1f} kernels, "
                      f"{row['syncs_per_layer']:g} syncs, {row['pycalls_per_layer']:g} rlserve Python calls a layer: "
                      + ", ".join(f"{k.split('::')[-1]} {v:g}" for k, v in row["per_layer"].items()
                                  if k != "pycalls"), flush=True)
                print("   outside the layers (per step): " + ", ".join(f"{k} {v:g}" for k, v in step.items()),
                      flush=True)
    return {"rows": out}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,4,16")
    ap.add_argument("--prefill", default="", help="N[,N...]: count eager prefill steps of N tokens instead")
    ap.add_argument("--mixed", type=int, default=0, metavar="D", help="with --prefill: also D decode rows first")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.prefill:
        res = main_prefill(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res["rows"], f, indent=1)
        return res
    from rlserve.layers import fused_ops, gemv

    fused_ops.set_fused_kernels(True, on_cpu=True)  # the CUDA path's kernels, through the interpreter
    counter = Counter()
    _patch_triton_launches(counter)
    # (GEMV on, GEMM rows, GEMM prologues folded): the small-batch GEMM as RLSERVE_DECODE_GEMM_ROWS=64 runs it
    # (RLSERVE_DECODE_GEMM_ROWS_FOLD=0, the default since session 18: one fused norm / SiLU-and-mul kernel
    # before each plain GEMM) and with the prologues folded in (=1)
    modes = {"cuBLAS (GEMV off)": (False, 0, False), "GEMV b1 + cuBLAS (default)": (True, 0, False),
             "GEMV b1 + GEMM 2..64 (ROWS=64)": (True, 64, False),
             "GEMV b1 + GEMM 2..64 folded (FOLD=1)": (True, 64, True)}
    out = []
    batches = [int(b) for b in args.batch.split(",")]
    with tempfile.TemporaryDirectory() as root:
        llms = {n: build(tiny_qwen3(root, n), max(batches)) for n in (2, 4)}
        for B in batches:
            for label, (on, rows, fold) in modes.items():
                gemv.set_enabled(on)  # decided per call: no CUDA graphs on the CPU
                gemv.set_rows(rows)
                gemv.set_rows_fold(fold)
                c2, c4 = (step_counts(llms[n], B, counter) for n in (2, 4))
                layer = {k: (c4[k] - c2[k]) / 2 for k in set(c4) | set(c2) if c4[k] != c2[k]}
                row = {"batch": B, "mode": label, "kernels_per_layer": sum(layer.values()),
                       "per_layer": dict(sorted(layer.items()))}
                out.append(row)
                print(f"B={B:3d} {label:36s} {row['kernels_per_layer']:5.1f} a layer: "
                      + ", ".join(f"{k.split('::')[1]} {v:g}" for k, v in row["per_layer"].items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return {"rows": out}


if __name__ == "__main__":
    main()
