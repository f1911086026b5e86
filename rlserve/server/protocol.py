"""Request bodies of the HTTP API (pydantic).

Every body is strict: a field rlserve does not implement is a 400 naming it (``code``
``unknown_field``), never silently ignored; a mistyped known field is a 400 too. The fields
accepted are OpenAI's plus the vLLM extensions rlserve implements (vLLM's names). ``model`` may
be left out: one model is served, and a request without ``model`` goes to it.

``/v1/completions`` and ``/v1/chat/completions`` bodies keep the fields they do not declare
(``extra="allow"``): :func:`rlserve.server.request_fields.check_extra_fields` sorts them into
no-ops (OpenAI's ``metadata``, ``store`` ...), vLLM fields refused unless at their default, and
unknown ones (400, or ignored and logged with ``--allow-unknown-fields``, vLLM's behaviour).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

import msgspec
from pydantic import BaseModel, ConfigDict, Field, StrictInt, WrapValidator, field_validator


#: A token id: a JSON integer. ``true`` and ``1.0`` are refused (pydantic's lax ``int`` reads them
#: as 1: a prompt of booleans would have been generated from).
TokenId = StrictInt


def fast_token_ids(flat: bool, nested: bool) -> WrapValidator:
    """A field's validator for prompts of token ids (the forms TRL and ``vllm bench serve`` send): a
    list of ints (``flat``) or a list of lists of ints, the first not empty (``nested``), as the
    field's type allows, is checked by msgspec in one C pass (``list[int]``: a bool or a float is refused, as
    :data:`TokenId`; 512 ids ~7 us where pydantic's union of CompletionRequest.prompt took ~110 us on
    the 2-core test host, 64 x 512 ~0.16 ms against ~1 ms). Anything else, or what msgspec refuses,
    goes to the field's own pydantic validation, which decides and words the error as before."""
    def check(value, handler):
        if type(value) is list and value:
            first = value[0]
            shape = list[int] if flat and type(first) is int else \
                list[list[int]] if nested and type(first) is list and first and type(first[0]) is int else None
            if shape is not None:
                try:
                    return msgspec.convert(value, shape)
                except msgspec.ValidationError:
                    pass
        return handler(value)

    return WrapValidator(check)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class StructuredOutputs(_Body):
    """vLLM (0.24+) ``structured_outputs``: exactly one of ``json`` (a JSON schema, as an object
    or a string), ``regex``, ``choice`` (the output is one of the strings), ``grammar`` (EBNF /
    GBNF) or ``json_object: true`` (any JSON object). Applied as a logits mask in the sampler."""

    json_: Optional[Union[dict[str, Any], str]] = Field(default=None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None


class JSONSchemaFormat(_Body):
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Body):
    """OpenAI ``response_format``: ``text``, ``json_object`` or ``json_schema`` (structured)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None


class _RouterFields(_Body):
    """Fields the SGLang router (``sglang-router``, :mod:`rlserve.scaleout.router`) adds to every
    request it forwards, accepted only at the value that means what rlserve does anyway
    (anything else is a 400 ``invalid_value``): ``no_stop_trim: false`` (stop strings are
    trimmed: ``include_stop_str_in_output`` is rlserve's switch), ``return_hidden_states: false``;
    chat also sends ``separate_reasoning`` / ``stream_reasoning``: any boolean, ignored (vLLM
    has neither; ``--reasoning-parser`` always separates the reasoning)."""

    no_stop_trim: Literal[False] = False
    return_hidden_states: Literal[False] = False


class SamplerFields(_Body):
    """The sampling fields of every generation route (completions, chat, responses): OpenAI's
    names plus vLLM's extensions. ``None`` takes the default of
    :meth:`rlserve.server.state.ServerState.sampling_params`."""

    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[TokenId]] = None
    # vLLM extensions
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def sampler_args(self) -> dict[str, Any]:
        """These fields as :class:`~rlserve.engine.sampling_params.SamplingParams` keyword
        arguments (``stop`` as a list of strings)."""
        args = {name: getattr(self, name) for name in SamplerFields.model_fields}
        stop = self.stop
        args["stop"] = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
        return args


class _SamplingFields(_RouterFields, SamplerFields):
    """Fields shared by completions and chat (OpenAI names + vLLM extensions)."""

    model: Optional[str] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # vLLM extensions
    return_token_ids: bool = False
    logit_bias: Optional[dict[str, float]] = None
    allowed_token_ids: Optional[list[TokenId]] = None  # vLLM's: only these ids may be drawn
    bad_words: Optional[list[str]] = None  # vLLM's: never generate these words (request_fields.bad_words_token_ids)
    user: Optional[str] = None
    return_tokens_as_token_ids: bool = False
    structured_outputs: Optional[StructuredOutputs] = None
    response_format: Optional[ResponseFormat] = None
    truncate_prompt_tokens: Optional[int] = None
    # vLLM's: which end truncate_prompt_tokens cuts ("left", the default: keep the last tokens; "right": the first)
    truncation_side: Optional[Literal["left", "right"]] = None
    # vLLM's: new tokens per streamed chunk at least; raises the server's --stream-interval
    stream_interval: Optional[int] = Field(default=None, ge=1)
    # vLLM's: leave the routing of the first N prompt tokens out of routed_experts (replay on)
    routed_experts_prompt_start: int = Field(default=0, ge=0)

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: Optional[StreamOptions], info) -> Optional[StreamOptions]:
        """vLLM's (and OpenAI's) rule: a non-empty ``stream_options`` without ``stream: true`` is
        a 400 (param ``stream_options``), not silently ignored. ``{}`` passes, as in vLLM."""
        if value is not None and value.model_fields_set and info.data.get("stream") is False:
            raise ValueError("stream_options can only be defined when stream=true")
        return value


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token
    ids, or a list of token-id lists. ``best_of``: accepted and ignored, as vLLM 0.32 does (its
    ``CompletionRequest`` has no such field any more: ``n`` completions are generated).
    ``echo`` with ``max_tokens: 0``: the prompt alone is returned (prompt-only scoring), as vLLM."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    prompt: Annotated[Union[str, list[str], list[TokenId], list[list[TokenId]]], fast_token_ids(True, True)]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = Field(default=None, ge=1)
    suffix: Optional[str] = None
    prompt_logprobs: Optional[int] = None
    add_special_tokens: bool = True


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # non-text parts are refused by the route, naming their type

    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None


class ChatTemplateFields(_Body):
    """How ``messages`` become a prompt (vLLM's names), shared by ``/v1/chat/completions`` and
    ``/tokenize``: the arguments of :func:`rlserve.server.chat_render.render_chat` after the
    messages."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None

    def chat_template_args(self) -> dict[str, Any]:
        """``render_chat``'s keyword arguments from this body: ``{field: value}``."""
        return {name: getattr(self, name) for name in ChatTemplateFields.model_fields}


class ChatCompletionRequest(_SamplingFields, ChatTemplateFields):
    """``POST /v1/chat/completions`` (the chat-template fields: :class:`ChatTemplateFields`).
    ``echo`` (vLLM's): the last message's content is put before each choice's content when
    that message's role is the answer's (``assistant``, or the last message's own role with
    ``add_generation_prompt: false``)."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None  # false: at most one tool call (forced and parsed)
    include_reasoning: bool = True  # false (with --reasoning-parser): no reasoning, logprobs or token ids
    add_special_tokens: bool = False
    echo: bool = False
    # vLLM's: the answer's prompt_logprobs (not with stream); with echo it defaults to top_logprobs
    prompt_logprobs: Optional[int] = None
    # the SGLang router's (see _RouterFields): either value does nothing (vLLM has no such fields)
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    # vLLM's: handed to the chat template (reasoning_effort also sets enable_thinking: see template_kwargs)
    documents: Optional[list[dict[str, str]]] = None
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]] = None

    def template_kwargs(self) -> Optional[dict[str, Any]]:
        """The chat template's extra keyword arguments as vLLM 0.32 builds them
        (``build_chat_params``): ``chat_template_kwargs``, overridden by ``documents`` and
        ``reasoning_effort`` when given, and ``enable_thinking`` = ``reasoning_effort != "none"``
        unless the request's kwargs set it. The reasoning parser reads the same (thinking on/off)."""
        extra = {"documents": self.documents, "reasoning_effort": self.reasoning_effort}
        user = self.chat_template_kwargs or {}
        if self.reasoning_effort is not None and "enable_thinking" not in user:
            extra["enable_thinking"] = self.reasoning_effort != "none"
        extra = {k: v for k, v in extra.items() if v is not None}
        return dict(user, **extra) if extra else self.chat_template_kwargs

    def chat_template_args(self) -> dict[str, Any]:
        return dict(super().chat_template_args(), chat_template_kwargs=self.template_kwargs())


class ResponsesTextFormat(_Body):
    """OpenAI Responses ``text.format``: ``text``, ``json_object`` (any JSON object) or
    ``json_schema`` (``schema`` required), applied through the structured-outputs path."""

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponsesTextConfig(_Body):
    format: Optional[ResponsesTextFormat] = None


class ResponsesRequest(SamplerFields, ChatTemplateFields):
    """``POST /v1/responses`` (OpenAI's Responses API, text generation; vLLM's field names for
    the extensions: :class:`SamplerFields`, :class:`ChatTemplateFields`).

    ``input``: a string (one user message) or a list of message items (``{"role", "content"}``,
    optionally ``"type": "message"``, ``id``, ``status``), checked by
    :func:`rlserve.server.responses_routes.input_messages`. The fields from ``store`` on are
    OpenAI's features rlserve does not have: accepted only at the value that asks for nothing
    (absent, null, false, empty, ``"auto"`` / ``"none"`` / ``"disabled"`` where that is the
    no-op), else a 400 naming the field (:func:`rlserve.server.responses_routes.refuse_unsupported`).
    Undeclared fields: as completions' (:func:`rlserve.server.request_fields.check_extra_fields`)."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    stream: bool = False
    text: Optional[ResponsesTextConfig] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    store: Optional[bool] = None
    background: Optional[bool] = None
    previous_response_id: Optional[str] = None
    conversation: Optional[Union[str, dict[str, Any]]] = None
    prompt: Optional[dict[str, Any]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    max_tool_calls: Optional[int] = None
    reasoning: Optional[dict[str, Any]] = None
    include: Optional[list[str]] = None
    top_logprobs: Optional[int] = None
    truncation: Optional[str] = None
    service_tier: Optional[str] = None


class TokenizeRequest(ChatTemplateFields):
    """``POST /tokenize`` (vLLM's route): either ``prompt`` (a string; ``add_special_tokens``
    defaults to true, as for completions) or ``messages`` (rendered with the chat template as
    ``/v1/chat/completions`` does; ``add_special_tokens`` defaults to false). The chat-only fields
    (:class:`ChatTemplateFields`) are refused with ``prompt``."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None
    return_token_strs: Optional[bool] = False


#: the fields of :class:`TokenizeRequest` that only go with ``messages``
TOKENIZE_CHAT_FIELDS = tuple(ChatTemplateFields.model_fields)


class DetokenizeRequest(_Body):
    """``POST /detokenize`` (vLLM's route): token ids → text, special tokens kept."""

    model: Optional[str] = None
    tokens: list[TokenId]


class TRLGenerateRequest(_Body):
    """TRL ``vllm-serve``'s ``POST /generate/`` body (plus ``prompt_ids`` / token-id prompts)."""

    prompts: Annotated[Optional[Union[list[str], list[list[TokenId]]]], fast_token_ids(False, True)] = None
    prompt_ids: Annotated[Optional[list[list[TokenId]]], fast_token_ids(False, True)] = None
    images: Optional[list[Any]] = None
    n: int = 1
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    logprobs: Optional[int] = 0
    truncate_prompt_tokens: Optional[int] = None
    guided_decoding_regex: Optional[str] = None
    generation_kwargs: dict[str, Any] = Field(default_factory=dict)


class AbortRequestsBody(_Body):
    """``POST /abort_requests`` body: ids to abort; none given = abort everything."""

    request_ids: Optional[list[str]] = None


PauseMode = Literal["abort", "wait", "keep"]
