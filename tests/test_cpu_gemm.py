"""The CPU team (rlserve/layers/cpu_gemm.py, csrc/cpu_team.c): its linear is float32-exact up to
summation order, and its bits depend on nothing but the row and the weight (row count, other rows,
team on or off, concurrent callers); its attention is the paged kernel's, bit for bit; an engine
with the team gives the greedy tokens of one without and really uses it."""

from __future__ import annotations

import threading

import pytest
import torch

from rlserve.layers import cpu_attention, cpu_gemm
from rlserve.models import llama_cpu

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="no C compiler: the CPU team cannot be built")


@pytest.fixture
def team():
    """A team of 2 in use for the test (restored after)."""
    prev = cpu_gemm.size()
    assert cpu_gemm.start(2).size == 2
    yield
    cpu_gemm.start(prev)


def _case(n_out, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_out, k, generator=g) * 0.05, torch.randn(n_out, generator=g)


@pytest.mark.parametrize("n_out,k", [(960, 576), (576, 1536), (37, 5), (100, 64), (200, 96)])
def test_linear_is_exact_up_to_summation_order(team, n_out, k):
    w, b = _case(n_out, k)
    packed = cpu_gemm.pack(w)
    assert packed.shape == (-(-n_out // 32), k, 32)
    for m in (1, 5, 13, 16, 18, 40):  # 13-18 rows: pair tiles (csrc/cpu_team_gemm.c: PAIR_MB)
        x = torch.randn(m, k)
        for bias in (None, b):
            got = cpu_gemm.linear(x, packed, n_out, bias)
            ref = (x.double() @ w.double().T + (0 if bias is None else bias.double()))
            # recursive float32 summation of k products (fused): |error| <= k 2^-24 sum |x||w|
            # (Higham, gamma_k), plus the bias add's half ulp of the result
            bound = k * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T) + 2.0 ** -24 * ref.abs()
            assert got.shape == (m, n_out) and got.dtype == torch.float32
            assert ((got.double() - ref).abs() <= bound + 1e-30).all()


def test_linear_bits_depend_only_on_the_row(team):
    """Batch-invariant by construction: a row alone, inside any batch, in a strided view, with
    the team on or off, and while another thread uses the team: the same bits."""
    w, b = _case(960, 576, seed=1)
    packed = cpu_gemm.pack(w)
    x = torch.randn(40, 576)
    full = cpu_gemm.linear(x, packed, 960, b)
    for i in (0, 7, 39):
        assert torch.equal(cpu_gemm.linear(x[i:i + 1], packed, 960, b), full[i:i + 1])
    assert torch.equal(cpu_gemm.linear(x[3:16], packed, 960, b), full[3:16])
    # 2-3 row blocks run k-piece by k-piece (csrc/cpu_team_gemm.c: KC), 4 blocks one pass each;
    # 13-18 rows in blocks of 6 over two panels at a time (pair tiles)
    for a, z in ((0, 24), (4, 29), (0, 36), (1, 38), (0, 16), (5, 21), (2, 20), (24, 37)):
        assert torch.equal(cpu_gemm.linear(x[a:z], packed, 960, b), full[a:z])
    wide = torch.randn(40, 700)
    wide[:, 50:626] = x
    assert torch.equal(cpu_gemm.linear(wide[:, 50:626], packed, 960, b), full)  # row stride 700
    cpu_gemm.start(1)
    assert torch.equal(cpu_gemm.linear(x, packed, 960, b), full)  # every chunk on the caller
    cpu_gemm.start(2)
    results = [None] * 4

    def call(i):
        for _ in range(20):
            results[i] = cpu_gemm.linear(x, packed, 960, b)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(torch.equal(r, full) for r in results)  # a busy team runs a caller's chunks inline


def test_linear_refuses_a_mismatched_weight(team):
    packed = cpu_gemm.pack(torch.randn(64, 16))
    with pytest.raises(ValueError, match="does not match"):
        cpu_gemm.linear(torch.randn(2, 17), packed, 64)
    with pytest.raises(ValueError, match="does not match"):
        cpu_gemm.linear(torch.randn(2, 16), packed, 100)


def test_attention_on_the_team_is_the_kernel_bit_for_bit(team):
    """One sequence per chunk through the same per-sequence code as the OpenMP entry point."""
    g = torch.Generator().manual_seed(2)
    B, H, Hkv, D, bs, nb = 11, 9, 3, 64, 16, 96
    kc, vc = torch.randn(nb, bs, Hkv, D, generator=g), torch.randn(nb, bs, Hkv, D, generator=g)
    lens = torch.randint(1, 8 * bs, (B,), generator=g, dtype=torch.int32)
    bt = torch.randperm(nb, generator=g).to(torch.int32)[: B * 8].reshape(B, 8).contiguous()
    q = torch.randn(B, H, D, generator=g)
    ref, got = torch.empty_like(q), torch.empty_like(q)
    fn = cpu_attention._load()
    assert fn is not None
    assert cpu_attention.call(fn, q, kc, vc, bt, lens, ref, H, Hkv, D, 0.125, 1) == 0
    assert cpu_gemm.paged_decode_call(q, kc, vc, bt, lens, got, H, Hkv, D, 0.125) == 0
    assert torch.equal(got, ref)
    assert cpu_gemm.paged_decode_call(q, kc, vc, bt, lens + 10_000, got, H, Hkv, D, 0.125) == 2  # past the table


def test_team_size_rule(monkeypatch):
    from rlserve import envs
    from rlserve.config import EngineConfig
    from rlserve.engine.cpu import cpu_threads

    monkeypatch.setattr(envs, "RLSERVE_CPU_TEAM", None)
    monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: 2)
    cfg = EngineConfig(model="x", device="cpu")
    assert cpu_threads.engine_team_size(cfg) == 2
    assert cpu_threads.engine_team_size(cfg, threads=2) == 1  # torch's OpenMP threads share the work instead
    assert cpu_threads.engine_team_size(cfg, ranks=2) == 1
    monkeypatch.setattr(envs, "RLSERVE_CPU_TEAM", 1)
    assert cpu_threads.engine_team_size(cfg) == 1
    cfg.extra["cpu_team"] = 3
    assert cpu_threads.engine_team_size(cfg) == 3
    cfg.extra["cpu_team"] = 0
    with pytest.raises(ValueError):
        cpu_threads.engine_team_size(cfg)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_with_the_team_gives_the_same_greedy_tokens(arch, tiny_model, monkeypatch):
    from rlserve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    prompts = [f"Team prompt {i}" + " more" * i for i in range(6)]
    path = tiny_model(arch)
    ref = LLM(path, dtype="float32", device="cpu", block_size=4, extra={"cpu_team": 1}).generate(prompts, params)
    calls = []
    real = cpu_gemm.linear
    monkeypatch.setattr(cpu_gemm, "linear", lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k))
    real_stack = llama_cpu.stack_forward  # a step's layers in one C call: the team's kernels there
    monkeypatch.setattr(llama_cpu, "stack_forward", lambda ctx, layers, h: calls.append(h.shape[0])
                        or real_stack(ctx, layers, h))
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, extra={"cpu_team": 2})
    assert cpu_gemm.size() == 2
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert 6 in calls and max(calls) > 6  # decode steps (6 rows), their LM head and the prefill used the team


def test_sixteen_sequences_on_the_team_give_hf_greedy_tokens(tiny_model, monkeypatch):
    """16 sequences at once: decode steps of 16 rows, the pair tiles' row count (csrc/cpu_team_gemm.c:
    PAIR_MB-row blocks over two panels), on the team of 2: HF transformers float32's greedy tokens."""
    from rlserve import LLM, SamplingParams
    from tests.test_engine import hf_greedy

    path = tiny_model("llama")
    prompts = [[3 + i, 5, 9 + i % 4, 2, 7 + i][: 2 + i % 4] for i in range(16)]
    calls = []
    real = cpu_gemm.linear
    monkeypatch.setattr(cpu_gemm, "linear", lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k))
    real_stack = llama_cpu.stack_forward
    monkeypatch.setattr(llama_cpu, "stack_forward", lambda ctx, layers, h: calls.append(h.shape[0])
                        or real_stack(ctx, layers, h))
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, extra={"cpu_team": 2})
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, min_tokens=8))
    assert [o.outputs[0].token_ids for o in got] == hf_greedy(path, prompts, 8)
    assert 16 in calls  # the decode steps of 16 rows ran on the team


def test_contention_guard_runs_steps_inline_after_a_losing_step(tiny_model, monkeypatch, caplog):
    """A team step that got fewer busy cores than MIN_CORES (here: any step, MIN_CORES huge)
    makes the next ones of its kind run inline on the calling thread, backing off 4, 8,
    ... steps, decode steps and the rest (the prefills) apart; tokens unchanged (the same kernel
    and bits either way). The first fallback is logged at info, once per engine."""
    import logging

    from rlserve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    prompts = [f"Guard {i}" for i in range(3)]
    path = tiny_model("llama")
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, extra={"cpu_team": 2})
    team = llm.engine.executor.runner.cpu_team
    assert team.size == 2
    ref = llm.generate(prompts, params)
    monkeypatch.setattr(cpu_gemm, "MIN_CORES", 1e9)
    for g in team.guards.values():
        g.skip, g.backoff = 0, cpu_gemm.MIN_BACKOFF
    team.logged = False
    inline_calls = []  # threads of each team call: linears (prefill, LM head) and decode stacks
    for name in ("linear", "decode_stack_call"):
        monkeypatch.setattr(cpu_gemm, name, lambda *a, _real=getattr(cpu_gemm, name), **k: inline_calls.append(
            cpu_gemm.current().threads_now()) or _real(*a, **k))
    before = cpu_gemm.guard_stats(team)
    with caplog.at_level(logging.INFO, logger="rlserve.layers.cpu_gemm"):
        got = llm.generate(prompts, params)
        got2 = llm.generate(prompts, params)
    after = cpu_gemm.guard_stats(team)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert [o.outputs[0].token_ids for o in got2] == [o.outputs[0].token_ids for o in ref]
    # per call: the prefill step ("other") and 11 decode steps. First call: the prefill measured
    # (prefills back off 4 steps of any kind, over by the fourth decode step); decode measured,
    # 4 inline, measured, 5 of 8 inline. Second call: the prefill measured (back-off 8); decode
    # 3 of 8 inline, measured, 7 of 16 inline
    assert after["lost"] - before["lost"] == after["steps"] - before["steps"] == 5
    assert after["inline"] - before["inline"] == 19
    assert set(inline_calls) == {1, 2}  # inline steps ran their team calls on the calling thread alone
    logged = [r for r in caplog.records if "CPU team: a step (" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.INFO  # once, though 5 steps lost


def test_guard_kinds_back_off_apart(team, monkeypatch):
    """A losing decode step sends the next decode steps inline, not the next prefill ("other")
    step, and the reverse: each kind backs off on its own losses (a single stream's batch-1
    decode step losing used to send its next prefill inline). A prefill's back-off runs out
    in steps of any kind (decode steps count), a decode step's in decode steps only."""
    monkeypatch.setattr(cpu_gemm, "MIN_CORES", 1e9)  # every measured step loses
    t = cpu_gemm.current()
    for kind, other in (("decode", "other"), ("other", "decode")):
        for g in t.guards.values():
            g.skip, g.backoff = 0, cpu_gemm.MIN_BACKOFF
        with cpu_gemm.step_guard(kind):
            assert t.threads_now() == 2  # measured, on the team
        assert t.guards[kind].skip == cpu_gemm.MIN_BACKOFF and t.guards[other].skip == 0
        with cpu_gemm.step_guard(other):
            assert t.threads_now() == 2  # the other kind still runs on the team
        with cpu_gemm.step_guard(kind):
            assert t.threads_now() == 1  # this kind backs off: inline
    # "other" lost last (back-off 4; the decode step and the inline prefill above spent 2): 2
    # decode steps (inline: decode lost too) use up the rest, and the next prefill runs on the team
    assert t.guards["other"].skip == cpu_gemm.MIN_BACKOFF - 2
    for _ in range(cpu_gemm.MIN_BACKOFF - 2):
        with cpu_gemm.step_guard("decode"):
            assert t.threads_now() == 1
    assert t.guards["other"].skip == 0 and t.guards["decode"].skip > 0
    with cpu_gemm.step_guard("other"):
        assert t.threads_now() == 2
    with pytest.raises(KeyError):
        with cpu_gemm.step_guard("prefill"):
            pass


@pytest.mark.parametrize("spin_is_busy", [True, False])
def test_guard_counts_the_spin_as_busy_or_not(team, monkeypatch, spin_is_busy):
    """cpu_gemm.SPIN_IS_BUSY: the workers' CPU counter here gains 10 s a step, all of it spin
    (the spin counter gains the same). Counted as busy, the step got far more than MIN_CORES
    cores and wins; not counted, only the calling thread's CPU is left, at most its wall time
    (one thread), below 1.5 cores: the step loses."""
    real = cpu_gemm._lib()
    ns = [0]

    def tick():
        ns[0] += 10 ** 10
        return ns[0]

    class Lib:  # the real library, with the worker CPU counter moved by the test
        def __getattr__(self, name):
            return getattr(real, name)

        rlserve_team_worker_cpu_ns = staticmethod(tick)

    monkeypatch.setattr(cpu_gemm, "_lib", lambda: Lib())
    monkeypatch.setattr(cpu_gemm, "sync_stats", lambda: {"jobs": 0, "wait_ns": 0, "spin_ns": tick(), "sleeps": 0})
    monkeypatch.setattr(cpu_gemm, "MIN_CORES", 1.5)
    monkeypatch.setattr(cpu_gemm, "SPIN_IS_BUSY", spin_is_busy)
    t = cpu_gemm.current()
    for g in t.guards.values():
        g.skip, g.backoff = 0, cpu_gemm.MIN_BACKOFF
    before = cpu_gemm.guard_stats(t)
    with cpu_gemm.step_guard("decode"):
        sum(range(10000))
    after = cpu_gemm.guard_stats(t)
    assert after["steps"] - before["steps"] == 1
    assert after["lost"] - before["lost"] == (0 if spin_is_busy else 1)


def test_team_state_is_per_engine(tiny_model, monkeypatch):
    """Two engines in one process: each keeps its own team size and guard (the one built last
    does not decide for the other), and each gives the tokens of a team-less engine."""
    from rlserve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6)
    prompts = [f"Per engine {i}" for i in range(4)]
    path = tiny_model("llama")
    two = LLM(path, dtype="float32", device="cpu", block_size=4, extra={"cpu_team": 2})
    one = LLM(path, dtype="float32", device="cpu", block_size=4, extra={"cpu_team": 1})  # built last
    t2, t1 = two.engine.executor.runner.cpu_team, one.engine.executor.runner.cpu_team
    assert (t2.size, t1.size) == (2, 1) and t2 is not t1
    sizes = {}
    real = cpu_gemm.linear

    def spy(x, *a, **k):
        sizes.setdefault(id(cpu_gemm.current()), set()).add(cpu_gemm.current().threads_now())
        return real(x, *a, **k)

    monkeypatch.setattr(cpu_gemm, "linear", spy)
    got2 = two.generate(prompts, params)
    got1 = one.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got2] == [o.outputs[0].token_ids for o in got1]
    assert id(t2) in sizes and id(t1) not in sizes  # the team-less engine never calls the team's linear
    assert 2 in sizes[id(t2)]  # the engine built first still ran on 2 threads
    assert t1.steps == t1.lost == 0 and t2.steps > 0  # guards: the team-less engine measured nothing


def test_a_late_worker_runs_no_chunk_of_the_next_job(team):
    """A worker that wakes for a job its caller already finished alone, while that caller is
    between publishing its next job and opening that job's ticket (``rlserve_team_test_pause_us``:
    a caller preempted there), must claim nothing: before the fix it read the next job's chunk
    count against the finished job's still-open ticket, ran the next job's chunks under the old
    generation and counted them in ``done``, so ``done`` ended above the job's chunk count (the
    caller could return while a worker still wrote into its output). The chunk count of the
    second job: 16 panels of 32 columns, cut in 8 chunks per team thread = 16 chunks."""
    import ctypes
    import time

    lib = cpu_gemm._lib()
    lib.rlserve_team_test_pause_us.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.rlserve_team_test_done.restype = ctypes.c_int64
    small_w, big_w = torch.randn(64, 8), torch.randn(16 * 32, 8)
    small, big = cpu_gemm.pack(small_w), cpu_gemm.pack(big_w)
    x = torch.randn(1, 8)
    try:
        dones = []
        for _ in range(4):
            lib.rlserve_team_test_pause_us(0, 10_000)  # the worker reads a job 10 ms after it sees it
            cpu_gemm.linear(x, small, 64)  # 2 chunks: both done by the caller meanwhile
            lib.rlserve_team_test_pause_us(40_000, 10_000)  # the worker reads while the caller waits
            got = cpu_gemm.linear(x, big, 16 * 32)
            lib.rlserve_team_test_pause_us(0, 0)
            time.sleep(0.03)  # a stray chunk would have been counted by now
            dones.append(lib.rlserve_team_test_done())
            # every output complete: within the float32 FMA chain's bound (Higham's gamma_K, K = 8)
            ref = x.double() @ big_w.double().T
            assert ((got.double() - ref).abs() <= 8 * 2.0 ** -24 * (x.double().abs() @ big_w.double().abs().T)).all()
    finally:
        lib.rlserve_team_test_pause_us(0, 0)
        lib.rlserve_team_start(0, cpu_gemm.DEFAULT_SPIN_US)
    assert dones == [16] * 4


def test_sync_stats_count_team_jobs_only(team):
    """``sync_stats``: a linear of 16 panels on the team is one job; one that runs on the caller
    alone (1 panel: one chunk) is none; the counters never go down."""
    packed = cpu_gemm.pack(torch.randn(16 * 32, 64))
    x = torch.randn(4, 64)
    s0 = cpu_gemm.sync_stats()
    for _ in range(3):
        cpu_gemm.linear(x, packed, 16 * 32)
    s1 = cpu_gemm.sync_stats()
    cpu_gemm.linear(x, cpu_gemm.pack(torch.randn(32, 64)), 32)
    s2 = cpu_gemm.sync_stats()
    assert s1["jobs"] - s0["jobs"] == 3 and s2["jobs"] == s1["jobs"]
    assert all(s1[k] >= s0[k] >= 0 for k in s0)


@pytest.mark.parametrize("n_out", [64, 70, 5])
def test_repack_in_place_equals_a_fresh_pack(n_out):
    """``pack(w, out=earlier)`` (a weight sync's repack) writes the earlier pack's memory and gives
    the same bits as a fresh pack, zero padding rows included; an ``out`` of another shape is
    ignored. The repack before this allocated fresh memory for every linear at every sync."""
    if not cpu_gemm.available():
        pytest.skip("the CPU team kernels are not built here")
    g = torch.Generator().manual_seed(n_out)
    first = cpu_gemm.pack(torch.randn(n_out, 48, generator=g))
    w = torch.randn(n_out, 48, generator=g)
    ptr = first.data_ptr()
    again = cpu_gemm.pack(w, out=first)
    assert again.data_ptr() == ptr and torch.equal(again, cpu_gemm.pack(w))
    other = torch.zeros(first.shape[0] + 1, 48, cpu_gemm.PANEL)  # another weight's shape
    assert cpu_gemm.pack(w, out=other).data_ptr() != other.data_ptr() and not other.any()
    layer = torch.nn.Module()
    layer.__dict__["_cpu_team_on"] = True
    cpu_gemm.build_team_weight(layer, w)
    kept = cpu_gemm.team_weight(layer).data_ptr()
    cpu_gemm.build_team_weight(layer, w * 2)
    assert cpu_gemm.team_weight(layer).data_ptr() == kept and torch.equal(cpu_gemm.team_weight(layer), cpu_gemm.pack(w * 2))
