"""An incremental JSON event parser: the ``(prefix, event, value)`` events of
`ijson <https://pypi.org/project/ijson/>`_'s ``parse_coro`` (yajl2_c backend), the library vLLM's
pre-v11 Mistral tool parser streams through (``vllm/parser/mistral.py``), without that
dependency.

Text is fed in pieces (:meth:`JsonEvents.feed`); each call returns the events the piece
completed, as yajl fires them: ``start_map`` / ``start_array`` at ``{`` / ``[``, ``end_map`` /
``end_array`` at ``}`` / ``]``, ``map_key`` and ``string`` at a string's closing quote (the value
decoded), ``boolean`` / ``null`` at their last letter, ``number`` once the next character ends it. The prefix is
ijson's: the keys from the top separated by dots, ``item`` for an array element
(``item.arguments.city``). Malformed JSON raises ValueError, and so does every later feed (ijson's
coroutine is closed by its first error).
"""

from __future__ import annotations

import json

_WS = " \t\n\r"
_LITERALS = {"true": ("boolean", True), "false": ("boolean", False), "null": ("null", None)}
_NUMBER_CHARS = set("0123456789+-.eE")


def _join(prefix: str, part: str) -> str:
    return f"{prefix}.{part}" if prefix else part


class JsonEvents:
    """One JSON value's events, fed piece by piece (see the module docstring)."""

    def __init__(self):
        self._stack: list[dict] = []  # {"map": bool, "prefix": str, "key": str | None, "want": str}
        self._want = "value"  # top level: "value", then "done"
        self._string: list[str] | None = None  # the raw characters of an open string (quotes included)
        self._escape = False
        self._scalar = ""  # an open number or literal
        self._dead: str | None = None

    # ---- where we are ----------------------------------------------------------------------
    def _value_prefix(self) -> str:
        if not self._stack:
            return ""
        top = self._stack[-1]
        return _join(top["prefix"], top["key"]) if top["map"] else _join(top["prefix"], "item")

    def _expect(self) -> str:
        return self._stack[-1]["want"] if self._stack else self._want

    def _set_expect(self, want: str) -> None:
        if self._stack:
            self._stack[-1]["want"] = want
        else:
            self._want = want

    def _after_value(self) -> None:
        self._set_expect("sep" if self._stack else "done")

    def _fail(self, why: str):
        self._dead = why
        raise ValueError(f"invalid JSON: {why}")

    # ---- feeding -----------------------------------------------------------------------------
    def feed(self, text: str) -> list[tuple[str, str, object]]:
        """The events ``text`` completes.

        Raises:
            ValueError: the JSON is malformed (here or in an earlier piece).
        """
        if self._dead is not None:
            raise ValueError(f"invalid JSON: {self._dead}")
        events: list[tuple[str, str, object]] = []
        for ch in text:
            self._char(ch, events)
        return events

    def _end_scalar(self, events) -> None:
        tok, self._scalar = self._scalar, ""
        if tok in _LITERALS:
            kind, value = _LITERALS[tok]
        else:
            try:
                value = json.loads(tok)
            except ValueError:
                self._fail(f"bad number {tok!r}")
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                self._fail(f"bad number {tok!r}")
            kind = "number"
        events.append((self._value_prefix(), kind, value))
        self._after_value()

    def _char(self, ch: str, events) -> None:
        if self._string is not None:
            self._string.append(ch)
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                raw, self._string = "".join(self._string), None
                try:
                    value = json.loads(raw)
                except ValueError:
                    self._fail("bad string")
                if self._expect() == "key":
                    top = self._stack[-1]
                    top["key"], top["want"] = value, "colon"
                    events.append((top["prefix"], "map_key", value))
                else:
                    events.append((self._value_prefix(), "string", value))
                    self._after_value()
            elif ch < " ":
                self._fail("control character in a string")
            return
        if self._scalar:
            if ch in _NUMBER_CHARS or ch.isalpha():
                self._scalar += ch
                if self._scalar[0].isalpha():
                    if not any(lit.startswith(self._scalar) for lit in _LITERALS):
                        self._fail(f"invalid literal {self._scalar!r}")
                    if self._scalar in _LITERALS:  # complete: yajl fires it at once (a number waits)
                        self._end_scalar(events)
                return
            self._end_scalar(events)
        if ch in _WS:
            return
        want = self._expect()
        if want in ("value", "value_or_close"):
            if ch == "]" and want == "value_or_close":
                self._close(events, map_=False)
            elif ch == '"':
                self._string = ['"']
            elif ch in "{[":
                is_map = ch == "{"
                prefix = self._value_prefix()
                events.append((prefix, "start_map" if is_map else "start_array", None))
                self._set_expect("sep")  # the parent's, once this container closes
                self._stack.append({"map": is_map, "prefix": prefix, "key": None,
                                    "want": "key_or_close" if is_map else "value_or_close"})
            elif ch == "-" or ch.isdigit() or ch in "tfn":
                self._scalar = ch
            else:
                self._fail(f"unexpected {ch!r}")
        elif want in ("key", "key_or_close"):
            if ch == '"':
                self._stack[-1]["want"] = "key"
                self._string = ['"']
            elif ch == "}" and want == "key_or_close":
                self._close(events, map_=True)
            else:
                self._fail(f"expected a key, got {ch!r}")
        elif want == "colon":
            if ch != ":":
                self._fail(f"expected ':', got {ch!r}")
            self._stack[-1]["want"] = "value"
        elif want == "sep":
            top = self._stack[-1]
            if ch == ",":
                top["want"] = "key" if top["map"] else "value"
            elif ch == ("}" if top["map"] else "]"):
                self._close(events, map_=top["map"])
            else:
                self._fail(f"unexpected {ch!r}")
        else:
            self._fail(f"{ch!r} after the end of the value")

    def _close(self, events, map_: bool) -> None:
        frame = self._stack.pop()
        events.append((frame["prefix"], "end_map" if map_ else "end_array", None))
        self._after_value()
