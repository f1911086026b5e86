"""rlserve.transfer: the weight-sync layer.

Trainer SDK (names mirror vLLM's ``vllm.distributed.weight_transfer``)::

    from rlserve.transfer import (WeightTransferTrainerFactory, HTTPWeightSyncClient, ModuleSource,
                                  GlooTrainerInitInfo, NCCLTrainerInitInfo, IPCTrainerInitInfo)

Modules:
    protocol     JSON data classes ``InitInfo`` / ``UpdateInfo`` and their validation
    packing      bucket plan, byte packing, the ``s64sum`` checksum
    group        the transfer process group (own TCPStore, gloo / NCCL, deadlines, teardown)
    sender       trainer-side broadcast (packed / unpacked)
    receiver     server-side receive into a sink (packed / unpacked / ipc)
    ipc          CUDA IPC handles as JSON
    trainer      the trainer SDK
    worker_ext   functions run on server workers through ``engine.collective_rpc``
    manager      ``WeightTransferManager``: the server's state machine
    checksums    sha256 per Hugging Face tensor (``/weight_checker``)
"""

_LAZY = {
    "WeightTransferTrainerFactory": "rlserve.transfer.trainer",
    "HTTPWeightSyncClient": "rlserve.transfer.trainer",
    "HTTPVLLMWeightSyncClient": "rlserve.transfer.trainer",
    "WeightSyncHTTPError": "rlserve.transfer.trainer",
    "WeightSyncConflictError": "rlserve.transfer.trainer",
    "ModuleSource": "rlserve.transfer.trainer",
    "TensorListSource": "rlserve.transfer.trainer",
    "TrainerInitInfo": "rlserve.transfer.trainer",
    "GlooTrainerInitInfo": "rlserve.transfer.trainer",
    "NCCLTrainerInitInfo": "rlserve.transfer.trainer",
    "IPCTrainerInitInfo": "rlserve.transfer.trainer",
    "TRLWeightSyncClient": "rlserve.transfer.trl",
    "InitInfo": "rlserve.transfer.protocol",
    "UpdateInfo": "rlserve.transfer.protocol",
    "WeightTransferManager": "rlserve.transfer.manager",
    "hf_state_checksums": "rlserve.transfer.checksums",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


__all__ = sorted(_LAZY)
