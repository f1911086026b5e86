"""Packed buckets that arrive at a new address every update (CUDA IPC packed, one call per bucket):
the worker records a bucket's load once per layout and replays it at the next bucket's address
(rlserve/transfer/server/bucket_plan.py). On the CPU, with a tiny Qwen3-MoE and per-expert names:
the model then equals the trainer's tensors exactly (float32 byte copies), the second sync replays
every bucket, a plan keeps no reference to the bucket it was recorded from, and what cannot be
replayed (a source outside the bucket) falls back to ``load_weights``.
"""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from rlserve.loader.weight_utils import split_fused_experts
from rlserve.transfer.server.bucket_plan import BucketPairs, BucketPlan
from rlserve.transfer.server.copy_plan import record_load
from rlserve.transfer.server.worker_load import _load_replayable, _params_signature
from rlserve.transfer.server.worker_state import WorkerTransferState
from rlserve.transfer.wire.packing import pack, plan_buckets
from tests.test_models import _load


@pytest.fixture(scope="module")
def moe(tiny_model):
    return tiny_model("qwen3_moe")


def _trainer(model, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Per-expert Hugging Face tensors of ``model``'s shapes with values of ``seed``."""
    from rlserve.transfer.server.checksums import export_plan

    items, _ = export_plan(model)
    g = torch.Generator().manual_seed(seed)
    named = [(n, torch.randn(f().shape, generator=g)) for n, f in items
             if ".experts." not in n or n.endswith(("gate_up_proj", "down_proj"))]
    return split_fused_experts(named)


def _sync(worker, st, named, plan, sig):
    """One update as the ipc packed receive makes it: per bucket a fresh buffer (a new address),
    one call each (plans not used by the call are dropped after it). Returns the replayed flags."""
    keep, flags = [], []
    for b in plan:
        buf = torch.empty(b.nbytes + 4096, dtype=torch.uint8)[4096:]  # not at its storage's start
        pack(buf, b, [named[s.index][1] for s in b.slots])
        keep.append(buf)  # (every buffer of the sync alive at once: no address comes back)
        replayed, _, _ = _load_replayable(worker, st, BucketPairs(buf, b), sig)
        st.drop_unused_plans()
        flags.append(replayed)
    return flags


def _model_tensors(model) -> dict[str, torch.Tensor]:
    from rlserve.transfer.server.checksums import export_plan

    items, _ = export_plan(model)
    return {n: f() for n, f in items}


def test_second_sync_replays_every_bucket_at_its_new_address(moe):
    model, _ = _load(moe)
    worker = SimpleNamespace(model=model, device=torch.device("cpu"))
    st = WorkerTransferState()
    first = _trainer(model, 1)
    plan = plan_buckets([n for n, _ in first], [t.dtype for _, t in first], [t.shape for _, t in first], 32 << 10)
    assert len(plan) > 4 and max(len(b.slots) for b in plan) > 2  # buckets of several per-expert tensors
    sig = _params_signature(worker)
    assert _sync(worker, st, first, plan, sig) == [False] * len(plan)  # recorded
    got = _model_tensors(model)
    assert all(torch.equal(got[n], t) for n, t in first)
    second = _trainer(model, 2)
    assert _sync(worker, st, second, plan, sig) == [True] * len(plan)  # replayed at new addresses
    got = _model_tensors(model)
    assert all(torch.equal(got[n], t) for n, t in second)
    assert len(st.bucket_plans) == len(plan)
    # the parameters moved (another signature): the plans are dropped and recorded again
    assert _sync(worker, st, first, plan, sig + (0,)) == [False] * len(plan)
    assert len(st.bucket_plans) == len(plan)


def _one_bucket(moe, seed: int):
    """A fresh model, per-expert trainer tensors of ``seed`` and ONE bucket packed with them."""
    model, _ = _load(moe)
    named = _trainer(model, seed)
    b = plan_buckets([n for n, _ in named], [t.dtype for _, t in named], [t.shape for _, t in named], 1 << 30)[0]
    buf = torch.empty(b.nbytes, dtype=torch.uint8)
    pack(buf, b, [t for _, t in named])
    return model, named, b, buf


def test_a_bucket_plan_holds_no_reference_to_its_bucket(moe):
    model, named, b, buf = _one_bucket(moe, 3)
    recorded, why = record_load(model.load_weights, list(BucketPairs(buf, b)))
    assert why is None
    bp = BucketPlan.from_plan(recorded, buf)
    assert bp is not None and len(bp) == len(recorded) >= len(named)
    ref = weakref.ref(buf.untyped_storage())
    del recorded, buf
    gc.collect()
    assert ref() is None
    other = torch.empty(b.nbytes, dtype=torch.uint8)
    pack(other, b, [t * 2 for _, t in named])
    bp.replay(other)
    got = _model_tensors(model)
    assert all(torch.equal(got[n], t * 2) for n, t in named)
    with pytest.raises(ValueError, match="bytes"):
        bp.replay(other[:-256])


def test_a_source_outside_the_bucket_is_not_replayable(moe):
    model, named, b, buf = _one_bucket(moe, 4)
    pairs = list(BucketPairs(buf, b))
    pairs[0] = (pairs[0][0], pairs[0][1].clone())  # e.g. a misaligned slot that unpack copied
    recorded, why = record_load(model.load_weights, pairs)
    assert why is None and BucketPlan.from_plan(recorded, buf) is None
