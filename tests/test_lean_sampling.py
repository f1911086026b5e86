"""The general sampler's lean paths (``rlserve.engine.core.lean_sampling``) against the path before
them (``set_lean(False)``: a copy of the logits, every row scored) on the same logits: the same
tokens, and bit-equal scores in the rows that asked for logprobs (NaN / zeros in the others); and
``cumulative_logprob`` None for a request that did not ask (vLLM's rule)."""

from __future__ import annotations

import pytest
import torch

from rlserve import LLM, SamplingParams
from rlserve.config import LOGPROBS_MODES
from rlserve.engine.core import lean_sampling
from rlserve.engine.core.sampler import Sampler, SamplingMetadata
from rlserve.engine.core.structured import apply_grammar_masks

V = 257
EOS = 256


class _Mask:
    """A structured-output state as ``apply_grammar_masks`` reads it (``waiting``,
    ``fill_mask``): allows the ids ``< allow`` only."""

    waiting = False

    def __init__(self, allow: int):
        self.allow = allow

    def fill_mask(self, bitmask: torch.Tensor, j: int) -> None:
        words = bitmask.shape[1]
        bits = torch.zeros(words * 32, dtype=torch.int64)
        bits[: self.allow] = 1
        w = (bits.view(words, 32) << torch.arange(32)).sum(1)
        bitmask[j] = torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)


def _logits(B: int, seed: int) -> torch.Tensor:
    """``[B, V]`` float32 logits with ties, an all ``-inf`` row, a NaN row and ``-inf`` columns."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, V, generator=g) * 3
    x[0, [5, 40, 200]] = x[0].max() + 1.0  # a three-way tie for the max (the first index wins)
    x[1] = float("-inf")
    x[2, 17] = float("nan")
    x[3, ::3] = float("-inf")
    x[4, [9, 10]] = 50.0  # a tie far above the rest
    return x


def _run(lean: bool, mode: str, logits: torch.Tensor, meta: SamplingMetadata):
    prev = lean_sampling.set_lean(lean)
    try:
        return Sampler({EOS}, V, generator_seed=7, logprobs_mode=mode)(logits, meta)
    finally:
        lean_sampling.set_lean(prev)


def _reference_scores(mode: str, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """``[B, V]`` scores of every row as the sampler computed them before session 22 (whole batch:
    ``log_softmax`` of the masked raw logits or of a copy processed by steps 1-7)."""
    raw = logits.clone()
    if meta.grammars is not None:
        apply_grammar_masks(raw, meta.grammars)
    if mode.startswith("processed_"):
        prev = lean_sampling.set_lean(False)
        try:
            raw = Sampler({EOS}, V).process_logits(raw, meta)[0]
        finally:
            lean_sampling.set_lean(prev)
    return torch.log_softmax(raw, dim=-1) if mode.endswith("_logprobs") else raw


def _check(logits: torch.Tensor, meta: SamplingMetadata, mode: str) -> None:
    before = logits.clone()
    old = _run(False, mode, logits, meta)
    new = _run(True, mode, logits, meta)
    torch.testing.assert_close(logits, before, rtol=0, atol=0, equal_nan=True)  # input untouched
    assert torch.equal(new.token_ids, old.token_ids)
    asked = [i for i, p in enumerate(meta.params) if p.logprobs is not None]
    idx = torch.tensor(asked, dtype=torch.long)
    ref = _reference_scores(mode, logits, meta)
    K = max((p.logprobs or 0) for p in meta.params)
    ref_top = ref.topk(K, dim=-1, sorted=True)
    ref_lp = ref.gather(1, old.token_ids.unsqueeze(1)).squeeze(1)
    for out, rows in ((old, torch.arange(len(meta.params))), (new, idx)):
        # bit-equal (rtol = atol = 0) in the rows scored, NaN where the whole-batch scores have NaN
        torch.testing.assert_close(out.logprobs[rows], ref_lp[rows], rtol=0, atol=0, equal_nan=True)
        assert torch.equal(out.topk_token_ids[rows], ref_top.indices[rows])
        torch.testing.assert_close(out.topk_logprobs[rows], ref_top.values[rows], rtol=0, atol=0, equal_nan=True)
    others = [i for i in range(len(meta.params)) if i not in asked]
    assert torch.isnan(new.logprobs[others]).all()
    assert new.topk_token_ids.shape == old.topk_token_ids.shape
    assert not new.topk_token_ids[others].any() and not new.topk_logprobs[others].any()


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_batch_equals_the_full_path(mode, seed):
    logits = _logits(8, seed)
    params = [SamplingParams(temperature=0.0, logprobs=[None, 0, 3, None, 2, None, 0, 5][i]) for i in range(8)]
    meta = SamplingMetadata(params, [[1, 2]] * 8, [[] for _ in range(8)])
    _check(logits, meta, mode)
    out = _run(True, mode, logits, meta)
    assert out.token_ids[0].item() == 5 and out.token_ids[4].item() == 9  # ties: the first index
    assert out.token_ids[2].item() == 17  # a NaN row: the NaN's index (torch.argmax, as before)
    assert out.token_ids[1].item() == 0  # all -inf: index 0


def test_greedy_batch_reads_the_logits_without_a_copy():
    logits = _logits(6, 3)
    meta = SamplingMetadata([SamplingParams(temperature=0.0)] * 6, [[1]] * 6, [[]] * 6)
    processed, tokens = Sampler({EOS}, V).process_logits(logits, meta)
    assert processed.data_ptr() == logits.data_ptr()
    assert torch.equal(tokens, logits.argmax(-1))
    prev = lean_sampling.set_lean(False)
    try:
        assert Sampler({EOS}, V).process_logits(logits, meta)[0].data_ptr() != logits.data_ptr()
    finally:
        lean_sampling.set_lean(prev)
    # a processor on one row: the batch is copied (the processors write into it)
    meta.params[2] = SamplingParams(temperature=0.0, logit_bias={3: 5.0})
    assert Sampler({EOS}, V).process_logits(logits, meta)[0].data_ptr() != logits.data_ptr()


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_mixed_batch_with_processors_equals_the_full_path(mode):
    logits = _logits(12, 5)
    params = [
        SamplingParams(temperature=0.0, logprobs=1),
        SamplingParams(temperature=0.8, seed=11),
        SamplingParams(temperature=0.0),  # NaN row (2)
        SamplingParams(temperature=1.2, top_k=7, logprobs=2),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
        SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05, logprobs=0),
        SamplingParams(temperature=0.0, logit_bias={100: 30.0}, logprobs=4),
        SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[12], logprobs=0),
        SamplingParams(temperature=1.0, allowed_token_ids=[1, 2, 3, 50]),
        SamplingParams(temperature=0.0, bad_words_token_ids=[[3, 4, 7], [8]], logprobs=3),
        SamplingParams(temperature=0.0, repetition_penalty=0.9),
        SamplingParams(temperature=0.5, seed=2, logprobs=0),
    ]
    outputs = [[1, 2, 3, 4][: i % 5] for i in range(12)]
    meta = SamplingMetadata(params, [[1, 9, 9]] * 12, outputs)
    _check(logits, meta, mode)
    greedy = SamplingMetadata([p for p in params if p.greedy], [[1, 9, 9]] * 7,
                              [o for p, o in zip(params, outputs) if p.greedy])
    _check(logits[[i for i, p in enumerate(params) if p.greedy]], greedy, mode)  # processors, all greedy


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_structured_output_masks_equal_the_full_path(mode):
    logits = _logits(5, 9)
    params = [SamplingParams(temperature=0.0, logprobs=[None, 2, 0, None, 1][i]) for i in range(5)]
    masks = [_Mask(40), None, _Mask(3), None, _Mask(250)]
    meta = SamplingMetadata(params, [[1]] * 5, [[]] * 5, grammars=masks)
    _check(logits, meta, mode)
    out = _run(True, mode, logits, meta)
    assert out.token_ids[0].item() == int(logits[0, :40].argmax())  # the tie at 5 is inside the mask
    assert out.token_ids[2].item() < 3


def test_no_row_asked_scores_nothing():
    logits = _logits(6, 4)
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(temperature=0.9, seed=1)] * 3
    out = _run(True, "raw_logprobs", logits, SamplingMetadata(params, [[1]] * 6, [[]] * 6))
    assert torch.isnan(out.logprobs).all() and out.topk_token_ids.shape == (6, 0)


def test_cumulative_logprob_only_when_asked(tiny_model):
    llm = LLM(tiny_model("llama"), dtype="float32", device="cpu", block_size=4)
    prompts = ["Hello world", "The capital of France is"]
    plain, asked = (llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=k))
                    for k in (None, 0))
    for a, b in zip(plain, asked):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids and len(ca.token_ids) == 6
        assert ca.cumulative_logprob is None and ca.logprobs is None
        assert cb.cumulative_logprob == pytest.approx(sum(d[t] for d, t in zip(cb.logprobs, cb.token_ids)), abs=1e-6)
        assert cb.cumulative_logprob < 0


def test_cpu_engine_steps_call_no_torch_argmax(tiny_model, monkeypatch):
    """Every argmax a CPU engine step takes is the one-pass C kernel (rlserve.layers.cpu_argmax; torch's CPU argmax
    costs several times more): greedy batches read in place, greedy rows after penalties / logit bias / bad words,
    drawn rows (the exponential race), with logprobs and prompt logprobs. A spy on ``torch.argmax`` and
    ``Tensor.argmax`` counts none during generation (grep of rlserve/, session 23: the sampler's three call sites
    are its only per-step argmax on the CPU)."""
    from rlserve.layers import cpu_argmax

    if not cpu_argmax.warm_up():
        pytest.skip("no C compiler: the argmax is torch's here")
    llm = LLM(tiny_model("llama"), dtype="float32", device="cpu", block_size=4)
    calls = []
    real_fn, real_method = torch.argmax, torch.Tensor.argmax

    def spy_fn(*a, **kw):
        calls.append("torch.argmax")
        return real_fn(*a, **kw)

    def spy_method(self, *a, **kw):
        calls.append("Tensor.argmax")
        return real_method(self, *a, **kw)

    monkeypatch.setattr(torch, "argmax", spy_fn)
    monkeypatch.setattr(torch.Tensor, "argmax", spy_method)
    prompts = [[5, 6, 7], [9, 3, 2, 8], [11, 12]]
    param_sets = [
        SamplingParams(temperature=0.0, max_tokens=4),
        SamplingParams(temperature=0.0, max_tokens=4, repetition_penalty=1.3, logit_bias={3: 2.0}, logprobs=2,
                       bad_words_token_ids=[[4]]),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=4, logprobs=1, prompt_logprobs=1),
    ]
    outs = [llm.generate(prompts, p) for p in param_sets]
    outs.append(llm.generate(prompts, [param_sets[0], param_sets[2], param_sets[1]]))  # a mixed batch
    assert all(len(o.outputs[0].token_ids) == 4 for batch in outs for o in batch)
    assert calls == []
    assert torch.argmax(torch.tensor([[0.0, 1.0]])).item() == 1 and calls == ["torch.argmax"]  # the spy counts
