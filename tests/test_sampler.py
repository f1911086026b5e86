"""Sampler, logits processors and prompt logprobs (CPU, small vocabularies)."""

import math

import pytest
import torch

from rlserve.engine.core.sampler import (
    Sampler,
    SamplingMetadata,
    compute_prompt_logprobs,
)
from rlserve.engine.sampling_params import SamplingParams, derive_seed

V = 32
EOS = 31


def meta(params, prompts=None, outputs=None):
    B = len(params)
    return SamplingMetadata(
        params=list(params),
        prompt_token_ids=prompts if prompts is not None else [[1, 2, 3]] * B,
        output_token_ids=outputs if outputs is not None else [[] for _ in range(B)],
    )


def rand_logits(B, v=V, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, v, generator=g) * scale


def test_greedy_equals_argmax_and_raw_logprobs():
    logits = rand_logits(6)
    params = [SamplingParams(temperature=0.0, logprobs=0) for _ in range(6)]
    out = Sampler({EOS}, V)(logits, meta(params))
    assert out.token_ids.dtype == torch.long and out.token_ids.shape == (6,)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    ref = torch.log_softmax(logits, -1).gather(1, logits.argmax(-1, keepdim=True)).squeeze(1)
    assert torch.allclose(out.logprobs, ref, atol=1e-6, rtol=0)
    assert out.topk_token_ids.shape == (6, 0) and out.topk_logprobs.shape == (6, 0)


def test_greedy_rows_in_mixed_batch_equal_argmax():
    logits = rand_logits(8, seed=1)
    params = [
        SamplingParams(temperature=0.0 if i % 2 == 0 else 1.3, top_k=5 if i % 4 == 1 else 0)
        for i in range(8)
    ]
    out = Sampler({EOS}, V)(logits, meta(params))
    am = logits.argmax(-1)
    for i in range(0, 8, 2):
        assert out.token_ids[i].item() == am[i].item()


def test_logprobs_are_raw_even_with_processing():
    logits = rand_logits(4, seed=2)
    params = [
        SamplingParams(temperature=0.5, top_k=4, logprobs=3),
        SamplingParams(temperature=1.7, top_p=0.5, repetition_penalty=1.5, logprobs=5),
        SamplingParams(temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5, logprobs=0),
        SamplingParams(min_p=0.2, min_tokens=4, logprobs=0),
    ]
    out = Sampler({EOS}, V)(logits, meta(params, outputs=[[3, 3, 4], [5, 6], [7, 7, 7], [8]]))
    lsm = torch.log_softmax(logits, -1)
    ref = lsm.gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
    assert out.logprobs.dtype == torch.float32
    assert torch.allclose(out.logprobs, ref, atol=1e-6, rtol=0)
    # top-k: K = max over batch = 5, sorted descending, equal to raw log_softmax top-k.
    assert out.topk_token_ids.shape == (4, 5) and out.topk_logprobs.shape == (4, 5)
    ref_v, ref_i = lsm.topk(5, -1)
    assert torch.equal(out.topk_token_ids, ref_i)
    assert torch.allclose(out.topk_logprobs, ref_v, atol=1e-6, rtol=0)
    assert torch.all(out.topk_logprobs[:, :-1] >= out.topk_logprobs[:, 1:])
    assert torch.allclose(out.topk_logprobs, lsm.gather(1, out.topk_token_ids), atol=1e-6, rtol=0)


def _nucleus(probs: torch.Tensor, p: float) -> set[int]:
    """Smallest set of most likely tokens whose mass >= p (float64 reference)."""
    order = probs.double().argsort(descending=True).tolist()
    keep, mass = set(), 0.0
    for t in order:
        keep.add(t)
        mass += probs[t].item()
        if mass >= p:
            break
    return keep


def _draws(params_one: SamplingParams, logits_row: torch.Tensor, n: int = 400, seed: int = 0) -> list[int]:
    logits = logits_row.unsqueeze(0).repeat(n, 1)
    out = Sampler({EOS}, V, generator_seed=seed)(logits, meta([params_one] * n))
    return out.token_ids.tolist()


def test_top_k_never_outside():
    row = rand_logits(1, seed=3)[0]
    allowed = set(row.topk(5).indices.tolist())
    toks = _draws(SamplingParams(temperature=2.0, top_k=5), row)
    assert set(toks) <= allowed
    assert len(set(toks)) == 5  # high temperature: all five show up in 400 draws


def test_top_p_never_outside():
    row = rand_logits(1, seed=4)[0]
    for p in (0.3, 0.7, 0.9):
        allowed = _nucleus(torch.softmax(row, -1), p)
        toks = _draws(SamplingParams(temperature=1.0, top_p=p), row)
        assert set(toks) <= allowed, (p, set(toks) - allowed)
        assert len(set(toks)) >= min(2, len(allowed))


def test_top_k_then_top_p_and_temperature():
    row = rand_logits(1, seed=5)[0]
    t = 0.8
    scaled = row / t
    top = scaled.topk(6)
    probs6 = torch.softmax(top.values, -1)
    kept = _nucleus(probs6, 0.8)
    allowed = {top.indices[i].item() for i in kept}
    toks = _draws(SamplingParams(temperature=t, top_k=6, top_p=0.8), row)
    assert set(toks) <= allowed


def test_min_p_never_outside():
    row = rand_logits(1, seed=6)[0]
    t = 1.5
    probs = torch.softmax(row / t, -1)
    allowed = set(torch.nonzero(probs >= 0.1 * probs.max()).flatten().tolist())
    toks = _draws(SamplingParams(temperature=t, min_p=0.1), row)
    assert set(toks) <= allowed
    assert len(set(toks)) >= 2


def test_temperature_frequencies_match_softmax():
    v = 8
    g = torch.Generator().manual_seed(7)
    row = torch.randn(v, generator=g)
    t = 0.7
    n = 20000
    logits = row.unsqueeze(0).repeat(n, 1)
    out = Sampler(set(), v, generator_seed=123)(logits, meta([SamplingParams(temperature=t)] * n))
    counts = torch.bincount(out.token_ids, minlength=v).double()
    expected = torch.softmax(row.double() / t, -1) * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    # df = 7; P(chi2 > 29) ~ 1.4e-4.
    assert chi2 < 29.0, (chi2, counts.tolist(), expected.tolist())


def test_penalties_follow_formulas():
    B = 3
    logits = rand_logits(B, seed=8)
    prompts = [[1, 2, 2, 9], [4, 5], [10]]
    outputs = [[2, 3, 3, 3], [5, 6, 6], []]
    params = [
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.25),
        SamplingParams(repetition_penalty=0.8),
        SamplingParams(frequency_penalty=1.0, presence_penalty=1.0),
    ]
    processed, greedy = Sampler({EOS}, V).process_logits(logits, meta(params, prompts, outputs))
    assert greedy is None
    expected = logits.clone()
    for i in range(B):
        p = params[i]
        seen = set(prompts[i]) | set(outputs[i])
        for tok in seen:
            l = expected[i, tok].item()
            expected[i, tok] = l / p.repetition_penalty if l > 0 else l * p.repetition_penalty
        for tok in set(outputs[i]):
            c = outputs[i].count(tok)
            expected[i, tok] -= p.frequency_penalty * c + p.presence_penalty
    assert torch.allclose(processed, expected, atol=1e-6, rtol=0)
    # Input untouched.
    assert torch.equal(logits, rand_logits(B, seed=8))


def test_greedy_applies_penalties():
    logits = torch.zeros(1, V)
    logits[0, 4] = 2.0
    logits[0, 7] = 1.9
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.2)]
    out = Sampler({EOS}, V)(logits, meta(params, prompts=[[4]], outputs=[[]]))
    assert out.token_ids.item() == 7  # 2.0 / 1.2 < 1.9
    params = [SamplingParams(temperature=0.0, presence_penalty=0.5)]
    out = Sampler({EOS}, V)(logits, meta(params, prompts=[[1]], outputs=[[4]]))
    assert out.token_ids.item() == 7


def test_temperature_scaling_in_processed_logits():
    logits = rand_logits(2, seed=9)
    params = [SamplingParams(temperature=0.5), SamplingParams(temperature=0.0)]
    processed, greedy = Sampler({EOS}, V).process_logits(logits, meta(params))
    assert torch.allclose(processed[0], logits[0] / 0.5)
    assert torch.equal(processed[1], logits[1])
    assert greedy[1].item() == logits[1].argmax().item()


def test_seeded_rows_independent_of_batch():
    rows = rand_logits(5, seed=10, scale=1.0)  # flat-ish: many plausible tokens
    s = Sampler({EOS}, V, generator_seed=1)
    a = SamplingParams(temperature=1.0, seed=1234)
    b = SamplingParams(temperature=0.9, top_p=0.95, seed=-7)
    outs_a, outs_b = [], []
    # Alone.
    outs_a.append(s(rows[0:1], meta([a], outputs=[[1, 2]])).token_ids.item())
    outs_b.append(s(rows[1:2], meta([b], outputs=[[5]])).token_ids.item())
    # With others, different order and positions.
    batch = torch.stack([rows[2], rows[1], rows[3], rows[0], rows[4]])
    params = [SamplingParams(), b, SamplingParams(temperature=0.0), a, SamplingParams(seed=99)]
    outputs = [[], [5], [9, 9], [1, 2], []]
    o = s(batch, meta(params, outputs=outputs)).token_ids.tolist()
    outs_b.append(o[1])
    outs_a.append(o[3])
    batch2 = torch.stack([rows[0], rows[4], rows[1]])
    o = s(batch2, meta([a, SamplingParams(), b], outputs=[[7, 8], [], [0]])).token_ids.tolist()
    outs_a.append(o[0])
    outs_b.append(o[2])
    # A fresh sampler (e.g. another replica, or recompute after preemption) agrees too.
    outs_a.append(Sampler({EOS}, V, generator_seed=77)(rows[0:1], meta([a], outputs=[[3, 3]])).token_ids.item())
    assert len(set(outs_a)) == 1, outs_a
    assert len(set(outs_b)) == 1, outs_b


def test_seeded_draws_vary_with_position_and_follow_distribution():
    row = torch.zeros(1, V)
    s = Sampler(set(), V)
    p = SamplingParams(seed=42)
    toks = [s(row, meta([p], outputs=[[0] * n])).token_ids.item() for n in range(64)]
    assert len(set(toks)) > 20  # uniform over 32: positions give fresh draws
    assert derive_seed(42, 0) != derive_seed(42, 1) and derive_seed(42, 0) != derive_seed(43, 0)


def test_unseeded_reproducible_per_generator_seed():
    logits = rand_logits(16, seed=11, scale=1.0)
    params = [SamplingParams()] * 16
    a = Sampler(set(), V, generator_seed=5)(logits, meta(params)).token_ids
    b = Sampler(set(), V, generator_seed=5)(logits, meta(params)).token_ids
    assert torch.equal(a, b)


def test_min_tokens_suppresses_eos_and_stop_tokens():
    logits = torch.zeros(2, V)
    logits[:, EOS] = 50.0
    logits[:, 5] = 40.0
    logits[:, 6] = 30.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, logprobs=0),
        SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[5]),
    ]
    s = Sampler({EOS}, V)
    out = s(logits, meta(params, outputs=[[1], [1, 2]]))
    assert out.token_ids.tolist() == [5, 6]
    # Raw logprob still reported for the sampled token.
    assert abs(out.logprobs[0].item() - torch.log_softmax(logits[0], -1)[5].item()) < 1e-6
    out = s(logits, meta(params, outputs=[[1, 2, 3], [1, 2, 3]]))
    assert out.token_ids.tolist() == [EOS, EOS]
    # ignore_eos: EOS is not masked by min_tokens (it does not end the sequence anyway).
    p = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert s(logits[:1], meta([p], outputs=[[1]])).token_ids.item() == EOS


def test_padded_vocab_is_trimmed():
    logits = rand_logits(3, v=V + 8, seed=12)
    logits[:, V:] = 100.0
    out = Sampler({EOS}, V)(logits, meta([SamplingParams(temperature=0.0, logprobs=0), SamplingParams(logprobs=0),
                                                     SamplingParams(logprobs=2)]))
    assert (out.token_ids < V).all()
    assert torch.equal(out.token_ids[0], logits[0, :V].argmax())
    assert torch.allclose(out.logprobs, torch.log_softmax(logits[:, :V], -1).gather(1, out.token_ids[:, None])[:, 0])


def test_prompt_logprobs_match_log_softmax():
    prompt = [3, 9, 1, 30, 9]
    logits = rand_logits(len(prompt) - 1, seed=13)
    res = compute_prompt_logprobs(logits, prompt, 3)
    assert len(res) == len(prompt) and res[0] is None
    lsm = torch.log_softmax(logits, -1)
    for i, d in enumerate(res[1:]):
        tok = prompt[i + 1]
        assert list(d)[0] == tok
        assert math.isclose(d[tok], lsm[i, tok].item(), abs_tol=1e-6)
        top = lsm[i].topk(3)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert math.isclose(d[t], v, abs_tol=1e-6)
        assert set(d) == {tok} | set(top.indices.tolist())
    res0 = compute_prompt_logprobs(logits, prompt, 0)
    assert all(len(d) == 1 for d in res0[1:])
    assert compute_prompt_logprobs(torch.empty(0, V), [7], 2) == [None]


def test_batch_size_mismatch_raises():
    with pytest.raises(ValueError):
        Sampler(set(), V)(rand_logits(2), meta([SamplingParams()]))


def test_top_k_mixed_rows():
    row = rand_logits(1, seed=14)[0]
    n = 200
    logits = row.unsqueeze(0).repeat(n, 1)
    params = [SamplingParams(temperature=3.0, top_k=3 if i % 2 else 0) for i in range(n)]
    processed, _ = Sampler(set(), V).process_logits(logits, meta(params))
    assert torch.isfinite(processed[0]).all()  # k = 0: unrestricted
    assert torch.isfinite(processed[1]).sum() == 3
    toks = Sampler(set(), V)(logits, meta(params)).token_ids.tolist()
    allowed = set(row.topk(3).indices.tolist())
    assert set(toks[1::2]) <= allowed
    assert len(set(toks[0::2]) - allowed) > 0
