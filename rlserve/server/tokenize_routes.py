"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, with the server's own tokenizer.

``vllm bench serve`` (random and prefix-repetition datasets) calls them before a run to
re-align its prompts to the server's tokenizer; without them it prints ``/tokenize unavailable,
skipping alignment`` and its prompts can carry a few more tokens than asked. As in vLLM they
are open (no ``--api-key``: vLLM guards only ``/v1``); the body-size limit and the prompt-size
check of the generation routes apply. The chat template renders in a template worker process
(:meth:`~rlserve.server.state.ServerState.render_chat`, bounded in time and size) and the
encoding runs on the server's tokenizer thread (:meth:`~rlserve.server.state.ServerState.off_loop`),
not on the event loop: a long prompt does not hold up the process's other requests.

``/tokenize`` answers ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs``
only with ``return_token_strs: true``, else null); ``/detokenize`` answers ``{"prompt"}``;
``GET /tokenizer_info`` (with ``--enable-tokenizer-info-endpoint``, as in vLLM) the tokenizer's
configuration (:func:`tokenizer_info_json`).
"""

from __future__ import annotations

from fastapi import APIRouter

from rlserve.server.errors import APIError
from rlserve.server.protocol import TOKENIZE_CHAT_FIELDS, DetokenizeRequest, TokenizeRequest
from rlserve.server.request_body import FastJSONRoute
from rlserve.server.state import ServerState


def make_tokenize_router(state: ServerState) -> APIRouter:
    """The ``/tokenize`` and ``/detokenize`` routes (open, as in vLLM).

    Errors (400): both or neither of ``prompt`` / ``messages``, chat-only fields with
    ``prompt``, empty ``messages``, a non-text content part, a failing chat template, text that
    is not valid Unicode or too long, token ids outside the vocabulary; 404 for an unknown
    ``model``.
    """
    router = APIRouter(route_class=FastJSONRoute)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        state.check_model(body.model)
        text = None
        if body.messages and body.prompt is None:
            text = await state.render_chat(body.messages, body.chat_template_args())
        chars = len(text if text is not None else body.prompt or "")
        return await state.off_loop(_tokenize, state, body, text, chars=chars)  # a long prompt must not stop the loop

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        state.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < state.vocab_size]
        if bad:
            raise APIError(400, f"token ids out of the vocabulary [0, {state.vocab_size}): {bad[:5]}", param="tokens",
                           code="invalid_token_id")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    if state.settings.enable_tokenizer_info_endpoint:
        @router.get("/tokenizer_info")
        async def tokenizer_info():
            return tokenizer_info_json(state.tokenizer, state.settings.chat_template)

    return router


def tokenizer_info_json(tokenizer, chat_template: str | None) -> dict:
    """``GET /tokenizer_info`` (``--enable-tokenizer-info-endpoint``) as vLLM 0.32's
    ``TokenizerInfo.to_dict`` builds it (``vllm/entrypoints/serve/tokenize/serving.py``): the
    tokenizer's ``init_kwargs`` (its ``tokenizer_config.json``) less ``vocab_file`` /
    ``merges_file``, an added token as its text, ``truncation_side`` "left" unless the tokenizer
    has one (vLLM loads the tokenizer of a generating model with it, ``vllm/tokenizers/registry.py``;
    rlserve's ``truncate_prompt_tokens`` keeps a prompt's end too), plus ``tokenizer_class`` (the Hugging Face
    class's name; vLLM's shows the name of its caching wrapper of that class) and
    ``chat_template`` when ``--chat-template`` gave one. A value JSON cannot carry is given
    as its ``str``."""
    def plain(obj):
        if hasattr(obj, "content"):
            return obj.content
        if isinstance(obj, dict):
            return {str(k): plain(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [plain(v) for v in obj]
        if obj is None or isinstance(obj, (str, int, float, bool)):
            return obj
        return str(obj)

    config = dict(getattr(tokenizer, "init_kwargs", None) or {})
    config.pop("vocab_file", None)
    config.pop("merges_file", None)
    config = plain(config)
    config.setdefault("truncation_side", "left")  # vLLM loads a generating model's tokenizer so (rlserve truncates alike)
    config["tokenizer_class"] = type(tokenizer).__name__
    if chat_template:
        config["chat_template"] = chat_template
    return config


def _tokenize(state: ServerState, body: TokenizeRequest, rendered: str | None) -> dict:
    """``/tokenize``'s answer (on the tokenizer thread: :meth:`ServerState.off_loop`);
    ``rendered``: the conversation's prompt text when ``messages`` were sent. Raises APIError
    400 as :func:`make_tokenize_router` lists."""
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send exactly one of prompt (a string) or messages (a conversation)",
                       param="prompt")
    if body.prompt is not None:
        extra = [f for f in TOKENIZE_CHAT_FIELDS if f in body.model_fields_set]
        if extra:
            raise APIError(400, f"{extra[0]} goes with messages, not prompt", param=extra[0], code="unknown_field")
        text, param = body.prompt, "prompt"
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
    else:
        if not body.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        text, param = rendered, "messages"
        add_special = bool(body.add_special_tokens)
    ids = state.encode_text(text, param, add_special)
    strs = list(state.tokenizer_threads.current().convert_ids_to_tokens(ids)) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}
