"""CPU micro-batches (rlserve/engine/cpu/cpu_microbatch.py): a decode step's rows split over threads
must give bit-equal results, keep order, surface errors without hanging, and back off when a
thread's core is shared."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from rlserve.engine.cpu import cpu_microbatch as mbm
from rlserve.engine.cpu.cpu_microbatch import CPUMicroBatches
from rlserve.layers import cpu_gemm
from rlserve.layers.attention import AttentionMetadata


@pytest.fixture(autouse=True)
def _no_cpu_team():
    """Micro-batches alone: steps of up to cpu_gemm.MAX_ROWS rows run whole on a CPU team (an
    engine built earlier in this process may have started one)."""
    prev = cpu_gemm.size()
    cpu_gemm.start(1)
    yield
    cpu_gemm.start(prev)


def test_plan_balances_contiguous_ranges_by_cost():
    mb = CPUMicroBatches(2, min_rows=2)
    assert mb.plan([1.0] * 16) == [(0, 8), (8, 16)]
    assert mb.plan([9.0, 1, 1, 1, 1, 1, 1, 1, 1, 1]) == [(0, 1), (1, 10)]  # cost 9 | 9
    assert mb.plan([0.0] * 4) == [(0, 2), (2, 4)]  # no cost information: equal rows
    assert mb.plan([100.0, 0.0]) == [(0, 1), (1, 2)]  # every micro-batch keeps at least one row
    assert CPUMicroBatches(3, min_rows=2).plan([1.0] * 7) == [(0, 3), (3, 5), (5, 7)]
    assert CPUMicroBatches(3, min_rows=2).plan([1.0, 1.0]) == [(0, 1), (1, 2)]


def test_plan_declines_small_steps_and_one_microbatch():
    assert CPUMicroBatches(2, min_rows=16).plan([1.0] * 15) is None
    assert CPUMicroBatches(2, min_rows=16).plan([1.0] * 16) == [(0, 8), (8, 16)]
    assert CPUMicroBatches(1, min_rows=2).plan([1.0] * 64) is None
    assert CPUMicroBatches(2, min_rows=16).plan([100.0, 300.0], rows=400) == [(0, 1), (1, 2)]  # 2 prompts
    assert CPUMicroBatches(2, min_rows=16).plan([1.0], rows=400) is None  # one sequence cannot be split
    with pytest.raises(ValueError, match=">= 1"):
        CPUMicroBatches(0)


def test_min_rows_from_the_environment(monkeypatch):
    monkeypatch.setenv("RLSERVE_CPU_MICROBATCH_MIN_ROWS", "40")
    assert CPUMicroBatches(2).min_rows == 40
    monkeypatch.setenv("RLSERVE_CPU_MICROBATCH_MIN_ROWS", "1")
    assert CPUMicroBatches(2).min_rows == 2  # a split needs two rows
    monkeypatch.setenv("RLSERVE_CPU_MICROBATCH_MIN_ROWS", "abc")
    with pytest.raises(ValueError, match="RLSERVE_CPU_MICROBATCH_MIN_ROWS must be an integer, got 'abc'"):
        CPUMicroBatches(2)


def test_run_keeps_order_uses_another_thread_and_caller_modes():
    mb = CPUMicroBatches(3, min_rows=2)
    seen = {}

    def fn(a, b):
        seen[(a, b)] = (threading.current_thread().name, torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        return list(range(a, b))

    with torch.inference_mode():
        out = mb.run(fn, [(0, 2), (2, 5), (5, 6)])
    assert out == [[0, 1], [2, 3, 4], [5]]
    assert seen[(0, 2)][0] == threading.current_thread().name
    assert {seen[(2, 5)][0], seen[(5, 6)][0]} == {"rlserve-cpu-microbatch-1", "rlserve-cpu-microbatch-2"}
    assert all(v[1:] == (True, False) for v in seen.values())  # inference mode carried over
    with torch.no_grad():
        mb.run(fn, [(0, 1), (1, 2)])
    assert seen[(1, 2)][1:] == (False, False)
    mb.close()


@pytest.mark.parametrize("failing", [0, 1])
def test_an_error_in_any_microbatch_is_raised_after_all_finish(failing):
    mb = CPUMicroBatches(2, min_rows=2)
    finished = []

    def fn(a, b):
        if a == failing:
            raise RuntimeError(f"boom in rows {a}:{b}")
        finished.append(a)
        return a

    with pytest.raises(RuntimeError, match=f"boom in rows {failing}:"):
        mb.run(fn, [(0, 1), (1, 2)])
    assert finished == [1 - failing]  # the other micro-batch ran to its end before the raise
    assert mb.run(lambda a, b: a * 10, [(0, 1), (1, 2)]) == [0, 10]  # still usable, nothing hangs
    mb.close()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs sched_setaffinity and 2 usable CPUs")
def test_a_split_keeps_the_threads_on_different_cpus():
    mb = CPUMicroBatches(2, min_rows=2)
    before = os.sched_getaffinity(0)
    masks = mb.run(lambda a, b: os.sched_getaffinity(0), [(0, 1), (1, 2)])
    assert len(masks[0]) == 1 and masks[0] <= before  # the caller stays on its CPU ...
    assert masks[1] == before - masks[0]  # ... and the micro-batch thread may use only the others
    assert os.sched_getaffinity(0) == before  # restored after the join
    mb.close()


def test_split_asks_its_veto_only_for_a_step_it_would_split():
    mb = CPUMicroBatches(2, min_rows=4)
    asked = []

    def veto(answer):
        return lambda: asked.append(answer) or answer

    fn = lambda a, b: torch.arange(a, b)  # noqa: E731
    with mbm.active(mb):
        assert mbm.split(fn, [1.0] * 3, veto=veto(False)) is None and asked == []  # under min_rows
        assert mbm.split(fn, [1.0] * 4, veto=veto(True)) is None and asked == [True]  # vetoed: whole
        assert mbm.split(fn, [1.0] * 4, veto=veto(False)).tolist() == [0, 1, 2, 3] and asked == [True, False]
    assert mbm.split(fn, [1.0] * 4, veto=veto(False)) is None and asked == [True, False]  # none current
    mb.close()


def test_a_busy_instance_runs_the_step_inline():
    mb = CPUMicroBatches(2, min_rows=2)
    with mb._busy:  # another step is running
        assert mb.run(lambda a, b: threading.current_thread().name, [(0, 1), (1, 2)]) == \
            [threading.current_thread().name] * 2


def test_contention_backs_off_doubling_then_resets():
    mb = CPUMicroBatches(2, min_rows=2)
    costs = [1.0] * 4
    assert mb.record([0.10, 0.10], [0.10, 0.095]) is False  # both threads had a core: 0.1 * 1.25 < 0.195
    assert mb.record([0.15, 0.15], [0.10, 0.10]) is False  # each 2/3 of a core: 0.1875 < 0.2, still a win
    assert mb.record([0.10, 0.20], [0.10, 0.10]) is True  # the second at half speed: 0.25 > 0.2
    assert [mb.plan(costs) for _ in range(mbm.MIN_BACKOFF)] == [None] * mbm.MIN_BACKOFF
    assert mb.plan(costs) == [(0, 2), (2, 4)]
    assert mb.record([0.30, 0.10], [0.10, 0.10]) is True  # again: twice as long
    assert [mb.plan(costs) for _ in range(2 * mbm.MIN_BACKOFF)] == [None] * (2 * mbm.MIN_BACKOFF)
    assert mb.plan(costs) is not None
    assert mb.record([0.1, 0.1], [0.1, 0.1]) is False
    assert mb.record([0.1, 0.2], [0.1, 0.1]) is True  # reset after the clean step: MIN_BACKOFF again
    assert sum(mb.plan(costs) is None for _ in range(4 * mbm.MIN_BACKOFF)) == mbm.MIN_BACKOFF
    assert mb.stats == {"splits": 6, "skipped": 4 * mbm.MIN_BACKOFF, "lost": 3}
    for _ in range(20):
        mb.record([1.0, 9.0], [1.0, 1.0])
    assert mb._backoff == mbm.MAX_BACKOFF


def test_microbatch_count_rule_and_overrides(monkeypatch):
    from rlserve.config import EngineConfig
    from rlserve.engine.cpu import cpu_threads

    monkeypatch.delenv("RLSERVE_CPU_MICROBATCHES", raising=False)
    monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: 2)
    cfg = EngineConfig(model="x", device="cpu")
    assert mbm.microbatch_count(cfg, threads=1) == 2
    assert mbm.microbatch_count(cfg, threads=2) == 1  # intra-op threads already use the cores
    assert mbm.microbatch_count(cfg, threads=1, ranks=2) == 1  # DP replicas / TP ranks share the machine
    monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: 1)
    assert mbm.microbatch_count(cfg, threads=1) == 1
    monkeypatch.setenv("RLSERVE_CPU_MICROBATCHES", "3")
    assert mbm.microbatch_count(cfg, threads=1) == 3
    cfg.extra["cpu_microbatches"] = 1
    assert mbm.microbatch_count(cfg, threads=1) == 1
    for bad in ("0", "two", "-1"):
        cfg.extra["cpu_microbatches"] = bad
        with pytest.raises(ValueError, match="cpu_microbatches"):
            mbm.microbatch_count(cfg)


@pytest.mark.parametrize("env,value,msg", [
    ("RLSERVE_CPU_MICROBATCHES", "0", "RLSERVE_CPU_MICROBATCHES must be an integer >= 1, got '0'"),
    ("RLSERVE_CPU_MICROBATCHES", "two", "RLSERVE_CPU_MICROBATCHES must be an integer >= 1, got 'two'"),
    ("RLSERVE_CPU_MICROBATCH_MIN_ROWS", "abc", "RLSERVE_CPU_MICROBATCH_MIN_ROWS must be an integer, got 'abc'"),
])
def test_serve_refuses_a_bad_setting_before_any_engine(tiny_model, monkeypatch, capsys, env, value, msg):
    """``rlserve serve`` checks the CPU settings before it starts an engine: one line of error
    on stderr, exit status 2, no traceback (an engine process used to raise after loading)."""
    from rlserve.cli import main

    monkeypatch.setenv(env, value)
    assert main(["serve", tiny_model("llama"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"rlserve serve: error: {msg}" in err and "Traceback" not in err, err
    monkeypatch.delenv(env)
    mbm.check_environment()  # the defaults pass


def test_sequences_slices_a_step():
    meta = AttentionMetadata.build([1, 1, 1], [5, 9, 2], [[3, 4], [5, 6, 7], [8]], 4)
    sub = meta.sequences(1, 3)
    assert sub.slot_mapping.tolist() == [7 * 4 + 0, 8 * 4 + 1]  # positions 8 and 1
    assert sub.seq_lens.tolist() == [9, 2] and sub.seq_lens_cpu == [9, 2] and sub.max_seq_len == 9
    assert sub.query_start_loc.tolist() == [0, 1, 2] and sub.query_start_loc_cpu == [0, 1, 2]
    assert sub.block_tables.tolist() == [[5, 6, 7], [8, 0, 0]] and sub.block_size == 4 and sub.max_query_len == 1
    mixed = AttentionMetadata.build([3, 1, 2], [3, 9, 6], [[3], [5, 6, 7], [8, 9]], 4)  # prefill, decode, chunk
    tail = mixed.sequences(1, 3)
    assert tail.slot_mapping.tolist() == [7 * 4 + 0, 9 * 4 + 0, 9 * 4 + 1]  # rows 3:6 of the step
    assert tail.query_start_loc.tolist() == [0, 1, 3] and tail.query_start_loc_cpu == [0, 1, 3]
    assert tail.max_query_len == 2 and tail.seq_lens_cpu == [9, 6]
    head = mixed.sequences(0, 1)
    assert head.slot_mapping.tolist() == [12, 13, 14] and head.max_query_len == 3 and head.max_seq_len == 3
    for a, b in ((2, 2), (-1, 1), (0, 4)):
        with pytest.raises(ValueError, match="sequences"):
            meta.sequences(a, b)


def test_writes_shared_block_finds_same_step_prefix_hits():
    # sequence 0 prefills blocks 3, 4; sequence 1 hit block 3 (prefix cache) and prefills block 5
    same_step_hit = AttentionMetadata.build([8, 4], [8, 8], [[3, 4], [3, 5]], 4)
    assert same_step_hit.writes_shared_block()
    # a hit on a block computed in an earlier step (no one writes it now) is fine
    earlier_hit = AttentionMetadata.build([4, 4], [8, 8], [[3, 4], [3, 5]], 4)
    assert not earlier_hit.writes_shared_block()
    decode = AttentionMetadata.build([1, 1, 1], [5, 9, 2], [[3, 4], [3, 6, 7], [8]], 4)
    assert not decode.writes_shared_block()  # block 3 is shared but only read
    assert AttentionMetadata.build([1, 1], [4, 6], [[3], [3, 7]], 4).writes_shared_block()  # both touch 3


def test_prefix_hits_in_the_same_step_stay_correct(tiny_model):
    """n samples of one prompt (prefix-cache hits on blocks computed in the same step) and
    distinct prompts together: the same tokens with micro-batches as without."""
    from rlserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=4, logprobs=2, n=3)
    prompts = ["one shared prompt of several blocks of tokens"] * 4 + [f"other {i}" for i in range(4)]
    path = tiny_model("llama")
    ref, _ = _generate(path, 1, prompts, params)
    got, runner = _generate(path, 2, prompts, params)
    assert runner.microbatches.stats["splits"] >= 3
    for a, b in zip(got, ref):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert [o.logprobs for o in a.outputs] == [o.logprobs for o in b.outputs]


def _generate(path, microbatches: int, prompts, params):
    from rlserve import LLM

    llm = LLM(path, dtype="float32", device="cpu", block_size=4, extra={"cpu_microbatches": microbatches, "cpu_team": 1})
    runner = llm.engine.executor.runner
    if runner.microbatches is not None:  # split every step, whatever else runs on the machine
        runner.microbatches.min_rows = 2
        runner.microbatches.split_cpu_overhead = 0.0
    return llm.generate(prompts, params), runner


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_microbatched_decode_is_bit_equal(arch, tiny_model):
    """Greedy tokens and logprobs of a tiny model with 2 and 3 micro-batches equal one micro-batch
    bit for bit (prefill of prompts of several lengths, decode), and the steps and the LM head
    really were split."""
    from rlserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6, logprobs=3)
    prompts = [f"Prompt number {i} says" + " more" * (i % 5) for i in range(7)]
    path = tiny_model(arch)
    ref, runner = _generate(path, 1, prompts, params)
    assert runner.microbatches is None
    for n in (2, 3):
        got, runner = _generate(path, n, prompts, params)
        assert runner.microbatches.stats["splits"] >= 5  # 5 decode steps and their LM heads
        for a, b in zip(got, ref):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].logprobs == b.outputs[0].logprobs  # bit-equal, not close


def test_microbatched_decode_with_the_attention_fallback(tiny_model, monkeypatch):
    """When the native attention kernel refuses a micro-batch, the layer's own attention runs on
    that micro-batch's metadata (``AttentionMetadata.sequences``): still the same tokens."""
    from rlserve import SamplingParams
    from rlserve.layers import cpu_attention

    params = SamplingParams(temperature=0, max_tokens=5, min_tokens=5, logprobs=2)
    prompts = [f"Fallback {i}" + " x" * i for i in range(6)]
    path = tiny_model("llama")
    ref, _ = _generate(path, 1, prompts, params)
    monkeypatch.setattr(cpu_attention, "call", lambda *a, **k: 1)  # the kernel refuses every call
    got, runner = _generate(path, 2, prompts, params)
    assert runner.microbatches.stats["splits"] >= 4
    for a, b in zip(got, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):  # another attention kernel
            assert la.keys() == lb.keys()
            for tok in la:  # float32 attention in another summation order: ~1e-6 (tolerance 1e-4)
                assert abs(la[tok] - lb[tok]) < 1e-4
