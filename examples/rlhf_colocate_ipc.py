"""RLHF weight syncing with trainer and server sharing one GPU: CUDA IPC for the data plane.

The same story as ``examples/rlhf_http_nccl.py`` on a single GPU (NCCL refuses two ranks on one
GPU): the server runs on GPU 0 with dummy weights and leaves room on the GPU
(``--gpu-memory-utilization``), the trainer loads the real weights there in bf16, pauses
generation, and sends them tensor by tensor (``packed=False``, the ipc default): the IPC handles
of the trainer's own parameters travel once as JSON, later syncs are one ``/sync_weights`` call
of ~100 bytes, and the server copies straight out of the trainer's memory. After resuming, the server's greedy completions are compared token for token
with the trainer's own ``generate`` (exit status 3 if one differs).

Run (one GPU):
    $ python examples/rlhf_colocate_ipc.py [--model DIR] [--gpu-memory-utilization 0.5]

Everything except the trainer's side of the handshake (below) is ``rlserve demo --backend ipc``
(:func:`rlserve.demo.run_demo`).
"""

import sys

from rlserve.demo import demo_options, example_parser, run_demo
from rlserve.transfer import IPCTrainerInitInfo, ModuleSource, WeightTransferTrainerFactory


def trainer_init(client, train_model, layout):
    """Open the trainer's end: no process group, only the server's consent over HTTP."""
    return WeightTransferTrainerFactory.trainer_init(
        init_info=IPCTrainerInitInfo(
            device=layout.trainer_device,  # the GPU the server also uses
            packed=False,  # the default for ipc: the server reads the parameters themselves
        ),
        client=client,
        source=ModuleSource(train_model),
    )


def main() -> int:
    ap = example_parser(__doc__)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                    help="the server's share of the GPU; the trainer uses the rest")
    args = ap.parse_args()
    opts = demo_options(args, backend="ipc", trainer_init=trainer_init)
    opts.server_args = ["--gpu-memory-utilization", str(args.gpu_memory_utilization)] + opts.server_args
    return run_demo(opts).exit_code

if __name__ == "__main__":
    sys.exit(main())
