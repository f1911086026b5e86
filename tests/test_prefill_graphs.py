"""Piecewise prefill graphs (``RLSERVE_PREFILL_CUDA_GRAPHS``, :mod:`rlserve.engine.worker.prefill_graphs`)
on CPU: the pieces run as plain calls on the buckets' static buffers (``emulate``; the capture itself
needs a GPU: ``benchmarks/device/s18_prefill.sh``), which checks the cut of the layer stack, the padding
rows and the buffer plumbing. Greedy tokens equal Hugging Face float32 and the eager engine's, logprobs
within tests/test_engine.py's 1e-4, for whole prompts, chunks, prefix hits and mixed steps; steps past
the largest bucket run eagerly."""

from types import SimpleNamespace

import pytest
import torch

from rlserve import LLM
from rlserve.engine.worker import prefill_graphs as pg
from tests.test_chunked_prefill import LP_ATOL, _greedy, _prompts, _tokens_lps
from tests.test_engine import hf_greedy

SIZES = [16, 40]


def test_parse_sizes():
    assert pg.parse_sizes(None, 8192) == [] and pg.parse_sizes("0", 8192) == [] and pg.parse_sizes("", 64) == []
    assert pg.parse_sizes("1", 8192) == list(pg.DEFAULT_SIZES)
    assert pg.parse_sizes("1", 1000) == [256, 512, 1000]
    assert pg.parse_sizes("2048, 512,512", 4096) == [512, 2048]
    with pytest.raises(ValueError, match="RLSERVE_PREFILL_CUDA_GRAPHS"):
        pg.parse_sizes("512,x", 4096)
    with pytest.raises(ValueError):
        pg.parse_sizes("-4", 4096)
    assert pg.parse_sizes([40, 16], 32) == [16, 32]  # (the list form of extra["prefill_cuda_graph_sizes"])
    with pytest.raises(ValueError, match=r"^extra\['prefill_cuda_graph_sizes'\]: every item must be an integer >= 1"):
        pg.parse_sizes([16, 0], 64, "extra['prefill_cuda_graph_sizes']")


@pytest.mark.parametrize("name", ["RLSERVE_CUDA_GRAPH_SIZES", "RLSERVE_PREFILL_CUDA_GRAPHS"])
@pytest.mark.parametrize("bad", ["64,0", "1,-8", "abc", "16,x", ",", "2.5"])
def test_graph_size_lists_refuse_bad_items_naming_the_variable(monkeypatch, name, bad):
    """Both comma lists go through one parser (rlserve.envs.positive_int_list): a bad item is a
    ValueError naming the variable at the read, as for every other variable. The decode sizes'
    read dropped items below 1 silently ("64,0" read as 64) and failed later on others (int()'s
    message, no variable named); the prefill buckets' was only checked when the graphs were built."""
    from rlserve import envs

    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=f"^{name}") as e:
        envs.read(name)
    assert repr(bad.split(",")[-1].strip() or bad) in str(e.value) or "list of integers" in str(e.value), str(e.value)


def test_graph_size_lists_read(monkeypatch):
    from rlserve import envs

    monkeypatch.setenv("RLSERVE_CUDA_GRAPH_SIZES", "1, 64,256,")
    assert envs.RLSERVE_CUDA_GRAPH_SIZES == [1, 64, 256]
    for raw, value in (("1", "1"), ("0", None), ("512, 2048", [512, 2048])):
        monkeypatch.setenv("RLSERVE_PREFILL_CUDA_GRAPHS", raw)
        assert envs.RLSERVE_PREFILL_CUDA_GRAPHS == value
        assert pg.parse_sizes(envs.RLSERVE_PREFILL_CUDA_GRAPHS, 1024) == pg.parse_sizes(raw, 1024)


def _llm(path, graphs: bool, device: str = "cpu", **kw):
    """float32 engine on ``device``; ``graphs``: piecewise prefill graphs of :data:`SIZES` (emulated on the
    CPU, captured on CUDA), else off (``"0"``, the way out of the CUDA default). Block size 8 on the CPU, 16 on CUDA (the Triton kernels' smallest), where the
    cache is 256 blocks."""
    extra = {"prefill_cuda_graph_sizes": SIZES if graphs else "0"}  # (on CUDA the default is on: "0" for eager)
    if graphs and device == "cpu":
        extra["prefill_cuda_graphs_emulate"] = True
    kw = {"block_size": 8 if device == "cpu" else 16, "max_num_batched_tokens": 64, **kw}
    if device != "cpu":  # a fixed cache: the reference engine is still alive when the graphs' one starts (a
        kw.setdefault("num_kv_blocks", 256)  # sized cache took 0.9 of the card: session 20's H100 run)
    return LLM(path, dtype="float32", device=device, extra=extra, **kw)


def count_runs(monkeypatch) -> list:
    """Record the token count of each step the piecewise graphs run."""
    seen = []
    real = pg.PrefillCUDAGraphs.run

    def run(self, input_ids, positions, meta):
        seen.append(input_ids.shape[0])
        return real(self, input_ids, positions, meta)

    monkeypatch.setattr(pg.PrefillCUDAGraphs, "run", run)
    return seen


@pytest.fixture(scope="module")
def qwen3(tiny_model):
    return tiny_model("qwen3")


def check_greedy_equals_hf_and_eager(path, chunked, monkeypatch, device="cpu"):
    """Whole prompts (unchunked: steps of 35 tokens, bucket 40; 14, bucket 16; 45, past every bucket:
    eager) or 20-token chunks replay the graphs; greedy tokens equal the eager engine's and HF's, logprobs
    within :data:`LP_ATOL`. Also run on CUDA by tests/gpu/test_prefill_graphs_gpu.py."""
    prompts = _prompts(0, [30, 5, 14, 45])
    kw = {"enable_chunked_prefill": chunked, "max_num_batched_tokens": 48 if not chunked else 20}
    want, want_lps = _tokens_lps(_llm(path, False, device, **kw).generate(prompts, _greedy()))
    llm = _llm(path, True, device, **kw)
    seen = count_runs(monkeypatch)
    got, got_lps = _tokens_lps(llm.generate(prompts, _greedy()))
    runner = llm.engine.executor.runner
    assert runner.prefill_graphs is not None and runner.prefill_graphs.sizes == ([16, 40] if not chunked else [16, 20])
    assert seen and all(n <= 40 for n in seen)  # capped at the step's token bound
    if not chunked:
        assert sorted(seen) == [14, 35]  # the 45-token step ran eagerly
    assert got == want == hf_greedy(path, prompts, 8)
    torch.testing.assert_close(torch.tensor(sum(got_lps, [])), torch.tensor(sum(want_lps, [])), atol=LP_ATOL, rtol=0)


def check_mixed_steps_and_prefix_hits(path, monkeypatch, device="cpu"):
    """Requests arriving one a step while others decode: mixed steps and a prefix-cache hit replay the graphs;
    the same equalities as :func:`check_greedy_equals_hf_and_eager`."""
    from tests.test_mixed_steps import _staggered

    prompts = _prompts(2, [30, 9, 23, 30])
    prompts[3] = prompts[0][:24] + prompts[3][24:]  # a prefix hit of 3 blocks of 8 (1 of 16 on CUDA)
    kw = dict(mixed_prefill_decode=True, enable_chunked_prefill=True, max_num_batched_tokens=24,
              max_consecutive_prefill_steps=1)
    want, _ = _staggered(_llm(path, False, device, **kw), prompts, _greedy())
    llm = _llm(path, True, device, **kw)
    seen = count_runs(monkeypatch)
    got, n_mixed = _staggered(llm, prompts, _greedy())
    assert n_mixed > 0 and seen
    assert llm.engine.stats["prefix_cache_hit_tokens"] > 0
    g, g_lps = _tokens_lps(got)
    w, w_lps = _tokens_lps(want)
    assert g == w == hf_greedy(path, prompts, 8)
    torch.testing.assert_close(torch.tensor(sum(g_lps, [])), torch.tensor(sum(w_lps, [])), atol=LP_ATOL, rtol=0)


@pytest.mark.parametrize("chunked", [False, True])
def test_greedy_equals_hf_and_eager(qwen3, chunked, monkeypatch):
    check_greedy_equals_hf_and_eager(qwen3, chunked, monkeypatch)


def test_mixed_steps_and_prefix_hits(qwen3, monkeypatch):
    check_mixed_steps_and_prefix_hits(qwen3, monkeypatch)


def test_off_where_not_supported(tiny_model):
    moe = LLM(tiny_model("qwen3_moe"), dtype="float32", device="cpu", block_size=8,
              extra={"prefill_cuda_graph_sizes": SIZES, "prefill_cuda_graphs_emulate": True})
    moe.generate([[5, 6, 7]], _greedy(2))
    runner = moe.engine.executor.runner
    assert runner.prefill_graphs is None and "not a dense" in runner._prefill_graphs_off
    eager = LLM(tiny_model("qwen3"), dtype="float32", device="cpu", block_size=8, enforce_eager=True,
                extra={"prefill_cuda_graph_sizes": SIZES, "prefill_cuda_graphs_emulate": True})
    eager.generate([[5, 6, 7]], _greedy(2))
    assert eager.engine.executor.runner._prefill_graphs_off == "CUDA graphs are off (--enforce-eager)"


def test_attention_out_buffer_equals_a_fresh_result():
    """``Attention.forward_cached(..., out=)`` (the piecewise graphs' static buffer) writes the same values it
    returns without ``out``, for a whole step and a mixed step's two calls (the torch backend copies)."""
    from rlserve.layers.attention import Attention
    from tests.attention_cases import make_paged_case

    for qlens, slens in (([5, 3], [9, 3]), ([1, 1, 6], [7, 12, 6])):
        q, kc, vc, meta = make_paged_case(qlens, slens, 4, 2, 8, 4, torch.float32)
        att = Attention(4, 8, 8 ** -0.5, 2)
        att.k_cache, att.v_cache = kc, vc
        T = q.shape[0]
        want = att.forward_cached(q.reshape(T, 32), meta)
        out = torch.full((T, 32), float("nan"))
        got = att.forward_cached(q.reshape(T, 32), meta, out=out)
        assert got is out and torch.equal(out, want)


def _allocated_bytes(bucket) -> int:
    """Bytes of every distinct storage behind a tensor the bucket (or its metadata) holds, but its output
    ``hidden`` (the graph pool's, counted apart in reserve_bytes): what it really allocated, found by
    walking its attributes, so a buffer added outside pg.bucket_buffers is counted too."""
    seen = {}
    for obj in (bucket, bucket.meta):
        for name, v in vars(obj).items():
            for t in (v.values() if isinstance(v, dict) else [v]):
                if isinstance(t, torch.Tensor) and name != "hidden":
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def test_bucket_buffer_bytes_is_what_a_bucket_allocates():
    """pg.bucket_buffer_bytes (the KV sizing's estimate) equals the bytes an emulated bucket really holds, in
    float32 and bfloat16; the buffers start as the pieces expect (padding slots -1, the rest 0). A bucket
    reads only the first layer's q_size of its model."""
    q_size = 48
    model = SimpleNamespace(model=SimpleNamespace(layers=[SimpleNamespace(self_attn=SimpleNamespace(q_size=q_size))]))
    for dtype in (torch.float32, torch.bfloat16):
        for size in (1, 16, 40):
            b = pg._Bucket(size, model, torch.device("cpu"), dtype)
            assert _allocated_bytes(b) == pg.bucket_buffer_bytes(size, q_size, dtype)
            assert pg.bucket_buffer_bytes(size, q_size, dtype) == size * (3 * 8 + 2 * q_size * dtype.itemsize) + 16
            assert b.q.dtype == b.attn.dtype == dtype and b.q.shape == b.attn.shape == (size, q_size)
            assert b.slots.tolist() == [-1] * size and b.input_ids.tolist() == b.positions.tolist() == [0] * size
            assert b.meta.slot_mapping is b.slots and b.meta.query_start_loc.tolist() == [0, 0]


def test_kv_sizing_reserves_the_prefill_graphs(qwen3, tiny_model, monkeypatch):
    """Session 18: the prefill graphs' buffers and pool (~300 MB for Qwen3-0.6B at 8,192 tokens) were
    allocated after the KV cache was sized, so --gpu-memory-utilization did not count them. The GPU
    sizing (Worker.determine_num_blocks, here on the emulated path with the CUDA memory numbers faked)
    now leaves pg.reserve_bytes free: that many fewer blocks than without the graphs; the static
    buffers part of it is exactly what the buckets hold once built; nothing where the graphs stay off."""
    llm_on, llm_off = _llm(qwen3, True), _llm(qwen3, False)
    w_on, w_off = llm_on.engine.executor, llm_off.engine.executor
    reserve = pg.reserve_bytes(w_on.runner)
    assert reserve > 0 and pg.reserve_bytes(w_off.runner) == 0
    a = llm_on.engine.executor.model.model.layers[0].self_attn
    hidden, inter = 64, 128  # the tiny qwen3 (tests/tiny_models.py)
    assert reserve == (sum(pg.bucket_buffer_bytes(s, a.q_size, torch.float32) for s in SIZES) + sum(SIZES) * hidden * 4
                       + 40 * 4 * (6 * hidden + 3 * inter + 2 * a.q_size + 2 * a.kv_size))
    llm_on.generate([[5] * 30], _greedy(2))  # builds the buckets
    graphs = w_on.runner.prefill_graphs
    assert sorted(graphs.buckets) == SIZES
    for size, b in graphs.buckets.items():
        assert _allocated_bytes(b) == pg.bucket_buffer_bytes(size, a.q_size, torch.float32)
    total = 8 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - (1 << 30), total))
    blocks = {}
    for name, w in (("on", w_on), ("off", w_off)):
        monkeypatch.setattr(w, "device", torch.device("cuda", 0))
        blocks[name] = w.determine_num_blocks()
    per_block = w_on.bytes_per_block()
    assert blocks["off"] - blocks["on"] in (reserve // per_block, reserve // per_block + 1), (blocks, reserve, per_block)
    moe = LLM(tiny_model("qwen3_moe"), dtype="float32", device="cpu", block_size=8,
              extra={"prefill_cuda_graph_sizes": SIZES, "prefill_cuda_graphs_emulate": True})
    assert pg.reserve_bytes(moe.engine.executor.runner) == 0  # (not supported: never captured)


def check_updates_aborts_and_sleep(path, other, monkeypatch, device="cpu", **engine_kw):
    """Session 21's adversarial schedule on the graphs: what they bake in (parameter storage, the KV cache,
    their static buffers) must follow every weight write, abort and sleep. In order, each answer checked
    against HF float32 greedy of the weights loaded then (logprobs against the eager engine run through the
    same schedule, within :data:`LP_ATOL`): a whole batch; a weight update (``load_weights`` of ``other``)
    between two chunks of a prompt (the prompt restarts under the new weights); an abort mid-chunk; sleep
    level 1 + wake (the weights come back); sleep level 2 + wake + a reload of the first weights (level 2
    drops them); a prefix hit after that. Every phase replays the graphs."""
    from safetensors.torch import load_file

    prompts = _prompts(5, [30, 9, 23])
    long = (prompts[0] + prompts[2]) * 2  # partial after one step, whatever runs ahead (H100, s21: 53 tokens were not)
    hf = {w: hf_greedy(w, prompts, 8) for w in (path, other)}  # (HF on the CPU, float32)
    assert hf[path] != hf[other]
    kw = dict(enable_chunked_prefill=True, max_num_batched_tokens=20, enable_sleep_mode=True, **engine_kw)
    seen = count_runs(monkeypatch)  # steps replayed from the graphs (the eager engine adds none)
    marks = []  # len(seen) after each phase of the graphs' run

    def schedule(llm) -> list:
        eng, outs = llm.engine, []

        def phase(out) -> None:
            outs.append(out)
            marks.append(len(seen))

        phase(llm.generate(prompts, _greedy()))
        eng.add_request("partial", long, _greedy())  # 106 tokens: 20-token chunks
        eng.step()  # one chunk computed (two with the overlapped loop, CUDA's default: one launched ahead)
        sched = eng.scheduler
        assert sched.prefilling, ("the prompt is not partial when the update comes: (computed, length) of the "
                                  f"running {[(q.num_computed_tokens, len(q)) for q in sched.running]}, "
                                  f"waiting {len(sched.waiting)}, overlap {eng._overlap is not None}")
        eng.load_weights(load_file(f"{other}/model.safetensors").items())
        last = None
        while eng.has_unfinished_requests():
            for o in eng.step():
                last = o
        phase([last])
        eng.add_request("cut", prompts[1] + prompts[0], _greedy())
        eng.step()
        eng.abort_request("cut")
        phase(llm.generate(prompts, _greedy()))
        llm.sleep(level=1)
        llm.wake_up()
        phase(llm.generate(prompts, _greedy()))
        llm.sleep(level=2)
        llm.wake_up()
        eng.load_weights(load_file(f"{path}/model.safetensors").items())
        phase(llm.generate(prompts, _greedy()))
        phase(llm.generate([prompts[0][:24] + prompts[1]], _greedy()))  # a prefix hit on 24 tokens
        return outs

    want = schedule(_llm(path, False, device, **kw))
    assert set(marks) == {0}
    marks.clear()
    llm = _llm(path, True, device, **kw)
    got = schedule(llm)
    assert llm.engine.executor.runner.prefill_graphs is not None
    assert all(b > a for a, b in zip([0] + marks, marks)), marks  # every phase replayed the graphs
    assert llm.engine.stats["prefix_cache_hit_tokens"] > 0
    expect = [hf[path], hf_greedy(other, [long], 8), hf[other], hf[other], hf[path],
              hf_greedy(path, [prompts[0][:24] + prompts[1]], 8)]
    for phase_no, (g, w, e) in enumerate(zip(got, want, expect)):
        g_toks, g_lps = _tokens_lps(g)
        w_toks, w_lps = _tokens_lps(w)
        assert g_toks == w_toks == e, f"phase {phase_no}"
        torch.testing.assert_close(torch.tensor(sum(g_lps, [])), torch.tensor(sum(w_lps, [])), atol=LP_ATOL, rtol=0)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_updates_aborts_and_sleep(qwen3, tiny_model, monkeypatch, overlap):
    """Plain and overlapped loops (``async_scheduling``: CUDA's default, a step launched ahead)."""
    check_updates_aborts_and_sleep(qwen3, tiny_model("qwen3", seed=1), monkeypatch, async_scheduling=overlap)
