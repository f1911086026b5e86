"""``--tool-call-parser mistral`` for a Hugging Face tokenizer with ``[TOOL_CALLS]`` and no
``[ARGS]`` (vLLM's "pre-v11" Mistral format): ``content[TOOL_CALLS][{"name": .., "arguments":
{..}}, ...]`` (a bare object is one call).

As vLLM 0.32's ``MistralToolParser`` on such a tokenizer (``vllm/parser/mistral.py``, its legacy
path, the reference for every rule here):

* whole output: the content is the text before ``[TOOL_CALLS]``, the calls the first JSON value
  after it (``raw_decode``: trailing text dropped; else the first ``[{...}]`` in it); each entry
  with a ``name`` or ``arguments`` is a call (a non-string name is ``""``, arguments kept when a
  string, else serialized, ``{}`` when missing). No call found: the JSON text is the content.
  ``tool_choice`` required / named: the output is a bare JSON array (forced by
  :meth:`MistralToolParser.forced_schema`), read without the marker. ``none``: all content.
* streamed: vLLM's state machine over the events of `ijson <https://pypi.org/project/ijson/>`_'s
  ``parse_coro`` (the library and coroutine vLLM streams through), each delta split at the JSON punctuation the state waits for: a call's name when its string
  closes, its arguments as the raw text of the object as it comes, text after the array as
  content, an empty delta where the array ends; a delta whose JSON is malformed sends nothing.
* tool-call ids are Mistral's: 9 random letters and digits.

The v11+ format (``name[ARGS]{...}``, a tokenizer with ``[ARGS]``) is refused at startup.
"""

from __future__ import annotations

import json
import random
import re
import string

from rlserve.server.tool_parsers.base import ToolParser

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ALNUM = string.ascii_letters + string.digits
_ARRAY_RE = re.compile(r"\[{.*}\]", re.DOTALL)

# vLLM's StreamingState
(WAIT_START, WAIT_KEY, NAME, NAME_DONE, WAIT_ARGS, ARGS_, ARGS_DONE, TOOL_DONE, ALL_DONE) = range(9)
# where each state's delta is cut: {character: stop after this many}
_SPLIT = {WAIT_START: {"{": 1}, WAIT_KEY: {":": 1, "{": 1, "}": 1}, NAME: {",": 1, "]": 1, "}": 1},
          WAIT_ARGS: {"{": 1, "}": 1}, ARGS_: {"}": 1}, ARGS_DONE: {"}": 1, "]": 1}, NAME_DONE: {"}": 1, "]": 1},
          TOOL_DONE: {"{": 1, "]": 1}}


def mistral_tool_call_id() -> str:
    """Mistral's tool-call id: 9 random ASCII letters and digits (vLLM's ``MistralToolCall``)."""
    return "".join(random.choices(_ALNUM, k=9))


def _split(text: str, stops: dict[str, int] | None) -> tuple[str, str]:
    """vLLM's ``_split_delta``: ``text`` cut after the first character of ``stops`` (each
    stopping after its count; quotes never stop here), ``(head, rest)``; all of it without stops."""
    if stops is None:
        return text, ""
    left = dict(stops)
    for i, c in enumerate(text):
        if c in left:
            left[c] -= 1
            if left[c] == 0:
                return text[:i + 1], text[i + 1:]
    return text, ""


def _function_calls(parsed) -> list[tuple[str, str]]:
    """vLLM's ``_pre_v11_function_calls``: ``[(name, arguments JSON)]`` of the parsed value."""
    if isinstance(parsed, dict):
        parsed = [parsed]
    if not isinstance(parsed, list):
        return []
    out = []
    for call in parsed:
        if not isinstance(call, dict) or not ("name" in call or "arguments" in call):
            continue
        name, args = call.get("name"), call.get("arguments")
        if args is None:
            args = "{}"
        elif not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        out.append((name if isinstance(name, str) else "", args))
    return out


class MistralToolParser(ToolParser):
    """Mistral's pre-v11 ``[TOOL_CALLS]`` calls (see the module docstring).

    Raises:
        ValueError: the vocabulary has no ``[TOOL_CALLS]`` token, or has ``[ARGS]`` (the v11+
            format, not implemented).
    """

    skip_special_tokens = False  # [TOOL_CALLS] is a special token: kept in the text while tools are on
    engine_based = True  # vLLM's MistralParser is a parser engine: fed deltas only
    make_id = staticmethod(mistral_tool_call_id)
    # required / named: read from a bare JSON array (tool_choice is set by the chat layer)

    def __init__(self, vocab, tools=None):
        super().__init__(vocab, tools)
        if BOT not in vocab:
            raise ValueError(f"the tokenizer has no {BOT!r} token (the mistral parser needs it)")
        if ARGS in vocab:
            raise ValueError(f"the tokenizer has {ARGS!r}: Mistral's v11+ call format (name{ARGS}{{...}}) is not "
                             "implemented here, only the pre-v11 [TOOL_CALLS][{...}] one")
        # imported here, not at the top: the parser registry imports this module at every server start
        import ijson

        self.bot_id = vocab[BOT]
        self.state = WAIT_START
        self.started = False
        # ijson's incremental parser: each ``send(bytes)`` appends the ``(prefix, event, value)`` events
        # that piece completed to ``self._events``; malformed JSON raises ijson.JSONError, at that
        # send and at every later one
        self._events = ijson.sendable_list()
        self._json = ijson.parse_coro(self._events)
        self._json_error = ijson.JSONError
        self._bare = False
        self._name: str | None = None
        self._string_args: str | None = None
        self._new_tool = False
        self._pending_id: str | None = None

    @property
    def _guided(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, dict)

    @staticmethod
    def forced_schema(tools: list[dict], tool_choice) -> dict | None:
        """vLLM's ``_build_guided_schema_pre_v11``: the JSON schema forcing ``required`` / a named
        call as a bare array ``[{"name": .., "arguments": ..}]`` (named: at most one item).
        None for ``auto`` / ``none``."""
        if tool_choice == "required":
            chosen, extra = tools, {}
        elif isinstance(tool_choice, dict):
            name = tool_choice["function"]["name"]
            chosen, extra = [t for t in tools if t["function"]["name"] == name], {"maxItems": 1}
        else:
            return None
        any_of = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                    "arguments": t["function"].get("parameters") or {"type": "object"}},
                   "required": ["name", "arguments"]} for t in chosen]
        return {"type": "array", "minItems": 1, **extra, "items": {"type": "object", "anyOf": any_of}}

    # ---- whole outputs -----------------------------------------------------------------------
    def extract(self, text):
        if self.suppress:
            return False, [], text
        content = None
        if BOT in text:
            content, *segments = text.split(BOT)
            raw = next((seg.strip() for seg in segments if seg.strip()), "")
        elif self._guided:
            raw = text.strip()
        else:
            return False, [], text
        try:
            parsed, _ = json.JSONDecoder().raw_decode(raw)
        except ValueError:
            found = _ARRAY_RE.findall(raw)
            try:
                parsed = json.loads(found[0]) if found else None
            except ValueError:
                parsed = None
        calls = _function_calls(parsed)
        if not calls:
            return False, [], raw
        return True, calls, content if content and content.strip() else None

    # ---- streams -------------------------------------------------------------------------------
    def stream(self, previous_text, current_text, delta_text, previous_ids, current_ids, delta_ids):
        if self.bot_id in delta_ids or BOT in delta_text:
            self.started = True
        elif not self.started and delta_text and self._guided:
            self.started = True
        if not self.started:
            return {"content": delta_text}
        try:
            out = self._stream(delta_text, delta_ids)
        except self._json_error:  # vLLM: a delta whose JSON does not parse sends nothing
            return None
        if out is not None and self.suppress:
            out.pop("tool_calls", None)
        return out

    def _feed(self, piece: str) -> None:
        """Sends ``piece`` to ijson and runs the state machine over the events it completed,
        those before a JSON error too (vLLM's coroutine target sees them as they come).

        Raises:
            ijson.JSONError: the JSON is malformed (in this piece or an earlier one).
        """
        try:
            self._json.send(piece.encode("utf-8"))
        finally:
            events = list(self._events)
            del self._events[:]
            self._on_events(events)

    def _on_events(self, events) -> None:
        """vLLM's ``update_stream_state_pre_v11_tokenizer`` over ijson's events."""
        for prefix, event, value in events:
            if prefix == "" and event == "start_map":
                self._bare = True
            if self._bare:
                prefix = f"item.{prefix}" if prefix else "item"
            if prefix == "item" and event == "start_map":
                self.state, self._new_tool = WAIT_KEY, True
            if prefix == "item" and event == "map_key" and value == "name":
                self.state = NAME
            if prefix == "item.name" and event == "string":
                self._name, self.state = value, NAME_DONE
            if prefix == "item" and event == "map_key" and value == "arguments":
                self.state = WAIT_ARGS
            if prefix == "item.arguments" and event == "start_map":
                self.state = ARGS_
            if prefix == "item.arguments" and event == "end_map":
                self.state = ARGS_DONE
            if prefix == "item.arguments" and event == "string":
                self._string_args = value
            if prefix == "item" and event == "end_map":
                self.state = ALL_DONE if self._bare else TOOL_DONE
            if prefix == "" and event == "end_array":
                self.state = ALL_DONE

    def _stream(self, delta_text: str, delta_ids) -> dict | None:
        """vLLM's ``_extract_tool_calls_streaming_pre_v11_tokenizer``."""
        content = None
        calls: list[dict] = []
        call = {"type": "function", "index": self.current_tool_id}
        modified = False
        if self.bot_id in delta_ids or BOT in delta_text:
            if not delta_text.startswith(BOT):
                content = delta_text.split(BOT)[0]
            delta_text = "".join(delta_text.split(BOT)[1:])
        while delta_text:
            before = self.state
            if self.state == ALL_DONE:
                content, delta_text = delta_text, ""
            else:
                piece, delta_text = _split(delta_text, _SPLIT.get(self.state))
                self._feed(piece)
            if self._new_tool:
                self._new_tool = False
                if modified:
                    calls.append(self._emit(call))
                modified = False
                self.current_tool_id += 1
                self.streamed_args_for_tool.append("")
                self.prev_tool_call_arr.append({})
                self._pending_id = mistral_tool_call_id()
                call = {"type": "function", "index": self.current_tool_id}
            fn = call.setdefault("function", {})
            if self._name is not None:
                modified = True
                fn["name"] = self.prev_tool_call_arr[self.current_tool_id]["name"] = self._name
                self._name = None
            if self._string_args is not None:
                modified = True
                fn["arguments"], self._string_args = self._string_args, None
            if self.state == NAME_DONE:
                self.state = WAIT_KEY
            if self.state in (ARGS_, ARGS_DONE) and before != ALL_DONE:
                if self.state == ARGS_DONE:
                    self.state = WAIT_KEY
                modified = True
                fn["arguments"] = fn.get("arguments", "") + piece
                if before != ARGS_:  # the first piece of the arguments: left-stripped
                    fn["arguments"] = fn["arguments"].lstrip()
        if modified:
            calls.append(self._emit(call))
        if content or calls:
            out: dict = {}
            if content:
                out["content"] = content
            if calls:
                out["tool_calls"] = calls
            return out
        return {} if self.state == ALL_DONE else None

    def _emit(self, call: dict) -> dict:
        """A call delta as sent: the new call's id on its first delta; the arguments counted
        as streamed (vLLM's ``_track_streamed_args_pre_v11``)."""
        if self._pending_id is not None:
            call = {"id": self._pending_id, **call}
            self._pending_id = None
        args = call.get("function", {}).get("arguments")
        if args is not None:
            i = self.current_tool_id
            self.streamed_args_for_tool[i] += args
            self.prev_tool_call_arr[i]["arguments"] = self.streamed_args_for_tool[i]
        return call

    def remaining_args(self) -> str:
        """Nothing: the arguments go out raw as they come, none is held back (vLLM's last delta
        of a call cut after its name carries ``"arguments": ""``)."""
        return ""

    def finish(self) -> dict | None:
        """Nothing is held back at the end (vLLM's engine flush has nothing for this path)."""
        return None
