"""Structured outputs (regex / JSON schema / choice / EBNF grammar) as a logits mask, through
xgrammar (https://github.com/mlc-ai/xgrammar, the library vLLM uses by default).

One :class:`GrammarCompiler` per tokenizer compiles a :class:`StructuredOutputsParams` into an
xgrammar ``CompiledGrammar`` (cached by the constraint, so the ``n`` samples of a request and
repeated constraints compile once). Each constrained sequence gets its own
:class:`GrammarState` (an xgrammar ``GrammarMatcher``): before every draw the sampler asks it
for the allowed tokens (:func:`apply_grammar_masks` sets the others to ``-inf``), and the
engine feeds it the drawn token (:meth:`GrammarState.accept`). Once the constraint is complete
the only allowed tokens are the EOS ids, so the sequence ends with finish reason ``stop``.

xgrammar is an optional dependency (``pip install rlserve[structured]``); without it a
constrained request is refused with :class:`~rlserve.errors.InvalidRequestError` naming the
package. The mask is applied with plain torch ops on the logits' device (no Triton/CUDA kernel
needed): xgrammar's bitmask is ``int32 [B, ceil(V / 32)]``, bit ``j`` of word ``w`` = token
``32 w + j`` allowed.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import re
import threading
from collections import OrderedDict

import torch

from rlserve.h2d import to_device
from rlserve.engine.sampling_params import StructuredOutputsParams
from rlserve.errors import InvalidRequestError

_CACHE_SIZE = 256  # compiled grammars kept per compiler (a JSON schema's is a few hundred kB at most)


def needs_xgrammar(field: str) -> str:
    """The message of a request whose ``field`` (what it sent: ``structured_outputs``,
    ``response_format``, ``guided_decoding_regex``, ``tool_choice`` ...) needs xgrammar where it is
    not installed: names the field and the extra that brings it."""
    return f"{field} needs the xgrammar package on the server: pip install 'rlserve[structured]'"


def xgrammar_installed() -> bool:
    """Whether xgrammar can be found (``importlib.util.find_spec``; not imported: it imports torch)."""
    import importlib.util

    return importlib.util.find_spec("xgrammar") is not None


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise InvalidRequestError(needs_xgrammar("structured_outputs")) from None
    return xgrammar


def constraint_key(spec: StructuredOutputsParams) -> str:
    """A constraint's identity, 64 hex characters (sha256 of its fields): what compiles to the
    same grammar has the same key."""
    fields = [spec.kind, spec.json, spec.regex, None if spec.choice is None else list(spec.choice), spec.grammar]
    return hashlib.sha256(json.dumps(fields).encode("utf-8", "surrogatepass")).hexdigest()


def _regex_escape(s: str) -> str:
    out = []
    for ch in s:
        out.append("\\" + ch if ch in r".^$*+?{}[]\|()/" else ch)
    return "".join(out)


class GrammarCompiler:
    """Compiles constraints for one tokenizer (thread-safe; compiled grammars cached).

    Args:
        tokenizer: a Hugging Face tokenizer (fast or slow).
        vocab_size: the number of logits columns the sampler sees (the model's real vocabulary;
            tokens beyond the tokenizer's are never allowed).
        eos_token_ids: the ids that end a sequence (allowed once the constraint is complete).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids)
        self._lock = threading.Lock()
        self._compiler = None
        self._cache: OrderedDict = OrderedDict()
        self._thread = None  # compile_async's ThreadPoolExecutor(1)

    def _get_compiler(self):
        if self._compiler is None:
            xgr = _xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compile(self, spec: StructuredOutputsParams):
        """The xgrammar ``CompiledGrammar`` of ``spec`` (the lock covers the cache, not the
        compile: two threads may compile different constraints at once; xgrammar releases the
        GIL while it compiles).

        Raises:
            InvalidRequestError: xgrammar is not installed, or the regex / schema / grammar is
                invalid (the message names the field and xgrammar's reason).
        """
        key = (spec.kind, spec.json, spec.regex, spec.choice, spec.grammar)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            compiler = self._get_compiler()
        kind = spec.kind
        try:
            if kind == "json":
                compiled = compiler.compile_json_schema(spec.json)
            elif kind == "json_object":  # OpenAI's json_object: an object (xgrammar's builtin is any value)
                compiled = compiler.compile_json_schema('{"type": "object"}')
            elif kind == "regex":
                compiled = compiler.compile_regex(spec.regex)
            elif kind == "choice":
                compiled = compiler.compile_regex("(" + "|".join(_regex_escape(c) for c in spec.choice) + ")")
            else:
                compiled = compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidRequestError(f"structured_outputs.{kind} is not valid: {xgrammar_reason(e)}") from None
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def compile_async(self, spec: StructuredOutputsParams) -> concurrent.futures.Future:
        """:meth:`compile` on this compiler's own thread (made on first use): its Future gives
        the ``CompiledGrammar`` or raises what ``compile`` raises. One thread: constraints
        compile one after another, beside the engine's steps, not inside them."""
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlserve-grammar")
        return self._thread.submit(self.compile, spec)

    def new_state(self, spec: StructuredOutputsParams, compiled=None) -> "GrammarState":
        """A fresh matcher for one sequence (``compiled``: ``spec``'s compiled grammar, when the
        caller has it; else :meth:`compile`, a cache hit after the first)."""
        return GrammarState(_xgrammar().GrammarMatcher(compiled if compiled is not None else self.compile(spec)),
                            self.vocab_size, spec.reasoning_end_ids, spec.reasoning_implicit_end_ids)


class PendingGrammars:
    """Requests whose constraint compiles on the compiler's thread: their sequences join the
    scheduler once it is compiled (the engine's step loop never waits for a compile, as vLLM's
    ``WAITING_FOR_FSM`` requests)."""

    def __init__(self):
        self._pending: dict[str, concurrent.futures.Future] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, request_id: str, future: concurrent.futures.Future) -> None:
        self._pending[request_id] = future

    def discard(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def ready(self, wait_s: float = 0.0) -> list[tuple[str, concurrent.futures.Future]]:
        """The requests whose compile ended (removed from here), waiting up to ``wait_s``
        seconds for the first when none has (the engine has nothing else to do)."""
        if wait_s > 0 and self._pending and not any(f.done() for f in self._pending.values()):
            concurrent.futures.wait(list(self._pending.values()), timeout=wait_s,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        done = [(rid, f) for rid, f in self._pending.items() if f.done()]
        for rid, _ in done:
            del self._pending[rid]
        return done


_XGR_WHERE = re.compile(r"^\s*(?:\[[0-9:.]+\]\s*)?(?:\S+\.(?:cc|cpp|cxx|h|hpp):\d+:\s*)?")
_XGR_CHECK = re.compile(r"^Check failed: \(.*?\) is false:\s*")


def xgrammar_reason(exc: BaseException) -> str:
    """xgrammar's error as a client should read it: without the time stamp and the C++ source
    location it starts with (``[02:42:28] /project/cpp/regex_converter.cc:94: ``), an internal
    check's condition (``Check failed: (error.empty()) is false: ``), the echo of the whole
    schema that follows a JSON syntax error (``The JSON string is:...``: the client sent it) and
    any stack trace; what is left is the reason and its position, one line."""
    text = str(exc).split("Stack trace:", 1)[0]
    lines = []
    for line in text.splitlines():
        line = _XGR_CHECK.sub("", _XGR_WHERE.sub("", line, count=1), count=1).strip()
        if line:
            lines.append(line)
    reason = " ".join(lines).split(" The JSON string is:", 1)[0].strip()
    return reason or type(exc).__name__


class GrammarState:
    """The constraint's state for one sequence (an xgrammar ``GrammarMatcher``), with vLLM's
    reasoning gate: given ``end_ids`` / ``implicit_end_ids``
    (:class:`~rlserve.engine.sampling_params.StructuredOutputsParams`' ``reasoning_*``), the
    constraint waits while the model reasons (:attr:`waiting`: no mask, nothing fed) and starts
    after an ``end_ids`` token (``</think>``) or with an ``implicit_end_ids`` token, as vLLM's
    ``StructuredOutputManager`` does under ``--reasoning-parser``.

    Attributes:
        vocab_size: logits columns the mask covers.
        waiting: the reasoning has not ended yet (the constraint is not applied).
    """

    def __init__(self, matcher, vocab_size: int, end_ids=(), implicit_end_ids=()):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._end_ids = frozenset(end_ids)
        self._implicit_end_ids = frozenset(implicit_end_ids)
        self.waiting = bool(self._end_ids or self._implicit_end_ids)

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (``int32 [B, ceil(V/32)]``, CPU;
        left as it is, all allowed, while :attr:`waiting`)."""
        if not self.waiting:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False when the constraint does not allow it (then the
        state is unchanged). While :attr:`waiting`: True, and a reasoning-end id opens the
        constraint (an implicit one is its first token, fed to it)."""
        token_id = int(token_id)
        if self.waiting:
            if token_id in self._end_ids:
                self.waiting = False
                return True
            if token_id not in self._implicit_end_ids:
                return True
            self.waiting = False
        return bool(self.matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The constraint is complete and its end (an EOS id) was accepted."""
        return not self.waiting and bool(self.matcher.is_terminated())


def apply_grammar_masks(logits: torch.Tensor, states: list) -> torch.Tensor:
    """In place: ``-inf`` at every token the row's constraint does not allow next.

    Args:
        logits: ``[B, V]`` float32 (any device).
        states: ``B`` entries, a :class:`GrammarState` or None (unconstrained row, as a
            state still :attr:`~GrammarState.waiting` for the reasoning to end).
    Returns:
        ``logits``. One host-to-device copy of the packed mask (``B x ceil(V/32)`` int32).
    """
    rows = [i for i, s in enumerate(states) if s is not None and not s.waiting]
    if not rows:
        return logits
    B, V = logits.shape
    words = (V + 31) // 32
    bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
    for j, i in enumerate(rows):
        states[i].fill_mask(bitmask, j)
    bm = to_device(bitmask, torch.int32, logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bm.unsqueeze(-1) >> shifts) & 1).bool().view(len(rows), words * 32)[:, :V]
    idx = to_device(rows, torch.long, logits.device)
    sub = logits.index_select(0, idx).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, idx, sub)
    return logits


def structured_from_request(obj: dict | None) -> StructuredOutputsParams | None:
    """The vLLM request field ``structured_outputs`` (``{"json" | "regex" | "choice" | "grammar"
    | "json_object": ...}``) as :class:`StructuredOutputsParams`; a JSON schema given as an object
    is serialised. Raises InvalidRequestError for none or several constraints."""
    if obj is None:
        return None
    schema = obj.get("json")
    if schema is not None and not isinstance(schema, str):
        schema = json.dumps(schema)  # vLLM's serialisation: the properties keep their order
    choice = obj.get("choice")
    return StructuredOutputsParams(json=schema, regex=obj.get("regex"),
                                   choice=tuple(choice) if choice is not None else None,
                                   grammar=obj.get("grammar"), json_object=bool(obj.get("json_object")))
