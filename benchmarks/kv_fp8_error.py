"""Error of the fp8 KV cache (``--kv-cache-dtype fp8`` / ``fp8_e5m2``) against the model-dtype
cache, on rlserve's engine: the logprobs of the same tokens, and greedy agreement.

A real checkpoint (``--model``, prompts: this repository's docs as English text), or one random
checkpoint of a model shape (``benchmarks/model_shapes.py``; weights drawn like a
Hugging Face initialisation, normal(0, 0.02) with RMSNorm weights 1, the same in every engine:
``load_format="dummy"``'s +-1e-3 would leave the attention near uniform and the error
meaningless), the same prompts (random ids, lengths in ``[--min-len, --max-len]``) through an
engine per ``--kv-cache-dtype`` value, one after the other in this process:

- teacher-forced: every prompt token's logprob (``prompt_logprobs=0``; its prefill writes the
  prompt's K/V into the cache and reads them back, so the fp8 rounding is in them): max |diff|,
  mean |diff| against the first dtype (``auto``), in nats;
- free-running greedy decode of ``--gen`` tokens: the fraction of prompts whose tokens equal
  the ``auto`` engine's, and the mean number of tokens before the first difference;
- the KV blocks each engine got for the same ``--gpu-memory-utilization``.

With ``--shape``, random weights are not a trained model: the numbers say how the cache's rounding propagates
through a network of this shape, not how a trained Qwen3 answers. e4m3's rounding is at most
2^-4 relative per element, e5m2's 2^-3.

Usage (GPU): ``python3 benchmarks/kv_fp8_error.py --shape qwen3-0.6b --json out.json``;
CPU smoke: ``--shape tiny-llama --device cpu --num-prompts 2 --min-len 8 --max-len 16 --gen 4``.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_shapes import save_shape, shape_config  # noqa: E402


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """normal(0, 0.02) for every weight and bias, 1.0 for norm weights; the same values for the
    same seed, shape and device whatever the engine (parameters in registration order)."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32) * 0.02)


def text_prompts(model: str, n: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """``n`` windows of English text (this repository's README and docs pages, tokenized by
    ``model``'s tokenizer), lengths drawn in ``[min_len, max_len]``."""
    from transformers import AutoTokenizer

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    docs = [os.path.join(root, "README.md")] + sorted(
        os.path.join(root, "docs", f) for f in os.listdir(os.path.join(root, "docs")) if f.endswith(".md"))
    ids = AutoTokenizer.from_pretrained(model)("\n".join(open(p, encoding="utf-8").read() for p in docs))["input_ids"]
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        start = int(torch.randint(0, max(1, len(ids) - length), (1,), generator=g))
        out.append(ids[start:start + length])
    return out


def run(path: str, kv: str, prompts, args) -> dict:
    from rlserve import LLM, SamplingParams

    real = args.model is not None
    kv, _, calc = kv.partition(":")  # "fp8:calc": --calculate-kv-scales
    llm = LLM(path, dtype=args.dtype, device=args.device, load_format="auto" if real else "dummy",
              skip_tokenizer_init=True, calculate_kv_scales=calc == "calc",
              max_model_len=args.max_len + args.gen + 8, max_num_seqs=max(len(prompts), 1),
              kv_cache_dtype=kv, enable_prefix_caching=False,
              **({"gpu_memory_utilization": args.gpu_memory_utilization} if args.device.startswith("cuda") else {}))
    if not real:
        init_weights(llm.engine.executor.runner.model, args.seed)
        from rlserve.loader.model_loader import process_weights_after_loading

        process_weights_after_loading(llm.engine.executor.runner.model)  # CPU: the packed weight copies
    t0 = time.perf_counter()
    tf = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    gen = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.gen, ignore_eos=True))
    res = {
        "kv_cache_dtype": kv + (":calc" if calc == "calc" else ""), "num_blocks": llm.engine.executor.runner.num_blocks,
        "block_size": llm.engine.config.block_size, "bytes_per_block": llm.engine.executor.bytes_per_block(),
        "seconds": time.perf_counter() - t0,
        "prompt_logprobs": [[next(iter(d.values())) for d in o.prompt_logprobs[1:]] for o in tf],
        "greedy": [list(o.outputs[0].token_ids) for o in gen],
    }
    del llm, tf, gen
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def run_vllm(path: str, kv: str, prompts, args) -> dict:
    """The same through vLLM's ``LLM`` (``--engine vllm``; run with vLLM's Python): its own fp8 KV
    cache (scales 1.0; ``:calc`` entries are not supported there)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, dtype=args.dtype, kv_cache_dtype=kv, enable_prefix_caching=False, seed=args.seed,
              max_model_len=args.max_len + args.gen + 8, max_num_seqs=max(len(prompts), 1),
              skip_tokenizer_init=True, gpu_memory_utilization=args.gpu_memory_utilization)
    t0 = time.perf_counter()
    ps = [{"prompt_token_ids": p} for p in prompts]
    tf = llm.generate(ps, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    gen = llm.generate(ps, SamplingParams(temperature=0, max_tokens=args.gen, ignore_eos=True), use_tqdm=False)
    cache = llm.llm_engine.vllm_config.cache_config
    res = {
        "kv_cache_dtype": kv, "num_blocks": cache.num_gpu_blocks, "block_size": cache.block_size, "bytes_per_block": 1,
        "seconds": time.perf_counter() - t0,
        "prompt_logprobs": [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])] for o, p in zip(tf, prompts)],
        "greedy": [list(o.outputs[0].token_ids) for o in gen],
    }
    del llm
    gc.collect()
    return res


def compare(ref: dict, other: dict) -> dict:
    diffs = [abs(a - b) for pa, pb in zip(ref["prompt_logprobs"], other["prompt_logprobs"]) for a, b in zip(pa, pb)]
    same = [ga == gb for ga, gb in zip(ref["greedy"], other["greedy"])]
    first = []
    for ga, gb in zip(ref["greedy"], other["greedy"]):
        k = next((i for i, (a, b) in enumerate(zip(ga, gb)) if a != b), len(ga))
        first.append(k)
    return {"kv_cache_dtype": other["kv_cache_dtype"], "logprob_max_abs_diff": max(diffs),
            "logprob_mean_abs_diff": sum(diffs) / len(diffs), "tokens_compared": len(diffs),
            "greedy_identical_fraction": sum(same) / len(same),
            "greedy_mean_tokens_before_first_diff": sum(first) / len(first),
            "blocks_vs_ref": other["num_blocks"] / ref["num_blocks"],
            "bytes_per_block_vs_ref": other["bytes_per_block"] / ref["bytes_per_block"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--model", default=None, help="a real checkpoint directory instead of --shape (its weights; "
                                                  "prompts: this repository's docs, tokenized)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--kv", default="auto,fp8,fp8_e5m2", help="comma-separated --kv-cache-dtype values, ':calc' "
                                                            "added for --calculate-kv-scales (fp8:calc); the first "
                                                            "is the reference")
    ap.add_argument("--engine", default="rlserve", choices=["rlserve", "vllm"],
                    help="vllm: vLLM's LLM (run this script with vLLM's Python)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                    help="rlserve on CUDA; vLLM everywhere (on CPU vLLM reserves this fraction of the host memory)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.model:
        prompts = text_prompts(args.model, args.num_prompts, args.min_len, args.max_len, args.seed)
        args.shape = os.path.basename(os.path.normpath(args.model))
    else:
        vocab = shape_config(args.shape).vocab_size
        g = torch.Generator().manual_seed(args.seed)
        lens = torch.randint(args.min_len, args.max_len + 1, (args.num_prompts,), generator=g).tolist()
        prompts = [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lens]
    runs = []
    with tempfile.TemporaryDirectory() as root:
        path = args.model or save_shape(args.shape, root)
        for kv in args.kv.split(","):
            fn = run_vllm if args.engine == "vllm" else run
            # each engine in a process of its own: its memory is given back before the next starts
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                runs.append(pool.submit(fn, path, kv, prompts, args).result())
            print(f"{kv}: {runs[-1]['num_blocks']} blocks of {runs[-1]['block_size']} tokens, "
                  f"{runs[-1]['seconds']:.1f} s", flush=True)
    card = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    rows = [compare(runs[0], r) for r in runs[1:]]
    for r in rows:
        print(f"{args.engine} {args.shape} {card} {r['kv_cache_dtype']} vs {runs[0]['kv_cache_dtype']}: logprob max |diff| "
              f"{r['logprob_max_abs_diff']:.4f}, mean {r['logprob_mean_abs_diff']:.5f} nats over "
              f"{r['tokens_compared']} tokens; greedy identical {r['greedy_identical_fraction']:.2f}, "
              f"{r['greedy_mean_tokens_before_first_diff']:.1f} tokens before the first diff (of {args.gen}); "
              f"blocks x{r['blocks_vs_ref']:.2f} (bytes per block x{r['bytes_per_block_vs_ref']:.2f})", flush=True)
    out = {"args": vars(args), "engine": args.engine, "card": card, "rows": rows,
           "blocks": {r["kv_cache_dtype"]: r["num_blocks"] for r in runs}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
