"""``--tool-call-parser qwen3_xml`` (also ``qwen3_coder``): Qwen3-Coder's XML tool calls::

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

As vLLM 0.32's Qwen3 parser engine (``vllm/parser/qwen3.py``, ``vllm/parser/engine/``): a lexer
over the markers (a possible marker prefix held back; ``<tool_call>`` / ``</tool_call>`` only
as their own token when token ids come with the text), a state machine over content / call /
name / arguments, arguments as JSON (:mod:`rlserve.server.tool_parsers.xml_args`: values typed
by the tool's schema) streamed as their stable prefix, the content's surrounding whitespace
stripped when calls were made. ``<think>`` / ``</think>`` are plain content here.
"""

from __future__ import annotations

from rlserve.server.tool_parsers.base import ToolParser, delta, make_tool_call_id
from rlserve.server.tool_parsers.xml_args import safe_prefix, string_keys, tool_properties, typed_args, xml_args_json

TERMINALS = {"<tool_call>": "TOOL_START", "</tool_call>": "TOOL_END", "<function=": "FUNC_PREFIX",
             "</function>": "FUNC_END", "<parameter=": "PARAM_START", "</parameter>": "PARAM_END",
             ">": "CLOSE_ANGLE", "<think>": "THINK", "</think>": "THINK"}
BY_ID = ("<tool_call>", "</tool_call>", "<think>", "</think>")  # terminals only as their own token
# (state, terminal) -> (next state, events); events: "start" (a call), "end" (its end), "arg" (the
# terminal's text is argument text)
MOVES = {("content", "TOOL_START"): ("preamble", ("start",)), ("content", "FUNC_PREFIX"): ("name", ("start",)),
         ("preamble", "TOOL_END"): ("content", ("end",)), ("preamble", "FUNC_PREFIX"): ("name", ()),
         ("name", "CLOSE_ANGLE"): ("args", ()), ("name", "FUNC_END"): ("between", ("end",)),
         ("args", "FUNC_END"): ("between", ("end",)), ("args", "PARAM_START"): ("args", ("arg",)),
         ("args", "PARAM_END"): ("args", ("arg",)), ("between", "TOOL_END"): ("content", ()),
         ("between", "TOOL_START"): ("preamble", ("start",)), ("between", "FUNC_PREFIX"): ("name", ("start",))}


class _Slot:
    def __init__(self):
        self.name, self.args, self.id, self.name_sent, self.streamed, self.keys = "", "", None, False, "", None


class Qwen3XmlToolParser(ToolParser):
    """Qwen3 XML tool calls (see the module docstring)."""

    skip_special_tokens = False
    structural_tag = "qwen_3_coder"
    engine_based = True

    def __init__(self, vocab, tools=None):
        super().__init__(vocab, tools)
        self._ids = {vocab[t]: t for t in BY_ID if t in vocab}
        self._reset()

    def _reset(self):
        self.state, self.index, self.buf, self.slots = "content", -1, "", []
        self._deferred, self._has_text = "", False

    # ---- lexer + state machine: text -> events (kind, value, call index) ----------------------
    def _lex(self, text: str, by_id: bool, final: bool) -> list:
        text, self.buf = self.buf + text, ""
        out, i, plain = [], 0, 0
        while i < len(text):
            hit = max((t for t in TERMINALS if text.startswith(t, i)), key=len, default=None)
            if hit is None:
                if not final and any(t.startswith(text[i:]) for t in TERMINALS):
                    self.buf = text[i:]
                    break
                i += 1
                continue
            if i > plain:
                out += self._text(text[plain:i])
            out += self._text(hit) if (by_id and hit in BY_ID) else self._terminal(hit)
            i = plain = i + len(hit)
        end = len(text) - len(self.buf)
        if end > plain:
            out += self._text(text[plain:end])
        return out

    def _text(self, text: str) -> list:
        kind = {"content": "text", "name": "name", "args": "arg"}.get(self.state)
        return [(kind, text, self.index)] if kind and text else []

    def _terminal(self, lit: str) -> list:
        move = MOVES.get((self.state, TERMINALS[lit]))
        if move is None:
            return self._text(lit)
        self.state, out = move[0], []
        for ev in move[1]:
            if ev == "start":
                self.index += 1
            out.append(("start" if ev == "start" else "end" if ev == "end" else "arg", lit, self.index))
        return out

    def _feed(self, text: str, ids: list[int]) -> list:
        """Events of a delta; with ids, a BY_ID marker counts only as its own token."""
        if not ids:
            return self._lex(text, False, False)
        out = []
        for lit in [self._ids[t] for t in ids if t in self._ids]:
            k = text.find(lit)
            if k < 0:
                continue
            out += self._lex(text[:k], True, False) + self._lex("", True, True)  # flush what was held
            out += self._terminal(lit)
            text = text[k + len(lit):]
        return out + self._lex(text, True, False)

    def _finish(self) -> list:
        out = self._lex("", False, True)
        if self.state != "content":
            if self.index >= 0:
                out.append(("end", "", self.index))
            self.state = "content"
        return out

    # ---- events -> deltas --------------------------------------------------------------------
    def _slot(self, i: int) -> _Slot:
        while len(self.slots) <= i:
            self.slots.append(_Slot())
        return self.slots[i]

    def _name_delta(self, i: int, name: str, calls: list, args: str | None = None) -> None:
        s = self._slot(i)
        s.name, s.name_sent, s.keys = name, True, string_keys(tool_properties(self.tools, name))
        s.id = s.id or make_tool_call_id()
        fn = {"name": name} if args is None else {"name": name, "arguments": args}
        calls.append({"id": s.id, "type": "function", "index": i, "function": fn})

    def _arg_delta(self, s: _Slot) -> str | None:
        js = typed_args(xml_args_json(s.args, True), self.tools, s.name) if s.name else xml_args_json(s.args, True)
        safe = safe_prefix(js, s.keys)
        if not safe or safe == s.streamed or (s.streamed and not safe.startswith(s.streamed)):
            return None
        diff, s.streamed = safe[len(s.streamed):], safe
        return diff or None

    def _flush_args(self, s: _Slot) -> str | None:
        js = xml_args_json(s.args, False)
        js = typed_args(js, self.tools, s.name) if js else js
        if js and len(js) > len(s.streamed) and (not s.streamed or js.startswith(s.streamed)):
            diff, s.streamed = js[len(s.streamed):], js
            return diff
        return None

    def _to_delta(self, events: list, finished: bool = False) -> dict | None:
        if not events and not self._deferred:
            return None
        calls, content, seen, carried = [], [], False, self._deferred
        for kind, value, i in events:
            if kind == "text":
                if seen:
                    self._deferred += value
                else:
                    content.append(value)
                continue
            if self.suppress:
                continue
            seen = True
            s = self._slot(i)
            if kind == "name":
                s.name += value
            elif kind == "arg":
                s.args += value
                if not s.name_sent:
                    if s.name:
                        self._name_delta(i, s.name, calls)
                else:
                    diff = self._arg_delta(s)
                    if diff:
                        calls.append({"index": i, "function": {"arguments": diff}})
            elif kind == "end":
                rest = self._flush_args(s)
                if not s.name_sent and s.name:
                    self._name_delta(i, s.name, calls, rest or "")
                elif rest and s.name_sent:
                    calls.append({"index": i, "function": {"arguments": rest}})
        calls = _coalesce(calls)
        if self._deferred and (not seen or not calls):
            now = self._deferred[len(carried):]
            content = ([carried] if carried else []) + content + ([now] if now else [])
            self._deferred = ""
        text = "".join(content)
        if not self._has_text and text:
            if text.strip():
                self._has_text = True
            elif self.slots:
                text = ""
            elif not finished:
                self._deferred, text = text, ""
        if text or calls:
            return delta(content=text or ..., tool_calls=calls)
        return None

    # ---- ToolParser ----------------------------------------------------------------------------
    def extract(self, text):
        self._reset()
        parts = [d.get("content") or "" for d in (self._to_delta(self._feed(text, [])),
                                                  self._to_delta(self._finish(), True)) if d]
        calls = []
        for s in self.slots:
            if not s.name and not s.args:
                continue
            name = s.name.strip()
            if name:
                args = xml_args_json(s.args, False) if s.args.strip() else "{}"
                calls.append((name, typed_args(args, self.tools, name)))
        content = "".join(parts)
        content = content.strip() if calls else content
        return bool(calls), calls, content or None

    def stream(self, previous_text, current_text, delta_text, previous_ids, current_ids, delta_ids):
        return self._to_delta(self._feed(delta_text, list(delta_ids)))

    def finish(self) -> dict | None:
        """The last delta: what the lexer held and the open call's end (vLLM's ``finish_streaming``)."""
        events = self._finish()
        return self._to_delta(events, True) if events or self._deferred else None

    def remaining_args(self) -> str:
        return ""


def _coalesce(calls: list) -> list:
    """One entry per call index: ids, names and argument text merged (vLLM's coalescing)."""
    merged: dict[int, dict] = {}
    for tc in calls:
        m = merged.get(tc["index"])
        if m is None:
            merged[tc["index"]] = tc
            continue
        for k in ("id", "type"):
            if k in tc and k not in m:
                m[k] = tc[k]
        fn, mf = tc.get("function", {}), m.setdefault("function", {})
        if "name" in fn and "name" not in mf:
            mf["name"] = fn["name"]
        if "arguments" in fn:
            mf["arguments"] = mf.get("arguments", "") + fn["arguments"] if "arguments" in mf else fn["arguments"]
    return calls if len(merged) == len(calls) else list(merged.values())
