"""A fake engine for the API-process load test (``benchmarks/api_stream_load.py``): it stands in
for :class:`~rlserve.engine.core.llm_engine.LLMEngine` inside a real engine-core process, so the
API process (FastAPI routes, SSE encoding, the front's output processor and detokenizer, the
reader thread, uvicorn) runs exactly as in ``rlserve serve`` while the "GPU" costs nothing.

Installed by ``RLSERVE_ENGINE_CORE_INIT=<this file>:install`` (the engine-core process calls it
before it builds its engine; :func:`install` makes ``LLMEngine(config, ...)`` build a
:class:`FakeEngine`). Its behaviour is set by the environment the harness passes:

* ``API_STREAM_FAKE_STEP_MS`` (default 10): one step every this many milliseconds (a decode step
  of Qwen3-0.6B at batch 256 on an H200 took 8.4-9.6 ms, BENCHMARKS.md "Decode step");
* ``API_STREAM_FAKE_PREFILL_TOKENS`` (default 16384): prompt tokens a step admits at most (a
  new request gets its first token in the step that admits it; vLLM's default
  ``max_num_batched_tokens`` for chunked prefill is 8192-16384);
* ``API_STREAM_FAKE_MAX_SEQS`` (default 256): running requests at most.

Each running sample gains one token per step, drawn from ``API_STREAM_FAKE_TOKEN_LO`` ..
``API_STREAM_FAKE_TOKEN_HI`` (default 3 .. 300: the tiny test tokenizer's ordinary tokens, no
special ones), and finishes with ``"length"`` at ``max_tokens`` (no EOS: the load test uses
``ignore_eos``). Stop strings are matched in the API process, as with the real engine
(:meth:`finish_sequences`). Not a model: no logits, so ``logprobs`` are a fixed ``-1.0``.
"""

from __future__ import annotations

import os
import random
import time
from types import SimpleNamespace


class _Seq:
    __slots__ = ("index", "output_token_ids", "sampled_logprobs", "logprobs", "finish_reason", "stop_reason",
                 "params", "routed_experts", "streamed")

    def __init__(self, index: int, params):
        self.index = index
        self.params = params
        self.output_token_ids: list[int] = []
        self.sampled_logprobs: list[float] = []
        self.logprobs = [] if params.logprobs is not None else None
        self.finish_reason = None
        self.stop_reason = None
        self.routed_experts = None
        self.streamed = False  # (EngineCore.add marks a streamed request's sequences, as Sequence.streamed)


class _Req:
    def __init__(self, request_id: str, prompt_ids: list[int], params):
        self.request_id = request_id
        self.prompt_token_ids = prompt_ids
        self.prompt_logprobs = None
        self.extra: dict = {}
        self.params = params
        self.seqs = [_Seq(i, params) for i in range(getattr(params, "n", 1) or 1)]
        self.started = False

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


class FakeEngine:
    """What :class:`~rlserve.engine.core.engine_core.EngineCore` (delta mode) and the
    engine-core process use of an engine, with a fixed step period (see the module docstring)."""

    supports_output_filter = True

    def __init__(self, config, dp_index: int = 0):
        self.config = config
        self.detokenize = False
        self.tokenizer = None
        self.vocab_size = 151936
        self.max_model_len = int(config.max_model_len or 4096)
        self.device = "cpu"
        self.dtype = "bfloat16"
        self.eos_token_ids: list[int] = []
        self.routed_experts = None
        self.block_manager = SimpleNamespace(num_blocks=1 << 20)
        self.requests: dict[str, _Req] = {}
        self.waiting: list[_Req] = []
        self.last_step_request_ids: list[str] = []
        self.step_s = float(os.environ.get("API_STREAM_FAKE_STEP_MS", "10")) / 1e3
        self.prefill_tokens = int(os.environ.get("API_STREAM_FAKE_PREFILL_TOKENS", "16384"))
        self.max_seqs = int(os.environ.get("API_STREAM_FAKE_MAX_SEQS", "256"))
        self.lo = int(os.environ.get("API_STREAM_FAKE_TOKEN_LO", "3"))
        self.hi = int(os.environ.get("API_STREAM_FAKE_TOKEN_HI", "300"))
        self.rng = random.Random(dp_index)
        self.next_step = 0.0
        self.steps = 0

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params) -> None:
        if isinstance(prompt, str):
            raise ValueError("the fake engine takes token-id prompts only")
        req = _Req(request_id, list(prompt), params)
        self.requests[request_id] = req
        self.waiting.append(req)

    def abort_request(self, request_id):
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            for s in req.seqs:
                if s.finish_reason is None:
                    s.finish_reason = "abort"
            if req in self.waiting:
                self.waiting.remove(req)
        return []

    def abort_all(self):
        return self.abort_request(list(self.requests))

    def finish_sequences(self, request_id: str, indices, reason: str = "stop"):
        req = self.requests.get(request_id)
        if req is None:
            return []
        for s in req.seqs:
            if s.index in set(indices) and s.finish_reason is None:
                s.finish_reason = reason
        if req.finished:
            del self.requests[request_id]
        return []

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> None:
        pass

    def start_tokenizer_load(self) -> None:
        """Called by the engine-core process after its ready message (``LLMEngine``'s deferred
        tokenizer load, main 005cd7d): no tokenizer here (without it the core exited at start)."""

    @property
    def stats(self) -> dict:
        return {"num_running": len(self.requests) - len(self.waiting), "num_waiting": len(self.waiting),
                "kv_cache_usage": 0.0, "num_steps": self.steps}

    # ---- stepping ----------------------------------------------------------------------
    def step(self, outputs_for=()):
        """One step: wait for the step period, admit waiting requests within the prefill budget,
        add one token to every running sample. Returns the finished requests' (minimal) outputs."""
        now = time.monotonic()
        if self.next_step > now:
            time.sleep(self.next_step - now)
        self.next_step = max(now, self.next_step) + self.step_s
        self.steps += 1
        budget = self.prefill_tokens
        running = sum(1 for r in self.requests.values() if r.started)
        while self.waiting and running < self.max_seqs and budget >= len(self.waiting[0].prompt_token_ids):
            req = self.waiting.pop(0)
            budget -= len(req.prompt_token_ids)
            req.started = True
            running += 1
        touched, finished = [], []
        rand = self.rng.randint
        for rid, req in list(self.requests.items()):
            if not req.started:
                continue
            touched.append(rid)
            max_tokens = req.params.max_tokens
            for s in req.seqs:
                if s.finish_reason is not None:
                    continue
                s.output_token_ids.append(rand(self.lo, self.hi))
                s.sampled_logprobs.append(-1.0)
                if s.logprobs is not None:
                    s.logprobs.append({s.output_token_ids[-1]: -1.0})
                if len(s.output_token_ids) >= max_tokens:
                    s.finish_reason = "length"
            if req.finished:
                del self.requests[rid]
                finished.append(SimpleNamespace(request_id=rid, finished=True))
        self.last_step_request_ids = touched
        return finished

    def shutdown(self) -> None:
        self.requests.clear()


def install() -> None:
    """Make ``LLMEngine(config, dp_index=...)`` build a :class:`FakeEngine` in this process."""
    from rlserve.engine.core import llm_engine

    def new(cls, config, *args, **kwargs):
        return FakeEngine(config, kwargs.get("dp_index", 0))

    llm_engine.LLMEngine.__new__ = new
