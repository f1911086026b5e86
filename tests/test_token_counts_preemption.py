"""``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total`` count a preempted request once (session 25,
METRICS2): vLLM 0.32 counts a request's prompt with its first output only ("Track first scheduled prefill, not
post-preemption repeat prefills", ``vllm/v1/core/sched/scheduler.py``; ``Request.take_prefill_stats`` hands it out
once) and generation tokens as outputs carry them (a recompute re-runs the prefill, it emits no token again).

A KV cache too small for four 40-token requests at once (``test_engine.py``'s preemption case: greedy outputs are
the same) makes the engine preempt and recompute; the counts are those of the tokens the requests got, through
both counting paths: the engine-core process's (:class:`EngineCore` deltas into the API process's
:class:`OutputProcessor`) and a thread's (:meth:`EngineCore.take_token_counts`). In-process, no server: the same
four requests added at once are batched the same way every run (the engine is deterministic)."""

from __future__ import annotations

import pytest

from rlserve import LLM
from rlserve.engine.core.engine_core import EngineCore
from rlserve.engine.front.output_processor import OutputProcessor
from rlserve.engine.sampling_params import SamplingParams

PROMPTS = [[5, 17, 42, 9, 77, 3, 8, 11], [100, 101, 7, 8, 30, 31, 32, 33, 34, 35, 36, 37], [3], [60, 61, 62, 63]]
N_TOK = 40


class _Req:
    def __init__(self, params):
        self.params, self.stream, self.prompt, self.arrival_time = params, False, None, 0.0


def _small_engine(path):
    return LLM(path, dtype="float32", device="cpu", block_size=4, num_kv_blocks=30, max_model_len=120,
               enable_prefix_caching=False).engine


@pytest.mark.parametrize("deltas", [True, False], ids=["engine-core process", "thread"])
def test_a_preempted_request_is_counted_once(tiny_model, deltas):
    engine = _small_engine(tiny_model("qwen2"))
    core = EngineCore(engine, deltas=deltas)
    params = SamplingParams(temperature=0, max_tokens=N_TOK, min_tokens=N_TOK)
    counted = []
    proc = OutputProcessor(None, lambda gen, prompt: counted.append((gen, prompt)))
    reqs = {f"r{i}": _Req(params) for i in range(len(PROMPTS))}
    for rid, prompt in zip(reqs, PROMPTS):
        core.add(rid, prompt, params, stream=False)
    finished = set()
    while core.busy():
        items = core.step()
        if deltas:
            items = proc.process(items, reqs)[0]
        else:
            counted.append(core.take_token_counts())
        finished |= {o.request_id for o in items if o.finished}
    assert finished == set(reqs)
    assert engine.stats["num_preemptions"] > 0  # (else this test shows nothing: the cache must be too small)
    assert sum(g for g, _ in counted) == len(PROMPTS) * N_TOK
    assert sum(p for _, p in counted) == sum(len(p) for p in PROMPTS)  # once each, not again after the recompute
    # the recomputes did run the prompts again (vLLM's prompt counter does not count them)
    assert engine.stats["prefill_tokens_computed"] > sum(len(p) for p in PROMPTS)
