"""rlserve.transfer: the weight-sync layer.

Trainer SDK (names mirror vLLM's ``vllm.distributed.weight_transfer``)::

    from rlserve.transfer import (WeightTransferTrainerFactory, HTTPWeightSyncClient, ModuleSource,
                                  GlooTrainerInitInfo, NCCLTrainerInitInfo, IPCTrainerInitInfo)

Layout (``README.md`` here has the full map)::

    wire/      what travels: protocol (InitInfo / UpdateInfo JSON), packing (bucket plan, s64sum,
               layout header), header (its checks), ipc (CUDA IPC handles as JSON), safe_pickle,
               vllm_store / vllm_ipc (vLLM's rendezvous and IPC formats), store_probe (a TCPStore answers?)
    backends/  data planes: group (TransferGroup: gloo / NCCL), nccl_lib (ctypes NCCL),
               vllm_group (vLLM's NCCL wire)
    server/    the server process: manager (+ manager_update / manager_info / manager_trl / manager_lora, session),
               receiver (+ receiver_ipc), worker_ext (+ worker_load), engine_calls, liveness,
               tcp_peer, direct, copy_plan, checksums
    sdk/       the trainer process: trainer (factory), client, sources (+ lora_source), init_info, engine,
               ipc_engine, sender, trl
    errors, host_ops, multi_tensor: shared by both sides
"""

_LAZY = {
    "WeightTransferTrainerFactory": "rlserve.transfer.sdk.trainer",
    "HTTPWeightSyncClient": "rlserve.transfer.sdk.trainer",
    "HTTPVLLMWeightSyncClient": "rlserve.transfer.sdk.trainer",
    "WeightSyncHTTPError": "rlserve.transfer.sdk.trainer",
    "WeightSyncConflictError": "rlserve.transfer.sdk.trainer",
    "WeightsRefusedNonFiniteError": "rlserve.transfer.sdk.trainer",
    "NonFiniteWeightsError": "rlserve.transfer.errors",
    "ModuleSource": "rlserve.transfer.sdk.trainer",
    "TensorListSource": "rlserve.transfer.sdk.trainer",
    "LoRASource": "rlserve.transfer.sdk.trainer",
    "TrainerInitInfo": "rlserve.transfer.sdk.trainer",
    "GlooTrainerInitInfo": "rlserve.transfer.sdk.trainer",
    "NCCLTrainerInitInfo": "rlserve.transfer.sdk.trainer",
    "IPCTrainerInitInfo": "rlserve.transfer.sdk.trainer",
    "TRLWeightSyncClient": "rlserve.transfer.sdk.trl",
    "InitInfo": "rlserve.transfer.wire.protocol",
    "UpdateInfo": "rlserve.transfer.wire.protocol",
    "WeightTransferManager": "rlserve.transfer.server.manager",
    "hf_state_checksums": "rlserve.transfer.server.checksums",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


__all__ = sorted(_LAZY)
