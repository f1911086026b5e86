"""The issue-33 classes of ``benchmarks/fuzz_http.py``: ``(class, method, path, body)`` cases.

* ``typed``: every field of the generation routes and of every nested kwargs dict
  (``generation_kwargs``, ``structured_outputs``, ``chat_template_kwargs``, ``logit_bias``,
  ``stream_options``, ``response_format``, ``text``) given a value of the wrong type: a float
  for an int, a string for a bool or a number, a list, an object, null, huge and negative
  numbers.
* ``surrogates``: a lone UTF-16 surrogate (JSON ``"\\ud800"``) in every string field.
* ``bombs``: chat templates and structured-output constraints that cost seconds of CPU or
  gigabytes if run unbounded (a canary client measures everyone else's latency meanwhile).
* ``trl``: TRL's weight routes with out-of-range values (``/init_communicator/`` world_size,
  port; loopback ``host`` only: nothing leaves the machine).

A body that is ``bytes`` is sent as is; anything else as JSON (``json.dumps`` escapes a lone
surrogate as ``\\ud800``, as a client in another language would send it).
"""

from __future__ import annotations

import json

SURROGATE = "a\ud800b"
INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "stream_interval",
              "best_of", "top_logprobs", "max_completion_tokens", "truncate_prompt_tokens")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "echo", "stream",
               "add_special_tokens", "return_token_ids", "return_tokens_as_token_ids",
               "add_generation_prompt", "continue_final_message", "no_stop_trim")
LIST_FIELDS = ("stop", "stop_token_ids")
# a value of each wrong kind; the fields' own kinds are left out per field
WRONG = {
    "float": 2.5, "str_int": "2", "str_bool": "yes", "list": [1], "object": {"a": 1}, "null": None,
    "huge": 10 ** 30, "huge_float": 1e300, "negative": -5, "min_int64": -(2 ** 63), "over_int64": 2 ** 64,
    "true": True, "zero": 0,
}
GEN_KWARGS = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
              "frequency_penalty", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos",
              "logprobs", "prompt_logprobs", "skip_special_tokens", "include_stop_str_in_output",
              "structured_outputs", "stream_interval")
HI = [{"role": "user", "content": "hi"}]


def _wrong_values(field: str) -> list:
    vals = dict(WRONG)
    if field in INT_FIELDS:
        vals.pop("zero")
    if field in FLOAT_FIELDS:
        vals.pop("zero")
    if field in BOOL_FIELDS:
        vals.pop("true")
    return list(vals.values())


def typed(model: str) -> list[tuple[str, str, object]]:
    """Wrong-typed values in the top-level fields and in every nested kwargs dict."""
    out = []
    for field in INT_FIELDS + FLOAT_FIELDS + BOOL_FIELDS[:3] + LIST_FIELDS:
        for v in _wrong_values(field):
            out.append(("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, field: v}))
            out.append(("POST", "/generate/", {"prompts": ["hi"], "max_tokens": 2, "generation_kwargs": {field: v}}))
    for field in GEN_KWARGS:
        for v in _wrong_values(field):
            out.append(("POST", "/generate/", {"prompts": ["hi"], "generation_kwargs": {field: v}}))
    for field in ("logprobs", "top_logprobs", "max_completion_tokens", "n", "temperature", "ignore_eos", "stop"):
        for v in _wrong_values(field):
            body = {"messages": HI, "max_tokens": 2, field: v}
            if field == "top_logprobs":
                body["logprobs"] = True
            out.append(("POST", "/v1/chat/completions", body))
    nested = {
        "structured_outputs": [{"choice": 5}, {"choice": [1, 2]}, {"choice": [None]}, {"choice": []},
                               {"regex": 5}, {"regex": ["a"]}, {"json": 5}, {"json": "not json"},
                               {"json": {"type": 5}}, {"grammar": {"a": 1}}, {"json_object": "yes"},
                               {"json_object": 2.5}, {"choice": ["a"], "regex": "b"}, {"nope": 1}, {}],
        "logit_bias": [{"1": "x"}, {"-1": 1}, {"99999999": 1}, {"a": 1}, {"1": 1e300}, {"1": None},
                       {"1.5": 1}, {str(2 ** 64): 1}, {"1": [1]}, [1, 2], "x"],
        "stream_options": [{"include_usage": "yes"}, {"include_usage": 2.5}, {"nope": 1}, [1], "x"],
        "response_format": [{"type": 5}, {"type": "json_schema", "json_schema": 5},
                            {"type": "json_schema", "json_schema": {"name": 5, "schema": []}}, {"type": "nope"}, []],
    }
    for field, values in nested.items():
        for v in values:
            extra = {"stream": True} if field == "stream_options" else {}
            out.append(("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, field: v, **extra}))
            out.append(("POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 2, field: v, **extra}))
    for v in nested["structured_outputs"]:
        out.append(("POST", "/generate/", {"prompts": ["hi"], "max_tokens": 2, "generation_kwargs":
                                           {"structured_outputs": v}}))
    for v in ({"add_generation_prompt": "yes"}, {"tools": 5}, {"messages": 5}, {"documents": "x"},
              {"continue_final_message": 2.5}, {"x": 10 ** 30}, {"bos_token": [1]}, [1], "x", 5):
        out.append(("POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "chat_template_kwargs": v}))
        out.append(("POST", "/tokenize", {"messages": HI, "chat_template_kwargs": v}))
    for v in ({"format": 5}, {"format": {"type": "json_schema", "schema": 5}}, {"format": {"type": "nope"}}, 5):
        out.append(("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2, "text": v}))
    for v in (2.5, "2", -1, 10 ** 30, None, [1]):
        out.append(("POST", "/v1/responses", {"input": "hi", "max_output_tokens": v}))
        out.append(("POST", "/detokenize", {"tokens": [v]}))
    return [("typed", *c) for c in out]


def surrogates(model: str) -> list[tuple[str, str, object]]:
    """A lone surrogate in every string field of the generation and tokenizer routes."""
    s = SURROGATE
    bodies = [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "model": s}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": [s]}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": s}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "user": s}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "suffix": s}),
        ("/v1/completions", {"prompt": [s], "max_tokens": 2}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": {s: 1}}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"regex": s}}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"choice": [s, "b"]}}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"grammar": f'root ::= "{s}"'}}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"json": {"const": s}}}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"json": s}}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "response_format": {"type": "json_schema",
                                                                               "json_schema": {"name": s}}}),
        ("/v1/chat/completions", {"messages": [{"role": s, "content": "hi"}], "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": s}], "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": s}]}],
                                  "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 2, "chat_template": s}),
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 2, "chat_template_kwargs": {s: s}}),
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 2, "tools": [{"type": "function",
                                                                             "function": {"name": s}}]}),
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 2, "stop": [s]}),
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 2, "model": s}),
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 2, "user": s}),
        ("/v1/responses", {"input": s, "max_output_tokens": 2}),
        ("/v1/responses", {"input": "hi", "instructions": s, "max_output_tokens": 2}),
        ("/v1/responses", {"input": "hi", "model": s, "max_output_tokens": 2}),
        ("/generate/", {"prompts": [s], "max_tokens": 2}),
        ("/generate/", {"prompts": ["hi"], "max_tokens": 2, "guided_decoding_regex": s}),
        ("/generate/", {"prompts": ["hi"], "max_tokens": 2, "generation_kwargs": {"stop": [s]}}),
        ("/tokenize", {"prompt": s}), ("/tokenize", {"prompt": "hi", "model": s}),
        ("/tokenize", {"messages": [{"role": "user", "content": s}]}),
        ("/detokenize", {"tokens": [1], "model": s}),
        ("/abort_requests", {"request_ids": [s]}),
        ("/update_weights", {"weight_version": s}),
    ]
    return [("surrogates", "POST", path, body) for path, body in bodies]


def bombs(model: str) -> list[tuple[str, str, object]]:
    """Chat templates and constraints that stall a server that runs them unbounded."""
    big_schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
    mid_schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}}
    out = []
    for tmpl in ("{{ 'x' * 10**9 }}", "{{ 3 ** 40000000 }}",
                 "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                 "{{ 'x' * 10**7 }}", "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
                 "{{ ('x' * 100000) | replace('', 'yyyy') }}"):
        out.append(("POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "chat_template": tmpl}))
    out.append(("POST", "/tokenize", {"messages": HI, "chat_template": "{{ 3 ** 40000000 }}"}))
    out.append(("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2,
                                          "chat_template": "{{ 'x' * 10**9 }}"}))
    for so in ({"choice": [f"c{i}" for i in range(100_000)]}, {"choice": [f"choice{i}" for i in range(4000)]},
               {"regex": "a" * 32768}, {"regex": "(a|b)*" * 2000}, {"json": big_schema}, {"json": mid_schema},
               {"grammar": "root ::= " + " ".join(['"a"'] * 8000)}, {"regex": "[a-z]{100000}"}):
        out.append(("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "structured_outputs": so}))
    out.append(("POST", "/generate/", {"prompts": ["hi"], "max_tokens": 2,
                                       "guided_decoding_regex": "(" + "|".join(f"c{i}" for i in range(100_000)) + ")"}))
    out.append(("POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": big_schema}}}))
    return [("bombs", *c) for c in out]


def trl(model: str) -> list[tuple[str, str, object]]:
    """TRL's weight routes with out-of-range values (loopback host only)."""
    out = []
    for ws in (-5, 0, 1, 10 ** 9, 2.5, "2", None, 2 ** 64):
        out.append(("POST", "/init_communicator/", {"host": "127.0.0.1", "port": 1, "world_size": ws}))
    for port in (-1, 0, 70000, "x", 2.5):
        out.append(("POST", "/init_communicator/", {"host": "127.0.0.1", "port": port, "world_size": 10 ** 9}))
    out += [("POST", "/init_communicator/", {"host": "127.0.0.1", "port": 1, "world_size": 2, "client_device_uuid": 5}),
            ("POST", "/init_communicator/", {"host": "", "port": 1, "world_size": 2 ** 64}),
            ("POST", "/close_communicator/", None),
            ("POST", "/update_named_param/", {"name": "x", "dtype": "torch.float32", "shape": [-1]}),
            ("POST", "/update_named_param/", {"name": "x", "dtype": "torch.nope", "shape": [1]}),
            ("POST", "/update_named_param/", {"name": 5, "dtype": 5, "shape": "x"}),
            ("POST", "/update_named_param/", {"name": "lm_head.weight", "dtype": "torch.float32",
                                              "shape": [2 ** 40, 2 ** 40]}),
            ("POST", "/close_communicator/", None)]
    return [("trl", *c) for c in out]


CLASSES = {"typed": typed, "surrogates": surrogates, "bombs": bombs, "trl": trl}


def encode(body) -> bytes | None:
    """The request body's bytes (``None``: no body)."""
    if body is None or isinstance(body, bytes):
        return body
    return json.dumps(body, allow_nan=True).encode()
