"""The sampler's ``logprobs_mode`` (vLLM's ``--logprobs-mode``) against a row-by-row reference
computation, prompt-logprob ranks, and the structured-output mask (xgrammar)."""

from __future__ import annotations

import math

import pytest
import torch

from rlserve.engine.core.sampler import LOGPROBS_MODES, Sampler, SamplingMetadata, compute_prompt_logprobs
from rlserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from rlserve.errors import InvalidRequestError

V = 40
EOS = 39


def reference_processed(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row's processed logits, written from the definitions (not from the sampler's code):
    CTRL repetition penalty over prompt + output, OpenAI frequency/presence penalties over the
    output, then (sampling rows) temperature, top-k, top-p over the top-k-truncated softmax
    (a token stays when the mass strictly above it is < p), min-p; -inf where removed."""
    x = logits.clone().double()
    seen = set(prompt) | set(output)
    for t in seen:
        if p.repetition_penalty != 1.0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    if p.greedy:
        return x
    x = x / p.temperature
    order = sorted(range(len(x)), key=lambda i: -x[i].item())
    keep = set(order[: p.top_k] if 0 < p.top_k < len(x) else order)
    if p.top_p < 1.0:
        kept = [i for i in order if i in keep]
        probs = torch.softmax(torch.stack([x[i] for i in kept]), 0)
        above, survivors = 0.0, set()
        for i, pr in zip(kept, probs.tolist()):
            if above < p.top_p:
                survivors.add(i)
            above += pr
        keep = survivors
    masked = torch.full_like(x, float("-inf"))
    for i in keep:
        masked[i] = x[i]
    if p.min_p > 0:
        probs = torch.softmax(masked, 0)
        masked[probs < p.min_p * probs.max()] = float("-inf")
    return masked


def reference_scores(mode: str, logits: torch.Tensor, p, prompt, output) -> torch.Tensor:
    if mode == "raw_logits":
        return logits.double()
    if mode == "raw_logprobs":
        return torch.log_softmax(logits.double(), 0)
    proc = reference_processed(logits, p, prompt, output)
    return proc if mode == "processed_logits" else torch.log_softmax(proc, 0)


PARAMS = [
    SamplingParams(temperature=0.0, logprobs=3),
    SamplingParams(temperature=0.7, top_k=6, logprobs=3),
    SamplingParams(temperature=1.3, top_p=0.6, logprobs=3, seed=5),
    SamplingParams(temperature=0.9, top_k=10, top_p=0.8, min_p=0.05, logprobs=3),
    SamplingParams(temperature=1.0, repetition_penalty=1.4, frequency_penalty=0.5, presence_penalty=0.3, logprobs=3),
    SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=3),
]
PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [1, 11, 12], [13, 14]]
OUTPUTS = [[], [20], [21, 21], [], [11, 22, 22, 23], [14, 14]]


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_logprobs_mode_matches_reference(mode):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(len(PARAMS), V, generator=g) * 3
    meta = SamplingMetadata(params=PARAMS, prompt_token_ids=PROMPTS, output_token_ids=OUTPUTS)
    out = Sampler({EOS}, V, logprobs_mode=mode)(logits, meta)
    for i, p in enumerate(PARAMS):
        ref = reference_scores(mode, logits[i], p, PROMPTS[i], OUTPUTS[i])
        t = int(out.token_ids[i])
        assert math.isfinite(reference_processed(logits[i], p, PROMPTS[i], OUTPUTS[i])[t].item()), \
            "the drawn token was removed by the processing"
        assert out.logprobs[i].item() == pytest.approx(ref[t].item(), abs=1e-5)
        want_top = ref.topk(3).values
        got_top = out.topk_logprobs[i]
        for a, b in zip(got_top.tolist(), want_top.tolist()):
            assert (a == b == -math.inf) or a == pytest.approx(b, abs=1e-5)


def test_processed_logprobs_are_the_drawn_distribution():
    """processed_logprobs of a top-k row put all mass on k tokens; raw ones do not."""
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=0.5, top_k=4, logprobs=V)
    meta = SamplingMetadata(params=[p], prompt_token_ids=[[1]], output_token_ids=[[]])
    proc = Sampler({EOS}, V, logprobs_mode="processed_logprobs")(logits, meta)
    raw = Sampler({EOS}, V, logprobs_mode="raw_logprobs")(logits, meta)
    assert math.isclose(proc.topk_logprobs[0, :4].exp().sum().item(), 1.0, abs_tol=1e-5)
    assert torch.isinf(proc.topk_logprobs[0, 4:]).all()
    assert torch.isfinite(raw.topk_logprobs).all()


def test_unknown_mode_refused():
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler({EOS}, V, logprobs_mode="processed")


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs"])
def test_prompt_logprobs_ranks_and_mode(mode):
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(3)) * 2
    prompt = [0, 4, 9, 17, 3, 30]
    entries, ranks = compute_prompt_logprobs(logits, prompt, 2, mode=mode, with_ranks=True)
    assert entries[0] is None and ranks[0] is None
    scores = logits if mode.endswith("_logits") else torch.log_softmax(logits, -1)  # prompts skip processing
    for pos in range(1, len(prompt)):
        row = scores[pos - 1]
        tgt = prompt[pos]
        assert entries[pos][tgt] == pytest.approx(row[tgt].item(), abs=1e-5)
        assert ranks[pos] == int((row >= row[tgt]).sum())
        top = row.topk(2)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert entries[pos][t] == pytest.approx(v, abs=1e-5)


# ---- structured outputs ------------------------------------------------------------------

xgr = pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (rlserve[structured])")


@pytest.fixture(scope="module")
def compiler():
    from rlserve.engine.core.structured import GrammarCompiler
    from tests.tiny_models import EOS_ID, build_tokenizer

    tok = build_tokenizer()
    return GrammarCompiler(tok, len(tok), {EOS_ID}), tok


def test_grammar_mask_equals_xgrammar_reference(compiler):
    from rlserve.engine.core.structured import apply_grammar_masks

    comp, tok = compiler
    V2 = len(tok)
    spec = StructuredOutputsParams(regex=r"(yes|no)[0-9]{2}")
    states = [comp.new_state(spec), None, comp.new_state(StructuredOutputsParams(choice=("Paris", "Berlin")))]
    logits = torch.randn(3, V2, generator=torch.Generator().manual_seed(0))
    masked = apply_grammar_masks(logits.clone(), states)
    assert torch.equal(masked[1], logits[1])  # the unconstrained row is untouched
    for row in (0, 2):
        ref_bm = xgr.allocate_token_bitmask(1, V2)
        states[row].matcher.fill_next_token_bitmask(ref_bm, 0)
        ref = logits[row:row + 1].clone()
        xgr.apply_token_bitmask_inplace(ref, ref_bm)
        assert torch.equal(torch.isinf(masked[row]), torch.isinf(ref[0]))
        allowed = torch.isfinite(masked[row]).nonzero().flatten().tolist()
        starts = ("yes", "no") if row == 0 else ("Paris", "Berlin")
        assert allowed and all(any(s.startswith(tok.decode([t])) for s in starts) for t in allowed)


def test_grammar_state_ends_with_eos(compiler):
    from tests.tiny_models import EOS_ID

    comp, tok = compiler
    st = comp.new_state(StructuredOutputsParams(choice=("no",)))
    for t in tok.encode("no", add_special_tokens=False):
        assert st.accept(t)
    assert not st.is_terminated
    assert not st.accept(tok.encode("x", add_special_tokens=False)[0])  # refused, state unchanged
    assert st.accept(EOS_ID) and st.is_terminated


def test_bad_words_ban_the_last_token_after_the_rest():
    """vLLM's ``apply_bad_words``: a one-token word is always banned; a longer one's last token
    only right after the rest of it; ids beyond the logits are skipped."""
    from rlserve.engine.core.sampler import SamplingMetadata, apply_bad_words

    p = SamplingParams(bad_words_token_ids=[[3], [5, 6, 7], [1, 99]])
    for past, banned in (([], {3}), ([5, 6], {3, 7}), ([6], {3}), ([5, 6, 1], {3})):
        meta = SamplingMetadata(params=[p, SamplingParams()], prompt_token_ids=[[0], [0]],
                                output_token_ids=[past, past])
        x = apply_bad_words(torch.zeros(2, 10), meta)
        assert set(torch.isinf(x[0]).nonzero().flatten().tolist()) == banned and not torch.isinf(x[1]).any()
    with pytest.raises(Exception, match="bad_words_token_ids"):
        SamplingParams(bad_words_token_ids=[[]])


@pytest.mark.parametrize("first", ["end", "implicit"])
def test_grammar_state_waits_for_the_reasoning_end(compiler, first):
    """vLLM's ``--reasoning-parser`` gate: with ``reasoning_end_ids`` the constraint is not
    applied (no mask, tokens not fed) until an end id is drawn, then from the next token; an
    ``implicit`` end id is the constraint's own first token."""
    from rlserve.engine.core.structured import apply_grammar_masks
    from tests.tiny_models import EOS_ID

    comp, tok = compiler
    a, b, x = (tok.encode(c, add_special_tokens=False)[0] for c in "abx")
    spec = StructuredOutputsParams(regex="ab", reasoning_end_ids=[x], reasoning_implicit_end_ids=(a,))
    st = comp.new_state(spec)
    assert spec.reasoning_end_ids == (x,) and st.waiting and not st.is_terminated
    logits = torch.zeros(1, len(tok))
    assert torch.equal(apply_grammar_masks(logits.clone(), [st]), logits)  # reasoning: all allowed
    assert st.accept(b) and st.accept(EOS_ID) and st.waiting  # free while reasoning (EOS included)
    if first == "end":
        assert st.accept(x) and not st.waiting  # the end token itself is not the constraint's
        assert not st.accept(b) and st.accept(a)
    else:
        assert st.accept(a) and not st.waiting  # <tool_call>-like: the constraint's first token
    masked = apply_grammar_masks(torch.zeros(1, len(tok)), [st])
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [b]
    assert st.accept(b) and st.accept(EOS_ID) and st.is_terminated


@pytest.mark.parametrize("spec,msg", [
    (dict(regex="(unclosed"), "regex"),
    (dict(json='{"type": "objec"}'), "json"),
    (dict(grammar="root ::= missing_rule"), "grammar"),
])
def test_bad_constraint_is_invalid_request(compiler, spec, msg):
    comp, _ = compiler
    with pytest.raises(InvalidRequestError, match=msg):
        comp.compile(StructuredOutputsParams(**spec))


def test_constraint_needs_exactly_one():
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=("b",))
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams()
