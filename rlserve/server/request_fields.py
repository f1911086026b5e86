"""Request fields of ``/v1/completions`` and ``/v1/chat/completions`` (``/v1/responses``: unknown
ones only) that rlserve has no model field for: OpenAI's and vLLM 0.32's fields that change nothing rlserve generates (accepted,
ignored), vLLM's fields accepted only at the value that asks for nothing (else a 400 that says
why), and everything else (unknown: a 400 ``unknown_field`` naming it, or, with
``--allow-unknown-fields``, vLLM's ignore-and-log: one log line per request naming the fields).

Where the names come from: vLLM 0.32's ``CompletionRequest`` / ``ChatCompletionRequest``
(``vllm/entrypoints/openai/{completion,chat_completion}/protocol.py``) minus the fields
rlserve implements, and OpenAI's chat / completions create bodies (``user``, ``metadata``,
``store``, ``service_tier``, ``safety_identifier``, ``prompt_cache_key``, ...).
``tests/test_request_fields_vllm.py`` checks the lists against the installed vLLM.
"""

from __future__ import annotations

import logging

from rlserve.server.errors import APIError

logger = logging.getLogger("rlserve.server.requests")

#: accepted with any value on both routes and ignored: ``{name: why it changes nothing here}``
NOOP_FIELDS: dict[str, str] = {
    "metadata": "OpenAI's tags for stored completions (rlserve stores nothing)",
    "store": "OpenAI's stored completions (rlserve stores nothing)",
    "service_tier": "OpenAI's processing tier (one tier here)",
    "safety_identifier": "OpenAI's end-user id for abuse monitoring",
    "prompt_cache_key": "OpenAI's prompt-cache routing hint (the prefix cache needs none)",
    "request_id": "vLLM's caller-chosen id (rlserve names requests itself)",
    "session_id": "vLLM's session routing hint (one engine here)",
    "cache_salt": "vLLM's prefix-cache isolation salt (the tokens generated are the same)",
    "kv_transfer_params": "vLLM's disaggregated-prefill parameters (no KV connector here)",
    "ec_transfer_params": "vLLM's encoder-cache transfer parameters (no connector here)",
    "vllm_xargs": "vLLM's extra arguments for custom logits processors (none here)",
    "length_penalty": "vLLM's beam-search length penalty (only read by beam search)",
    "mm_payload": "vLLM's multimodal payload format (text models only here)",
    "priority": "vLLM's scheduling priority: its default FCFS scheduler ignores it too (rlserve schedules first "
                "come, first served)",
    "return_token_offsets": "vLLM's token offsets of the /render endpoints (generation routes ignore it, as vLLM's)",
    "return_mm_kwargs": "vLLM's multimodal kwargs in the answer (text models only here)",
}
#: chat only, accepted with any value and ignored (on completions they are unknown, as in vLLM)
CHAT_NOOP_FIELDS: dict[str, str] = {
    "media_io_kwargs": "vLLM's multimodal loading options (text models only here)",
    "mm_processor_kwargs": "vLLM's multimodal processor options (text models only here)",
}

_BEAM = "beam search is not implemented in rlserve; sample n completions (n, temperature) instead"
#: ``{name: (values that ask for nothing, why another value is refused)}`` on both routes
DEFAULT_ONLY_FIELDS: dict[str, tuple[tuple, str]] = {
    "use_beam_search": ((False, None), _BEAM),
    "watermarking": ((False, None), "output watermarking is not implemented"),
    "spaces_between_special_tokens": ((True, None), "special tokens are always detokenized with spaces between "
                                                    "them here (vLLM's default)"),
    "logprob_token_ids": ((None, []), "logprob_token_ids is not implemented: ask for logprobs / top_logprobs"),
    "prompt_embeds": ((None,), "prompt embeddings are not accepted: send text or token ids"),
    "repetition_detection": ((None,), "repetition_detection is not implemented"),
    "thinking_token_budget": ((None,), "thinking_token_budget is not implemented"),
}
#: chat only, as :data:`DEFAULT_ONLY_FIELDS`
CHAT_DEFAULT_ONLY_FIELDS: dict[str, tuple[tuple, str]] = {
    "return_prompt_text": ((None, False), "return_prompt_text is not implemented"),
}


def _same(value, allowed: tuple) -> bool:
    """``value`` equals one of ``allowed`` (a bool is not taken for the int 0 / 1, nor 0 for False)."""
    return any(value == a and type(value) is type(a) or (value is None and a is None) for a in allowed)


def check_extra_fields(body, route: str, allow_unknown: bool) -> list[str]:
    """Sort out the request's fields that its model does not declare (``body.model_extra``).

    Args:
        body: the parsed request (a pydantic model with ``extra="allow"``).
        route: ``"completions"``, ``"chat"`` (which lists apply) or ``"responses"`` (no list: its
            model declares OpenAI's fields itself); also named in the log line.
        allow_unknown: ``--allow-unknown-fields``: ignore unknown fields, logging one line.
    Returns:
        the unknown fields that were ignored (empty unless ``allow_unknown``).
    Raises:
        APIError 400: a field of :data:`DEFAULT_ONLY_FIELDS` at a value that asks for something
            (``code`` ``unsupported_value``, the reason in the message); an unknown field
            without ``allow_unknown`` (``code`` ``unknown_field``, as pydantic's refusal was).
    """
    extra = body.model_extra or {}
    if not extra:
        return []
    chat = route == "chat"
    unknown = []
    for name, value in extra.items():
        if route == "responses":  # its model declares OpenAI's no-op fields itself: the rest is unknown
            unknown.append(name)
            continue
        if name in NOOP_FIELDS or (chat and name in CHAT_NOOP_FIELDS):
            continue
        rule = DEFAULT_ONLY_FIELDS.get(name) or (CHAT_DEFAULT_ONLY_FIELDS.get(name) if chat else None)
        if rule is not None:
            if not _same(value, rule[0]):
                raise APIError(400, f"{name} is not supported: {rule[1]}", param=name, code="unsupported_value")
            continue
        unknown.append(name)
    if unknown and not allow_unknown:
        names = ", ".join(repr(u) for u in unknown[:5])
        raise APIError(400, f"unknown field{'s' if len(unknown) > 1 else ''} {names}: rlserve does not implement "
                            f"{'them' if len(unknown) > 1 else 'it'} (see the README's list of supported request "
                            "fields; start the server with --allow-unknown-fields to ignore such fields, as vLLM "
                            "does)", param=unknown[0], code="unknown_field")
    if unknown:
        logger.warning("%s request: ignored unknown field%s %s (--allow-unknown-fields)", route,
                       "s" if len(unknown) > 1 else "", ", ".join(sorted(unknown)))
    return unknown


#: vLLM's VLLM_MAX_NUM_BAD_WORDS default: token sequences one request's ``bad_words`` may make
MAX_BAD_WORD_SEQUENCES = 128


def bad_words_token_ids(tokenizer, words: list[str] | None, vocab_size: int) -> list[list[int]] | None:
    """vLLM's ``bad_words`` as the token sequences it bans (``SamplingParams.update_from_tokenizer``):
    each word (left-stripped) tokenized without special tokens, and with a leading space when
    that gives another first token and as many tokens (so the word is banned at the start and
    in the middle of the text); duplicate words once. None for none.

    Raises:
        APIError 400 (param ``bad_words``, vLLM's messages): a word that tokenizes to nothing,
            more than :data:`MAX_BAD_WORD_SEQUENCES` sequences, ids outside the vocabulary.
    """
    if not words:
        return None
    if tokenizer is None:
        raise APIError(400, "bad_words needs the server's tokenizer (it runs with --skip-tokenizer-init)",
                       param="bad_words")
    out: list[list[int]] = []
    for word in dict.fromkeys(words):
        for prefix in ("", " "):
            ids = list(tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
            if not ids:
                if not prefix:
                    raise APIError(400, "bad_words entries must tokenize to at least one token.", param="bad_words")
                continue
            if not prefix or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
                if len(out) > MAX_BAD_WORD_SEQUENCES:
                    raise APIError(400, f"Too many bad words after tokenization: {len(out)}. The max number is "
                                        f"{MAX_BAD_WORD_SEQUENCES}.", param="bad_words")
    bad = [t for ids in out for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"The model vocabulary size is {vocab_size}, but the following tokens were specified as "
                            f"bad: {bad}.", param="bad_words")
    return out
