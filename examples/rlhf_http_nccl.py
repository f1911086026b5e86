"""RLHF weight syncing against an ``rlserve serve`` HTTP server, NCCL for the data plane.

rlserve's port of vLLM's ``examples/rl/rlhf_http_nccl.py``:

  * OpenAI-compatible API for inference requests
  * HTTP endpoints for the weight-transfer control plane
  * NCCL for the weight data plane

Default layout (single node, 3 GPUs; ``--tp``, ``--server-gpus``, ``--trainer-gpu`` change it):
  Inference -- GPUs 0-1, ``rlserve serve`` with TP=2 and fp8 quantization
  Training  -- GPU 2, a bf16 Hugging Face model in this process
               (the server quantizes to fp8 as it loads)
The trainer needs a GPU of its own: NCCL refuses two ranks on one GPU.

The script starts the server itself, then:

  1. Generate over HTTP -> gibberish (server started with dummy weights).
  2. Pause generation, sync real weights trainer -> server over NCCL, resume.
  3. Generate again -> sensible output, compared token for token with the trainer's own greedy
     ``generate``. fp8 rounds every weight, so some completions may drift from the bf16
     trainer's after a few tokens: the script reports the agreement, it does not hide it.

Run (the default model is fetched on first use):
    $ python examples/rlhf_http_nccl.py [--model DIR]        # 3 GPUs: TP=2 on 0-1, trainer on 2
    $ python examples/rlhf_http_nccl.py --tp 1               # 2 GPUs: TP=1 on 0, trainer on 1
    $ python examples/rlhf_http_nccl.py --tp 2 --server-gpus 2,3 --trainer-gpu 0
``--server-gpus`` defaults to the first ``--tp`` GPUs and ``--trainer-gpu`` to the GPU after
the server's last one; the script checks that the machine has them before starting anything.

The differences from vLLM's script: the imports (``rlserve.transfer``), the server command
(``python -m rlserve serve``; no dev-mode variable: the control routes are on by default on a
loopback bind), and the check at the end. Server start/stop, generation, the trainer's greedy
reference and the table come from :mod:`rlserve.demo`, which ``rlserve demo`` uses too.
"""

import argparse
import os
import shlex
import sys

from rlserve.demo import NCCL_SAFE_ENV

# NVLink multicast off in every process (this one and the server), before torch starts NCCL.
os.environ.update(NCCL_SAFE_ENV)

import torch  # noqa: E402

from rlserve.demo import (  # noqa: E402
    PROMPTS,
    DemoServer,
    Layout,
    compare_completions,
    complete,
    describe_mismatches,
    example_parser,
    exit_on_signals,
    format_table,
    load_trainer_model,
    measure_gaps,
    serve_command,
    trainer_greedy,
)
from rlserve.download import resolve_model  # noqa: E402
from rlserve.transfer import (  # noqa: E402
    HTTPWeightSyncClient,
    ModuleSource,
    NCCLTrainerInitInfo,
    WeightTransferTrainerFactory,
)

SERVER_PORT = 8000
BASE_URL = f"http://127.0.0.1:{SERVER_PORT}"

INFERENCE_TP_SIZE = 2  # default --tp; the server takes the first TP GPUs, the trainer the next one


def gpu_ids(value: str) -> list[int]:
    try:
        ids = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated GPU indices, got {value!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative GPU indices, got {value!r}")
    return ids


def gpu_layout(tp: int, server_gpus: list[int] | None, trainer_gpu: int | None,
               num_gpus: int) -> tuple[list[int], int]:
    """The server's GPUs and the trainer's GPU; raises ValueError with the reason when the
    options disagree or this machine lacks one of the GPUs."""
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    server = list(server_gpus) if server_gpus is not None else list(range(tp))
    if len(server) != tp:
        raise ValueError(f"--server-gpus {','.join(map(str, server))} names {len(server)} GPU(s) but --tp is {tp}: "
                         "give one GPU per tensor-parallel rank")
    if len(set(server)) != len(server):
        raise ValueError(f"--server-gpus {','.join(map(str, server))} repeats a GPU")
    trainer = max(server) + 1 if trainer_gpu is None else trainer_gpu
    if trainer < 0:
        raise ValueError(f"--trainer-gpu must be >= 0, got {trainer}")
    if trainer in server:
        raise ValueError(f"the trainer's GPU {trainer} is one of the server's ({','.join(map(str, server))}): "
                         "NCCL refuses two ranks on one GPU; use examples/rlhf_colocate_ipc.py to share a GPU")
    missing = sorted(i for i in set(server) | {trainer} if i >= num_gpus)
    if missing:
        if num_gpus >= 2:
            hint = (f"pick GPUs among 0-{num_gpus - 1} with --server-gpus / --trainer-gpu, or a smaller --tp "
                    f"(e.g. --tp {num_gpus - 1}: server on the first {num_gpus - 1}, trainer on GPU {num_gpus - 1})")
        elif num_gpus == 1:
            hint = "with one GPU, use examples/rlhf_colocate_ipc.py (CUDA IPC)"
        else:
            hint = "without GPUs, use examples/rlhf_cpu_gloo.py (gloo)"
        raise ValueError(f"this layout (server TP={tp} on GPU(s) {','.join(map(str, server))}, trainer on GPU "
                         f"{trainer}) needs GPU(s) {','.join(map(str, missing))}, but this machine has {num_gpus} "
                         f"GPU(s); {hint}")
    return server, trainer


def main() -> int:
    ap = example_parser(__doc__, demo_flags=False)  # --model, --port, --max-tokens as rlserve demo
    ap.add_argument("--tp", type=int, default=INFERENCE_TP_SIZE, help="the server's tensor-parallel size (default 2)")
    ap.add_argument("--server-gpus", type=gpu_ids, default=None,
                    help="comma-separated GPUs of the server, one per TP rank (default: the first TP GPUs)")
    ap.add_argument("--trainer-gpu", type=int, default=None,
                    help="the trainer's GPU, not one of the server's (default: the GPU after the server's last)")
    args = ap.parse_args()
    args.port = args.port or SERVER_PORT
    try:
        server_gpus, trainer_gpu = gpu_layout(args.tp, args.server_gpus, args.trainer_gpu, torch.cuda.device_count())
    except ValueError as e:
        print(f"error: {e}")
        return 1
    trainer_device = f"cuda:{trainer_gpu}"
    model_path = resolve_model(args.model)
    base_url = f"http://127.0.0.1:{args.port}"

    layout = Layout(backend="nccl", server_device="cuda", server_device_ids=server_gpus,
                    trainer_device=trainer_device, dtype="bfloat16", tensor_parallel_size=args.tp)
    print(f"[layout] {layout.describe()} (server fp8)")
    cmd = serve_command(model_path, layout, args.port, quantization="fp8", extra_args=["--enforce-eager"])
    print(f"[server] Launching: {shlex.join(cmd)}")
    server = DemoServer(cmd, base_url, env=NCCL_SAFE_ENV, log_path="-", startup_timeout_s=900)

    with exit_on_signals(), server:  # the server (its whole process group) stops on every exit path
        # The trainer sits on a GPU of its own (by default the one after the server's), and is NCCL rank 0.
        torch.cuda.set_device(trainer_device)
        print(f"[trainer] Loading training model: {model_path} on {trainer_device}")
        train_model = load_trainer_model(model_path, trainer_device, "bfloat16")
        server.wait_healthy()
        print("[server] Ready.")

        # Generate with dummy weights -- expect nonsense.
        before = complete(base_url, PROMPTS, args.max_tokens)

        # The transfer NCCL group is the trainer plus every inference worker.
        client = HTTPWeightSyncClient(base_url)
        world_size = client.get_world_size() + 1
        # master_port 0: the SDK binds its store on a port the kernel picks before it tells the
        # server (vLLM's example picks get_open_port(), which another process can take first)
        master_address, master_port = "127.0.0.1", 0
        print(f"[transfer] Rendezvous at {master_address}, world_size={world_size} "
              f"(1 trainer + {world_size - 1} rlserve workers)")

        # `trainer_init` drives the handshake: it initializes the server's transfer engine while
        # opening the trainer's own NCCL endpoint, so both ends rendezvous together.
        engine = WeightTransferTrainerFactory.trainer_init(
            init_info=NCCLTrainerInitInfo(
                master_address=master_address,
                master_port=master_port,
                world_size=world_size,
                rank=0,  # single-GPU trainer is the sole (sender) rank
                packed=True,
                device=trainer_device,
            ),
            client=client,
            source=ModuleSource(train_model),
        )
        print(f"[transfer] Group up on port {engine.init_info.master_port}")

        client.pause()
        # Drives start_weight_update / update_weights / finish_weight_update, concurrent with the
        # NCCL broadcast.
        print("[sync] Broadcasting weights via NCCL...")
        engine.send_weights()
        st = engine.last_stats
        print(f"[sync] Weight broadcast complete: {st.get('bytes', 0) / 1e6:.1f} MB in "
              f"{st.get('total_seconds', 0):.2f}s ({st.get('gbps', 0):.2f} GB/s on the data plane), "
              f"weight version {st.get('weight_version')}.")
        client.resume()
        engine.shutdown()

        # Generate with the synced weights -- expect sensible output.
        after = complete(base_url, PROMPTS, args.max_tokens)
        reference = trainer_greedy(train_model, [c.prompt_token_ids for c in after], args.max_tokens)
        mismatches = compare_completions(after, reference)
        bad = {m.index for m in mismatches}
        print(format_table(PROMPTS, before, after, [i not in bad for i in range(len(PROMPTS))]))

        print(f"[check] {len(PROMPTS) - len(bad)} of {len(PROMPTS)} completions equal the bf16 trainer's greedy "
              "generate token for token.")
        if bad:
            measure_gaps(train_model, after, mismatches)  # the trainer's logit gap where each first differs
            print(f"[check] fp8 serving drifts from the bf16 trainer (expected with --quantization fp8; "
                  f"`rlserve demo` runs without it):\n{describe_mismatches(mismatches)}")
        if all(b.token_ids == a.token_ids for b, a in zip(before, after)):
            print("[check] the completions did not change: the sync had no effect")
            return 1
        print("[server] Shutting down...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
