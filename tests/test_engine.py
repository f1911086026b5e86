"""The engine against Hugging Face transformers (float32): greedy tokens, logprobs,
prefix caching, preemption, seeded sampling, bad input."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlserve import LLM, SamplingParams
from rlserve.errors import InvalidRequestError, UnsupportedArchitectureError
from tests.tiny_models import ARCHS

PROMPTS = [
    "The capital of France is",
    "Hello world! Hello there, how are you today? I am fine",
    "Once",
    "def main():\n    print('hello')",
]
NEW_TOKENS = 32


def hf_greedy(path: str, prompt_ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    """HF ``generate`` greedy continuation of each prompt (unbatched, float32). EOS is
    suppressed for ``new_tokens`` tokens, like our ``min_tokens``."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    outs = []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs


@pytest.fixture(scope="module")
def llms(tiny_model):
    cache = {}

    def get(arch, **kw):
        key = (arch, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = LLM(tiny_model(arch), dtype="float32", device="cpu", **kw)
        return cache[key]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf(arch, tiny_model, llms):
    path = tiny_model(arch)
    llm = llms(arch)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = llm.generate(PROMPTS, params)
    ref = hf_greedy(path, [o.prompt_token_ids for o in outs], NEW_TOKENS)
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r
        assert o.outputs[0].finish_reason == "length"
        assert len(o.outputs[0].token_ids) == NEW_TOKENS


def test_logprobs_match_hf(tiny_model, llms):
    path = tiny_model("llama")
    llm = llms("llama")
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, logprobs=3, prompt_logprobs=2)
    out = llm.generate(PROMPTS[1], params)[0]
    comp = out.outputs[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    full = torch.tensor([out.prompt_token_ids + comp.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(full).logits[0].float(), dim=-1)
    P = len(out.prompt_token_ids)
    for i, tok in enumerate(comp.token_ids):
        row = logp[P - 1 + i]
        d = comp.logprobs[i]
        assert abs(d[tok] - row[tok].item()) < 1e-4
        top = torch.topk(row, 3)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(d[t] - v) < 1e-4
    assert abs(comp.cumulative_logprob - sum(comp.logprobs[i][t] for i, t in enumerate(comp.token_ids))) < 1e-4
    assert out.prompt_logprobs[0] is None
    for j in range(1, P):
        tok = out.prompt_token_ids[j]
        assert abs(out.prompt_logprobs[j][tok] - logp[j - 1, tok].item()) < 1e-4


def test_prefix_cache_hit_same_output_fewer_prefill_tokens(tiny_model):
    llm = LLM(tiny_model("llama"), dtype="float32", device="cpu", block_size=4)
    long_prompt = "Hello world! Hello there, how are you today? I am fine, thank you. The quick brown fox"
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    first = llm.generate(long_prompt, params)[0]
    before = llm.engine.stats["prefill_tokens_computed"]
    second = llm.generate(long_prompt, params)[0]
    computed = llm.engine.stats["prefill_tokens_computed"] - before
    P = len(first.prompt_token_ids)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert computed < P
    assert computed == P - ((P - 1) // 4) * 4
    assert llm.engine.stats["prefix_cache_hit_tokens"] >= ((P - 1) // 4) * 4
    # after a reset nothing is reused
    llm.engine.reset_prefix_cache()
    before = llm.engine.stats["prefill_tokens_computed"]
    third = llm.generate(long_prompt, params)[0]
    assert llm.engine.stats["prefill_tokens_computed"] - before == P
    assert third.outputs[0].token_ids == first.outputs[0].token_ids


def test_preemption_keeps_greedy_outputs(tiny_model, llms):
    params = SamplingParams(temperature=0, max_tokens=40, min_tokens=40)
    ref = llms("qwen2").generate(PROMPTS, params)
    small = LLM(tiny_model("qwen2"), dtype="float32", device="cpu", block_size=4, num_kv_blocks=30,
                max_model_len=120, enable_prefix_caching=False)
    outs = small.generate(PROMPTS, params)
    assert small.engine.stats["num_preemptions"] > 0
    for a, b in zip(outs, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_seeded_sampling_independent_of_batch(llms):
    llm = llms("mistral")
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, min_tokens=20, seed=1234)
    other = SamplingParams(temperature=1.0, max_tokens=25)
    alone = llm.generate(PROMPTS[0], seeded)[0].outputs[0].token_ids
    mixed = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]], [other, seeded, other])[1].outputs[0].token_ids
    assert alone == mixed
    different = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, min_tokens=20, seed=99))
    assert different[0].outputs[0].token_ids != alone


def test_n_samples_and_stop(llms):
    llm = llms("llama")
    out = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    greedy = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, min_tokens=12))[0].outputs[0]
    tok = greedy.token_ids[3]
    stopped = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[tok]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == tok
    assert stopped.token_ids == greedy.token_ids[: greedy.token_ids.index(tok) + 1]


def test_bad_input_raises_and_engine_keeps_serving(tiny_model, llms):
    llm = llms("llama")
    eng = llm.engine
    vocab = eng.vocab_size
    bad = [
        ("", SamplingParams()),
        ([], SamplingParams()),
        ([1] * eng.max_model_len, SamplingParams(max_tokens=1)),
        ([5, vocab], SamplingParams()),
        ([5, -1], SamplingParams()),
    ]
    for i, (prompt, sp) in enumerate(bad):
        with pytest.raises(InvalidRequestError):
            eng.add_request(f"bad-{i}", prompt, sp)
    with pytest.raises(InvalidRequestError):  # one bad prompt in a batch: nothing is queued
        llm.generate(["fine", [5, vocab]], SamplingParams(max_tokens=2))
    for kwargs in ({"max_tokens": -1}, {"top_p": 0.0}, {"top_p": 1.5}, {"temperature": -0.5}, {"n": 0}):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**kwargs)
    assert not eng.has_unfinished_requests()
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, min_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4


def test_unknown_architecture(tiny_model, tmp_path):
    import json
    import shutil

    src = tiny_model("llama")
    dst = tmp_path / "weird"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError):
        LLM(str(dst), dtype="float32", device="cpu")


def test_abort(llms):
    eng = llms("llama").engine
    eng.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50))
    eng.add_request("b", PROMPTS[1], SamplingParams(temperature=0, max_tokens=5, min_tokens=5))
    eng.step()
    outs = eng.abort_request("a")
    assert outs[0].outputs[0].finish_reason == "abort"
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert set(done) == {"b"} and len(done["b"].outputs[0].token_ids) == 5
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.mark.parametrize("chunked", [True, False])
def test_cpu_prefill_budget_default_and_long_prompt(tiny_model, chunked):
    """On CPU a prefill step takes at most 1024 tokens by default (several prompts split over
    steps); a prompt longer than that is prefilled in chunks (``enable_chunked_prefill=True``; off by default since session 17) or
    runs alone in one step (``enable_chunked_prefill=False``), with HF's greedy tokens either way."""
    path = tiny_model("llama", max_position_embeddings=2048)
    llm = LLM(path, dtype="float32", device="cpu", enable_chunked_prefill=chunked)
    assert llm.engine.config.max_num_batched_tokens == 1024
    rows = []
    real = llm.engine.executor.execute
    llm.engine.executor.execute = lambda step: rows.append((step.is_prefill, len(step.input_ids))) or real(step)
    try:
        ids = [[(7 * i + 3 * j) % 200 + 5 for j in range(n)] for i, n in enumerate([1500, 700, 600])]
        outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=4, min_tokens=4))
    finally:
        llm.engine.executor.execute = real
    # chunked: 1024 of the first; its last 476 + 548 of the second; the second's last 152 + the third
    assert [n for p, n in rows if p] == ([1024, 1024, 752] if chunked else [1500, 700, 600])
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, ids, 4)


def test_max_tokens_beyond_the_context_is_clamped(tiny_model):
    """prompt + max_tokens over max_model_len: the sequence ends at the context's end with finish_reason
    "length" (vLLM's offline LLM.generate does the same; its server clamps max_tokens), not a refusal; greedy
    ids equal those of a request that asked for exactly the room left."""
    llm = LLM(tiny_model("llama"), device="cpu", max_model_len=32)
    prompt = [5, 6, 7, 8, 9, 10]
    big, exact = llm.generate([prompt, prompt], [SamplingParams(max_tokens=10 ** 9, temperature=0, ignore_eos=True),
                                                 SamplingParams(max_tokens=32 - 6, temperature=0, ignore_eos=True)])
    assert len(big.outputs[0].token_ids) == 32 - 6 and big.outputs[0].finish_reason == "length"
    assert big.outputs[0].token_ids == exact.outputs[0].token_ids
