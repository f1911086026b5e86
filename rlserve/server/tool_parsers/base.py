"""What every tool-call parser shares: the tool-call id, the delta dicts, the text helpers and
the :class:`ToolParser` base (one instance per request and per choice, stateful when streamed).

A delta is the dict a chat stream chunk carries as ``delta``, with exactly the keys vLLM 0.32
sets on its ``DeltaMessage`` (dumped with ``exclude_unset``): ``content`` / ``reasoning`` (str or
None) and ``tool_calls`` (a list of ``{"id", "type", "index", "function": {"name"} |
{"arguments"}}``, only the keys set). Reference: vLLM 0.32's ``vllm/tool_parsers/``.
"""

from __future__ import annotations

import json
import uuid


def make_tool_call_id() -> str:
    """vLLM's random tool-call id: ``chatcmpl-tool-`` + 16 hex digits (the low 64 bits of a
    uuid4, as vLLM's ``random_uuid``)."""
    return f"chatcmpl-tool-{uuid.uuid4().int & ((1 << 64) - 1):016x}"


def delta(content=..., reasoning=..., tool_calls=None) -> dict:
    """A delta dict with only the keys given (``...``: not set); an empty ``tool_calls`` is left
    out, as vLLM's serializer drops it."""
    d: dict = {}
    if content is not ...:
        d["content"] = content
    if reasoning is not ...:
        d["reasoning"] = reasoning
    if tool_calls:
        d["tool_calls"] = tool_calls
    return d


def tool_delta(index: int, *, name: str | None = None, arguments: str | None = None, new: bool = False) -> dict:
    """One ``tool_calls`` entry of a delta: a new call (``new``: id, type, name, and arguments when
    given) or more of an announced one (``arguments`` only)."""
    fn: dict = {}
    if name is not None:
        fn["name"] = name
    if arguments is not None:
        fn["arguments"] = arguments
    if new:
        return {"id": make_tool_call_id(), "type": "function", "index": index, "function": fn}
    return {"index": index, "function": fn}


def registry_class(table: dict[str, type], flag: str, name: str) -> type:
    """``table[name]``, the class a ``--FLAG NAME`` picks.

    Raises:
        ValueError: an unknown name (the message lists the known ones, as argparse would).
    """
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"--{flag} {name}: unknown (choose from {', '.join(sorted(table))})") from None


def partial_tag_overlap(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ends ``text`` (0: none): the part
    of ``text`` that may become ``tag`` and must be held back while streaming."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def is_complete_json(text: str) -> bool:
    """Whether ``text`` is one whole JSON value."""
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


class ToolParser:
    """Base of the tool-call parsers (vLLM's legacy ``ToolParser`` interface).

    Attributes (streaming state, as vLLM's): ``prev_tool_call_arr`` (one dict per call seen:
    ``name``, ``arguments``), ``streamed_args_for_tool`` (the argument text sent per call).
    ``skip_special_tokens``: what the
    parser needs the request's ``skip_special_tokens`` to be while tools are on (None: as asked).
    ``structural_tag``: the name of the call format that forces ``required`` / named calls
    (:mod:`rlserve.server.tool_parsers.structural`); those are parsed as ``auto``. A parser
    without one may force them with a JSON schema instead (:meth:`forced_schema`).
    """

    skip_special_tokens: bool | None = None
    make_id = staticmethod(make_tool_call_id)  # a new call's id (vLLM's form for this parser)
    tool_choice = None  # the request's, set by the chat layer (rlserve.server.chat_output)
    engine_based = False  # vLLM's engine_based_streaming: fed deltas only, flushed at the end (finish)
    suppress = False  # engine-based, tool_choice none: calls are taken out of the content, not returned
    structural_tag: str | None = None  # the format that forces required / named calls (structural.py)

    def __init__(self, vocab: dict[str, int], tools: list[dict] | None = None):
        self.vocab = vocab
        self.tools = tools or []
        self.prev_tool_call_arr: list[dict] = []
        self.streamed_args_for_tool: list[str] = []
        self.current_tool_id = -1
        self.current_tool_name_sent = False

    @staticmethod
    def forced_schema(tools: list[dict], tool_choice) -> dict | None:
        """The JSON schema that forces ``tool_choice`` (required / named) where the parser has
        no :attr:`structural_tag` (None: nothing forced)."""
        return None

    def extract(self, text: str) -> tuple[bool, list[tuple[str, str]], str | None]:
        """Tool calls in a whole output: ``(tools_called, [(name, arguments JSON)], content)``;
        a malformed call leaves the text as content (``(False, [], text)``)."""
        raise NotImplementedError

    def stream(self, previous_text: str, current_text: str, delta_text: str,
               previous_ids: list[int], current_ids: list[int], delta_ids: list[int]) -> dict | None:
        """The delta for ``delta_text`` (``current_text = previous_text + delta_text``), or None
        when there is nothing to send yet."""
        raise NotImplementedError

    def remaining_args(self) -> str:
        """Arguments of the last call parsed but not yet streamed (sent with the last delta)."""
        if not self.prev_tool_call_arr:
            return ""
        i = len(self.prev_tool_call_arr) - 1
        args = self.prev_tool_call_arr[i].get("arguments", {})
        expected = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        actual = self.streamed_args_for_tool[i] if i < len(self.streamed_args_for_tool) else ""
        return expected[len(actual):] if expected.startswith(actual) else ""
