"""Error of online fp8 W8A8 (``--quantization fp8``) against the unquantized model.

Runs the same prompts through four variants of one checkpoint, on rlserve's own model code
(paged KV cache, batched prefill, then batched greedy decode):

    fp32            float32 weights and activations (the reference)
    bf16            bfloat16 weights and activations (what a GPU server runs unquantized)
    fp8 (fp32 act)  fp8 weights, activations quantized per token from float32, float32 out
    fp8 (bf16 act)  fp8 weights, activations quantized per token from bfloat16, bf16 out
                    (what ``--quantization fp8`` serves on a GPU)

and prints, for each variant against fp32 and against bf16:

- teacher-forced logits over every prompt position: max |Δ|, mean |Δ|, relative error
  ``||Δ||_F / ||ref||_F``, mean KL(ref || variant) in nats, top-1 agreement;
- free-running greedy generation of ``--gen`` tokens per prompt: the fraction of generated
  positions whose token equals the reference's token at that position, and the mean number
  of tokens before the first divergence.

On CPU the fp8 variants use the emulated path (the same function as ``torch._scaled_mm``);
on a CUDA device with compute capability >= 8.9 they use ``torch._scaled_mm``.

Usage:
    python benchmarks/fp8_error.py                               # tiny random-init models (CI shapes)
    python benchmarks/fp8_error.py --model /path/to/SmolLM2-135M-Instruct --device cuda
    python benchmarks/fp8_error.py --model default              # the cached default model
    python benchmarks/fp8_error.py --json out.json              # also write the numbers
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rlserve.config import EngineConfig  # noqa: E402
from rlserve.layers.attention import Attention, AttentionMetadata  # noqa: E402
from rlserve.loader import load_model  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "Reinforcement learning from human feedback trains a policy by",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time there was a tiny model that",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Water boils at a temperature of",
    "Here is a list of the planets of the solar system, in order from the sun:",
    "In 1969, the first humans to walk on the Moon were",
]

VARIANTS = [
    ("fp32", torch.float32, None),
    ("bf16", torch.bfloat16, None),
    ("fp8 (fp32 act)", torch.float32, "fp8"),
    ("fp8 (bf16 act)", torch.bfloat16, "fp8"),
]

BLOCK = 16


def tokenize(path: str, vocab: int, n: int) -> list[list[int]]:
    """Token ids of the first ``n`` prompts (random ids when the model has no tokenizer)."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        return [tok(p, add_special_tokens=False)["input_ids"] for p in (PROMPTS * n)[:n]]
    except Exception:  # noqa: BLE001 - no tokenizer: random prompts
        g = torch.Generator().manual_seed(0)
        return [torch.randint(3, vocab, (12 + 3 * i,), generator=g).tolist() for i in range(n)]


@torch.inference_mode()
def run(model, prompts: list[list[int]], gen: int, device: torch.device, dtype: torch.dtype):
    """Prefill every prompt (logits of all positions), then ``gen`` batched greedy decode steps.

    Returns:
        ``(prefill_logits [sum(len)] x V float32 on CPU, list of generated token lists)``.
    """
    seqs = [list(p) for p in prompts]
    max_len = max(len(p) for p in prompts) + gen
    per_seq = -(-max_len // BLOCK)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(seqs))]
    for m in model.modules():
        if isinstance(m, Attention):
            shape = (per_seq * len(seqs), BLOCK, m.num_kv_heads, m.head_dim)
            m.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            m.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    def step(query_lens):
        ids, pos = [], []
        for s, q in zip(seqs, query_lens):
            ids += s[len(s) - q:]
            pos += list(range(len(s) - q, len(s)))
        meta = AttentionMetadata.build(query_lens, [len(s) for s in seqs], tables, BLOCK, device)
        hidden = model(torch.tensor(ids, device=device), torch.tensor(pos, device=device), meta)
        return model.compute_logits(hidden)

    qlens = [len(s) for s in seqs]
    logits = step(qlens)
    prefill = logits.float().cpu()
    last = torch.cumsum(torch.tensor(qlens), 0) - 1
    nxt = logits[last.to(logits.device)].argmax(-1).tolist()
    outs = [[] for _ in seqs]
    for t in range(gen):
        for i, tok in enumerate(nxt):
            seqs[i].append(tok)
            outs[i].append(tok)
        if t == gen - 1:
            break
        nxt = step([1] * len(seqs)).argmax(-1).tolist()
    return prefill, outs


def compare(ref_logits, ref_tokens, logits, tokens) -> dict:
    d = logits - ref_logits
    logp_ref = torch.log_softmax(ref_logits, -1)
    logp = torch.log_softmax(logits, -1)
    kl = (logp_ref.exp() * (logp_ref - logp)).sum(-1).mean().item()
    same = total = 0
    prefix = []
    for a, b in zip(ref_tokens, tokens):
        eq = [x == y for x, y in zip(a, b)]
        same += sum(eq)
        total += len(eq)
        prefix.append(eq.index(False) if False in eq else len(eq))
    return {
        "max_abs": d.abs().max().item(),
        "mean_abs": d.abs().mean().item(),
        "rel_fro": (d.norm() / ref_logits.norm()).item(),
        "kl": kl,
        "top1": (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(),
        "greedy_agree": same / max(total, 1),
        "prefix_mean": sum(prefix) / max(len(prefix), 1),
        "logits_absmax_ref": ref_logits.abs().max().item(),
    }


def measure(path: str, device: torch.device, n_prompts: int, gen: int, variants=VARIANTS) -> dict:
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(path)
    prompts = tokenize(path, hf_config.vocab_size, n_prompts)
    results = {}
    for name, dtype, quant in variants:
        cfg = EngineConfig(model=path, device=str(device), dtype=str(dtype).replace("torch.", ""), quantization=quant)
        t0 = time.perf_counter()
        model = load_model(cfg, hf_config, device, dtype)
        t_load = time.perf_counter() - t0
        t0 = time.perf_counter()
        logits, tokens = run(model, prompts, gen, device, dtype)
        results[name] = {"logits": logits, "tokens": tokens, "load_s": t_load, "run_s": time.perf_counter() - t0}
        del model
    table = {}
    for base in ("fp32", "bf16"):
        for name in results:
            if name == base or (base == "bf16" and name == "fp32"):
                continue
            r, v = results[base], results[name]
            table[f"{name} vs {base}"] = compare(r["logits"], r["tokens"], v["logits"], v["tokens"])
    return {
        "model": path,
        "device": str(device),
        "prompts": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "gen_tokens_per_prompt": gen,
        "table": table,
        "timings": {k: {"load_s": v["load_s"], "run_s": v["run_s"]} for k, v in results.items()},
        "sample": {k: v["tokens"][0][:16] for k, v in results.items()},
    }


def print_table(res: dict) -> None:
    print(f"\n## {res['model']}  ({res['device']}, {res['prompts']} prompts, {res['prompt_tokens']} prompt tokens, "
          f"{res['gen_tokens_per_prompt']} greedy tokens each; |ref logits| max "
          f"{next(iter(res['table'].values()))['logits_absmax_ref']:.2f})")
    hdr = ("comparison", "max|Δ|", "mean|Δ|", "rel", "KL", "top-1", "greedy", "prefix")
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for k, m in res["table"].items():
        print(f"| {k} | {m['max_abs']:.4f} | {m['mean_abs']:.5f} | {m['rel_fro']:.4f} | {m['kl']:.2e} | "
              f"{100 * m['top1']:.1f}% | {100 * m['greedy_agree']:.1f}% | {m['prefix_mean']:.1f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None,
                    help="HF checkpoint directory, or 'default' for the cached SmolLM2-135M-Instruct "
                         "(default: tiny random-init models of the CI architectures)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--gen", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--archs", default="llama,qwen2,opt,smollm", help="tiny architectures (without --model)")
    ap.add_argument("--json", default=None, help="write the numbers to this file")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    torch.manual_seed(0)
    if args.model == "default":
        from rlserve.download import ensure_default_model

        paths = [str(ensure_default_model())]
    elif args.model:
        paths = [args.model]
    else:
        from tests.tiny_models import make_tiny_model

        tmp = tempfile.mkdtemp(prefix="fp8_error_")
        paths = [make_tiny_model(a, os.path.join(tmp, a)) for a in args.archs.split(",")]
    env = {"torch": torch.__version__, "python": platform.python_version(),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    print(f"fp8 error benchmark: torch {env['torch']}, device {device}" + (f" ({env['gpu']})" if env["gpu"] else ""))
    all_res = []
    for p in paths:
        res = measure(p, device, args.prompts, args.gen)
        print_table(res)
        print("timings (s):", {k: round(v["run_s"], 2) for k, v in res["timings"].items()})
        all_res.append(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "results": all_res}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
