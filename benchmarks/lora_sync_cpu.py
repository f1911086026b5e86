"""The adapter-only sync's per-tensor host work, counted on a CPU (the GPU numbers: benchmarks/lora_gpu.py).

An adapter sync of Qwen3-8B moves 504 factors (36 layers x 7 projections x A, B). What its cost does not
scale with is per-tensor work: Python and one kernel launch per small op. Two parts of it, measured here
with the Qwen3-8B layer structure (36 layers: packed q/k/v, o, packed gate/up, down; 144 LoRA layers) at
tiny widths so that only the per-op cost is left:

- commit: the received factors made into a served adapter on the kernel path's slot buffers, the
  module-by-module path (``adapter_from_parts`` + ``LoRALinear.add``, before session 14) vs the batched one
  (:mod:`rlserve.lora.slots`, four ``torch._foreach_*`` calls); reported: the memory-writing aten ops called
  from Python (``torch.profiler``; each one a kernel launch on CUDA, a ``_foreach_`` op one per chunk of its
  list), and wall ms on this CPU, median of ``--reps``;
- trainer: ``LoRASource.named_tensors()`` of a 36-layer PEFT model (every sync lists its factors: before
  session 14 each call walked the model's parameters, ``named_parameters_walk_ms``; now the constructor
  does, once).

Usage: python benchmarks/lora_sync_cpu.py [--reps 20] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYERS, HIDDEN, KV, INTER, RANK, MAX_RANK = 36, 64, 16, 96, 16, 16
_VIEWS = {"aten::select", "aten::slice", "aten::as_strided", "aten::view", "aten::alias", "aten::detach",
          "aten::t", "aten::transpose", "aten::expand", "aten::unsqueeze", "aten::reshape", "aten::_reshape_alias",
          "aten::contiguous", "aten::to", "aten::lift_fresh", "aten::empty", "aten::empty_strided", "aten::isfinite",
          "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense"}


def _lora_layers(slots: int = 2):
    from rlserve.lora.layers import LoRALinear

    out, targets = [], {}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        for slices, fin in (([(f"{p}.self_attn.q_proj", 0, HIDDEN), (f"{p}.self_attn.k_proj", HIDDEN, KV),
                              (f"{p}.self_attn.v_proj", HIDDEN + KV, KV)], HIDDEN),
                            ([(f"{p}.self_attn.o_proj", 0, HIDDEN)], HIDDEN),
                            ([(f"{p}.mlp.gate_proj", 0, INTER), (f"{p}.mlp.up_proj", INTER, INTER)], HIDDEN),
                            ([(f"{p}.mlp.down_proj", 0, HIDDEN)], INTER)):
            lin = LoRALinear(slices, fin)
            lin.use_slots(slots, MAX_RANK, torch.bfloat16, "cpu")
            out.append(lin)
            targets.update({m: (n, fin) for m, _, n in slices})
    return out, targets


def _parts(targets, g):
    return {m: {"A": torch.randn(RANK, fin, generator=g), "B": torch.randn(out, RANK, generator=g)}
            for m, (out, fin) in targets.items()}


def commit(reps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from rlserve.lora.adapter import adapter_from_parts
    from rlserve.lora.slots import slot_plan, write_slots

    layers, targets = _lora_layers()
    g = torch.Generator().manual_seed(0)

    def old(parts):
        ad = adapter_from_parts(parts, RANK, 2.0, targets, torch.bfloat16, "cpu", "bench", check_finite=False)
        for lin in layers:
            lin.add(1, ad.weights, 1)

    def new(parts):
        write_slots(slot_plan(layers, parts, 1), 2.0)

    res = {"tensors": 2 * len(targets), "lora_layers": len(layers)}
    for name, fn in (("module_by_module", old), ("batched", new)):
        walls = []
        for _ in range(reps):
            parts = _parts(targets, g)
            t = time.perf_counter()
            fn(parts)
            walls.append(time.perf_counter() - t)
        parts = _parts(targets, g)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn(parts)
        ops = [e for e in prof.events() if e.name.startswith("aten::")]
        # ops called from Python (not from inside another op) that write memory: one launch each on CUDA,
        # except a _foreach_ op, which launches one kernel per chunk of its list there (here its CPU
        # fallback runs per tensor inside it)
        top = [e.name for e in ops if (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
               and e.name not in _VIEWS]
        res[name] = {"wall_ms_median": round(statistics.median(walls) * 1e3, 2), "writing_ops_from_python": len(top),
                     "foreach_calls": sum(n.startswith("aten::_foreach") for n in top)}
    return res


def trainer(reps: int) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlserve.transfer import LoRASource

    cfg = LlamaConfig(vocab_size=128, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=1)
    peft = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    t = time.perf_counter()
    src = LoRASource(peft, "policy")  # finds the factors' modules (one walk of the parameters)
    first = time.perf_counter() - t
    n = len(list(src.named_tensors()))
    walls = []
    for _ in range(reps):
        t = time.perf_counter()
        list(src.named_tensors())
        walls.append(time.perf_counter() - t)
    t = time.perf_counter()
    list(peft.named_parameters())
    walk = time.perf_counter() - t
    return {"tensors": n, "constructor_ms": round(first * 1e3, 2), "named_tensors_ms_median": round(
        statistics.median(walls) * 1e3, 2), "named_parameters_walk_ms": round(walk * 1e3, 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    res = {"date": time.strftime("%Y-%m-%d"), "load_1min": round(os.getloadavg()[0], 1), "commit": commit(args.reps),
           "trainer": trainer(args.reps)}
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
