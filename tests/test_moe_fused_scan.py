"""The MoE in-place CUDA IPC load gets the one-pass copy + checksum + non-finite test that the
dense load gets (rlserve/transfer/server/copy_plan.py ``_pairs_by_source``), also when the
trainer's tensors alias: a trainer that gathers every layer into one reused set of buffers
(``benchmarks/sync.py --gpu-trainer layer-pool``, FSDP-style) hands the same memory under every
layer's names. Before, any aliasing source made the replay give up the fused pass and the
receiver read every source again (checksums, then one NaN test per tensor: 18,867 launches for
Qwen3-30B-A3B's per-expert names, 20x the copy floor on an H100).

On the CPU (float32 tiny Qwen3-MoE, the host copy-and-scan of the same plan), fused and
per-expert names: the replay returns one exact ``s64sum`` per source, a flipped byte in one expert
tensor changes exactly the sums of the names that hold it, and a NaN there is flagged for exactly
those names.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from rlserve.loader.weight_utils import split_fused_experts
from rlserve.transfer.server.copy_plan import FixedPairs
from rlserve.transfer.server.worker_load import _load_replayable, _params_signature
from rlserve.transfer.server.worker_state import WorkerTransferState
from rlserve.transfer.wire.packing import tensor_checksum
from tests.test_models import _load

_LAYER = re.compile(r"\.layers\.\d+\.")


def _trainer(model, seed: int, layer_pool: bool, per_expert: bool) -> list[tuple[str, torch.Tensor]]:
    """Hugging Face tensors of ``model``'s shapes (fused expert names, or per-expert views of them),
    values of ``seed``; ``layer_pool``: every layer's names map to the first layer's tensor objects."""
    from rlserve.transfer.server.checksums import export_plan

    items, _ = export_plan(model)
    g = torch.Generator().manual_seed(seed)
    pool: dict[str, torch.Tensor] = {}
    named = []
    for n, f in items:
        if ".experts." in n and not n.endswith(("gate_up_proj", "down_proj")):
            continue  # the fused names only (the per-expert ones are views of them, below)
        key = _LAYER.sub(".layers.*.", n) if layer_pool else n
        t = pool.get(key)
        if t is None:
            t = pool[key] = torch.randn(f().shape, generator=g)
        named.append((n, t))
    return split_fused_experts(named) if per_expert else named


def _replay_scan(arch_path: str, layer_pool: bool, per_expert: bool, mutate=None):
    """Record the load of a trainer's tensors, then replay it with the fused scan asked for (as the
    ipc receive does); ``mutate(pairs)`` changes the trainer's memory before the replay. Returns
    ``(pairs, scan, model)``."""
    model, _ = _load(arch_path)
    worker = SimpleNamespace(model=model, device=torch.device("cpu"))
    st = WorkerTransferState()
    pairs = FixedPairs(_trainer(model, 1, layer_pool, per_expert))
    sig = _params_signature(worker)
    replayed, scan, plan = _load_replayable(worker, st, pairs, sig, want_sums=True, check_finite=True)
    assert not replayed and scan is None and plan is not None  # recorded (a plan: replayable)
    if mutate is not None:
        mutate(pairs)
    replayed, scan, _ = _load_replayable(worker, st, pairs, sig, want_sums=True, check_finite=True)
    assert replayed
    return pairs, scan, model


@pytest.mark.parametrize("per_expert", [False, True], ids=["fused-names", "per-expert-names"])
@pytest.mark.parametrize("layer_pool", [False, True], ids=["own-tensors", "layer-pool"])
def test_moe_replay_returns_fused_sums(tiny_model, layer_pool, per_expert):
    pairs, scan, model = _replay_scan(tiny_model("qwen3_moe"), layer_pool, per_expert)
    assert scan is not None and scan.sums is not None  # the fused pass ran (None on the old code with aliasing)
    assert scan.sums.tolist() == [tensor_checksum(t) for _, t in pairs]
    assert scan.bad is not None and not any(scan.bad.tolist())
    if layer_pool:  # the aliasing is real: fewer distinct tensors than names
        assert len({t.data_ptr() for _, t in pairs}) < len(pairs)
    if per_expert:
        assert sum(".experts.0." in n for n, _ in pairs) == 3 * model.config.num_hidden_layers
    # every layer's parameters hold what its names sent (aliases: the same bytes in each layer)
    w13 = model.model.layers[1].mlp.experts.w13_weight.data
    named = dict(pairs)
    if per_expert:
        src = named["model.layers.1.mlp.experts.2.gate_proj.weight"]
        assert torch.equal(w13[2, : src.shape[0]], src)
    else:
        assert torch.equal(w13, named["model.layers.1.mlp.experts.gate_up_proj"])


def test_dense_replay_returns_fused_sums_with_aliasing(tiny_model):
    """The same for a dense model (what the dense path already had without aliasing)."""
    pairs, scan, _ = _replay_scan(tiny_model("qwen3"), True, False)
    assert scan is not None and scan.sums.tolist() == [tensor_checksum(t) for _, t in pairs]


@pytest.mark.parametrize("layer_pool", [False, True], ids=["own-tensors", "layer-pool"])
def test_a_flipped_expert_byte_changes_exactly_its_names_sums(tiny_model, layer_pool):
    """The receiver compares these sums with the trainer's: a byte that changed between the
    trainer's checksum and the server's read shows in the sums of exactly the names holding it."""
    model, _ = _load(tiny_model("qwen3_moe"))
    expected = None
    target = "model.layers.0.mlp.experts.1.up_proj.weight"

    def flip(pairs):
        nonlocal expected
        expected = [tensor_checksum(t) for _, t in pairs]
        t = dict(pairs)[target]
        t.view(torch.int32).view(-1)[5] ^= 1 << 9  # one bit of one element
    pairs, scan, model = _replay_scan(tiny_model("qwen3_moe"), layer_pool, True, flip)
    got = scan.sums.tolist()
    differ = [n for (n, _), a, b in zip(pairs, got, expected) if a != b]
    held = [n for n, t in pairs if t.data_ptr() == dict(pairs)[target].data_ptr()]
    assert differ == held and target in held
    assert len(held) == (model.config.num_hidden_layers if layer_pool else 1)
    assert got == [tensor_checksum(t) for _, t in pairs]  # and what was read is what was summed


def test_a_nan_in_one_expert_is_flagged_in_the_same_pass(tiny_model):
    target = "model.layers.1.mlp.experts.3.down_proj.weight"

    def poison(pairs):
        dict(pairs)[target].view(-1)[7] = float("nan")
    pairs, scan, _ = _replay_scan(tiny_model("qwen3_moe"), False, True, poison)
    flagged = [n for (n, _), f in zip(pairs, scan.bad.tolist()) if f]
    assert flagged == [target]


def test_receiver_scan_of_unfused_sources_sums_and_flags_each_tensor():
    """Where the sink's load did not sum (a TP shard, a cast), the ipc receive reads the sources
    once more for every checksum and NaN test together (receiver_ipc._scan_sources; on the CPU
    its per-tensor fallback): exact sums, the poisoned tensor flagged, aliases included."""
    from rlserve.transfer.server.receiver_ipc import _IpcSet, _scan_sources

    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(5, 7, generator=g), torch.randn(64, generator=g).to(torch.bfloat16)
    pairs = FixedPairs([("a", a), ("b", b), ("a_again", a)])
    st = _IpcSet([], [a, b, a], ["a", "b", "a_again"], ["float32", "bfloat16", "float32"],
                 [[5, 7], [64], [5, 7]], pairs=pairs)
    sums, bad = _scan_sources(st, pairs, check=True)
    assert sums.tolist() == [tensor_checksum(t) for t in (a, b, a)]
    assert bad.tolist() == [False, False, False]
    b[9] = float("inf")
    sums, bad = _scan_sources(st, pairs, check=True)
    assert bad.tolist() == [False, True, False] and sums[1].item() == tensor_checksum(b)
    sums, bad = _scan_sources(st, pairs, check=False)
    assert bad is None and sums.tolist() == [tensor_checksum(t) for t in (a, b, a)]


def test_staged_per_expert_updates_reuse_their_buffers_and_commit_pairs(tiny_model):
    """Staged (``--weight-staging device``) with the same mapped tensors each update (a FixedPairs,
    as the ipc receive hands its set): the second stage reuses the buffers without per-tensor work,
    each commit loads exactly the newly staged values (the second through the previous commit's
    FixedPairs: a replay), and a discard drops every cached reference to the buffers."""
    from rlserve.transfer.server import worker_ext
    from rlserve.transfer.server.worker_load import _stage

    model, _ = _load(tiny_model("qwen3_moe"))
    worker = SimpleNamespace(model=model, device=torch.device("cpu"), extension_state={})
    st = worker_ext._state(worker)
    pairs = FixedPairs(_trainer(model, 4, False, True))
    cpu = torch.device("cpu")
    for rnd in range(3):
        for _, t in pairs:
            t.normal_(generator=torch.Generator().manual_seed(rnd))
        _stage(st, pairs, None, cpu, False, want_sums=False)
        dsts = st.stage_fixed.dsts
        assert all(st.staging[n] is d for (n, _), d in zip(pairs, dsts))
        out = worker_ext.commit(worker)
        assert out["names"] == len(pairs) and out["replayed"] == (rnd > 0)
        assert st.commit_pairs is not None and (rnd == 0 or st.commit_pairs.pairs is first)
        first = st.commit_pairs.pairs
        got = model.model.layers[1].mlp.experts.w2_weight.data[5]
        assert torch.equal(got, dict(pairs)["model.layers.1.mlp.experts.5.down_proj.weight"])
        if rnd == 0:
            kept = dsts
        else:
            assert all(a is b for a, b in zip(kept, dsts))  # the same staging buffers
    worker_ext.discard(worker)
    assert st.stage_fixed is None and st.commit_pairs is None and not st.staging_bufs
    _stage(st, pairs, None, cpu, False, want_sums=False)  # fresh buffers after a discard
    assert not any(a is b for a, b in zip(kept, st.stage_fixed.dsts))
