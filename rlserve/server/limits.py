"""Bounds on the size of one request, checked before any work is done for it, so that no
single request can hold the server for minutes or exhaust its memory:

* the body: at most ``max_body_bytes`` (413 before the body is parsed; a ``Content-Length``
  over the limit is refused before a byte is read, a chunked body once it passes it);
* a text prompt: at most ``max_prompt_chars`` characters (400 ``context_length_exceeded``
  before tokenizing: a longer text cannot fit in ``max_model_len`` tokens, see
  :func:`max_prompt_chars`);
* sampling: ``n`` / ``best_of`` at most the scheduler's batch (``--max-num-seqs``), prompts x
  ``n`` at most ``max_request_sequences``, ``logprobs`` / ``prompt_logprobs`` at most
  ``--max-logprobs``, at most :data:`MAX_STOP` stop strings of at most :data:`MAX_STOP_CHARS`
  characters and :data:`MAX_STOP_TOKEN_IDS` stop token ids (each in the vocabulary).

* a structured-output constraint: at most :data:`MAX_CONSTRAINT_CHARS` characters (the JSON
  schema as sent, the regex, the grammar, or the choices together) and :data:`MAX_CHOICES`
  choices (400 ``constraint_too_large`` before it compiles), and it must compile within
  :data:`COMPILE_TIMEOUT_S` seconds (400 ``constraint_timeout``).

``max_tokens`` is an upper bound: clamped to the room the prompt leaves in the context
(``max_model_len - prompt``, as vLLM 0.32; :meth:`rlserve.server.state.ServerState.check_length`).

A prompt too long for the context is named as vLLM 0.32 names it (``vllm/renderers/params.py``:
``_text_len_check``, ``_token_len_check``; the same on ``/v1/completions``, ``/v1/chat/completions`` and
``/v1/responses``, seen on vLLM CPU 0.32's own server, session 22): ``param`` :data:`TOO_LONG_TEXT_PARAM`
for a text over the character bound, :data:`TOO_MANY_TOKENS_PARAM` for more tokens than ``max_model_len``.
``code`` stays ``context_length_exceeded`` (vLLM's is the status, 400, an integer: rlserve's codes are strings,
``rlserve/server/errors.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Annotated

import msgspec

from starlette.exceptions import HTTPException as StarletteHTTPException

from rlserve.server.errors import APIError, send_error

#: ``param`` of a text prompt over the character bound (vLLM's ``_text_len_check``)
TOO_LONG_TEXT_PARAM = "input_text"
#: ``param`` of a prompt of more tokens than ``max_model_len`` (vLLM's ``_token_len_check``)
TOO_MANY_TOKENS_PARAM = "input_tokens"

#: Default largest request body (bytes): 64 MiB holds a batch of ~8M token ids as JSON.
DEFAULT_MAX_BODY_BYTES = 64 << 20
#: Default largest number of sequences (prompts x n) one request may ask for.
DEFAULT_MAX_REQUEST_SEQUENCES = 16384
#: Stop strings per request at most (each is matched against every new piece of text).
MAX_STOP = 64
#: Characters per stop string at most.
MAX_STOP_CHARS = 4096
#: Stop token ids per request at most.
MAX_STOP_TOKEN_IDS = 1024
#: Characters of one structured-output constraint at most. xgrammar's compile time grows with
#: the constraint's size, faster than linearly; measured with the tests' 330-token vocabulary
#: on the 2-core machine: a 60,000-character regex 1.4 s, a 2,000-property JSON schema
#: (~45,000 characters) 5.3 s, 20,000 choices (~210,000 characters) 9 s, 4,000 choices 0.2 s.
MAX_CONSTRAINT_CHARS = 32768
#: ``structured_outputs.choice`` entries at most (see MAX_CONSTRAINT_CHARS).
MAX_CHOICES = 4096
#: Seconds the API process waits for a constraint's compile before it answers 400; the compile
#: itself (a thread: it cannot be stopped) ends within the size bound's time.
COMPILE_TIMEOUT_S = 10.0


def check_constraint(spec, param: str) -> None:
    """The size bound of a structured-output constraint (a
    :class:`~rlserve.engine.sampling_params.StructuredOutputsParams`).

    Raises:
        APIError 400 ``constraint_too_large`` naming ``param``'s field.
    """
    if spec.choice is not None and len(spec.choice) > MAX_CHOICES:
        raise APIError(400, f"{param}.choice: at most {MAX_CHOICES} choices, got {len(spec.choice)}",
                       param=f"{param}.choice", code="constraint_too_large")
    for kind, text in (("json", spec.json), ("regex", spec.regex), ("grammar", spec.grammar),
                       ("choice", None if spec.choice is None else "|".join(map(str, spec.choice)))):
        if isinstance(text, str) and len(text) > MAX_CONSTRAINT_CHARS:
            raise APIError(400, f"{param}.{kind}: at most {MAX_CONSTRAINT_CHARS} characters, got {len(text)} (a "
                                "larger constraint takes seconds to compile)", param=f"{param}.{kind}",
                           code="constraint_too_large")


def max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """The longest text prompt that can fit in ``max_model_len`` tokens: ``max_model_len`` x the
    longest token string of the vocabulary (added tokens included). A token never stands for
    more characters than its vocabulary string has (byte-level BPE: one character per byte;
    SentencePiece byte fallback ``<0x0A>``: six for one), so a longer text has more than
    ``max_model_len`` tokens. No tokenizer (``skip_tokenizer_init``): 0 (no text prompts)."""
    if tokenizer is None:
        return 0
    try:
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    except Exception:  # noqa: BLE001 - a tokenizer without get_vocab: a generous bound
        longest = 64
    return max_model_len * max(longest, 1)


@dataclasses.dataclass
class RequestLimits:
    """The bounds of one server (see the module docstring).

    Attributes:
        max_body_bytes: largest request body, bytes (413 above).
        max_prompt_chars: longest text prompt, characters (:func:`max_prompt_chars`).
        max_n: largest ``n`` / ``best_of`` (the scheduler's ``max_num_seqs``).
        max_request_sequences: largest prompts x ``n`` of one request.
        max_logprobs: largest ``logprobs`` / ``prompt_logprobs`` / ``top_logprobs``.
        vocab_size: stop token ids must be in ``[0, vocab_size)``.
    """

    max_body_bytes: int
    max_prompt_chars: int
    max_n: int
    max_request_sequences: int
    max_logprobs: int
    vocab_size: int

    def check_prompt_chars(self, text: str, param: str, max_model_len: int) -> None:
        """Raises APIError 400 ``context_length_exceeded`` (``param`` :data:`TOO_LONG_TEXT_PARAM`, as vLLM; the
        message names the request's field ``param``) for a text too long to fit."""
        if len(text) > self.max_prompt_chars:
            raise APIError(400, f"This model's maximum context length is {max_model_len} tokens; the prompt "
                                f"({param}) has {len(text)} characters, more than {self.max_prompt_chars} (the most "
                                f"that {max_model_len} tokens can hold). Shorten the prompt.",
                           param=TOO_LONG_TEXT_PARAM, code="context_length_exceeded")

    def check_sequences(self, num_prompts: int, n, param: str = "prompt") -> None:
        """Raises APIError 400 when ``n`` is over ``max_n`` (param ``n``) or ``num_prompts x n``
        exceeds ``max_request_sequences`` (param ``param``)."""
        self.check_sampling({"n": n})
        if isinstance(n, int) and not isinstance(n, bool) and num_prompts * max(n, 1) > self.max_request_sequences:
            raise APIError(400, f"{num_prompts} prompt(s) x n={n} = {num_prompts * n} sequences; one request may ask "
                                f"for at most {self.max_request_sequences} (rlserve serve --max-request-sequences); "
                                "split the batch", param=param)

    def check_sampling(self, kw: dict) -> None:
        """Bounds of the SamplingParams fields in ``kw`` (values may be of any type: type errors
        are left to SamplingParams). Raises APIError 400 naming the field."""

        def num(name):
            v = kw.get(name)
            return v if isinstance(v, int) and not isinstance(v, bool) else None

        for name in ("n", "best_of"):
            v = num(name)
            if v is not None and v > self.max_n:
                raise APIError(400, f"{name} must be at most {self.max_n} (the scheduler's batch, --max-num-seqs), "
                                    f"got {v}", param=name)
        for name in ("logprobs", "prompt_logprobs"):
            v = num(name)
            if v is not None and 0 <= self.max_logprobs < v:  # --max-logprobs -1: no limit
                raise APIError(400, f"{name} must be at most {self.max_logprobs} (--max-logprobs), got {v}",
                               param=name)
        stop = kw.get("stop")
        if isinstance(stop, (list, tuple)):
            if len(stop) > MAX_STOP:
                raise APIError(400, f"stop: at most {MAX_STOP} stop strings, got {len(stop)}", param="stop")
            for s in stop:
                if isinstance(s, str) and len(s) > MAX_STOP_CHARS:
                    raise APIError(400, f"stop: a stop string has at most {MAX_STOP_CHARS} characters, got {len(s)}",
                                   param="stop")
        elif isinstance(stop, str) and len(stop) > MAX_STOP_CHARS:
            raise APIError(400, f"stop: a stop string has at most {MAX_STOP_CHARS} characters, got {len(stop)}",
                           param="stop")
        ids = kw.get("stop_token_ids")
        if isinstance(ids, (list, tuple)):
            if len(ids) > MAX_STOP_TOKEN_IDS:
                raise APIError(400, f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}",
                               param="stop_token_ids")
            check_token_ids(ids, self.vocab_size, "stop_token_ids", param="stop_token_ids")


@functools.lru_cache(maxsize=8)
def _vocab_ids(vocab_size: int):
    """msgspec's type of a list of token ids in ``[0, vocab_size)``."""
    return list[Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]]


def check_token_ids(ids, vocab_size: int, what: str, param: str) -> None:
    """Every id of ``ids`` is an int (not a bool) in ``[0, vocab_size)``.

    Raises:
        APIError 400 ``invalid_token_id``: "{what} must be integers, got [...]" for
        non-int entries, else "{what} out of the vocabulary [0, V): [...]" (the first 5 named).
    """
    if not ids:
        return
    try:  # the common case in one C pass (a 512-id prompt: ~8 us; ~40 with set(map(type)), min and max)
        msgspec.convert(ids, _vocab_ids(vocab_size))
        return
    except msgspec.ValidationError:  # (a bool or a float is refused too) the loops below say what is wrong
        pass
    not_int = [t for t in ids if not isinstance(t, int) or isinstance(t, bool)]
    if not_int:
        raise APIError(400, f"{what} must be integers, got {not_int[:5]}", param=param,
                       code="invalid_token_id")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"{what} out of the vocabulary [0, {vocab_size}): {bad[:5]}", param=param,
                       code="invalid_token_id")


class BodySizeLimit:
    """ASGI middleware: a request body larger than ``max_bytes`` is answered 413 (OpenAI-style
    JSON error) before the application parses it. A ``Content-Length`` over the limit is
    refused without reading the body; a chunked body is counted as it arrives.

    Args:
        app: the ASGI app.
        max_bytes: the limit in bytes.
        on_error: ``on_error(status)`` for each refusal (metrics), optional.
    """

    def __init__(self, app, max_bytes: int, on_error=None):
        self.app = app
        self.max_bytes = int(max_bytes)
        self.on_error = on_error

    async def _refuse(self, send, size: str) -> None:
        if self.on_error is not None:
            self.on_error(413)
        await send_error(send, 413, f"the request body ({size}) is larger than the limit of {self.max_bytes} "
                                    "bytes (rlserve serve --max-request-body-bytes)",
                         code="request_too_large", headers=((b"connection", b"close"),))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers") or []:
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    declared = -1
                if declared > self.max_bytes:
                    return await self._refuse(send, f"{declared} bytes")
        seen = 0
        started = False

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:  # the app's HTTPException handler answers it (413)
                    raise BodyTooLargeError(self.max_bytes)
            return msg

        async def tracking_send(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLargeError:
            if started:
                raise
            await self._refuse(send, f"over {self.max_bytes} bytes")


class BodyTooLargeError(StarletteHTTPException):
    """Raised while the body is read once it passes the limit: a 413 (FastAPI passes an
    HTTPException raised while it reads the body through unchanged)."""

    def __init__(self, max_bytes: int):
        super().__init__(413, f"the request body is larger than the limit of {max_bytes} bytes "
                              "(rlserve serve --max-request-body-bytes)")
