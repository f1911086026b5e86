"""Run in a Python that has vLLM (``tests/vllm_python.py``): prints, as JSON, what vLLM 0.32's
own request code makes of the request fields ``tests/test_request_fields_vllm.py`` checks
rlserve against (issue 38 items 1-3). Each fact comes from vLLM's code, not from its docs:

* ``schema_key``: the JSON-schema text vLLM hands xgrammar for a ``{zeta, alpha}`` schema
  (``vllm.v1.structured_output.request.get_structured_output_key``): the properties' order kept.
* ``logit_bias``: ``SamplingParams.from_optional``'s ``logit_bias`` for string keys and biases
  beyond [-100, 100] (clipped).
* ``echo0``: ``CompletionRequest.to_sampling_params`` of ``echo: true, max_tokens: 0,
  logprobs: 2``: one token generated, prompt logprobs with logprobs' top-k.
* ``echo_plp``: the same with ``prompt_logprobs: 1``: the prompt logprobs' own top-k wins.
* ``chat_echo_plp``: chat ``echo: true, logprobs: true, top_logprobs: 2``: prompt logprobs 2.
* ``best_of``: ``best_of: 3, n: 1``: not a field (an extra, ignored), ``n`` stays 1.
* ``fields``: every field of ``CompletionRequest`` / ``ChatCompletionRequest`` with its default
  (``repr``), ``extra``: their ``model_config["extra"]`` (vLLM ignores unknown fields).
"""

from __future__ import annotations

import json


def facts() -> dict:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.structured_output.request import get_structured_output_key

    schema = {"type": "object", "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "integer"}},
              "required": ["zeta", "alpha"]}
    bias = SamplingParams.from_optional(logit_bias={"5": 250.0, "7": -300, "9": 1.5}).logit_bias
    echo0 = CompletionRequest(prompt="hi", echo=True, max_tokens=0, logprobs=2).to_sampling_params(0)
    echo_plp = CompletionRequest(prompt="hi", echo=True, max_tokens=3, logprobs=2,
                                 prompt_logprobs=1).to_sampling_params(3)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], echo=True, logprobs=True,
                                 top_logprobs=2).to_sampling_params(4, {})
    best = CompletionRequest(prompt="hi", best_of=3, n=1)
    return {
        "schema_key": get_structured_output_key(StructuredOutputsParams(json=schema))[1],
        "logit_bias": {str(k): v for k, v in sorted(bias.items())},
        "echo0": {"max_tokens": echo0.max_tokens, "prompt_logprobs": echo0.prompt_logprobs, "logprobs": echo0.logprobs},
        "echo_plp": {"prompt_logprobs": echo_plp.prompt_logprobs, "logprobs": echo_plp.logprobs},
        "chat_echo_plp": chat.prompt_logprobs,
        "best_of": {"is_field": "best_of" in CompletionRequest.model_fields, "n": best.to_sampling_params(16).n},
        "fields": {"completion": {k: repr(v.default) for k, v in CompletionRequest.model_fields.items()},
                   "chat": {k: repr(v.default) for k, v in ChatCompletionRequest.model_fields.items()}},
        "extra": [CompletionRequest.model_config.get("extra"), ChatCompletionRequest.model_config.get("extra")],
    }


if __name__ == "__main__":
    print(json.dumps(facts(), sort_keys=True))
