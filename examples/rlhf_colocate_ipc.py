"""Colocated RL on one GPU: the server sleeps while the trainer trains, CUDA IPC syncs the weights.

A GRPO-shaped loop with trainer and ``rlserve serve --enable-sleep-mode`` sharing GPU 0:

    generate rollouts -> POST /sleep?level=2 (the server's weights and KV cache go back to the
    driver) -> a training step that allocates that memory -> POST /wake_up?tags=weights -> ipc
    weight sync -> POST /wake_up?tags=kv_cache -> generate ...

``--iterations`` times (default 3). The first sync (before the loop) opens the IPC session: the
handles of the trainer's own parameters travel once as JSON, later syncs are one
``/sync_weights`` call and the server copies straight out of the trainer's memory (CUDA IPC
needs no NCCL, which refuses two ranks on one GPU). Every generation's greedy completions are
compared token for token with the trainer's own ``generate`` (16-bit dtypes: up to near ties,
``--tie-tolerance``), and after every sync the server's weights with the trainer's (sha256 of
each tensor, ``/weight_checker``); exit status 3 if one differs. Each phase's time, and the device memory
the trainer sees free before and after each sleep (``torch.cuda.mem_get_info``), are printed
(``--report FILE``: also as JSON).

Run (one GPU):
    $ python examples/rlhf_colocate_ipc.py [--model DIR] [--gpu-memory-utilization 0.8]

``--model`` may be a directory with only a ``config.json`` (a model shape, e.g. from
``benchmarks/model_shapes.py``; add ``--tokenizer DIR``): the trainer then starts from
Hugging Face's random initialisation and the server from dummy weights.
"""

import json
import os
import shlex
import sys
import time


def trainer_init(client, train_model, layout):
    """Open the trainer's end: no process group, only the server's consent over HTTP."""
    from rlserve.transfer import IPCTrainerInitInfo, ModuleSource, WeightTransferTrainerFactory

    return WeightTransferTrainerFactory.trainer_init(
        init_info=IPCTrainerInitInfo(
            device=layout.trainer_device,  # the GPU the server also uses
            packed=False,  # the default for ipc: the server reads the parameters themselves
        ),
        client=client,
        source=ModuleSource(train_model),
    )


def _trainer_model(model_dir: str, device: str, dtype: str):
    """The trainer's model: the checkpoint, or Hugging Face's random init of a shape-only dir."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlserve.demo import load_trainer_model, torch_dtype

    if any(f.endswith((".safetensors", ".bin", ".pt")) for f in os.listdir(model_dir)):
        return load_trainer_model(model_dir, device=device, dtype=dtype)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return model.to(torch_dtype(dtype)).eval()


def _weights_equal(engine, model, dtype: str) -> bool:
    """Whether the server's weights are the trainer's, bit for bit (``/weight_checker``: sha256
    of every tensor on both sides, in the server's dtype)."""
    from rlserve.demo import torch_dtype
    from rlserve.transfer import ModuleSource, hf_state_checksums

    mine = hf_state_checksums(ModuleSource(model).named_tensors(), torch_dtype(dtype))
    return bool(engine.client.weight_checker(compare=mine)["compare"]["match"])


def training_step(model, free_bytes: int, fill: float = 0.8) -> dict:
    """A stand-in for the trainer's step: hold ``fill`` x the free device memory (the optimizer
    states and activations a real step would), run one forward/backward on random tokens and
    move the weights with SGD (in place: the IPC handles of the parameters stay valid), then give
    everything back to the driver so the server can wake. Returns bytes held and seconds."""
    import torch

    t0 = time.perf_counter()
    dev = next(model.parameters()).device
    held = torch.empty(int(free_bytes * fill), dtype=torch.uint8, device=dev)
    held.fill_(1)
    ids = torch.randint(0, model.config.vocab_size, (4, 64), device=dev)
    model.train()
    logits = model(ids).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-1e-2)  # a large step: the next rollouts differ visibly
                p.grad = None
    model.eval()
    torch.cuda.synchronize(dev)
    n = held.numel()
    del held, logits, loss
    torch.cuda.empty_cache()
    return {"held_bytes": n, "seconds": time.perf_counter() - t0}


def main() -> int:
    import torch

    from rlserve.demo import choose_layout, default_tie_tolerance, example_parser
    from rlserve.download import resolve_model

    ap = example_parser(__doc__, demo_flags=False)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8,
                    help="the server's share of the GPU while awake (asleep it holds almost none)")
    ap.add_argument("--iterations", type=int, default=3, help="generate / sleep / train / wake / sync rounds")
    ap.add_argument("--sleep-level", type=int, default=2, choices=[1, 2],
                    help="2 (default): weights discarded, refilled by the sync; 1: kept in host memory, "
                         "then the sync runs after a full wake")
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (for a shape-only --model)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--tie-tolerance", type=float, default=None,
                    help="nats (default: 0 in float32, 0.5 in 16-bit dtypes)")
    ap.add_argument("--report", default=None, help="write the phase times as JSON here")
    ap.add_argument("--server-args", default="", help="extra `rlserve serve` flags, one string")
    args = ap.parse_args()
    layout = choose_layout("ipc", dtype=args.dtype)
    model_dir = args.model if os.path.isdir(args.model) else resolve_model(args.model)
    port = args.port  # 0: the server binds a port the kernel picks; its URL comes from its ready line
    extra = ["--enable-sleep-mode", "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.tokenizer:
        extra += ["--tokenizer", args.tokenizer]
    extra += shlex.split(args.server_args)
    url = f"http://127.0.0.1:{port}" if port else None
    tol = default_tie_tolerance(args.dtype) if args.tie_tolerance is None else args.tie_tolerance
    report: dict = {"layout": layout.describe(), "iterations": []}
    torch.cuda.set_device(0)
    try:
        return _run(args, layout, model_dir, url, port, extra, tol, report)
    finally:
        if args.report:
            with open(args.report, "w") as f:
                json.dump(report, f, indent=1, default=str)


def _run(args, layout, model_dir, url, port, extra, tol, report) -> int:
    from rlserve.demo import DemoServer, serve_command

    with DemoServer(serve_command(model_dir, layout, port, extra_args=extra), url) as server:
        try:
            return _loop(args, layout, model_dir, url, tol, report, server)
        except BaseException:
            print(f"--- server log tail ---\n{server.log_tail()}", file=sys.stderr)
            raise


def _loop(args, layout, model_dir, url, tol, report, server) -> int:
    import torch

    from rlserve.demo import compare_completions, complete, measure_gaps, trainer_greedy, PROMPTS
    from rlserve.transfer import HTTPWeightSyncClient

    t0 = time.perf_counter()
    server.wait_healthy()
    report["server_start_s"] = time.perf_counter() - t0
    url = server.url
    model = _trainer_model(model_dir, layout.trainer_device, args.dtype)
    client = HTTPWeightSyncClient(url)
    t0 = time.perf_counter()
    engine = trainer_init(client, model, layout)
    engine.send_weights()  # the server starts from dummy weights: the trainer's, before rollouts
    report["first_sync_s"] = time.perf_counter() - t0
    mismatched = 0
    try:
        for it in range(args.iterations + 1):
            row: dict = {}
            t0 = time.perf_counter()
            comps = complete(url, PROMPTS, max_tokens=args.max_tokens)
            row["generate_s"] = time.perf_counter() - t0
            ref = trainer_greedy(model, [c.prompt_token_ids for c in comps], args.max_tokens)
            mism = compare_completions(comps, ref)
            measure_gaps(model, comps, mism)
            bad = [m for m in mism if not m.near_tie(tol)]
            row["greedy_equal_trainer"] = f"{len(comps) - len(mism)}/{len(comps)}" + \
                (f" ({len(mism) - len(bad)} near ties)" if len(mism) > len(bad) else "")
            mismatched += len(bad)
            if it == args.iterations:
                report["final"] = row
                print(f"[final] generate {row['generate_s']:.2f}s, = trainer {row['greedy_equal_trainer']}")
                break
            free_awake = torch.cuda.mem_get_info()[0]
            t0 = time.perf_counter()
            row["sleep"] = client.sleep(level=args.sleep_level)
            row["sleep_s"] = time.perf_counter() - t0
            free_asleep = torch.cuda.mem_get_info()[0]
            row["trainer_free_gib_awake"] = free_awake / 2**30
            row["trainer_free_gib_asleep"] = free_asleep / 2**30
            row["released_gib"] = (free_asleep - free_awake) / 2**30
            step = training_step(model, free_asleep)
            row["train_step_s"], row["train_held_gib"] = step["seconds"], step["held_bytes"] / 2**30
            t0 = time.perf_counter()
            if args.sleep_level == 2:  # vLLM's RLHF order: weights, sync, then the KV cache
                client.wake_up(tags=["weights"])
                row["wake_weights_s"] = time.perf_counter() - t0
                t1 = time.perf_counter()
                engine.send_weights()
                row["sync_s"] = time.perf_counter() - t1
                t1 = time.perf_counter()
                client.wake_up(tags=["kv_cache"])
                row["wake_kv_cache_s"] = time.perf_counter() - t1
            else:  # level 1: the host copy comes back first, then the new weights over it
                client.wake_up()
                row["wake_s"] = time.perf_counter() - t0
                t1 = time.perf_counter()
                engine.send_weights()
                row["sync_s"] = time.perf_counter() - t1
            row["wake_and_sync_s"] = time.perf_counter() - t0
            row["weights_equal_trainer"] = _weights_equal(engine, model, args.dtype)  # sha256 per tensor
            mismatched += not row["weights_equal_trainer"]
            report["iterations"].append(row)
            print(f"[{it}] generate {row['generate_s']:.2f}s (= trainer {row['greedy_equal_trainer']}), "
                  f"sleep {row['sleep_s']:.2f}s releasing {row['released_gib']:.1f} GiB, train step "
                  f"{row['train_step_s']:.2f}s holding {row['train_held_gib']:.1f} GiB, wake + sync "
                  f"{row['wake_and_sync_s']:.2f}s (sync {row['sync_s']:.2f}s), weights = trainer's: "
                  f"{row['weights_equal_trainer']}", flush=True)
    finally:
        engine.shutdown()
    if mismatched:
        print(f"{mismatched} completion(s) differ from the trainer's beyond near ties", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
