"""``--tool-call-parser llama3_json`` (also ``llama4_json``): Llama 3.x / 4 JSON tool calls,
``{"name": ..., "parameters": {...}}`` objects (``arguments`` also read), optionally after
``<|python_tag|>``, several separated by ``; ``.

As vLLM 0.32's ``Llama3JsonToolParser``: a whole output's calls are every JSON object in it
with a ``name`` (the content is then None; one without ``name`` / arguments leaves the whole text
as content); streamed, only an output that starts with ``<|python_tag|>`` or ``{`` is read as
calls, through the `partial-json-parser <https://pypi.org/project/partial-json-parser/>`_
library (what vLLM uses: the partial object is completed, names only once whole), the
arguments sent as the common prefix of successive re-serializations. Needs ``<|python_tag|>``
in the vocabulary (ValueError otherwise) and the partial-json-parser package (ImportError).
"""

from __future__ import annotations

import json
import re

from rlserve.server.tool_parsers.base import ToolParser, delta, is_complete_json, tool_delta

BOT = "<|python_tag|>"
_BRACE = re.compile(r"\{")


def _partial_loads(text: str, flags):
    """``(object, characters read)`` of the (partial) JSON at the start of ``text`` (vLLM's
    ``partial_json_loads``: a complete value followed by more text is read up to its end)."""
    import partial_json_parser

    try:
        return partial_json_parser.loads(text, flags), len(text)
    except json.JSONDecodeError as e:
        if "Extra data" in e.msg:
            return json.JSONDecoder().raw_decode(text)
        raise


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


class Llama3JsonToolParser(ToolParser):
    """Llama 3 JSON tool calls (see the module docstring)."""

    structural_tag = "llama"

    def __init__(self, vocab, tools=None):
        super().__init__(vocab, tools)
        if BOT not in vocab:
            raise ValueError(f"the tokenizer has no {BOT!r} token (llama3_json needs it)")
        import partial_json_parser  # noqa: F401 - fail at startup, not on the first stream

    def extract(self, text):
        if not (BOT in text or "{" in text):
            return False, [], text
        end, calls = -1, []
        for m in _BRACE.finditer(text):
            if m.start() <= end:
                continue
            try:
                obj, n = json.JSONDecoder().raw_decode(text[m.start():])
                end = m.start() + n
                args = obj["arguments"] if "arguments" in obj else obj["parameters"]
                calls.append((obj["name"], json.dumps(args, ensure_ascii=False)))
            except Exception:  # noqa: BLE001 - vLLM's rule: any bad object leaves the text as content
                return False, [], text
        return (True, calls, None) if calls else (False, [], text)

    def _args_delta(self, i: int, args_diff: str) -> dict:
        self.streamed_args_for_tool[i] += args_diff
        return delta(tool_calls=[tool_delta(i, arguments=args_diff)])

    def stream(self, previous_text, current_text, delta_text, previous_ids, current_ids, delta_ids):
        from partial_json_parser.core.exceptions import MalformedJSON
        from partial_json_parser.core.options import Allow

        if not (current_text.startswith(BOT) or current_text.startswith("{")):
            return delta(content=delta_text)
        flags = Allow.ALL if self.current_tool_name_sent else Allow.ALL & ~Allow.STR
        try:
            arr, complete = [], []
            try:
                start = len(BOT) if current_text.startswith(BOT) else 0
                while start < len(current_text):
                    obj, n = _partial_loads(current_text[start:], flags)
                    complete.append(is_complete_json(current_text[start:start + n]))
                    start += n + len("; ")
                    if "parameters" in obj:
                        assert "arguments" not in obj, "model generated both parameters and arguments"
                        obj["arguments"] = obj["parameters"]
                    arr.append(obj)
            except MalformedJSON:
                return None
            if not arr:
                return None
            cur = arr[self.current_tool_id]
            out = None
            if len(arr) > self.current_tool_id + 1:  # a new call starts: flush the last one's arguments
                if self.current_tool_id >= 0 and cur.get("arguments"):
                    args = json.dumps(cur["arguments"], ensure_ascii=False)
                    out = self._args_delta(self.current_tool_id,
                                           args[len(self.streamed_args_for_tool[self.current_tool_id]):])
                self.current_tool_id = len(arr) - 1
                self.current_tool_name_sent = False
                self.streamed_args_for_tool.append("")
                return out
            if not self.current_tool_name_sent:
                if cur.get("name"):
                    out = delta(tool_calls=[tool_delta(self.current_tool_id, name=cur["name"], new=True)])
                    self.current_tool_name_sent = True
            elif cur.get("arguments"):
                sent = len(self.streamed_args_for_tool[self.current_tool_id])
                args = json.dumps(cur["arguments"], ensure_ascii=False)
                prev = self.prev_tool_call_arr[self.current_tool_id].get("arguments")
                diff = None
                if complete[self.current_tool_id]:
                    diff = args[sent:]
                elif prev:
                    prev_json = json.dumps(prev, ensure_ascii=False)
                    if args != prev_json:
                        diff = _common_prefix(prev_json, args)[sent:]
                if diff is not None:
                    out = self._args_delta(self.current_tool_id, diff)
            self.prev_tool_call_arr = arr
            return out
        except Exception:  # noqa: BLE001 - as vLLM: a delta that fails to parse sends nothing
            return None
