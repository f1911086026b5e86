"""Non-finite weights on a GPU server (CUDA IPC, trainer and server on one GPU): the compiled
Triton chunk kernel tests every element for NaN / inf in its copy + checksum pass, and an ipc
sync holding one NaN / inf is refused with 400 ``non_finite_weights`` naming the tensor -- per
tensor handles (the fused load) and packed buckets (the bucket scan) -- in place 503 until a
good sync, staged the old weights stay. CPU twins: tests/test_finite_scan.py,
tests/test_transfer_nonfinite.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from rlserve.transfer import (  # noqa: E402
    HTTPWeightSyncClient,
    IPCTrainerInitInfo,
    ModuleSource,
    TensorListSource,
    WeightsRefusedNonFiniteError,
    WeightTransferTrainerFactory,
    hf_state_checksums,
)
from tests.gpu.transfer_gpu_common import generate, load_hf, serve  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2]
TARGET = "model.layers.1.mlp.down_proj.weight"


def _bad(dt, n, at, value):
    t = torch.linspace(-3, 3, n, device="cuda").to(dt)
    t[at: at + 1] = torch.tensor([value], device="cuda").to(dt)
    return t


def test_multi_tensor_sum_gpu_flags_nonfinite():
    """Every dtype, NaN / +inf / -inf at the start, middle and odd tail of a tensor, chunks of
    1000 words and of the default size: exactly the poisoned sources flagged, sums unchanged,
    bytes copied; e4m3fn's largest finite value (448) and integers with all bits set are not."""
    from rlserve.transfer.multi_tensor import MultiTensorSum
    from rlserve.transfer.wire.packing import as_bytes, checksum_tensor

    srcs, want = [], []
    for dt in DTYPES:
        fi = torch.finfo(dt)
        srcs.append(torch.tensor([fi.max, -fi.max] * 2049, dtype=torch.float64, device="cuda").to(dt))
        want.append(0)
        bads = [float("nan")] if dt == torch.float8_e4m3fn else [float("nan"), float("inf"), float("-inf")]
        for v in bads:
            for at in (0, 20_000, 70_001):
                srcs.append(_bad(dt, 70_003, at, v))
                want.append(1)
    srcs.append(torch.full((1 << 16,), -1, dtype=torch.int32, device="cuda"))
    want.append(0)
    sums = [int(checksum_tensor(as_bytes(s))) for s in srcs]
    for chunk in (1000, 1 << 20):
        dsts = [torch.zeros_like(s) for s in srcs]
        op = MultiTensorSum.build(srcs, dsts, chunk_words=chunk, check_finite=True)
        assert op.run().tolist() == sums
        assert [int(b != 0) for b in op.bad.tolist()] == want
        assert all(torch.equal(as_bytes(s), as_bytes(d)) for s, d in zip(srcs, dsts))


@pytest.mark.parametrize("packed,staging", [(False, "none"), (True, "none"), (False, "device")])
def test_ipc_nonfinite_sync_refused(tiny_model, packed, staging):
    path = tiny_model("llama")
    hf = load_hf(path, "cuda", torch.bfloat16)
    with serve(path, "ipc", "--enforce-eager", staging=staging) as srv:
        client = HTTPWeightSyncClient(srv.url, timeout_s=120)
        eng = WeightTransferTrainerFactory.trainer_init(
            init_info=IPCTrainerInitInfo(packed=packed, packed_buffer_size_bytes=64 << 10, timeout_s=60),
            client=client, source=ModuleSource(hf))
        eng.send_weights()
        good = generate(srv.url).json()["completion_ids"]
        mine = hf_state_checksums(ModuleSource(hf).named_tensors(), torch.bfloat16)
        named = [(n, t.detach().clone()) for n, t in ModuleSource(hf).named_tensors()]
        dict(named)[TARGET].view(-1)[11] = float("nan")
        eng.source = TensorListSource(named)
        with pytest.raises(WeightsRefusedNonFiniteError) as ei:
            eng.send_weights()
        assert ei.value.status_code == 400 and repr(TARGET) in ei.value.message
        r = generate(srv.url)
        if staging == "none":
            assert r.status_code == 503
        else:
            assert r.status_code == 200 and r.json()["completion_ids"] == good
        eng.source = ModuleSource(hf)
        eng.send_weights()
        r = generate(srv.url)
        assert r.status_code == 200 and r.json()["completion_ids"] == good
        assert client.weight_checker(compare=mine)["compare"]["match"]
        eng.shutdown()
