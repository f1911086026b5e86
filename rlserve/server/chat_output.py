"""Tool calls and reasoning in chat answers: ``--tool-call-parser`` / ``--reasoning-parser`` /
``--enable-auto-tool-choice`` and a request's ``tools`` / ``tool_choice``, as vLLM 0.32's chat
serving applies them (``vllm/parser/abstract_parser.py::DelegatingParser``,
``vllm/entrypoints/openai/chat_completion/serving.py``).

:class:`ChatOutputConfig` is the server's (built once, from the flags);
:meth:`ChatOutputConfig.parser` makes a :class:`ChatOutputParser` per request choice, which reads
a whole output (:meth:`ChatOutputParser.message`) or is fed each streamed delta
(:meth:`ChatOutputParser.delta`). Only the answer's text is split: the token ids returned with
``return_token_ids`` stay every generated id (the markup the parsers remove included), for
token-in/token-out training.
"""

from __future__ import annotations

import dataclasses

from rlserve.server.reasoning import reasoning_parser_class
from rlserve.server.tool_parsers import tool_parser_class
from rlserve.server.tool_parsers.base import delta as make_delta, make_tool_call_id


class ChatOutputConfig:
    """The server's parsers.

    Args:
        tool_parser: ``--tool-call-parser`` name, or None.
        reasoning_parser: ``--reasoning-parser`` name, or None.
        enable_auto_tools: ``--enable-auto-tool-choice`` (parse calls with ``tool_choice`` auto).
        tokenizer: the model's Hugging Face tokenizer (its vocabulary; each token's text for
            counting reasoning tokens).
        structured_in_reasoning: constraints apply in the reasoning too (vLLM's
            ``--structured-outputs-config`` ``enable_in_reasoning``; :meth:`reasoning_gate`).

    Raises:
        ValueError: an unknown parser name, a parser whose tokens the vocabulary lacks, or
            one whose library is not installed.
    """

    def __init__(self, tool_parser: str | None, reasoning_parser: str | None, enable_auto_tools: bool, tokenizer,
                 structured_in_reasoning: bool = False):
        self.structured_in_reasoning = bool(structured_in_reasoning)
        self.tool_cls = tool_parser_class(tool_parser) if tool_parser else None
        self.reasoning_cls = reasoning_parser_class(reasoning_parser) if reasoning_parser else None
        self.enable_auto_tools = bool(enable_auto_tools)
        self.tokenizer = tokenizer
        # the parsers' marker lookups need the vocabulary; without a parser it is never read
        self.vocab = vocab = tokenizer.get_vocab() if (tool_parser or reasoning_parser) else {}
        for flag, name, make in (("--reasoning-parser", reasoning_parser, lambda: self.reasoning_cls(vocab, {})),
                                 ("--tool-call-parser", tool_parser, lambda: self.tool_cls(vocab, []))):
            try:  # raises now, at startup, not per request
                if name:
                    make()
            except (ValueError, ImportError) as e:
                raise ValueError(f"{flag} {name}: {e}") from None

    @property
    def active(self) -> bool:
        """Whether answers are parsed at all (a tool or a reasoning parser is set)."""
        return self.tool_cls is not None or self.reasoning_cls is not None

    def check_tool_choice(self, tool_choice) -> str | None:
        """vLLM's refusal of a ``tool_choice`` this server cannot honour (the message), or None."""
        if self.tool_cls is not None or tool_choice in (None, "none"):
            return None
        if tool_choice == "auto":
            return '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        desc = f'function "{tool_choice["function"]["name"]}"' if isinstance(tool_choice, dict) \
            else f'"{tool_choice}"'
        return f"tool_choice={desc} requires --tool-call-parser to be set"

    def skip_special_tokens(self, tools, tool_choice) -> bool | None:
        """What the tool parser needs ``skip_special_tokens`` to be for this request (None: as
        asked): hermes keeps special tokens whenever tools are on, as vLLM's ``adjust_request``."""
        if self.tool_cls is None or not tools or tool_choice == "none":
            return None
        return self.tool_cls.skip_special_tokens

    def reasoning_gate(self, spec, prompt_ids: list[int], chat_template_kwargs: dict | None,
                       include_reasoning: bool = True):
        """``spec`` (a :class:`~rlserve.engine.sampling_params.StructuredOutputsParams` or None)
        with vLLM's reasoning gate: under ``--reasoning-parser``, a constraint (a forced tool
        call, a ``response_format``, ``structured_outputs``) applies only once the reasoning has
        ended, so the model thinks freely first (vLLM's ``StructuredOutputManager``). Unchanged
        when no reasoning parser is set, when the prompt already ends the reasoning (thinking
        off: ``</think>`` in the prompt; the parser's ``is_reasoning_end``) or with
        ``include_reasoning: false`` (vLLM constrains from the first token then), or with
        ``enable_in_reasoning``."""
        if spec is None or self.reasoning_cls is None or not include_reasoning or self.structured_in_reasoning:
            return spec
        rp = self.reasoning_cls(self.vocab, chat_template_kwargs)
        if rp.is_reasoning_end(list(prompt_ids)):
            return spec
        explicit, implicit = rp.gate_ids()
        return dataclasses.replace(spec, reasoning_end_ids=explicit, reasoning_implicit_end_ids=implicit)

    def parser(self, tools: list[dict] | None, tool_choice, chat_template_kwargs: dict | None,
               include_reasoning: bool = True) -> "ChatOutputParser":
        """A fresh parser for one choice of one request (``include_reasoning``: vLLM's request
        field; false drops the reasoning from answers and deltas)."""
        return ChatOutputParser(self, tools, tool_choice, chat_template_kwargs, include_reasoning)


class ChatOutputParser:
    """One choice's parse (see the module docstring). ``tools_streamed``: a streamed delta
    carried a tool call (the finish reason becomes ``tool_calls``)."""

    def __init__(self, cfg: ChatOutputConfig, tools, tool_choice, chat_template_kwargs, include_reasoning=True):
        self.cfg = cfg
        self.include_reasoning = include_reasoning
        self.tool_choice = tool_choice
        self.has_tools = bool(tools)
        self._kwargs = chat_template_kwargs
        self.reasoning = cfg.reasoning_cls(cfg.vocab, chat_template_kwargs) if cfg.reasoning_cls else None
        self.tools = cfg.tool_cls(cfg.vocab, tools) if cfg.tool_cls else None
        if self.tools is not None:
            self.tools.tool_choice = tool_choice
        self.named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
        self.required = tool_choice == "required"
        self.tools_streamed = False
        # stream state (vLLM's StreamState)
        # vLLM's Parser._engine_based: every parser set is engine-based (qwen3 / qwen3_xml)
        self._engine_based = (self.reasoning is None or self.reasoning.engine_based) and \
            (self.tools is None or self.tools.engine_based)
        if self.tools is not None and tool_choice == "none" and self.tools.engine_based:
            self.tools.suppress = True  # the engine still takes the call markup out of the content
        self._reasoning_ended = False
        self._prompt_checked = False
        self._tool_text_started = False
        self._prev_text = ""
        self._prev_ids: list[int] = []

    # ---- whole outputs -----------------------------------------------------------------------
    def _tool_calls(self, content: str | None) -> tuple[list | None, str | None]:
        """vLLM's ``DelegatingParser._extract_tool_calls``: ``([(name, arguments)] | None, content)``.
        Every parser here forces ``required`` / named calls in its own format (a structural
        tag), so those are parsed as ``auto`` (vLLM's ``supports_required_and_named=False``)."""
        tp = self.tools
        if tp is None:
            return [], content
        if self.tool_choice == "none":
            return [], (tp.extract(content or "")[2] if self._engine_based else content)
        if not self.cfg.enable_auto_tools:
            return [], content
        called, calls, rest = tp.extract(content if content is not None else "")
        if called:
            return calls, (None if rest is not None and rest.strip() == "" else rest)
        if (self.required or self.named is not None) and (content is None or not content.strip()):
            return [], None
        return None, ((rest or None) if self._engine_based else content)

    def parse(self, text: str) -> tuple[str | None, str | None, list | None]:
        """vLLM's ``Parser.parse`` of a whole output: ``(reasoning, content, [(name, arguments)]
        or None)`` (None: tools were parsed for and none found; ``[]``: not parsed for)."""
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract(text)
        else:
            reasoning, content = None, text
        calls, content = self._tool_calls(content)
        return reasoning, content, calls

    def reasoning_tokens(self, ids: list[int]) -> int:
        """How many of a whole output's ``ids`` are reasoning (usage's ``reasoning_tokens``; 0
        without a reasoning parser)."""
        if self.reasoning is None:
            return 0
        pieces = self.cfg.tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)
        return type(self.reasoning)(self.cfg.vocab, self._kwargs).count(list(ids), pieces)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The chat message fields of a whole output and the choice's finish reason:
        ``({"content", "reasoning", "tool_calls": [{"id", "type", "function": {"name",
        "arguments"}}]}, finish_reason)`` (``tool_calls`` empty when none; the finish reason
        ``tool_calls`` for calls made under ``auto``, or under ``required`` when the output
        stopped)."""
        reasoning, content, calls = self.parse(text)
        auto_called = False
        if self.named is not None or self.required:
            content = content or ""
        elif not (self.cfg.enable_auto_tools and self.tools is not None) or self.tool_choice == "none" \
                or not self.has_tools:
            calls = []
        else:
            auto_called = bool(calls)
        make_id = self.tools.make_id if self.tools is not None else make_tool_call_id
        tool_calls = [{"id": make_id(), "type": "function", "function": {"name": n, "arguments": a}}
                      for n, a in (calls or [])]
        if auto_called or (self.required and finish_reason == "stop"):
            finish_reason = "tool_calls"
        if not self.include_reasoning:
            reasoning = None
        return {"content": content, "reasoning": reasoning, "tool_calls": tool_calls}, finish_reason

    # ---- streams -------------------------------------------------------------------------------
    def _tool_delta(self, prev_text, cur_text, delta_text, prev_ids, cur_ids, delta_ids) -> dict | None:
        tp = self.tools
        if self.tool_choice == "none" and not self._engine_based:
            return make_delta(content=delta_text) if delta_text else None
        return tp.stream(prev_text, cur_text, delta_text, prev_ids, cur_ids, delta_ids)

    def delta(self, delta_text: str, delta_ids: list[int], prompt_ids: list[int] | None, finished: bool) -> dict | None:
        """The stream delta for one engine output of this choice (vLLM's ``parse_delta``): a
        dict with ``content`` / ``reasoning`` / ``tool_calls`` as vLLM sets them, or None when
        there is nothing to send for it."""
        rp = self.reasoning
        if not self._prompt_checked and prompt_ids is not None:
            self._prompt_checked = True
            if rp is None or rp.is_reasoning_end(list(prompt_ids)):
                self._reasoning_ended = True
        if self._engine_based:
            cur_text, cur_ids = delta_text, list(delta_ids)
        else:
            cur_text, cur_ids = self._prev_text + delta_text, self._prev_ids + list(delta_ids)
        out = None
        transitioned = False
        if rp is not None and not self._reasoning_ended:
            out = rp.stream(self._prev_text, cur_text, delta_text, self._prev_ids, cur_ids, list(delta_ids))
            if rp.ends_in(list(delta_ids)):
                self._reasoning_ended = transitioned = True
                cur_ids = rp.content_ids(list(delta_ids))
                cur_text = ((out or {}).get("content") or "") + rp.flush()
                if self._engine_based:
                    if cur_text:
                        out = out if out is not None else {}
                        out["content"] = cur_text
                else:
                    delta_text = cur_text
        if self.tools is not None and self._reasoning_ended:
            if not self._tool_text_started:
                self._tool_text_started = True
                self._prev_text, self._prev_ids = "", []
                delta_text, delta_ids = cur_text, cur_ids
            reasoning = (out or {}).get("reasoning")
            out = self._tool_delta(self._prev_text, cur_text, delta_text, self._prev_ids, cur_ids, list(delta_ids))
            if reasoning:
                if out is None:
                    out = make_delta(reasoning=reasoning)
                elif not out.get("reasoning"):
                    out["reasoning"] = reasoning
        if out is None and not transitioned and (rp is None or self._reasoning_ended) and \
                (self.tools is None or not self._reasoning_ended):
            out = make_delta(content=delta_text)
        if self._engine_based:
            self._prev_text, self._prev_ids = "", []
        else:
            self._prev_text, self._prev_ids = cur_text, cur_ids
        if finished:
            out = self._finish(out)
        if out is not None and out.get("tool_calls"):
            self.tools_streamed = True
        if out is not None and not self.include_reasoning:
            out.pop("reasoning", None)
            if not out.get("content") and not out.get("tool_calls"):
                return None
        return out

    def _finish(self, out: dict | None) -> dict | None:
        """The last delta: a tool call's parsed-but-unsent arguments appended (vLLM's
        ``finalize_generation``), then what engine-based parsers still hold (vLLM's
        ``_flush_engine_parsers``): held reasoning text, an open call's end."""
        if self.tools is not None and out and out.get("tool_calls") and "function" in out["tool_calls"][-1]:
            fn = out["tool_calls"][-1]["function"]
            fn["arguments"] = (fn.get("arguments") or "") + self.tools.remaining_args()
        if self.reasoning is not None and not self._reasoning_ended:
            held = self.reasoning.flush()
            if held:
                out = out if out is not None else {}
                out["reasoning"] = (out.get("reasoning") or "") + held
        if self.tools is not None and self.tools.engine_based:
            flush = self.tools.finish()
            if flush is not None:
                if out is None:
                    out = flush
                else:
                    if flush.get("content"):
                        out["content"] = (out.get("content") or "") + flush["content"]
                    if flush.get("tool_calls"):
                        out["tool_calls"] = (out.get("tool_calls") or []) + flush["tool_calls"]
        return out

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """A streamed choice's finish reason: ``tool_calls`` when a tool call was streamed under
        ``auto`` / ``required`` and the output stopped (vLLM's rule)."""
        if self.tools_streamed and self.named is None and finish_reason == "stop":
            return "tool_calls"
        return finish_reason
