"""Scheduler policy: prefill steps and decode steps alternate while requests wait
(``max_consecutive_prefill_steps``, default 1; 0 = prefill steps first without bound), and a
burst of equal requests therefore finishes staggered instead of in one step."""

import pytest

from rlserve.config import EngineConfig
from rlserve.engine.core.block_manager import BlockManager
from rlserve.engine.sampling_params import SamplingParams
from rlserve.engine.core.scheduler import Scheduler
from rlserve.errors import InvalidRequestError


def _seqs(n: int, length: int = 4):
    from rlserve.engine.core.sequence import Sequence

    return [Sequence(f"r{i}", 0, [10 * i + j for j in range(length)], SamplingParams(max_tokens=100), 4)
            for i in range(n)]


def _run(sch: Scheduler, steps: int) -> list[tuple[str, list[str]]]:
    """``steps`` schedules, each step's sequences advanced by one token as the engine would.
    Returns ``("P" | "D", request ids)`` per step."""
    out = []
    for _ in range(steps):
        batch = sch.schedule()
        for s in batch.seqs:
            s.num_computed_tokens = len(s)
            s.output_token_ids.append(1)
        out.append(("P" if batch.is_prefill else "D", [s.request_id for s in batch.seqs]))
    return out


def _scheduler(limit: int | None) -> Scheduler:
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    kw = {} if limit is None else {"max_consecutive_prefill_steps": limit}
    return Scheduler(bm, max_num_seqs=16, max_num_batched_tokens=8, **kw)  # two 4-token prompts per step


def test_default_alternates_prefill_and_decode_steps_while_requests_wait():
    sch = _scheduler(None)
    assert sch.max_consecutive_prefill_steps == 1
    for s in _seqs(6):
        sch.add(s)
    assert _run(sch, 7) == [
        ("P", ["r0", "r1"]), ("D", ["r0", "r1"]),
        ("P", ["r2", "r3"]), ("D", ["r0", "r1", "r2", "r3"]),
        ("P", ["r4", "r5"]), ("D", ["r0", "r1", "r2", "r3", "r4", "r5"]),
        ("D", ["r0", "r1", "r2", "r3", "r4", "r5"]),
    ]


def test_zero_runs_every_prefill_first():
    sch = _scheduler(0)
    for s in _seqs(6):
        sch.add(s)
    assert _run(sch, 4) == [("P", ["r0", "r1"]), ("P", ["r2", "r3"]), ("P", ["r4", "r5"]),
                            ("D", ["r0", "r1", "r2", "r3", "r4", "r5"])]


def test_two_prefill_steps_in_a_row_then_a_decode_step():
    sch = _scheduler(2)
    for s in _seqs(8):
        sch.add(s)
    kinds = [k for k, _ in _run(sch, 7)]
    assert kinds == ["P", "P", "D", "P", "P", "D", "D"]


def test_a_request_arriving_after_a_decode_step_is_prefilled_next():
    sch = _scheduler(None)
    a, b = _seqs(2)
    sch.add(a)
    assert _run(sch, 3) == [("P", ["r0"]), ("D", ["r0"]), ("D", ["r0"])]
    sch.add(b)  # arrives while r0 decodes: the next step is its prefill
    assert _run(sch, 3) == [("P", ["r1"]), ("D", ["r0", "r1"]), ("D", ["r0", "r1"])]


def test_bad_limit_is_refused():
    with pytest.raises(ValueError, match="max_consecutive_prefill_steps must be >= 0"):
        Scheduler(BlockManager(4, 4), 4, 8, max_consecutive_prefill_steps=-1)
    with pytest.raises(InvalidRequestError, match="max_consecutive_prefill_steps"):
        EngineConfig("unused", max_consecutive_prefill_steps=-1)


def _finish_steps(path: str, limit: int) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Six 8-token prompts (two per 16-token prefill step), 5 greedy tokens each: the step
    each request finished in, and its tokens."""
    from rlserve.engine.core.llm_engine import LLMEngine

    eng = LLMEngine(EngineConfig(path, dtype="float32", device="cpu", max_num_batched_tokens=16,
                                 max_consecutive_prefill_steps=limit, enable_prefix_caching=False))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for i in range(6):
        eng.add_request(f"r{i}", [3 + i + j for j in range(8)], params)
    finished, tokens, step = {}, {}, 0
    while eng.has_unfinished_requests():
        step += 1
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = step
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return finished, tokens


def test_engine_burst_finishes_staggered_with_the_same_tokens(tiny_model):
    path = tiny_model("llama")
    lockstep, tok0 = _finish_steps(path, 0)
    staggered, tok1 = _finish_steps(path, 1)
    # prefill-first: 3 prefill steps, then 4 decode steps in which all six run: one finish step
    assert lockstep == {f"r{i}": 7 for i in range(6)}
    # alternating: P D P D P D D D D -- each pair starts decoding one decode step after the one
    # before, and finishes one step after it
    assert staggered == {"r0": 7, "r1": 7, "r2": 8, "r3": 8, "r4": 9, "r5": 9}
    assert tok1 == tok0 and all(len(t) == 5 for t in tok0.values())


def test_engine_default_is_no_bound_on_cpu(tiny_model):
    from rlserve.engine.core.llm_engine import LLMEngine

    cfg = EngineConfig(tiny_model("llama"), dtype="float32", device="cpu")
    assert cfg.max_consecutive_prefill_steps is None  # resolved by the engine, per device
    eng = LLMEngine(cfg)
    assert cfg.max_consecutive_prefill_steps == 0 and eng.scheduler.max_consecutive_prefill_steps == 0


# --- the prefill budget while sequences decode (issue 37, session 15) ---

def _streamed(seqs):
    for s in seqs:
        s.streamed = True  # as EngineCore.add marks a streamed request's sequences
    return seqs


def _budget_scheduler(**kw) -> Scheduler:
    """16 tokens a step (four 4-token prompts) with nothing running, 8 sequences at most."""
    return Scheduler(BlockManager(64, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=16,
                     **kw)


def test_default_prefill_budget_while_decoding_is_2048_at_most_max_num_batched_tokens():
    from rlserve.engine.core.scheduler import DECODING_PREFILL_TOKENS

    assert DECODING_PREFILL_TOKENS == 2048
    sch = Scheduler(BlockManager(64, 4), max_num_seqs=256, max_num_batched_tokens=8192)
    assert sch.prefill_budget() == 8192  # nothing running
    sch.running = _streamed(_seqs(1))
    assert sch.prefill_budget() == 2048
    sch.running = _streamed(_seqs(240))
    assert sch.prefill_budget() == 2048
    sch.running = _seqs(240)  # none streamed (the offline LLM, plain completions): no stall to bound
    assert sch.prefill_budget() == 8192
    sch.running = _seqs(239) + _streamed(_seqs(1))
    assert sch.prefill_budget() == 2048
    small = Scheduler(BlockManager(64, 4), max_num_seqs=256, max_num_batched_tokens=1024)  # the CPU default
    small.running = _streamed(_seqs(240))
    assert small.prefill_budget() == 1024


def test_default_burst_of_512_token_prompts_while_one_decodes():
    """Issue 37's workload in small: 512-token prompts; with one sequence decoding, 4 prompts (2048
    tokens) a prefill step instead of 16 (8192), prefill and decode steps alternating."""
    from rlserve.engine.core.sequence import Sequence

    sch = Scheduler(BlockManager(4096, 16, enable_prefix_caching=False), max_num_seqs=256,
                    max_num_batched_tokens=8192)
    seqs = _streamed([Sequence(f"r{i}", 0, [1 + i] * 512, SamplingParams(max_tokens=100), 16) for i in range(17)])
    sch.add(seqs[0])
    _run(sch, 1)
    for s in seqs[1:]:
        sch.add(s)
    steps = _run(sch, 4)
    assert [(k, len(ids)) for k, ids in steps] == [("D", 1), ("P", 4), ("D", 5), ("P", 4)]


def test_fixed_prefill_budget_while_decoding():
    sch = _budget_scheduler(max_prefill_tokens_while_decoding=4)
    for s in _streamed(_seqs(6)):
        sch.add(s)
    assert [ids for _, ids in _run(sch, 6)] == [["r0", "r1", "r2", "r3"], ["r0", "r1", "r2", "r3"],
                                              ["r4"], ["r0", "r1", "r2", "r3", "r4"], ["r5"],
                                              ["r0", "r1", "r2", "r3", "r4", "r5"]]
    # = max_num_batched_tokens: the policy before session 15 (four prompts a step while others decode)
    old = _budget_scheduler(max_prefill_tokens_while_decoding=16)
    for s in _streamed(_seqs(8)):
        old.add(s)
    assert [ids for _, ids in _run(old, 3)][2] == ["r4", "r5", "r6", "r7"]


def test_a_prompt_longer_than_the_budget_runs_alone():
    from rlserve.engine.core.sequence import Sequence

    sch = _budget_scheduler(max_prefill_tokens_while_decoding=4)
    sch.add(_streamed(_seqs(1))[0])
    _run(sch, 2)
    sch.add(Sequence("long", 0, list(range(100, 112)), SamplingParams(max_tokens=100), 4))
    sch.add(Sequence("short", 0, [7, 8], SamplingParams(max_tokens=100), 4))
    assert _run(sch, 3) == [("P", ["long"]), ("D", ["r0", "long"]), ("P", ["short"])]


def test_bad_prefill_budget_is_refused():
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding must be >= 1"):
        Scheduler(BlockManager(4, 4), 4, 8, max_prefill_tokens_while_decoding=0)
    with pytest.raises(InvalidRequestError, match="max_prefill_tokens_while_decoding must be >= 1"):
        EngineConfig("unused", max_prefill_tokens_while_decoding=0)


def test_engine_and_cli_pass_the_budget(tiny_model):
    from rlserve.cli.serve import engine_config_from_args
    from rlserve.engine.core.llm_engine import LLMEngine
    from rlserve.cli import build_parser

    eng = LLMEngine(EngineConfig(tiny_model("llama"), dtype="float32", device="cpu",
                                 max_prefill_tokens_while_decoding=32))
    assert eng.scheduler.max_prefill_tokens_while_decoding == 32
    args = build_parser().parse_args(["serve", "m", "--max-prefill-tokens-while-decoding", "512"])
    assert engine_config_from_args(args, "m").max_prefill_tokens_while_decoding == 512
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--max-prefill-tokens-while-decoding", "0"])


def test_engine_core_marks_a_streamed_requests_sequences(tiny_model):
    from rlserve.engine.core.engine_core import EngineCore
    from rlserve.engine.core.llm_engine import LLMEngine

    core = EngineCore(LLMEngine(EngineConfig(tiny_model("llama"), dtype="float32", device="cpu")), 0, 0)
    core.add("s", [3, 4, 5], SamplingParams(max_tokens=2, n=2), stream=True)
    core.add("p", [3, 4, 5], SamplingParams(max_tokens=2), stream=False)
    assert [q.streamed for q in core.engine.requests["s"].seqs] == [True, True]
    assert [q.streamed for q in core.engine.requests["p"].seqs] == [False]
