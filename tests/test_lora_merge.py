"""The one-adapter LoRA fast path (rlserve.lora.merge) on the CPU engine: steps all on one adapter
run with it merged into the weights and still give PEFT's merged model's tokens and logprobs;
any other step, and any worker call, puts the base weights back bit for bit."""

from __future__ import annotations

import pytest
import torch

from rlserve import LLM, SamplingParams
from rlserve.lora.merge import AFTER_STEPS
from rlserve.lora.model import lora_of
from tests.lora_adapters import hf_greedy_logprobs, make_adapter, merged_model

NEW_TOKENS = AFTER_STEPS + 6  # the adapter is merged part way through the decode
#: float32 on both sides; the merged weights are rounded once to float32 as PEFT's are
#: (tests/test_lora.py's bound against PEFT's merged model)
LP_ATOL = 1e-4
PROMPTS = [[5, 9, 13, 17, 21, 3], [7, 7, 8, 30, 2, 11, 12], [40, 41, 42]]


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    base = tiny_model("llama")
    d = tmp_path_factory.mktemp("lora-merge")
    return base, {1: make_adapter(base, d / "a1", seed=1, r=8, alpha=16),
                  2: make_adapter(base, d / "a2", seed=2, r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"])}


def _llm(base, monkeypatch, setting):
    monkeypatch.setenv("RLSERVE_LORA_MERGE", setting)
    return LLM(base, dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4,
               enable_prefix_caching=False)


def _loaded(base, paths, monkeypatch, setting, ids=(1,)):
    """An engine (``RLSERVE_LORA_MERGE=setting``) holding ``paths[i]`` under id ``i`` for ``ids``,
    and its LoRAModel."""
    llm = _llm(base, monkeypatch, setting)
    lora = lora_of(llm.engine.model)
    for i in ids:
        lora.load(i, paths[i])
    return llm, lora


def _gen(llm, ids):
    params = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, lora_int_id=a)
              for a in ids]
    outs = llm.generate(PROMPTS[:len(ids)], params)
    return [(list(o.outputs[0].token_ids), [o.outputs[0].logprobs[i][t] for i, t in enumerate(o.outputs[0].token_ids)])
            for o in outs]


def _weights(llm) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in llm.engine.model.named_parameters()}


def _check(got, base, adapter, prompt):
    want_ids, want_lps = hf_greedy_logprobs(merged_model(base, adapter), prompt, NEW_TOKENS)
    assert got[0] == want_ids
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want_lps), atol=LP_ATOL, rtol=0)


def test_one_adapter_merges_and_matches_peft(setup, monkeypatch):
    base, paths = setup
    llm, lora = _loaded(base, paths, monkeypatch, "1", ids=(1, 2))
    before = _weights(llm)
    base_out = _gen(llm, [0, 0])
    assert lora.merge.merges == 0
    outs = _gen(llm, [1, 1, 1])  # every sequence on adapter 1: merged after AFTER_STEPS steps
    assert lora.merge.merges == 1 and lora.merge.merged == 1
    for out, prompt in zip(outs, PROMPTS):
        _check(out, base, paths[1], prompt)
    # the merged weights are W + B'A: not the base ones while merged
    assert any(not torch.equal(p, before[n]) for n, p in llm.engine.model.named_parameters())
    # a step on the base model puts the base weights back, bit for bit
    assert _gen(llm, [0, 0]) == base_out
    assert lora.merge.merged == 0 and lora.merge.restores == 1
    assert all(torch.equal(p, before[n]) for n, p in llm.engine.model.named_parameters())
    # another adapter after the first: restored, then merged in its turn
    outs = _gen(llm, [2, 2])
    assert lora.merge.merged == 2 and lora.merge.merges == 2
    for out, prompt in zip(outs, PROMPTS):
        _check(out, base, paths[2], prompt)
    # a mixed batch never merges
    mixed = _gen(llm, [1, 0, 2])
    assert lora.merge.merged == 0 and lora.merge.merges == 2
    for out, a, prompt in zip(mixed, [1, 0, 2], PROMPTS):
        _check(out, base, paths.get(a), prompt)


def test_worker_call_sees_base_weights_and_merge_off_is_unchanged(setup, monkeypatch):
    base, paths = setup
    llm, lora = _loaded(base, paths, monkeypatch, "1")
    before = _weights(llm)
    merged = _gen(llm, [1, 1])
    assert lora.merge.merged == 1
    # any worker call (a weight sync, checksums, sleep) first takes the adapter out
    sums = llm.engine.collective_rpc("tests.test_lora_merge:_weight_sums")[0]
    assert sums == {n: float(t.double().sum()) for n, t in before.items()}
    assert lora.merge.merged == 0
    # the same requests without the fast path: the same tokens (logprobs: summation order only)
    off, lora_off = _loaded(base, paths, monkeypatch, "0")
    assert lora_off.merge is None
    for (m_ids, m_lps), (o_ids, o_lps) in zip(merged, _gen(off, [1, 1])):
        assert m_ids == o_ids
        torch.testing.assert_close(torch.tensor(m_lps), torch.tensor(o_lps), atol=LP_ATOL, rtol=0)


def _weight_sums(worker) -> dict[str, float]:
    """An rpc target: every parameter's float64 sum as the worker sees it."""
    return {n: float(p.detach().double().sum()) for n, p in worker.model.named_parameters()}


def test_policy_waits_for_steps_in_a_row(setup, monkeypatch):
    from rlserve.lora.merge import MergedAdapter

    base, paths = setup
    llm, lora = _loaded(base, paths, monkeypatch, "1")
    m = MergedAdapter(lora)
    # what the CUDA KV-cache sizing leaves free: a copy of every decoder linear's weight + the
    # largest float32 B'A (tiny llama: qkv_proj, o_proj, gate_up_proj, down_proj per layer)
    ws = [p for n, p in llm.engine.model.named_parameters() if n.endswith(("qkv_proj.weight", "o_proj.weight",
                                                                    "gate_up_proj.weight", "down_proj.weight"))]
    assert len(ws) == 4 * 2
    assert m.reserve_bytes() == sum(4 * w.numel() for w in ws) + 4 * max(w.numel() for w in ws)
    for _ in range(AFTER_STEPS - 1):
        assert m.prepare([1, 1]) is False
    assert m.prepare([1, 0]) is False  # a base row resets the count
    assert [m.prepare([1]) for _ in range(AFTER_STEPS)] == [False] * (AFTER_STEPS - 1) + [True]
    assert m.merged == 1 and m.prepare(None) is False and m.merged == 0
    m.restore()  # nothing merged: nothing to do
    assert m.restores == 1


def test_bad_setting_is_refused(setup, monkeypatch):
    base, _ = setup
    with pytest.raises(ValueError, match="RLSERVE_LORA_MERGE"):
        _llm(base, monkeypatch, "yes")


def test_kernel_path_delta_equals_dense_path_delta():
    """The merge's ``B' A`` read from the kernel path's slot buffers (CUDA) equals the dense path's
    (CPU), for a packed q/k/v layer with an adapter on two of its three slices, rank below the max."""
    from rlserve.lora.layers import LoRALinear
    from rlserve.lora.merge import MergedAdapter

    g = torch.Generator().manual_seed(0)
    slices = [("l.q_proj", 0, 8), ("l.k_proj", 8, 4), ("l.v_proj", 12, 4)]
    weights = {m: (torch.randn(3, 16, generator=g), torch.randn(n, 3, generator=g)) for m, _, n in slices
               if m != "l.k_proj"}
    dense, slots = LoRALinear(slices, 16), LoRALinear(slices, 16)
    slots.use_slots(2, 8, torch.float32, "cpu")
    dense.add(5, weights)
    slots.add(5, weights, slot=1)
    want = torch.zeros(16, 16)
    want[0:8] = weights["l.q_proj"][1] @ weights["l.q_proj"][0]
    want[12:16] = weights["l.v_proj"][1] @ weights["l.v_proj"][0]
    for lin in (dense, slots):  # float32 sums of 3 products (padding zeros add exactly): rounding only
        torch.testing.assert_close(MergedAdapter._delta(None, lin, 5), want, rtol=1e-6, atol=1e-6)
        assert MergedAdapter._delta(None, lin, 6) is None


class _FakeLoRA:
    """What kv_budget / MergedAdapter.reserve_bytes read of a LoRAModel: ``_linears``, ``merge``."""

    def __init__(self, auto: bool):
        from rlserve.lora.merge import MergedAdapter

        self._linears = [(torch.nn.Linear(64, 32, bias=False), None), (torch.nn.Linear(32, 64, bias=False), None)]
        self.merge = MergedAdapter(self, auto=auto)


def test_auto_keeps_the_fast_path_only_where_the_kv_cache_can_spare_the_copy(monkeypatch, caplog):
    """RLSERVE_LORA_MERGE=auto (the default): on CUDA the copy of the weights is set aside only when the
    KV cache left still holds max_num_seqs x max_model_len; otherwise the path is dropped and the KV
    cache keeps the memory. Off a GPU auto is off; 1 always sets the memory aside. Each decision is logged."""
    from rlserve.lora.merge import kv_budget, policy

    monkeypatch.delenv("RLSERVE_LORA_MERGE", raising=False)
    assert policy(torch.device("cpu")) == "off" and policy(torch.device("cuda", 0)) == "auto"
    monkeypatch.setenv("RLSERVE_LORA_MERGE", "1")
    assert policy(torch.device("cpu")) == "on"
    monkeypatch.setenv("RLSERVE_LORA_MERGE", "0")
    assert policy(torch.device("cuda")) == "off"
    reserve = 2 * 64 * 32 * 4 + 4 * 64 * 32  # both weight copies (float32) + the largest float32 B'A
    per_block = 1000
    caplog.set_level("INFO", logger="rlserve.lora.merge")
    fits = _FakeLoRA(auto=True)
    assert fits.merge.reserve_bytes() == reserve
    # 10 blocks needed: 10,000 bytes + the copy fit exactly into the budget
    assert kv_budget(fits, reserve + 10 * per_block, per_block, blocks_needed=10) == 10 * per_block
    assert fits.merge is not None and "fast path on (RLSERVE_LORA_MERGE=auto)" in caplog.text
    short = _FakeLoRA(auto=True)
    assert kv_budget(short, reserve + 10 * per_block, per_block, blocks_needed=11) == reserve + 10 * per_block
    assert short.merge is None and "fast path off (RLSERVE_LORA_MERGE=auto)" in caplog.text
    unbounded = _FakeLoRA(auto=True)
    assert kv_budget(unbounded, 10**12, per_block, blocks_needed=None) == 10**12 and unbounded.merge is None
    forced = _FakeLoRA(auto=False)
    assert kv_budget(forced, reserve + 5 * per_block, per_block, blocks_needed=11) == 5 * per_block
    assert forced.merge is not None


def test_merge_and_restore_are_logged_once_at_info(setup, monkeypatch, caplog):
    base, paths = setup
    llm, lora = _loaded(base, paths, monkeypatch, "1")
    caplog.set_level("DEBUG", logger="rlserve.lora.merge")
    for _ in range(2):
        _gen(llm, [1, 1])  # merged part way
        _gen(llm, [0])  # restored
    assert lora.merge.merges == 2 and lora.merge.restores == 2
    info = [r.getMessage() for r in caplog.records if r.name == "rlserve.lora.merge" and r.levelname == "INFO"]
    assert len(info) == 2, info
    assert "merged into the base weights" in info[0] and "taken out of the base weights" in info[1]
