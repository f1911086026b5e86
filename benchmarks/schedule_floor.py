"""The HBM floor of the offline workload for a big model shape at a given KV-cache size, from
rlserve's own scheduler run on the CPU with a tiny stand-in model (issue 35: can the
Qwen3-30B-A3B shape reach 1.3x vLLM on one GPU?).

The schedule of ``benchmarks/throughput.py``'s workload (which steps run, how many tokens and
sequences each, how many cached tokens each sequence attends to) depends on the sequences'
lengths, the KV capacity in blocks and the scheduler's limits, not on the model's weights. So
this runs that workload through ``rlserve.LLM`` on the CPU with ``--stand-in`` (a small model
of the same architecture), with the CUDA scheduler settings (``max_num_batched_tokens`` 8192,
one prefill step at a time while sequences run) and ``num_kv_blocks`` = ``--kv-tokens`` / 16,
records every step (:class:`workload_floor.FloorRecorder`'s trace) and prices each step for
``--shape``: bytes = every non-expert weight once (the input embedding not: one row a token),
of each MoE layer the experts a batch of ``n`` tokens is expected to touch under uniform
top-k routing, ``E * (1 - (1 - K / E) ** n)`` (:func:`decode_step.weight_bytes`'s rule), plus
the KV of every attended token (layers x 2 x kv_heads x head_dim x 2 bytes, bf16); seconds =
bytes / ``--bandwidth`` (read + write bytes of a device copy per second: 3.02e12 on the H100 80GB
HBM3, BENCHMARKS.md "Offline workload vs its own HBM floor"). Prefill steps are compute-bound:
their bytes floor is a loose bound, reported apart.

What it cannot say: vLLM's own schedule (it mixes decode tokens into its prefill steps); the
``--kv-tokens`` of vLLM's run under rlserve's scheduler is the nearest stand-in.

    python benchmarks/schedule_floor.py --kv-tokens 158768,147776 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_shapes import save_shape, shape_config  # noqa: E402
from throughput import make_workload  # noqa: E402
from workload_floor import FloorRecorder  # noqa: E402

BLOCK = 16  # rlserve's default block size (tokens a KV block)


def shape_bytes(cfg) -> dict:
    """bf16 bytes of a (Qwen3-MoE) shape: ``dense`` (attention, norms, routers, LM head: read once
    a step; the input embedding left out), ``expert`` (one expert of one layer: gate + up + down),
    ``kv_token`` (one token's K and V over all layers)."""
    H, L = cfg.hidden_size, cfg.num_hidden_layers
    hd = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    attn = H * q + 2 * H * kv + q * H + 2 * hd + 2 * H  # q, k, v, o; q/k norms; the two RMSNorms
    E = getattr(cfg, "num_experts", 0)
    router = H * E
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * H
    return {"dense": 2 * (L * (attn + router) + head + H), "expert": 2 * 3 * H * cfg.moe_intermediate_size,
            "experts": E, "top_k": cfg.num_experts_per_tok, "layers": L, "kv_token": 2 * L * 2 * kv}


def step_bytes(sb: dict, tokens: int, attended: int) -> tuple[float, float]:
    """``(weight bytes, KV bytes)`` one step of ``tokens`` tokens attending ``attended`` tokens reads."""
    E, K = sb["experts"], sb["top_k"]
    used = E * (1 - (1 - K / E) ** tokens)
    return sb["dense"] + sb["layers"] * sb["expert"] * used, sb["kv_token"] * attended


def run_schedule(stand_in: str, kv_tokens: int, args, root: str) -> list[dict]:
    """The workload through rlserve on the CPU with ``stand_in``; the step trace."""
    from rlserve import LLM, SamplingParams

    prompts, out_lens = make_workload(args.num_seqs, args.min_len, args.max_len, shape_config(args.shape).vocab_size,
                                      args.seed)
    vocab = shape_config(stand_in).vocab_size
    prompts = [[t % vocab for t in p] for p in prompts]
    llm = LLM(save_shape(stand_in, root), dtype="float32", device="cpu", load_format="dummy", skip_tokenizer_init=True,
              max_model_len=2 * args.max_len + 8, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=8192,
              max_consecutive_prefill_steps=1, num_kv_blocks=-(-kv_tokens // BLOCK), seed=args.seed)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in out_lens]
    rec = FloorRecorder(llm.engine)
    with rec:
        outs = llm.generate(prompts, params)
    assert sum(len(o.outputs[0].token_ids) for o in outs) == sum(out_lens)
    kv_tok = rec.kv_tok
    return [{"kind": s["kind"], "tokens": s["tokens"], "seqs": s["seqs"], "attended": s["kv_bytes"] // kv_tok}
            for s in rec.trace if s["kind"] != "end"]


def price(trace: list[dict], sb: dict, bw: float) -> dict:
    out = {}
    for kind, name in (("P", "prefill"), ("D", "decode")):
        steps = [s for s in trace if s["kind"] == kind]
        wb = kb = 0.0
        for s in steps:
            w, k = step_bytes(sb, s["tokens"], s["attended"])
            wb, kb = wb + w, kb + k
        out[name] = {"steps": len(steps), "tokens": sum(s["tokens"] for s in steps),
                     "weight_bytes": wb, "kv_bytes": kb, "floor_s": (wb + kb) / bw,
                     "mean_batch": (sum(s["seqs"] for s in steps) / len(steps)) if steps else 0.0}
    out["floor_s"] = out["prefill"]["floor_s"] + out["decode"]["floor_s"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", help="the shape priced (model_shapes.py)")
    ap.add_argument("--stand-in", default="small-qwen3-moe", help="the model that runs the schedule on the CPU")
    ap.add_argument("--kv-tokens", default="158768,147776",
                    help="comma-separated KV capacities in tokens (default: rlserve's and vLLM 0.24's on the H100, s15)")
    ap.add_argument("--bandwidth", type=float, default=3.02e12, help="device copy bytes/s (read + write)")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    sb = shape_bytes(shape_config(args.shape))
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for kv in (int(x) for x in args.kv_tokens.split(",")):
            t0 = time.perf_counter()
            trace = run_schedule(args.stand_in, kv, args, root)
            r = {"kv_tokens": kv, **price(trace, sb, args.bandwidth), "cpu_s": time.perf_counter() - t0}
            rows.append(r)
            d, p = r["decode"], r["prefill"]
            print(f"KV {kv:7d} tokens: floor {r['floor_s']:.2f} s = decode {d['floor_s']:.2f} s ({d['steps']} steps, "
                  f"mean batch {d['mean_batch']:.1f}; weights {d['weight_bytes'] / 1e12:.2f} TB, KV "
                  f"{d['kv_bytes'] / 1e12:.2f} TB) + prefill {p['floor_s']:.2f} s ({p['steps']} steps)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "shape_bytes": sb, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
