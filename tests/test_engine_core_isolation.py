"""A request whose handling raises fails alone, in the engine-core process mode (the server's
default): with a clear error, while the requests beside it complete and the engine keeps
serving. Two places handle one request's data: the core adding it (tokenizing, validating,
compiling its grammar) and the API process turning its tokens into text."""

from __future__ import annotations

import asyncio

import pytest

T = 120.0  # bound on every wait (seconds)
POISON = [77, 77, 77]  # a prompt the patched core cannot add
HERE = "tests.test_engine_core_isolation"  # this module as the engine-core process imports it


def faulty_add():
    """``RLSERVE_ENGINE_CORE_INIT`` hook (runs in the engine-core process before the engine is
    built): adding a request whose prompt starts with :data:`POISON` raises a plain bug."""
    from rlserve.engine.core.llm_engine import LLMEngine

    real = LLMEngine.add_request

    def add_request(self, request_id, prompt, params=None):
        if list(prompt[:3]) == POISON:
            raise KeyError("poisoned prompt")
        return real(self, request_id, prompt, params)

    LLMEngine.add_request = add_request


def core_request_ids(core) -> list[str]:
    """Engine call: the requests the core still tracks."""
    return sorted(core.requests)


@pytest.fixture(scope="module")
def aeng(tiny_model):
    """An AsyncEngine in process mode whose core cannot add :data:`POISON` prompts."""
    from rlserve.config import EngineConfig
    from rlserve.engine.front.async_engine import AsyncEngine

    mp = pytest.MonkeyPatch()
    mp.setenv("RLSERVE_ENGINE_CORE_INIT", f"{HERE}:faulty_add")
    try:
        engine = AsyncEngine(EngineConfig(model=tiny_model("llama"), device="cpu", dtype="float32",
                                          max_model_len=256), engine_mode="process")
    finally:
        mp.undo()
    try:
        yield engine
    finally:
        engine.shutdown()


async def _final(aeng, prompt, sp, stream, request_id=None):
    last = None
    async for o in aeng.generate(prompt, sp, request_id, stream=stream):
        last = o
    return last


def test_a_request_the_core_cannot_add_fails_alone(aeng):
    """Adding it raises a plain bug in the core: it ends with EngineStepError naming the request
    and the error (HTTP 500 ``engine_error``); the requests beside it, streamed or not, finish."""
    from rlserve.errors import EngineStepError
    from rlserve.engine.sampling_params import SamplingParams
    from rlserve.server.errors import exception_to_error

    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def scenario():
        return await asyncio.gather(
            _final(aeng, POISON + [5], sp, True, "poisoned-1"), _final(aeng, [5, 6, 7], sp, True),
            *[_final(aeng, [5, 6, 8 + i], sp, False) for i in range(2)], return_exceptions=True)

    bad, *good = asyncio.run(asyncio.wait_for(scenario(), T))
    assert isinstance(bad, EngineStepError), bad
    assert "could not add request poisoned-1" in str(bad) and "KeyError" in str(bad) and "poisoned prompt" in str(bad)
    err = exception_to_error(bad)
    assert err.status == 500 and err.code == "engine_error"
    for o in good:
        assert len(o.outputs[0].token_ids) == 24 and o.outputs[0].finish_reason == "length"
    assert aeng.is_alive()


def test_a_request_whose_text_cannot_be_made_fails_alone(aeng):
    """The API process's detokenizer raises on one request's tokens: that request ends with
    EngineStepError (HTTP 500 ``engine_error``) and is aborted in the core; the others finish
    with their text; the engine serves the next request."""
    from rlserve.errors import EngineStepError
    from rlserve.engine.sampling_params import SamplingParams, StructuredOutputsParams

    outputs = aeng._replicas[0]._outputs
    real = outputs.tokenizer
    try:
        tok = aeng.tokenizer
        bad_id = tok.encode("é")[0]  # the first byte of é (its own token in the tiny byte-level BPE)
        assert tok.decode([bad_id]) == "\ufffd"

        class Broken:
            """The real tokenizer, except that decoding ``bad_id`` raises (no Rust fast path)."""

            def decode(self, ids, **kw):
                if bad_id in ids:
                    raise ValueError(f"cannot decode token {bad_id}")
                return tok.decode(ids, **kw)

        outputs.tokenizer = Broken()

        def forced(regex, max_tokens):
            return SamplingParams(temperature=0, max_tokens=max_tokens,
                                  structured_outputs=StructuredOutputsParams(regex=regex))

        async def scenario():
            res = await asyncio.gather(
                _final(aeng, [5, 6, 7], forced("é[a-z]{200}", 120), True),  # fails at its first token
                _final(aeng, [5, 6, 8], forced("hello world", 40), True),
                _final(aeng, [5, 6, 9], forced("hello there", 40), False),
                return_exceptions=True)
            tracked = await aeng.call_engines(f"{HERE}:core_request_ids")
            after = await _final(aeng, [5, 6, 7], forced("the end", 20), False)
            return res, tracked, after

        (bad, good1, good2), tracked, after = asyncio.run(asyncio.wait_for(scenario(), T))
        assert isinstance(bad, EngineStepError), bad
        assert f"cannot decode token {bad_id}" in str(bad) and "processing the outputs of request" in str(bad)
        assert good1.outputs[0].text == "hello world" and good2.outputs[0].text == "hello there"
        assert tracked == [[]]  # the failed request was aborted in the core, not left generating
        assert after.outputs[0].text == "the end" and after.outputs[0].finish_reason == "stop"
        assert aeng.is_alive()
    finally:
        outputs.tokenizer = real
