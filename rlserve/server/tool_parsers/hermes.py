"""``--tool-call-parser hermes`` (also ``qwen3_json``): Hermes 2 Pro / Qwen2.5 / Qwen3 JSON tool
calls, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one tag pair per call.

As vLLM 0.32's ``Hermes2ProToolParser``: the content is the text before the first
``<tool_call>``; streamed, the name goes out once complete (with the call's id) and the
arguments as the raw text after ``"arguments":`` as it grows (the outer object's closing
``}`` held back), a possible ``<tool_call>`` prefix of the content held back.
``tool_choice`` required / named: the calls are forced in this same format
(:mod:`rlserve.server.tool_parsers.structural`) and parsed as with ``auto``.
"""

from __future__ import annotations

import json
import re

from rlserve.server.tool_parsers.base import ToolParser, delta, is_complete_json, partial_tag_overlap, tool_delta

START, END = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_NAME_RE = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGS_RE = re.compile(r'"arguments"\s*:\s*')


class HermesToolParser(ToolParser):
    """Hermes / Qwen JSON-in-tags tool calls (see the module docstring). Needs the request's
    ``skip_special_tokens`` off (the tags are special tokens in some models), as vLLM sets it."""

    skip_special_tokens = False
    # vLLM 0.32 (VLLM_ENFORCE_STRICT_TOOL_CALLING, on by default) forces required / named calls
    # in the hermes format through a structural tag, and parses them as auto
    structural_tag = "hermes"

    def __init__(self, vocab, tools=None):
        super().__init__(vocab, tools)
        self._sent_content = 0

    def extract(self, text):
        if START not in text:
            return False, [], text
        try:
            calls = []
            for m in _CALL_RE.findall(text):
                obj = json.loads(m[0] if m[0] else m[1])
                calls.append((obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)))
        except Exception:  # noqa: BLE001 - vLLM's rule: a malformed call leaves the text as content
            return False, [], text
        content = text[:text.find(START)]
        return True, calls, content if content else None

    def _content(self, text: str) -> str | None:
        end = text.index(START) if START in text else len(text) - partial_tag_overlap(text, START)
        if end > self._sent_content:
            out = text[self._sent_content:end]
            self._sent_content = end
            return out
        return None

    @staticmethod
    def _call_jsons(text: str) -> list[tuple[str, bool]]:
        out, pos = [], 0
        while (start := text.find(START, pos)) != -1:
            body = start + len(START)
            end = text.find(END, body)
            if end != -1:
                out.append((text[body:end].strip(), True))
                pos = end + len(END)
                continue
            raw = text[body:]
            k = partial_tag_overlap(raw, END)
            raw = (raw[:-k] if k else raw).strip()
            out.append((raw, is_complete_json(raw) if raw else False))
            break
        return out

    def _args_diff(self, i: int, tc_json: str, complete: bool) -> str | None:
        m = _ARGS_RE.search(tc_json)
        if not m:
            return None
        args = tc_json[m.end():]
        if complete:
            args = args.rstrip()
            if args.endswith("}"):
                args = args[:-1].rstrip()
        if len(args) <= len(self.streamed_args_for_tool[i]):
            return None
        diff = args[len(self.streamed_args_for_tool[i]):]
        self.streamed_args_for_tool[i] = args
        self.prev_tool_call_arr[i]["arguments"] = args
        return diff

    def stream(self, previous_text, current_text, delta_text, previous_ids, current_ids, delta_ids):
        try:
            content = self._content(current_text)
            calls = []
            for i, (tc_json, complete) in enumerate(self._call_jsons(current_text)):
                if i >= len(self.prev_tool_call_arr):
                    self.prev_tool_call_arr.append({})
                    self.streamed_args_for_tool.append("")
                if "name" not in self.prev_tool_call_arr[i]:
                    m = _NAME_RE.search(tc_json)
                    if not m:
                        break
                    self.prev_tool_call_arr[i]["name"] = m.group(1)
                    calls.append(tool_delta(i, name=m.group(1), new=True))
                diff = self._args_diff(i, tc_json, complete)
                if diff:
                    calls.append(tool_delta(i, arguments=diff))
            if content or calls:
                return delta(content=content, tool_calls=calls)
            return None
        except Exception:  # noqa: BLE001 - as vLLM: a delta that fails to parse sends nothing
            return None
