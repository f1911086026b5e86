"""LoRA on the GPU: decode throughput with adapters vs the base model, and adapter-only sync vs a
full weight sync, one process, one GPU (``benchmarks/model_shapes.py`` shapes, dummy weights).

Decode (offline ``LLM``, bfloat16, ``--enable-lora --max-loras 4 --max-lora-rank R`` per rank):
``--batch`` prompts of ``--prompt-len`` random token ids, greedy, ``ignore_eos``; cases ``base``
(every request on the base model: the base CUDA graphs), ``one`` (all on adapter 1), ``four``
(request i on adapter i % 4 + 1); adapters of rank R on all seven projections with random
factors (the kernels' cost does not depend on values). Decode tok/s = ``batch x (T - 1)`` / (wall
of a ``T``-token run - wall of a 1-token run), median of ``--reps`` runs, cases interleaved.

Sync (``rlserve serve`` with ``--weight-transfer-config '{"backend": "ipc"}'`` and ``--enable-lora``,
a trainer process holding the HF model and PEFT adapters on the same GPU): wall and bytes of
``engine.send_weights()`` for the full model (``ModuleSource``, bfloat16) and for PEFT adapters of
each rank (``LoRASource``, float32 factors, as PEFT keeps them), ``--reps`` syncs each (the first
of each kind also registers handles / compiles; the median of the rest is reported).

Usage (GPU):
    python benchmarks/lora_gpu.py --shape qwen3-8b --ranks 16 64 --out benchmarks/results/lora-gpu-H100-DATE.json
CPU smoke run (dense path, gloo sync): --shape tiny-llama --device cpu --dtype float32
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.model_shapes import save_shape  # noqa: E402


def _adapter(lora, rank: int, seed: int):
    """A random adapter of ``rank`` on every LoRA-capable module of ``lora``'s model."""
    from rlserve.lora.adapter import LoRAAdapter

    g = torch.Generator(device=lora.device).manual_seed(seed)
    w = {}
    for mod, (out_f, in_f) in lora.targets.items():
        a = torch.randn(rank, in_f, generator=g, device=lora.device) / in_f ** 0.5
        b = torch.randn(out_f, rank, generator=g, device=lora.device) * 0.01
        w[mod] = (a.to(lora.dtype), b.to(lora.dtype))
    return LoRAAdapter(rank, 1.0, w)


def decode(path: str, rank: int, args, deadline: float) -> dict:
    from rlserve import LLM, SamplingParams
    from rlserve.lora.model import lora_of

    t0 = time.perf_counter()
    llm = LLM(path, device=args.device, dtype=args.dtype, load_format="dummy", skip_tokenizer_init=True, seed=0,
              enable_lora=True, max_loras=4, max_lora_rank=rank, max_num_seqs=args.batch,
              max_model_len=args.prompt_len + args.max_tokens + 16)
    lora = lora_of(llm.engine.model)
    for i in range(1, 5):
        lora.add(i, _adapter(lora, rank, i))
    load_s = time.perf_counter() - t0
    V = llm.engine.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, V - 1, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    ids = {"base": [0] * args.batch, "one": [1] * args.batch, "four": [i % 4 + 1 for i in range(args.batch)]}

    def run(case, n):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, lora_int_id=a) for a in ids[case]]
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        assert all(len(o.outputs[0].token_ids) == n for o in outs)
        return time.perf_counter() - t

    for case in ids:  # warm-up: compiles the kernels, captures the LoRA decode graphs
        run(case, 4)
    walls: dict[str, list] = {c: [] for c in ids}
    for _ in range(args.reps):
        for case in ids:
            if time.perf_counter() > deadline:
                break
            full, one = run(case, args.max_tokens), run(case, 1)
            walls[case].append(args.batch * (args.max_tokens - 1) / max(full - one, 1e-9))
    graphs = llm.engine.executor.runner.lora_graphs
    out = {"rank": rank, "load_and_adapters_s": round(load_s, 2), "batch": args.batch, "prompt_len": args.prompt_len,
           "max_tokens": args.max_tokens, "kernel_path": lora.kernel,
           "lora_graph_replays": graphs.num_replays if graphs is not None else 0,
           "decode_tok_s": {c: round(statistics.median(v), 1) for c, v in walls.items() if v},
           "decode_tok_s_all": {c: [round(x, 1) for x in v] for c, v in walls.items()}}
    del llm, lora, graphs
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    print(json.dumps(out), flush=True)
    return out


def sync(path: str, args, deadline: float) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlserve.server.launch import free_port
    from rlserve.server.testing import ServerProcess
    from rlserve.transfer import (GlooTrainerInitInfo, HTTPWeightSyncClient, IPCTrainerInitInfo, LoRASource,
                                  ModuleSource, WeightTransferTrainerFactory)

    from tests.tiny_models import build_tokenizer

    backend = "ipc" if args.device.startswith("cuda") else "gloo"
    tok = os.path.join(os.path.dirname(path), "tokenizer")  # the server needs one; requests are not made
    build_tokenizer().save_pretrained(tok)
    extra = ["--num-kv-blocks", "64"] if backend == "ipc" else []
    srv = ServerProcess(path, "--tokenizer", tok, "--device", args.device, "--dtype", args.dtype, "--load-format", "dummy",
                        "--max-model-len", "256", "--max-num-seqs", "4", "--enforce-eager",
                        "--enable-lora", "--max-loras", "1", "--max-lora-rank", str(max(args.ranks)),
                        "--weight-transfer-config", json.dumps({"backend": backend}), *extra, startup_timeout_s=400)
    out: dict = {"backend": backend}
    with srv:
        dt = getattr(torch, args.dtype)
        with torch.device(args.device):
            hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dt)
        hf.eval()

        def init(source):
            ii = IPCTrainerInitInfo(timeout_s=120) if backend == "ipc" else \
                GlooTrainerInitInfo(master_port=free_port(), world_size=2, timeout_s=120)
            return WeightTransferTrainerFactory.trainer_init(init_info=ii, client=HTTPWeightSyncClient(srv.url),
                                                            source=source)

        def timed(eng, label):
            walls, fin = [], None
            for _ in range(args.reps + 1):
                if time.perf_counter() > deadline and walls:
                    break
                t = time.perf_counter()
                fin = eng.send_weights()
                walls.append(time.perf_counter() - t)
            res = {"first_s": round(walls[0], 4), "median_s": round(statistics.median(walls[1:] or walls), 4),
                   "all_s": [round(w, 4) for w in walls], "bytes": int(fin.get("bytes", 0)),
                   "answer": {k: fin.get(k) for k in ("weight_version", "lora_version", "tensors", "adapter_bytes")}}
            print(label, json.dumps(res), flush=True)
            return res

        eng = init(ModuleSource(hf))
        out["full"] = timed(eng, "full")
        eng.shutdown()
        for rank in args.ranks:
            if time.perf_counter() > deadline:
                break
            peft = get_peft_model(hf, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                 "up_proj", "down_proj"]))
            eng = init(LoRASource(peft, "policy"))
            out[f"lora_r{rank}"] = timed(eng, f"lora r{rank}")
            eng.shutdown()
            hf = peft.unload()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--parts", nargs="+", default=["decode", "sync"])
    p.add_argument("--budget-s", type=float, default=1e9, help="stop starting new measurements after this")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    deadline = time.perf_counter() + args.budget_s
    path = save_shape(args.shape, tempfile.mkdtemp(prefix="lora-gpu-"))
    res = {"shape": args.shape, "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
           "date": time.strftime("%Y-%m-%d"), "args": vars(args)}

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)

    if "decode" in args.parts:
        res["decode"] = []
        for rank in args.ranks:
            if time.perf_counter() > deadline:
                break
            res["decode"].append(decode(path, rank, args, deadline))
            save()
    if "sync" in args.parts and time.perf_counter() < deadline:
        res["sync"] = sync(path, args, deadline)
    save()
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
