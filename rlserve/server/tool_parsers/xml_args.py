"""Arguments of Qwen3 XML tool calls as JSON, as vLLM 0.32's parser engine builds them
(``vllm/parser/qwen3.py::_qwen3_arg_converter``, ``vllm/parser/engine/parser_engine.py``'s
``_fix_arg_types`` / ``_safe_arg_prefix``, ``vllm/tool_parsers/utils.py``'s
``coerce_to_schema_type``): ``<parameter=NAME>VALUE</parameter>`` pairs become a JSON object of
strings, each then coerced to the type the tool's schema gives it, and a streamed call's
arguments go out as the prefix of that JSON that later text cannot change."""

from __future__ import annotations

import json
import math
import re

_PARAM_RE = re.compile(r"<\s*parameter\s*=\s*([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s*=))", re.DOTALL)
_PARTIAL_PARAM_RE = re.compile(r"<\s*parameter\s*=\s*([^>]+)>(.*)$", re.DOTALL)
_ALIASES = {"str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
            "int": "integer", "int32": "integer", "int64": "integer", "uint": "integer", "uint32": "integer",
            "uint64": "integer", "long": "integer", "short": "integer", "unsigned": "integer", "float": "number",
            "float32": "number", "float64": "number", "double": "number", "bool": "boolean", "dict": "object",
            "arr": "array", "list": "array", "sequence": "array"}
_ENUM_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
               (dict, "object"))


def _trim(value: str) -> str:
    """One leading and one trailing newline off (the template's markup around a value)."""
    return value[1 if value.startswith("\n") else 0:len(value) - (1 if value.endswith("\n") else 0)]


def xml_args_json(raw: str, partial: bool) -> str:
    """The JSON object (string values) of a call body's parameters; ``partial``: the body is
    still being generated, an unclosed last parameter counts with what it has."""
    params: dict[str, object] = {m.group(1): _trim(m.group(2)) for m in _PARAM_RE.finditer(raw)}
    if partial:
        m = _PARTIAL_PARAM_RE.search(_PARAM_RE.sub("", raw))
        if m and m.group(1):
            params[m.group(1)] = _trim(m.group(2))
    return json.dumps(params, ensure_ascii=False)


def schema_types(schema) -> list[str]:
    """The JSON types a schema allows (``type``, ``enum`` values, ``anyOf`` / ``oneOf`` /
    ``allOf``); ``["string"]`` when it says none."""
    if not isinstance(schema, dict):
        return ["string"]
    types: set[str] = set()
    t = schema.get("type")
    types.update([t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] if isinstance(t, list) else [])
    if isinstance(schema.get("enum"), list):
        for v in schema["enum"]:
            types.add("null" if v is None else next((n for k, n in _ENUM_TYPES if isinstance(v, k)), "string"))
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema[key] if isinstance(schema.get(key), list) else []:
            types.update(schema_types(sub))
    return list(types) if types else ["string"]


def _finite(obj) -> bool:
    try:
        json.dumps(obj, allow_nan=False)
        return True
    except (ValueError, TypeError):
        return False


def coerce(value: str, types: list[str]):
    """``value`` as the first of null, integer, number, boolean, object, array, string that
    ``types`` allows and it reads as; else its JSON value; else itself."""
    allowed = {_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types}
    for t in ("null", "integer", "number", "boolean", "object", "array", "string"):
        if t not in allowed:
            continue
        if t == "null" and value.lower() == "null":
            return None
        if t == "string":
            return value
        if t == "integer":
            try:
                return int(value)
            except ValueError:
                continue
        if t == "number":
            try:
                v = float(value)
            except ValueError:
                continue
            if math.isfinite(v):
                return v if v != int(v) else int(v)
        if t == "boolean" and value.lower().strip() in ("true", "1", "false", "0"):
            return value.lower().strip() in ("true", "1")
        if t in ("object", "array"):
            try:
                parsed = json.loads(value)
            except ValueError:
                continue
            if _finite(parsed):
                return parsed
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return parsed if _finite(parsed) else value


def _coerce_value(value, schema: dict):
    """``(value, changed)`` with ``value`` coerced per ``schema`` (nested objects / arrays too)."""
    if isinstance(value, str):
        out = coerce(value, schema_types(schema))
        return out, out is not value
    if isinstance(value, dict):
        props = schema.get("properties")
        return value, isinstance(props, dict) and coerce_dict(value, props)
    if isinstance(value, list):
        items, changed = schema.get("items"), False
        if isinstance(items, dict):
            for i, item in enumerate(value):
                new, c = _coerce_value(item, items)
                if c:
                    value[i], changed = new, True
        return value, changed
    out = coerce(json.dumps(value, ensure_ascii=False), schema_types(schema))
    return (out, True) if type(out) is not type(value) or out != value else (value, False)


def coerce_dict(args: dict, properties: dict) -> bool:
    """Coerce ``args`` in place per ``properties``; whether anything changed."""
    changed = False
    for k, v in args.items():
        if isinstance(properties.get(k), dict):
            new, c = _coerce_value(v, properties[k])
            if c:
                args[k], changed = new, True
    return changed


def tool_properties(tools: list[dict], name: str) -> dict:
    """The ``properties`` of tool ``name``'s parameters ({} when none)."""
    for t in tools:
        fn = t.get("function", {})
        if fn.get("name") == name:
            return (fn.get("parameters") or {}).get("properties", {})
    return {}


def typed_args(args_json: str, tools: list[dict], name: str) -> str:
    """``args_json`` with its values coerced to the tool's schema (unchanged when nothing is)."""
    props = tool_properties(tools, name) if tools and name else {}
    if not props:
        return args_json
    try:
        args = json.loads(args_json)
    except ValueError:
        return args_json
    if isinstance(args, dict) and coerce_dict(args, props):
        return json.dumps(args, ensure_ascii=False)
    return args_json


def string_keys(properties: dict) -> set[str] | None:
    """Keys whose value is always a string (safe to stream while open); None: no schema."""
    if not properties:
        return None
    return {k for k, s in properties.items() if set(schema_types(s)) == {"string"}}


def safe_prefix(js: str, keys: set[str] | None = None) -> str:
    """The prefix of an arguments object ``js`` that later text cannot change: up to the last
    top-level value, that value included only while it is an open string of a key in ``keys``
    (``None``: any key)."""
    last_colon, last_key, pending, in_str, esc, s0, depth = -1, None, None, False, False, -1, 0
    for i, c in enumerate(js):
        if esc:
            esc = False
        elif in_str:
            if c == "\\":
                esc = True
            elif c == '"':
                in_str = False
                if depth == 1 and s0 >= 0:
                    pending = js[s0 + 1:i]
        elif c == '"':
            in_str, s0 = True, i
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
        elif c == ":" and depth == 1:
            last_colon, last_key, pending = i, pending, None
    if last_colon < 0:
        return ""
    end = last_colon + 1
    while end < len(js) and js[end] in " \t\n\r":
        end += 1
    if end >= len(js) or js[end] != '"' or (keys is not None and last_key not in keys):
        return js[:end]
    esc = False
    for i in range(end + 1, len(js)):
        if esc:
            esc = False
        elif js[i] == "\\":
            esc = True
        elif js[i] == '"':
            return js[:i]
    return js
