"""Recorded weight loads (rlserve.transfer.server.copy_plan): a replay equals a fresh load_weights,
and loads that a replay could not reproduce are refused."""

import pytest
import torch
from transformers import AutoConfig

from rlserve.config import EngineConfig
from rlserve.loader import load_model
from rlserve.transfer.server.checksums import export_hf_tensors
from rlserve.transfer.server.copy_plan import FixedPairs, plan_key, record_load, source_tensors
from rlserve.transfer.wire.packing import tensor_checksum


def _model(path, dtype=torch.float32):
    return load_model(EngineConfig(model=path, device="cpu", dtype=str(dtype).removeprefix("torch."),
                                   load_format="dummy"), AutoConfig.from_pretrained(path), "cpu", dtype)


def _hf_like(model, seed):
    """Persistent source tensors with the model's HF names and shapes, random values."""
    named, _ = export_hf_tensors(model)
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(t.shape, generator=g, dtype=torch.float32)) for n, t in named]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "opt"])
def test_replay_equals_load_weights_after_sources_change(arch, tiny_model):
    model = _model(tiny_model(arch))
    pairs = _hf_like(model, 0)
    plan, why = record_load(model.load_weights, pairs)
    assert plan is not None, why
    assert len(plan) == len(pairs)  # one copy per HF tensor (q/k/v and gate/up into fused params)
    for _, t in pairs:  # the trainer updates its tensors in place
        t.mul_(-0.5).add_(0.25)
    key = plan_key(pairs)
    plan.replay()
    assert plan_key(pairs) == key
    got = dict(export_hf_tensors(model)[0])
    for n, t in pairs:
        if n in got:
            assert torch.equal(got[n], t), n
    # and a fresh model loaded through load_weights from the same tensors is identical
    fresh = _model(tiny_model(arch))
    fresh.load_weights(pairs)
    for (n, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), n


def test_fixed_pairs_remember_key_and_sources(tiny_model):
    """The receiver's mapped ipc tensors travel as one FixedPairs across updates: its plan key
    and source list are computed once and equal what plain pairs give."""
    model = _model(tiny_model("llama"))
    pairs = _hf_like(model, 1)
    fixed = FixedPairs(pairs)
    assert plan_key(fixed) == plan_key(pairs)
    assert plan_key(fixed) is plan_key(fixed)  # remembered, not recomputed
    src = source_tensors(fixed)
    assert src is source_tensors(fixed) and len(src) == len(pairs)
    assert all(a is b for a, (_, b) in zip(src, pairs))
    plan, why = record_load(model.load_weights, fixed)
    assert plan is not None, why
    for _, t in pairs:
        t.mul_(2.0)
    scan = plan.replay(src)  # every source copied whole once: copied and summed in one pass
    assert scan.sums.tolist() == [tensor_checksum(t) for t in src] and scan.bad is None
    for _, t in pairs:
        t.mul_(2.0)
    t = src[1]
    t.view(-1)[3] = float("-inf")  # tested in the same pass when asked
    scan = plan.replay(src, check_finite=True)
    assert scan.sums.tolist() == [tensor_checksum(t) for t in src]
    assert scan.bad.tolist() == [i == 1 for i in range(len(src))]
    got = dict(export_hf_tensors(model)[0])
    for n, t in pairs:
        if n in got:
            assert torch.equal(got[n], t), n


def test_dtype_converting_copies_are_replayable(tiny_model):
    model = _model(tiny_model("llama"), torch.bfloat16)
    pairs = _hf_like(model, 1)  # float32 sources into a bfloat16 model: copy_ converts
    plan, why = record_load(model.load_weights, pairs)
    assert plan is not None, why
    for _, t in pairs:
        t.add_(1.0)
    plan.replay()
    got = dict(export_hf_tensors(model)[0])
    for n, t in pairs:
        if n in got:
            assert torch.equal(got[n], t.to(torch.bfloat16)), n


def test_loads_a_replay_would_get_wrong_are_refused():
    dst = torch.zeros(4)
    src = torch.ones(4)

    def computed(pairs):  # copies a temporary: a replay would copy stale values
        dst.copy_(pairs[0][1] * 2)

    def fill_over_copy(pairs):  # replaying fills before copies would lose the 7
        dst.copy_(pairs[0][1])
        dst[0:1].fill_(7.0)

    def other_write(pairs):
        dst.copy_(pairs[0][1])
        dst.add_(1.0)

    def disjoint_fill(pairs):  # e.g. vocabulary padding rows: replayable
        dst[:2].copy_(pairs[0][1][:2])
        dst[2:].zero_()

    plan, why = record_load(computed, [("w", src)])
    assert plan is None and "temporary" in why and torch.equal(dst, torch.full((4,), 2.0))
    plan, why = record_load(fill_over_copy, [("w", src)])
    assert plan is None and "overlapping" in why and dst[0].item() == 7.0
    plan, why = record_load(other_write, [("w", src)])
    assert plan is None and "in-place write" in why and torch.equal(dst, torch.full((4,), 2.0))
    plan, why = record_load(disjoint_fill, [("w", src)])
    assert plan is not None, why
    dst.fill_(5.0)
    src.fill_(3.0)
    plan.replay()
    assert dst.tolist() == [3.0, 3.0, 0.0, 0.0]


def test_replay_through_narrowed_source_views():
    """A TP-style load copies a slice of the source; the replay reads the same slice again."""
    dst = torch.zeros(2, 3)
    src = torch.arange(12.0).view(4, 3)
    plan, _ = record_load(lambda p: dst.copy_(p[0][1].narrow(0, 2, 2)), [("w", src)])
    src.add_(100)
    plan.replay()
    assert torch.equal(dst, src[2:4])


def test_recording_does_not_import_torch_dynamo():
    """torch wraps a ``TorchDispatchMode``'s ``__torch_dispatch__`` in ``_disable_dynamo``, which
    imports ``torch._dynamo`` at its first call: the first weight sync's first recorded load paid
    ~2 s of CPU for it on the 2-core machine. The recorder opts out (nothing compiles inside it);
    a fresh interpreter records a load, replays it, and has still not imported torch._dynamo."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from rlserve.transfer.server.copy_plan import record_load\n"
        "dst = torch.zeros(6, 4); src = torch.arange(24.).reshape(6, 4)\n"
        "plan, why = record_load(lambda pairs: dst[1:].copy_(pairs[0][1][1:]), [('w', src)])\n"
        "assert plan is not None, why\n"
        "src.mul_(2); plan.replay()\n"
        "assert torch.equal(dst[1:], src[1:]) and not dst[0].any()\n"
        "print('dynamo' if 'torch._dynamo' in sys.modules else 'no dynamo')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "no dynamo", out.stdout
