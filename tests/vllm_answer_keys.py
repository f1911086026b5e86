"""Run in a Python that has vLLM (``tests/vllm_python.py``): prints, as JSON, the keys of every
object of vLLM's chat, completions and Responses answers and stream chunks / events,
``{name: sorted keys}``.

Each object is built as vLLM's serving code builds it
(``vllm/entrypoints/openai/{chat_completion,completion}/serving.py``: which fields it sets) and
dumped as it dumps it: a non-streamed answer whole (``model_dump()``, the API router's
``JSONResponse``), a chunk with ``exclude_unset=True``, the last usage chunk with
``exclude_none=True`` (chat also ``exclude_unset``; completions ``exclude_unset=False``). The
``system_fingerprint`` is a string, as vLLM's default ``--fingerprint-mode full`` makes it.
Responses (``vllm/entrypoints/openai/responses/{serving,streaming_events,api_router}.py``, no
parser, no harmony): ``ResponsesResponse.from_request`` dumped ``model_dump(mode="json",
by_alias=True)`` (``metrics`` is left out when None), each event ``model_dump_json(by_alias=True)``
as built by ``emit_simple_content_open`` / ``_delta`` / ``_done``.
``tests/test_server_vllm_keys.py`` compares rlserve's answers with these (and its literal copy
of vLLM 0.32's with this).
"""

from __future__ import annotations

import json


def keys_of_vllm() -> dict[str, list[str]]:
    """``{name: sorted keys}`` of vLLM's objects (names: see the returned dict's construction)."""
    from vllm.entrypoints.generate.base.protocol import DeltaMessage
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionLogProb, ChatCompletionLogProbs, ChatCompletionLogProbsContent, ChatCompletionResponse,
        ChatCompletionResponseChoice, ChatCompletionResponseStreamChoice, ChatCompletionStreamResponse, ChatMessage)
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionLogProbs, CompletionResponse, CompletionResponseChoice, CompletionResponseStreamChoice,
        CompletionStreamResponse)
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    fp = "vllm-0.32.0-0123abcd"
    out: dict[str, dict] = {}

    def usage(p=3, c=2, **kw):
        return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c, **kw)

    top = ChatCompletionLogProb(token="a", logprob=-1.0, bytes=[97])
    chat_lp = ChatCompletionLogProbs(content=[ChatCompletionLogProbsContent(token="a", logprob=-1.0, bytes=[97],
                                                                             top_logprobs=[top])])
    # chat_completion_full_generator
    msg = ChatMessage(role="assistant", reasoning=None, content="hi")
    choice = ChatCompletionResponseChoice(index=0, message=msg, logprobs=chat_lp, finish_reason="length",
                                          stop_reason=None, token_ids=None, routed_experts=None)
    u = usage(completion_tokens_details=None)
    u.prompt_tokens_details = None
    resp = ChatCompletionResponse(id="x", created=1, model="m", choices=[choice], usage=u, system_fingerprint=fp,
                                  prompt_logprobs=None, prompt_token_ids=None, prompt_text=None,
                                  kv_transfer_params=None, ec_transfer_params=None, metrics=None)
    d = resp.model_dump()
    out["chat.response"] = d
    out["chat.choice"] = d["choices"][0]
    out["chat.message"] = d["choices"][0]["message"]
    out["chat.logprobs"] = d["choices"][0]["logprobs"]
    out["chat.logprobs.content"] = d["choices"][0]["logprobs"]["content"][0]
    out["chat.logprobs.top"] = d["choices"][0]["logprobs"]["content"][0]["top_logprobs"][0]
    out["usage"] = d["usage"]
    # request_output_to_completion_response
    cmp_lp = CompletionLogProbs(text_offset=[0], token_logprobs=[-1.0], tokens=["a"], top_logprobs=[{"a": -1.0}])
    cchoice = CompletionResponseChoice(index=0, text="hi", logprobs=cmp_lp, finish_reason="length", stop_reason=None,
                                       prompt_logprobs=None, prompt_token_ids=None, token_ids=None,
                                       routed_experts=None)
    d = CompletionResponse(id="x", created=1, model="m", choices=[cchoice], usage=usage(), system_fingerprint=fp,
                           kv_transfer_params=None, ec_transfer_params=None, metrics=None).model_dump()
    out["completion.response"] = d
    out["completion.choice"] = d["choices"][0]
    out["completion.logprobs"] = d["choices"][0]["logprobs"]
    assert d["usage"].keys() == out["usage"].keys()

    # chat_completion_stream_generator: the role chunk (continuous usage: 0 completion tokens)
    def chat_chunk(choice, continuous=False, **kw):
        chunk = ChatCompletionStreamResponse(id="x", object="chat.completion.chunk", created=1, choices=[choice],
                                             model="m", **kw)
        if continuous:
            chunk.usage = usage(c=0, completion_tokens_details=None)
        return json.loads(chunk.model_dump_json(exclude_unset=True))

    role = ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""),
                                              logprobs=None, finish_reason=None)
    d = chat_chunk(role, prompt_token_ids=None, prompt_text=None)
    out["chat.chunk.first"], out["chat.chunk.first.choice"] = d, d["choices"][0]
    out["chat.chunk.first.delta"] = d["choices"][0]["delta"]
    out["chat.chunk.first.continuous"] = chat_chunk(role, True, prompt_token_ids=None, prompt_text=None)
    mid = ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(content="ab"), logprobs=None,
                                             finish_reason=None, token_ids=None)
    d = chat_chunk(mid)
    out["chat.chunk"], out["chat.chunk.choice"], out["chat.chunk.delta"] = d, d["choices"][0], d["choices"][0]["delta"]
    d = chat_chunk(mid, True)
    out["chat.chunk.continuous"], out["chat.chunk.continuous.usage"] = d, d["usage"]
    last = ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(content=""), logprobs=None,
                                              finish_reason="length", stop_reason=None, token_ids=None)
    d = chat_chunk(last)
    out["chat.chunk.last.choice"] = d["choices"][0]
    # the terminal chunk without include_usage: the fingerprint rides on it
    chunk = ChatCompletionStreamResponse(id="x", object="chat.completion.chunk", created=1, choices=[last], model="m")
    chunk.system_fingerprint = fp
    out["chat.chunk.last.no_usage"] = json.loads(chunk.model_dump_json(exclude_unset=True))
    final = usage(completion_tokens_details=None)
    final.prompt_tokens_details = None
    d = json.loads(ChatCompletionStreamResponse(id="x", object="chat.completion.chunk", created=1, choices=[],
                                                model="m", usage=final, system_fingerprint=fp, metrics=None)
                   .model_dump_json(exclude_unset=True, exclude_none=True))
    out["chat.chunk.usage"], out["chat.chunk.usage.usage"] = d, d["usage"]

    # completion_stream_generator
    def cmp_chunk(finish, continuous=False, fingerprint=False):
        ch = CompletionResponseStreamChoice(index=0, text="a", logprobs=cmp_lp, finish_reason=finish,
                                            stop_reason=None, prompt_token_ids=None, token_ids=None)
        chunk = CompletionStreamResponse(id="x", object="text_completion", created=1, model="m", choices=[ch])
        if fingerprint:
            chunk.system_fingerprint = fp
        if continuous:
            chunk.usage = usage(c=1)
        return json.loads(chunk.model_dump_json(exclude_unset=True))

    d = cmp_chunk(None)
    out["completion.chunk"], out["completion.chunk.choice"] = d, d["choices"][0]
    d = cmp_chunk(None, continuous=True)
    out["completion.chunk.continuous"], out["completion.chunk.continuous.usage"] = d, d["usage"]
    out["completion.chunk.last.no_usage"] = cmp_chunk("length", fingerprint=True)
    d = json.loads(CompletionStreamResponse(id="x", created=1, model="m", choices=[], usage=usage(),
                                            system_fingerprint=fp, metrics=None)
                   .model_dump_json(exclude_unset=False, exclude_none=True))
    out["completion.chunk.usage"], out["completion.chunk.usage.usage"] = d, d["usage"]
    _responses(out)
    return {name: sorted(obj) for name, obj in out.items()}


def _responses(out: dict) -> None:
    """Adds the Responses API's objects to ``out`` (names ``responses.*``): the non-streamed answer
    (``responses_full_generator``, a ``SimpleContext``: no per-turn metrics) and the events of
    ``responses_stream_generator`` for one text message."""
    from vllm.entrypoints.openai.responses.protocol import (
        InputTokensDetails, OutputTokensDetails, ResponseCompletedEvent, ResponseCreatedEvent,
        ResponseInProgressEvent, ResponsesRequest, ResponsesResponse, ResponseUsage)
    from vllm.entrypoints.openai.responses.streaming_events import (
        SimpleStreamingState, emit_simple_content_delta, emit_simple_content_done, emit_simple_content_open)
    from vllm.sampling_params import SamplingParams

    request = ResponsesRequest(model="m", input="hi", max_output_tokens=5)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=5)
    usage = ResponseUsage(input_tokens=3, output_tokens=2, total_tokens=5,
                          input_tokens_details=InputTokensDetails(cache_write_tokens=0, cached_tokens=0,
                                                                  input_tokens_per_turn=[], cached_tokens_per_turn=[]),
                          output_tokens_details=OutputTokensDetails(reasoning_tokens=0, tool_output_tokens=0,
                                                                    output_tokens_per_turn=[],
                                                                    tool_output_tokens_per_turn=[]))

    def response(status, output, usage_):
        return ResponsesResponse.from_request(request, params, model_name="m", created_time=1, output=output,
                                              status=status, usage=usage_, input_messages=None,
                                              output_messages=None, kv_transfer_params=None,
                                              ec_transfer_params=None)

    state = SimpleStreamingState()
    events = emit_simple_content_open(state) + emit_simple_content_delta(state, "ab") + emit_simple_content_done(state)
    item = events[-1].item
    d = response("completed", [item], usage).model_dump(mode="json", by_alias=True)
    out["responses.response"], out["responses.usage"] = d, d["usage"]
    out["responses.usage.input_tokens_details"] = d["usage"]["input_tokens_details"]
    out["responses.usage.output_tokens_details"] = d["usage"]["output_tokens_details"]
    out["responses.message"], out["responses.output_text"] = d["output"][0], d["output"][0]["content"][0]
    initial = response("in_progress", [], None).model_dump(mode="json", by_alias=True)
    events = [ResponseCreatedEvent(type="response.created", sequence_number=0, response=initial),
              ResponseInProgressEvent(type="response.in_progress", sequence_number=1, response=initial),
              *events, ResponseCompletedEvent(type="response.completed", sequence_number=-1,
                                              response=response("completed", [item], usage))]
    for event in events:
        d = json.loads(event.model_dump_json(indent=None, by_alias=True))
        name = "responses.event." + d["type"].removeprefix("response.")
        out[name] = d
        for inner in ("response", "item", "part"):
            if inner in d:
                out[f"{name}.{inner}"] = d[inner]


if __name__ == "__main__":
    print(json.dumps(keys_of_vllm(), sort_keys=True))
