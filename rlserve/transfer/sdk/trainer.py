"""Trainer SDK: push a training model's weights into a running rlserve server.

Mirrors vLLM's trainer-side API, so a script written like vLLM's ``rlhf_http_nccl.py`` ports by
changing imports::

    from rlserve.transfer import (HTTPWeightSyncClient, ModuleSource, NCCLTrainerInitInfo,
                                  WeightTransferTrainerFactory)

    engine = WeightTransferTrainerFactory.trainer_init(
        init_info=NCCLTrainerInitInfo(master_address=ip, master_port=port,
                                      world_size=server_world_size + 1),
        client=HTTPWeightSyncClient("http://localhost:8000", admin_key=None),
        source=ModuleSource(train_model),
    )
    engine.send_weights()            # start_weight_update -> update_weights (+ broadcast) -> finish
    engine.shutdown()

``send_weights``:

1. collects the metadata (names, dtypes, shapes: no gather) and, unless ``checksums=False``, one
   ``s64sum`` checksum per bucket (a pass over the tensors: FSDP gathers every parameter once for
   it, then again to send);
2. ``POST /start_weight_update`` with the whole ``update_info``: the server validates it against
   its model and answers 400 before any byte moves;
3. ``POST /update_weights`` on a background thread while this thread broadcasts (the server only
   joins the broadcast while its handler runs); if the HTTP call fails, the broadcast gives up at
   once; ipc instead sends one ``update_weights`` per bucket carrying that bucket's CUDA IPC
   handle;
4. ``POST /finish_weight_update`` (``weight_version`` auto-increments on the server unless given).

After a failed transfer the group is torn down on both sides; the next ``send_weights`` first
re-runs the init handshake (``engine.reinit()`` does it explicitly).

FSDP2 trainers: every rank builds the engine with its own ``rank`` (0 talks to the server and
sends, the others only iterate the source so that ``full_tensor()`` gathers line up) and every
rank calls ``send_weights``.
"""

from __future__ import annotations

# The SDK's public names, importable from here (and, lazily, from ``rlserve.transfer``).
from rlserve.transfer.sdk.client import (  # noqa: F401
    HTTPVLLMWeightSyncClient,
    HTTPWeightSyncClient,
    WeightSyncConflictError,
    WeightSyncHTTPError,
    WeightsRefusedNonFiniteError,
)
from rlserve.transfer.sdk.engine import GroupTrainerEngine, TrainerWeightTransferEngine
from rlserve.transfer.sdk.init_info import (  # noqa: F401
    GlooTrainerInitInfo,
    IPCTrainerInitInfo,
    NCCLTrainerInitInfo,
    TrainerInitInfo,
)
from rlserve.transfer.sdk.ipc_engine import IPCTrainerEngine
from rlserve.transfer.sdk.sources import ModuleSource, TensorListSource, hf_name  # noqa: F401
from rlserve.transfer.sdk.lora_source import LoRASource  # noqa: F401


class FollowerTrainerEngine(TrainerWeightTransferEngine):
    """Ranks != 0 of a sharded trainer: iterate the source (collectives) and send nothing."""


class WeightTransferTrainerFactory:
    """Entry point, named as in vLLM."""

    @staticmethod
    def trainer_init(init_info: TrainerInitInfo, client: HTTPWeightSyncClient | None = None,
                     source=None) -> TrainerWeightTransferEngine:
        """Initialise the server's transfer engine and this trainer's end, together.

        gloo / NCCL: ``POST /init_weight_transfer_engine`` runs on a background thread while this
        thread hosts the TCPStore and joins the group: both ends rendezvous together; returns
        once both succeeded (at most ``timeout_s``). ipc: the HTTP call only.

        Args:
            init_info: :class:`GlooTrainerInitInfo`, :class:`NCCLTrainerInitInfo` or
                :class:`IPCTrainerInitInfo`.
            client: the server's :class:`HTTPWeightSyncClient` (required on rank 0).
            source: :class:`ModuleSource` (or anything with ``metadata()`` and
                ``named_tensors()``).
        Raises:
            WeightSyncHTTPError: the server refused the init_info.
            TransferTimeoutError / WeightTransferFailedError: the rendezvous failed.
        """
        if source is None:
            raise ValueError("trainer_init needs a source (e.g. ModuleSource(model))")
        if init_info.rank != 0:
            return FollowerTrainerEngine(init_info, None, source)
        if client is None:
            raise ValueError("trainer_init needs a client on rank 0")
        if init_info.backend in ("gloo", "nccl"):
            return GroupTrainerEngine(init_info, client, source)
        if init_info.backend == "ipc":
            return IPCTrainerEngine(init_info, client, source)
        raise ValueError(f"unknown backend {init_info.backend!r}")
