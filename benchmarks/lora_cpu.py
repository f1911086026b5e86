"""LoRA on the CPU engine (offline, float32): what ``--enable-lora`` and adapters cost per output token.

The model is SmolLM2-135M's shape with dummy weights (``benchmarks/model_shapes.py``); adapters are
random PEFT-format directories (``adapter_config.json`` written by PEFT's ``LoraConfig``, factors in
``adapter_model.safetensors``) on all seven projections at rank ``--rank``. Each case runs in a fresh
process (one engine thread, as the 2-core machine's default), its cases alternating over ``--reps``;
reported: CPU seconds and wall seconds per output token of one ``generate`` call (``--num-prompts``
token-id prompts of ``--prompt-len`` tokens, ``--max-tokens`` new tokens each, greedy, ``ignore_eos``).

Cases: ``base`` (no ``--enable-lora``), ``lora-off`` (``--enable-lora``, every request on the base
model), ``one`` (every request on one adapter, ``RLSERVE_LORA_MERGE=1``: the one-adapter fast path merges it
after 16 steps, :mod:`rlserve.lora.merge`; the merge is in the timed call), ``one-unmerged`` (the same
with ``RLSERVE_LORA_MERGE=0``: the per-token LoRA path), ``mixed`` (requests spread over the base model and
four adapters).

Usage:
    python benchmarks/lora_cpu.py --reps 3 --out benchmarks/results/lora-cpu-CPU-DATE.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CASES = ("base", "lora-off", "one", "one-unmerged", "mixed")

_CHILD = r"""
import json, sys, time
import torch
from rlserve import LLM, SamplingParams
model, adapters, case, n, plen, mt, rank = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], *map(int, sys.argv[4:8])
torch.set_num_threads(1)
kw = dict(enable_lora=True, max_loras=4, max_lora_rank=max(16, rank)) if case != "base" else {}
llm = LLM(model, device="cpu", dtype="float32", load_format="dummy", skip_tokenizer_init=True, seed=0, **kw)
if case in ("one", "one-unmerged", "mixed"):
    from rlserve.lora.model import lora_of
    for i, p in enumerate(adapters, 1):
        lora_of(llm.engine.model).load(i, p)
g = torch.Generator().manual_seed(0)
V = llm.engine.vocab_size
prompts = [torch.randint(10, V - 1, (plen,), generator=g).tolist() for _ in range(n)]
ids = {"base": [0] * n, "lora-off": [0] * n, "one": [1] * n, "one-unmerged": [1] * n,
       "mixed": [i % 5 for i in range(n)]}[case]
params = [SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True, lora_int_id=a) for a in ids]
# warm-up on the base model: the timed call pays the one-adapter fast path's merge
llm.generate(prompts[:2], [SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True)] * 2)
c0, w0 = time.process_time(), time.perf_counter()
outs = llm.generate(prompts, params)
cpu, wall = time.process_time() - c0, time.perf_counter() - w0
toks = sum(len(o.outputs[0].token_ids) for o in outs)
print(json.dumps({"case": case, "cpu_ms_per_token": 1e3 * cpu / toks, "wall_ms_per_token": 1e3 * wall / toks,
                  "tokens": toks}))
"""


def make_adapters(model_dir: str, out: str, rank: int, count: int) -> list[str]:
    """``count`` random rank-``rank`` adapters for the model at ``model_dir`` (all seven projections)."""
    import torch
    from peft import LoraConfig
    from safetensors.torch import save_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    h, i = cfg.hidden_size, cfg.intermediate_size
    d = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    paths = []
    for k in range(count):
        path = os.path.join(out, f"adapter{k}")
        LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=[m.split(".")[1] for m in shapes]).save_pretrained(path)
        g = torch.Generator().manual_seed(k)
        tensors = {}
        for layer in range(cfg.num_hidden_layers):
            for m, (o, n) in shapes.items():
                pre = f"base_model.model.model.layers.{layer}.{m}"
                tensors[f"{pre}.lora_A.weight"] = torch.randn(rank, n, generator=g) * 0.01
                tensors[f"{pre}.lora_B.weight"] = torch.randn(o, rank, generator=g) * 0.01
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        paths.append(path)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=None, help="also write every run's figures here (JSON)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from model_shapes import save_shape

    with tempfile.TemporaryDirectory() as tmp:
        model = save_shape(args.shape, os.path.join(tmp, "model"))
        adapters = make_adapters(model, tmp, args.rank, 4)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        results = {c: [] for c in CASES}
        for _ in range(args.reps):
            for case in CASES:
                out = subprocess.run([sys.executable, "-c", _CHILD, model, json.dumps(adapters), case,
                                      str(args.num_prompts), str(args.prompt_len), str(args.max_tokens),
                                      str(args.rank)], capture_output=True, text=True,
                                     env=dict(env, RLSERVE_LORA_MERGE="0" if case == "one-unmerged" else "1"))
                if out.returncode != 0:
                    sys.exit(f"case {case} failed (exit status {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
                results[case].append(json.loads(out.stdout.strip().splitlines()[-1]))
        load = os.getloadavg()[0]
        print(f"{args.shape}, rank {args.rank}, {args.num_prompts} prompts x {args.prompt_len} tokens, "
              f"{args.max_tokens} new each; load {load:.1f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), "load_end": load, "runs": results}, f, indent=1)
        for case in CASES:
            cpu = sorted(r["cpu_ms_per_token"] for r in results[case])
            wall = sorted(r["wall_ms_per_token"] for r in results[case])
            print(f"{case:12s} cpu ms/token {' '.join(f'{x:.2f}' for x in cpu)}   wall {' '.join(f'{x:.2f}' for x in wall)}")


if __name__ == "__main__":
    main()
