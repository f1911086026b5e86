"""Wire format between the API server process and an engine-core process.

Two ZMQ sockets per engine replica (see :mod:`rlserve.engine.front.core_client`):

* input, API → core (``PUSH`` → ``PULL``): :class:`AddRequest`, :class:`Abort`,
  :class:`SetWeightVersion`, :class:`UtilityCall`, :class:`Shutdown`;
* output, core → API (``PUSH`` → ``PULL``): :class:`CoreReady` / :class:`CoreFailed` once at
  start, then :class:`CoreOutputs` (one per engine step: every request's :class:`RequestDelta`
  of that step in one message) and :class:`UtilityResult`.

With ``rlserve serve --api-server-count N`` (N > 1) the core has one such pair per API process
(its ``client_index``, vLLM's name): each request's outputs go to the process that added it;
utility calls come from process 0 only; :class:`FrontState` / :class:`FrontStateAck` carry process
0's admission state to the others (:mod:`rlserve.engine.front.front_sync`).

Outputs cross as token-id deltas: each step sends, per request that advanced, only the tokens
(and their logprobs) sampled since the request's previous delta -- O(new tokens), not O(length)
-- and no text: the API process detokenizes, matches stop strings and builds vLLM's cumulative
``RequestOutput`` (:mod:`rlserve.engine.front.output_processor`). A stop string found there ends its
sample in the core with :class:`StopSamples` (the core may have sampled a token or two past it
meanwhile; the API process drops them, so the result is the in-engine detokenizer's). Which
requests get a delta each step: streamed ones and those with stop strings; any other request
gets one delta, when it finishes.

Every message is a msgspec ``Struct`` (tagged union, MessagePack): typed, schema-checked on
decode, never pickle. Sampling parameters travel as the engine's own dataclass
(:class:`~rlserve.engine.sampling_params.SamplingParams`), so a field added there travels
without a change here. That one schema is enforced on both sides: the API process builds every
request's parameters with :func:`params_from_fields` (the core's decoder's type check, the
dataclass's range check and the wire's limits: a bad value is an :class:`InvalidParamsError`
naming the field, HTTP 400), and the core's loop fails a message it cannot decode alone
(:mod:`rlserve.engine.core.core_proc`), never itself. Messages on one socket arrive in the order they were sent: a utility
call's result comes after the outputs of every step run before it.
"""

from __future__ import annotations

import builtins
import re
from typing import Any, Union

import msgspec

from rlserve.engine.sampling_params import SamplingParams, clip_logit_bias
import rlserve.errors as errors
import rlserve.transfer.errors as terrors
from rlserve.errors import InvalidRequestError


class ErrorInfo(msgspec.Struct, frozen=True):
    """An exception by class name and message (:func:`error_info` / :func:`rebuild_error`)."""

    type: str
    message: str


# ---- API → core ------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add", omit_defaults=True):
    """Queue a request. ``prompt``: token ids (the API tokenizes) or text.
    ``arrival_time``: ``time.monotonic()`` seconds in the API process. ``stream``: send an
    output every step (else only the final one). ``client_index``: the API process that sent it
    (vLLM's name; ``rlserve serve --api-server-count N``: 0..N-1): its outputs and errors go to
    that process's output socket (0, the default, is left off the wire)."""

    request_id: str
    prompt: Union[list[int], str]
    params: SamplingParams
    stream: bool
    arrival_time: float
    client_index: int = 0


class Abort(msgspec.Struct, tag="abort"):
    """Abort requests (a client went away); no reply (their final outputs are sent)."""

    request_ids: list[str]


class SetWeightVersion(msgspec.Struct, tag="version"):
    """Stamp ``version`` on outputs of the steps that follow; no reply."""

    version: str


class UtilityCall(msgspec.Struct, tag="call"):
    """Call ``method`` with ``args`` between two steps; answered by a :class:`UtilityResult`
    with the same ``call_id``. Methods: see :data:`rlserve.engine.core.core_proc.UTILITY_METHODS`."""

    call_id: int
    method: str
    args: list[Any] = []


class StopSamples(msgspec.Struct, tag="stop"):
    """Finish samples ``indices`` of request ``request_id`` with ``finish_reason == "stop"``
    (the API process matched a stop string in their text); no reply. When that finishes the
    request, its final delta is sent (the API process has already ended it)."""

    request_id: str
    indices: list[int]


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Stop: fail the requests in flight, shut the engine down, exit."""


class FrontStateAck(msgspec.Struct, tag="front_ack"):
    """API process ``client_index`` (> 0) applied :class:`FrontState` ``epoch``: every request it
    sent before this message reached the core first (one input pipe per API process keeps its order).
    ``aborted``: the requests of its own that the state's abort ended (counted at the first relay of an
    ``abort_seq`` only: with data parallelism every core relays the same state)."""

    epoch: int
    client_index: int
    aborted: int = 0


InputMessage = Union[AddRequest, Abort, SetWeightVersion, UtilityCall, StopSamples, Shutdown, FrontStateAck]


# ---- core → API ------------------------------------------------------------------------
class EngineInfo(msgspec.Struct):
    """What the API process needs to know about a started engine replica.

    Attributes:
        pid: the engine-core process id.
        vocab_size / max_model_len / max_num_batched_tokens: resolved by the engine.
        device: e.g. ``"cpu"``, ``"cuda:0"``. dtype: e.g. ``"bfloat16"``.
        num_kv_blocks: KV-cache size in blocks. eos_token_ids: the engine's EOS ids.
    """

    pid: int
    vocab_size: int
    max_model_len: int
    max_num_batched_tokens: int | None
    device: str
    dtype: str
    num_kv_blocks: int | None = None
    eos_token_ids: list[int] = []


class CoreReady(msgspec.Struct, tag="ready"):
    info: EngineInfo


class CoreFailed(msgspec.Struct, tag="failed"):
    """The engine could not be built (the process exits after sending this)."""

    error: ErrorInfo


class CoreExiting(msgspec.Struct, tag="exiting"):
    """The core has left its loop (its requests failed, its engine shut down) and ends its
    process next (``os._exit``). What remains is the kernel freeing the process's memory
    (0.2-0.3 s for SmolLM2 fp32 on a loaded 2-core CPU), which a kill would not shorten."""


class RequestError(msgspec.Struct):
    request_id: str
    error: ErrorInfo


class SampleDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one sample of a request gained since its previous delta.

    Attributes:
        index: the sample's index in ``[0, n)``.
        token_ids: token ids sampled since (a terminating EOS / stop token id included).
        sampled_logprobs: per token of ``token_ids`` its logprob (the terms the API process
            adds up into ``cumulative_logprob``, in the engine's order: the same float); empty
            when the request did not ask for logprobs (its ``cumulative_logprob`` is None).
        logprobs: per token ``{token_id: logprob}`` (sampled + top-k), when the request asked.
        finish_reason / stop_reason: set once the engine finished the sample ("stop" with the
            stop token id or None for EOS / a completed structured output, "length", "abort").
        routed_experts: with the finish, when replay is on: the sample's routed expert ids as
            ``.npy`` bytes (:func:`rlserve.engine.routed_experts.npy_bytes`; read without pickle).
    """

    index: int
    token_ids: list[int]
    sampled_logprobs: list[float]
    logprobs: Union[list[dict[int, float]], None] = None
    finish_reason: Union[str, None] = None
    stop_reason: Union[int, str, None] = None
    routed_experts: Union[bytes, None] = None


class RequestStart(msgspec.Struct, array_like=True, omit_defaults=True):
    """Sent once per request, with its first delta: what the engine resolved at its start.

    Attributes:
        prompt_token_ids: the prompt's ids (the detokenizer's left context).
        prompt_logprobs / prompt_logprob_ranks: as in
            :class:`~rlserve.engine.outputs.RequestOutput`, when asked (None before prefill).
    """

    prompt_token_ids: list[int]
    prompt_logprobs: Union[list[Union[dict[int, float], None]], None] = None
    prompt_logprob_ranks: Union[list[Union[int, None]], None] = None


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's progress in one engine step (or command).

    Attributes:
        request_id: the caller's id.
        samples: the samples that gained tokens or finished.
        finished: the engine finished the request (every sample); its last delta.
        weight_versions: every weight version seen while it ran, in order (the last one
            produced its newest token).
        first_token_time: ``time.monotonic()`` seconds of its first sampled token, or None.
        start: with the request's first delta only.
        scheduled_time: ``time.monotonic()`` seconds of its first prefill step, or None.
    """

    request_id: str
    samples: list[SampleDelta]
    finished: bool
    weight_versions: list[str]
    first_token_time: Union[float, None] = None
    start: Union[RequestStart, None] = None
    scheduled_time: Union[float, None] = None


def per_step_deltas(stream: bool, params) -> bool:
    """Whether the core sends a request a :class:`RequestDelta` every step it advances: a streamed
    request, or one with stop strings (matched in the API process). The others get one at least
    every ``engine_core.PROGRESS_EVERY_S`` seconds while they advance (their tokens reach
    ``vllm:generation_tokens_total`` as they are made) and their last one."""
    return bool(stream or params.stop)


class CoreOutputs(msgspec.Struct, tag="outputs"):
    """Everything one engine step (or one command) produced.

    Attributes:
        deltas: per request that advanced (:func:`per_step_deltas`; the others every
            ``PROGRESS_EVERY_S`` and at a keep-pause's freeze), finished or was aborted, its
            :class:`RequestDelta`; a ``finished`` one is the request's last.
        errors: requests that ended with an error (refused on add, or a failed step).
        stats: the engine's stats snapshot when it was refreshed (at most every 0.2 s).
    """

    deltas: list[RequestDelta] = []
    errors: list[RequestError] = []
    stats: dict[str, Any] | None = None


class UtilityResult(msgspec.Struct, tag="result"):
    call_id: int
    result: Any = None
    error: ErrorInfo | None = None


class FrontState(msgspec.Struct, tag="front_state"):
    """API process 0's admission state, relayed by the core to API processes 1..N-1
    (:mod:`rlserve.engine.front.front_sync`); each answers with :class:`FrontStateAck`.

    Attributes:
        epoch: the core's count of relays (the ack names it).
        paused / pause_mode: new requests are held (``abort`` / ``wait`` / ``keep``).
        refusal: what ``generate`` raises now instead of admitting (``{"type": "sleeping" |
            "unavailable", "message", "code"}``: 503 ``model_sleeping`` / ``weights_lost`` /
            ``model_unavailable``), or None.
        weight_version: process 0's label (the cores stamp outputs themselves; this one is for
            the other processes' own reports: ``/metrics``, a held request's abort).
        abort_held: abort the requests held now (process 0's ``abort_all``: ``/abort_requests``
            without ids, a sleep).
        abort_ids: abort the requests these ids name (``/abort_requests`` with ids:
            ``AsyncEngine.ids_matching``).
        abort_seq: process 0's number for this abort (``abort_held`` / ``abort_ids``; 0: none), the same in
            every core's relay: a process counts the requests it aborted once (:class:`FrontStateAck`).
    """

    epoch: int
    paused: bool
    pause_mode: Union[str, None] = None
    refusal: Union[dict[str, str], None] = None
    weight_version: Union[str, None] = None
    abort_held: bool = False
    abort_ids: Union[list[str], None] = None
    abort_seq: int = 0


OutputMessage = Union[CoreReady, CoreFailed, CoreOutputs, UtilityResult, CoreExiting, FrontState]


def input_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(InputMessage)


def output_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(OutputMessage)


def to_wire(value: Any) -> Any:
    """A utility call's result as something MessagePack holds: sets and tuples become lists,
    dict keys stay as they are; anything else unknown becomes its ``str``."""
    return msgspec.to_builtins(value, enc_hook=str, str_keys=False)


def error_info(exc: BaseException) -> ErrorInfo:
    return ErrorInfo(type(exc).__name__, str(exc))


def rebuild_error(info: ErrorInfo) -> BaseException:
    """The exception :func:`error_info` described, as rlserve's own class of that name where
    there is one (so HTTP statuses stay the same across the process boundary), else a
    built-in exception class of that name, else ``RuntimeError("Type: message")``."""
    for mod in (errors, terrors):
        cls = getattr(mod, info.type, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            break
    else:
        cls = getattr(builtins, info.type, None)
        if not (isinstance(cls, type) and issubclass(cls, Exception)):
            return RuntimeError(f"{info.type}: {info.message}")
    try:
        return cls(info.message)
    except Exception:  # noqa: BLE001 - a class whose constructor wants more
        return RuntimeError(f"{info.type}: {info.message}")


# ---- the API process's side of the schema ---------------------------------------------------
class InvalidParamsError(InvalidRequestError):
    """A sampling parameter the engine core would not accept.

    Attributes:
        field: the offending field as a dotted path into
            :class:`~rlserve.engine.sampling_params.SamplingParams` (``"top_k"``, ``"stop.0"``,
            ``"structured_outputs.choice.2"``), or None when no single field is to blame.
        message: the whole message; it starts with ``field`` when there is one
            (``"top_k: expected int, got float (2.5)"``, ``"top_p must be in (0, 1], got 5.0"``).
        code: the HTTP error's ``code``: ``"invalid_value"`` for a value of the wrong type (what
            pydantic's type errors answer for the same field given at a route's top level),
            ``"invalid_request"`` for one out of range.
    """

    def __init__(self, field: str | None, message: str, code: str = "invalid_request"):
        if field and not message.startswith(field):
            message = f"{field}: {message}"
        super().__init__(message)
        self.field = field
        self.message = message
        self.code = code

    def renamed(self, name: str) -> str:
        """The message with the field called ``name`` (how the request named it, e.g.
        ``generation_kwargs.top_k``)."""
        if self.field and self.message.startswith(self.field):
            return name + self.message[len(self.field):]
        return self.message


_PATH = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_FIELD_NAMES = frozenset(SamplingParams.__dataclass_fields__)
#: what MessagePack (and so the wire) holds of an integer: int64 .. uint64
_WIRE_INT_MIN, _WIRE_INT_MAX = -(1 << 63), (1 << 64) - 1


def _dotted(path: str) -> str:
    """msgspec's ``.stop[0].x`` as ``stop.0.x``."""
    return re.sub(r"\[(\d+)\]", r".\1", path).lstrip(".")


def _value_at(fields: dict, dotted: str):
    value: Any = fields
    for part in dotted.split("."):
        try:
            value = value[int(part)] if isinstance(value, (list, tuple)) else (
                value[part] if isinstance(value, dict) else getattr(value, part))
        except (KeyError, IndexError, ValueError, TypeError, AttributeError):
            return None
    return value


def _unwireable(value, path: str) -> tuple[str, str] | None:
    """``(path, reason)`` of the first part of ``value`` MessagePack cannot carry (an integer
    outside int64 .. uint64, text that is not valid Unicode), else None."""
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return None
    if isinstance(value, int):
        if not _WIRE_INT_MIN <= value <= _WIRE_INT_MAX:
            return path, f"the integer must be in [-2**63, 2**64 - 1], got {value}"
        return None
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return path, (f"a lone UTF-16 surrogate (U+{ord(value[e.start]):04X}) at character {e.start} is not "
                          "valid Unicode text")
        return None
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            bad = _unwireable(v, f"{path}.{i}")
            if bad is not None:
                return bad
        return None
    if hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:
            bad = _unwireable(getattr(value, name), f"{path}.{name}")
            if bad is not None:
                return bad
    return None


def params_from_fields(fields: dict[str, Any]) -> SamplingParams:
    """The request's :class:`~rlserve.engine.sampling_params.SamplingParams`, checked against
    the schema the engine core decodes :class:`AddRequest` with: every field's type exactly as
    the core's decoder checks it (an int field takes no float or bool, a bool field no string),
    then the dataclass's own range checks (``SamplingParams.validate``), then what the wire can
    carry (integers in int64 .. uint64, text valid Unicode). What passes here decodes in the core.

    Args:
        fields: ``SamplingParams`` keyword arguments as the request gave them (JSON values;
            ``structured_outputs`` may be a built ``StructuredOutputsParams``); ``stop`` may be
            one string; ``stop`` / ``stop_token_ids`` may be None (none).

    Raises:
        InvalidParamsError: naming the field (``field``) and what is wrong with it.
    """
    fields = dict(fields)
    unknown = sorted(set(fields) - _FIELD_NAMES)
    if unknown:
        raise InvalidParamsError(unknown[0], f"not a sampling parameter; known: {', '.join(sorted(_FIELD_NAMES))}")
    if isinstance(fields.get("stop"), str):
        fields["stop"] = [fields["stop"]]
    for name in ("stop", "stop_token_ids"):
        if name in fields and fields[name] is None:
            del fields[name]
    if fields.get("logit_bias") is not None:  # JSON's string keys as token ids (msgspec takes no str for int)
        try:
            fields["logit_bias"] = clip_logit_bias(fields["logit_bias"])
        except InvalidRequestError as e:
            raise InvalidParamsError("logit_bias", str(e)) from None
    try:
        params = msgspec.convert(fields, SamplingParams)
    except msgspec.ValidationError as e:
        m = _PATH.match(str(e))
        msg, path = m.group("msg"), _dotted(m.group("path") or "")
        if not path:  # SamplingParams.validate's message: it starts with the field's name
            first = msg.split(" ", 1)[0]
            raise InvalidParamsError(first if first in _FIELD_NAMES else None, msg) from None
        if msg.startswith("Expected `"):
            got = _value_at(fields, path)
            msg = msg.replace("`", "").replace("Expected", "expected", 1)
            if got is not None and _unwireable(got, "") is None:
                msg += f" ({msgspec.json.encode(got).decode()[:80]})"
            raise InvalidParamsError(path, msg, code="invalid_value") from None
        raise InvalidParamsError(path, msg) from None
    try:
        msgspec.msgpack.encode(params)
    except (OverflowError, UnicodeEncodeError, TypeError) as e:  # which field: looked for only now
        bad = _unwireable(params, "")
        raise InvalidParamsError(*((bad[0].lstrip("."), bad[1]) if bad is not None else (None, str(e)))) from None
    return params
