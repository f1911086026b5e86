"""The compiled (CUDA) paths of the packed CUDA IPC sync, without a server: the trainer's
one-launch pack (rlserve/transfer/wire/pack_device.py) and the server's bucket-plan replay at a new
address (rlserve/transfer/server/bucket_plan.py). Their CPU tests run the same kernels through
Triton's interpreter (tests/test_finite_scan.py, tests/test_moe_bucket_plan.py), which is
synchronous; here the copies are queued on a CUDA stream like in the server."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from rlserve.transfer.wire.packing import checksum, pack, plan_buckets  # noqa: E402


def _model_on_cuda(path):
    from tests.test_models import _load

    model, _ = _load(path)
    return model.to("cuda")


def _experts_named(model, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Per-expert Hugging Face tensors of ``model``'s shapes, random values of ``seed``, on CUDA."""
    from rlserve.transfer.server.checksums import export_plan

    g = torch.Generator(device="cuda").manual_seed(seed)
    items, _ = export_plan(model)
    return [(n, torch.randn(f().shape, generator=g, device="cuda")) for n, f in items
            if ".experts." in n and n.endswith(".weight")]


def test_bucket_plan_replay_on_cuda_reads_each_new_address(tiny_model):
    """Record a bucket's load at one address, replay at another (inside a larger allocation) and
    then at the FIRST address refilled with new values (the trainer reuses its buffers within a
    sync): after each replay, synchronized, the model's experts hold exactly the bucket's values."""
    from rlserve.transfer.server.bucket_plan import BucketPairs, BucketPlan
    from rlserve.transfer.server.checksums import export_plan
    from rlserve.transfer.server.copy_plan import record_load

    model = _model_on_cuda(tiny_model("qwen3_moe"))
    named = _experts_named(model, 1)
    b = plan_buckets([n for n, _ in named], [t.dtype for _, t in named], [t.shape for _, t in named], 1 << 30)[0]
    first = torch.zeros(b.nbytes, dtype=torch.uint8, device="cuda")
    pack(first, b, [t for _, t in named])
    recorded, why = record_load(model.load_weights, list(BucketPairs(first, b)))
    bp = BucketPlan.from_plan(recorded, first)
    assert why is None and bp is not None and bp._op is not None and not bp._slow  # one launch on CUDA
    for k, buf in enumerate([torch.zeros(b.nbytes + 4096, dtype=torch.uint8, device="cuda")[1024:], first]):
        vals = [t * (k + 2) + 1 for _, t in named]
        pack(buf, b, vals)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # the receiver's side stream
            bp.replay(buf)
            assert bp.mismatch(buf) is None, k  # the worker's check of a first replay (CUDA: checksums)
        stream.synchronize()
        got = {n: f() for n, f in export_plan(model)[0]}
        assert all(torch.equal(got[n], v) for (n, _), v in zip(named, vals)), k
    # a pointer table that reads the wrong address (two same-size chunks swapped) is caught
    words = bp._op._words.tolist()
    i, j = next((i, j) for i in range(len(words)) for j in range(i + 1, len(words)) if words[i] == words[j])
    bp._op._src_ptrs[[i, j]] = bp._op._src_ptrs[[j, i]].clone()
    bp.replay(first)
    assert "checksums differ" in (bp.mismatch(first) or "")


def test_device_packer_on_cuda_equals_pack_at_fresh_buffers():
    """The trainer's one-launch pack on CUDA: each fresh buffer (stale bytes in it) holds exactly
    pack()'s bytes and the returned sum is their checksum; sources updated in place (same
    addresses, the cached op) are packed with their new values."""
    from rlserve.transfer.wire.pack_device import DevicePacker

    g = torch.Generator(device="cuda").manual_seed(2)
    params = [torch.randn(48, 64, generator=g, device="cuda").to(torch.bfloat16),
              torch.randn(100, generator=g, device="cuda"), torch.arange(12, dtype=torch.int64, device="cuda")]
    (b,) = plan_buckets(["x", "y", "z"], [t.dtype for t in params], [t.shape for t in params], 1 << 20)
    packer = DevicePacker()
    for step in range(3):
        want = torch.zeros(b.nbytes, dtype=torch.uint8, device="cuda")
        pack(want, b, params)
        buf = torch.full((b.nbytes + 64,), 0xAB, dtype=torch.uint8, device="cuda")
        total = packer.pack(buf, b, params)
        assert total is not None and int(total) == checksum(want), step
        assert torch.equal(buf[: b.nbytes], want), step
        params[0].mul_(-2)
        params[1].add_(1)
    assert len(packer._ops) == 1
