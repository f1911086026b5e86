"""RLHF weight syncing on a CPU-only machine: ``rlserve serve`` + a trainer, gloo for the data plane.

The same story as ``examples/rlhf_http_nccl.py`` on CPUs: the server starts with dummy weights
(gibberish), the trainer loads the real ones with Hugging Face transformers (float32), pauses
generation, pushes its weights over a gloo process group (trainer = rank 0, the server's worker =
rank 1, rendezvous on the trainer's TCP store), resumes, and the server's greedy completions then
equal the trainer's own ``generate`` token for token (exit status 3 if one does not).

Run:
    $ python examples/rlhf_cpu_gloo.py [--model DIR] [--port 0] [--max-tokens 32] (--help: all of rlserve demo's
      flags but --backend)

Everything except the trainer's side of the handshake (below) is ``rlserve demo --backend gloo``
(:func:`rlserve.demo.run_demo`).
"""

import sys

from rlserve.demo import demo_options, example_parser, run_demo
from rlserve.transfer import GlooTrainerInitInfo, ModuleSource, WeightTransferTrainerFactory


def trainer_init(client, train_model, layout):
    """Open the trainer's end: the server joins the gloo group while this process hosts its store."""
    world_size = client.get_world_size() + 1  # every server worker + this trainer
    return WeightTransferTrainerFactory.trainer_init(
        init_info=GlooTrainerInitInfo(
            master_address="127.0.0.1",
            master_port=0,  # a port the kernel picks, listening before the server is told of it
            world_size=world_size,
            rank=0,
            packed=True,  # tensors travel in ~1 GiB buckets, two in flight
        ),
        client=client,
        source=ModuleSource(train_model),
    )


def main() -> int:
    args = example_parser(__doc__).parse_args()  # rlserve demo's flags but --backend
    return run_demo(demo_options(args, backend="gloo", trainer_init=trainer_init)).exit_code

if __name__ == "__main__":
    sys.exit(main())
