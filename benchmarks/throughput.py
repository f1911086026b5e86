"""Offline generation throughput: rlserve against Hugging Face ``generate``, one run.

Workload (nano-vllm's): ``--num-seqs`` sequences with random prompt lengths and random
output lengths in ``[--min-len, --max-len]``, random token ids, ``ignore_eos``, fixed seed,
random weights of a named model shape (``benchmarks/model_shapes.py``).

HF cannot give each row of a batch its own output length, so it runs batches of
``--hf-batch`` prompts (left-padded) to the batch's longest output length; only the
requested tokens count as output (the rest is padding work HF does anyway).

Usage:
    python benchmarks/throughput.py --shape smollm2-135m --device cpu --num-seqs 16 --min-len 16 --max-len 64
    python benchmarks/throughput.py --shape qwen3-0.6b --device cuda --dtype bfloat16   # 256 x 100..1024
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_shapes import save_shape, shape_config  # noqa: E402


def make_workload(num_seqs: int, min_len: int, max_len: int, vocab: int, seed: int):
    """Prompts (token-id lists) and output lengths, deterministic for ``seed``."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_seqs)]
    out_lens = [rng.randint(min_len, max_len) for _ in range(num_seqs)]
    return prompts, out_lens


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_rlserve(path: str, prompts, out_lens, args) -> dict:
    from rlserve import LLM, SamplingParams

    llm = LLM(
        path, dtype=args.dtype, device=args.device, load_format="dummy", skip_tokenizer_init=True,
        max_model_len=2 * args.max_len + 8, enforce_eager=args.enforce_eager,
        max_num_seqs=args.max_num_seqs, seed=args.seed,
    )
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in out_lens]
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4, ignore_eos=True)] * 2)  # warm-up
    _sync(args.device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    _sync(args.device)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(out_lens), (n_out, sum(out_lens))
    return {"engine": "rlserve", "seconds": dt, "output_tokens": n_out, "tokens_per_s": n_out / dt}


def run_hf(path: str, prompts, out_lens, args) -> dict:
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(shape_config(args.shape), dtype=dtype).to(args.device).eval()
    pad = 0
    total = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), args.hf_batch):
        ps, ls = prompts[i : i + args.hf_batch], out_lens[i : i + args.hf_batch]
        width = max(len(p) for p in ps)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in ps], device=args.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device=args.device)
        with torch.no_grad():
            model.generate(
                ids, attention_mask=mask, do_sample=True, temperature=0.6, max_new_tokens=max(ls),
                min_new_tokens=max(ls), pad_token_id=pad,
            )
        total += sum(ls)
    _sync(args.device)
    dt = time.perf_counter() - t0
    return {"engine": "hf-generate", "seconds": dt, "output_tokens": total, "tokens_per_s": total / dt}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=None, help="HF batch size (default: all prompts at once)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.hf_batch = args.hf_batch or args.num_seqs
    vocab = shape_config(args.shape).vocab_size
    prompts, out_lens = make_workload(args.num_seqs, args.min_len, args.max_len, vocab, args.seed)
    machine = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{platform.processor() or 'cpu'} x{os.cpu_count()}"
    results = []
    with tempfile.TemporaryDirectory() as root:
        path = save_shape(args.shape, root)
        results.append(run_rlserve(path, prompts, out_lens, args))
        print("rlserve:", results[-1], flush=True)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        if not args.no_hf:
            results.append(run_hf(path, prompts, out_lens, args))
    print(f"shape={args.shape} device={args.device} ({machine}) dtype={args.dtype} seqs={args.num_seqs} "
          f"lens={args.min_len}..{args.max_len}")
    for r in results:
        print(f"  {r['engine']:12s} {r['output_tokens']:8d} tok  {r['seconds']:8.2f} s  {r['tokens_per_s']:10.1f} tok/s")
    if len(results) == 2:
        print(f"  speedup rlserve / hf: {results[0]['tokens_per_s'] / results[1]['tokens_per_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": machine, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
