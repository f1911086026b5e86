"""The piecewise prefill graphs' default (``RLSERVE_PREFILL_CUDA_GRAPHS=auto``, on since session 21) and what it
must survive, on the CPU's emulated graphs (``extra["prefill_cuda_graphs_emulate"]``: the pieces run as calls on
the buckets' static buffers; the capture itself is tests/gpu/test_prefill_graphs_gpu.py's):

- the setting: unset is ``auto`` (buckets 256..8192 capped at the most tokens a step holds, max_num_batched_tokens
  and max_num_seqs x max_model_len), ``0`` off, ``1`` forced; off CUDA the default logs nothing at INFO;
- where the default leaves them off, with the reason the start-up log gives and no KV memory reserved for them:
  --enforce-eager, LoRA, --batch-invariant, MoE, online fp8 weights, tensor-parallel linears, an fp8 KV cache
  (``1`` forces them there where the Triton kernels run);
- sleep level 1 and 2 and wake keep the same graphs (the decode graphs' rule: the weights and the cache wake at the
  same addresses, here the arena path's stand-in arenas), and after a level-2 sleep and an in-place weight sync the
  graphs serve the new weights: greedy tokens equal Hugging Face's float32 of the synced checkpoint;
- the pieces read the live parameters (every parameter's storage, by address), so a captured graph reads what a
  weight sync copied in.
"""

import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlserve import LLM
from rlserve.engine.worker import prefill_graphs as pg
from tests.test_chunked_prefill import _greedy, _prompts
from tests.test_engine import hf_greedy
from tests.test_prefill_graphs import count_runs

EMULATE = {"prefill_cuda_graphs_emulate": True}


def _emulated(path, **kw):
    """float32 CPU engine with the default setting (no buckets given), the graphs emulated."""
    kw = {"block_size": 8, "max_num_batched_tokens": 64, **kw}
    return LLM(path, dtype="float32", device="cpu", extra={**EMULATE, **kw.pop("extra", {})}, **kw)


@pytest.fixture(scope="module")
def qwen3(tiny_model):
    return tiny_model("qwen3")


def test_unset_is_auto_and_zero_is_off(monkeypatch, qwen3, caplog):
    from rlserve import envs

    monkeypatch.delenv("RLSERVE_PREFILL_CUDA_GRAPHS", raising=False)
    assert envs.RLSERVE_PREFILL_CUDA_GRAPHS == "auto"
    assert pg.parse_sizes("auto", 8192) == list(pg.DEFAULT_SIZES) == pg.parse_sizes("1", 8192)
    assert pg.parse_sizes("auto", 300) == [256, 300]
    # the default engine on the CPU: off (no CUDA graphs), said at DEBUG only
    with caplog.at_level(logging.DEBUG, logger="rlserve.engine.worker.model_runner"):
        llm = LLM(qwen3, dtype="float32", device="cpu", block_size=8)
        llm.generate([[5, 6, 7]], _greedy(2))
    runner = llm.engine.executor.runner
    assert runner.prefill_graphs is None and runner._prefill_graphs_off == "CUDA graphs are off"
    lines = [r for r in caplog.records if "prefill piecewise CUDA graphs off" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.DEBUG]
    # the default where they apply: on, the default buckets capped at the step's 300 tokens
    llm = _emulated(qwen3, max_num_batched_tokens=300)
    llm.generate([[5, 6, 7]], _greedy(2))
    assert llm.engine.executor.runner.prefill_graphs.sizes == [256, 300]
    # ... and at max_num_seqs x max_model_len when that is fewer tokens (2 x 96)
    llm = _emulated(qwen3, max_num_batched_tokens=1024, max_num_seqs=2, max_model_len=96)
    llm.generate([[5, 6, 7]], _greedy(2))
    assert llm.engine.executor.runner.prefill_graphs.sizes == [192]
    # 0: off, nothing reserved
    monkeypatch.setenv("RLSERVE_PREFILL_CUDA_GRAPHS", "0")
    llm = _emulated(qwen3)
    llm.generate([[5, 6, 7]], _greedy(2))
    runner = llm.engine.executor.runner
    assert runner.prefill_graphs is None and runner._prefill_graphs_off == "off (RLSERVE_PREFILL_CUDA_GRAPHS=0)"
    assert pg.reserve_bytes(runner) == 0


@pytest.mark.parametrize("case", ["enforce_eager", "lora", "batch_invariant", "moe", "fp8_weights", "fp8_kv"])
def test_default_stays_off_where_unsafe(tiny_model, case):
    """Each case: the engine generates the eager engine's greedy tokens, no graphs, the logged reason, and the KV
    sizing reserves nothing for them (pg.reserve_bytes 0)."""
    path = tiny_model("qwen3_moe" if case == "moe" else "qwen3")
    kw, why = {
        "enforce_eager": ({"enforce_eager": True}, "CUDA graphs are off (--enforce-eager)"),
        "lora": ({"enable_lora": True, "max_lora_rank": 8}, "LoRA adapters"),
        "batch_invariant": ({"batch_invariant": True}, "--batch-invariant"),
        "moe": ({}, "not a dense Llama-family model"),
        "fp8_weights": ({"quantization": "fp8"}, "quantized or tensor-parallel linears"),
        "fp8_kv": ({"kv_cache_dtype": "fp8"}, "an fp8 KV cache without the Triton kernels"),
    }[case]
    prompts = _prompts(1, [30, 12])
    llm = _emulated(path, **kw)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy())]
    runner = llm.engine.executor.runner
    assert runner.prefill_graphs is None and why in runner._prefill_graphs_off, runner._prefill_graphs_off
    assert pg.reserve_bytes(runner) == 0
    eager = LLM(path, dtype="float32", device="cpu", block_size=8, max_num_batched_tokens=64,
                extra={"prefill_cuda_graph_sizes": "0"}, **kw)
    assert got == [o.outputs[0].token_ids for o in eager.generate(prompts, _greedy())]


def test_fp8_kv_cache_off_by_default_forced_by_one(qwen3, monkeypatch):
    """With the Triton kernels (faked on: pg.why_off's question only), an fp8 cache leaves the default off,
    naming the way to force it, and ``1`` (or a bucket list) turns them on; tensor-parallel linears stay off."""
    from rlserve.layers import fused_ops

    llm = _emulated(qwen3, kv_cache_dtype="fp8")
    runner = llm.engine.executor.runner
    monkeypatch.setattr(fused_ops, "triton_enabled", lambda t: True)
    sizes = runner._prefill_graph_sizes()
    assert "RLSERVE_PREFILL_CUDA_GRAPHS=1 turns them on" in pg.why_off(runner, sizes)
    for forced in ("1", "16,32"):
        runner.config.extra["prefill_cuda_graph_sizes"] = forced
        assert not runner._prefill_graphs_auto() and pg.why_off(runner, runner._prefill_graph_sizes()) is None
    monkeypatch.setattr(runner.model.model.layers[1].mlp.down_proj, "tp_size", 2)
    assert pg.why_off(runner, sizes) == "quantized or tensor-parallel linears"


def _faked_gpu_blocks(monkeypatch, llm, budget):
    """``(determine_num_blocks(), bytes_per_block())`` of ``llm``'s worker on a faked card (CUDA memory numbers
    faked as in tests/test_prefill_graphs.py) where the cache and the prefill graphs have ``budget`` bytes."""
    w = llm.engine.executor
    monkeypatch.setattr(w, "device", torch.device("cuda", 0))
    # x --gpu-memory-utilization = the budget + the 512 MiB headroom + the activation estimate
    total = int((budget + (512 << 20) + w._activation_estimate()) / w.config.gpu_memory_utilization) + 1
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total, total))
    try:
        return w.determine_num_blocks(), w.bytes_per_block()
    finally:
        monkeypatch.setattr(w, "device", torch.device("cpu"))


def test_small_kv_budget_leaves_the_default_off(qwen3, monkeypatch):
    """Under ``auto`` the GPU KV sizing (Worker.determine_num_blocks, CUDA memory numbers faked as in
    tests/test_prefill_graphs.py) reserves the graphs' pg.reserve_bytes only while that is at most
    pg.MAX_KV_SHARE of its budget; above, nothing is reserved (as many blocks as with them off), the graphs stay
    off with the reason, and the engine still serves. A bucket list is reserved whatever the budget."""
    def blocks(llm, budget):
        return _faked_gpu_blocks(monkeypatch, llm, budget)

    big, small = _emulated(qwen3), _emulated(qwen3)
    need = pg.reserve_bytes(big.engine.executor.runner)
    assert need > 0 and pg.MAX_KV_SHARE == 0.10
    n, per = blocks(big, 20 * need)  # a twentieth: reserved
    assert big.engine.executor.runner._prefill_graphs_off is None and n in (19 * need // per, 19 * need // per + 1)
    n, per = blocks(small, 5 * need)  # a fifth: off, nothing reserved
    runner = small.engine.executor.runner
    assert n in (5 * need // per - 1, 5 * need // per) and "more than 10%" in runner._prefill_graphs_off
    assert "RLSERVE_PREFILL_CUDA_GRAPHS=1" in runner._prefill_graphs_off
    prompts = _prompts(4, [30, 12])
    assert [o.outputs[0].token_ids for o in small.generate(prompts, _greedy())] == hf_greedy(qwen3, prompts, 8)
    assert runner.prefill_graphs is None
    forced = _emulated(qwen3, extra={"prefill_cuda_graph_sizes": "16,40"})
    assert pg.kv_reserve(forced.engine.executor.runner, 2 * need) == pg.reserve_bytes(forced.engine.executor.runner) > 0


def test_the_reserve_is_computed_once_per_start(qwen3, monkeypatch):
    """pg.reserve_bytes runs once per start (session 22, FIX item 5: the GPU KV sizing and the capture each
    computed it): the sizing (here on a faked card) and the capture with its log line read the number
    pg.reserve_once kept on the runner."""
    calls = []
    real = pg.reserve_bytes
    monkeypatch.setattr(pg, "reserve_bytes", lambda runner: calls.append(runner) or real(runner))
    llm = _emulated(qwen3)
    runner = llm.engine.executor.runner
    _faked_gpu_blocks(monkeypatch, llm, 1 << 40)  # a budget where the graphs are reserved
    prompts = _prompts(2, [30, 12])
    want = hf_greedy(qwen3, prompts, 8)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy())] == want
    assert runner.prefill_graphs is not None and runner.prefill_graphs.captured and calls == [runner]
    assert runner._prefill_graphs_reserve == real(runner) > 0


def check_sleep_wake_and_sync(path, new_path, monkeypatch, device="cpu"):
    """Level 1 and wake keep the graphs object and replay it, greedy as before the sleep; level 2, wake of the
    weights, an in-place load of the checkpoint ``new_path`` (a trainer's sync), wake of the cache: the same
    graphs replay the synced weights, greedy equal to Hugging Face float32 of ``new_path``. Also run on CUDA
    (real VMM arenas, captured graphs) by tests/gpu/test_prefill_graphs_gpu.py."""
    from rlserve.loader import iterate_checkpoint

    kw = dict(enable_sleep_mode=True, max_model_len=128, max_num_seqs=4)
    llm = _emulated(path, **kw) if device == "cpu" else _cuda(path, **kw)
    assert llm.engine.executor.sleep.vmm
    prompts = _prompts(3, [30, 12, 21])
    seen = count_runs(monkeypatch)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy())]
    runner = llm.engine.executor.runner
    graphs = runner.prefill_graphs
    assert graphs is not None and seen
    addrs = [p.data_ptr() for p in llm.engine.model.parameters()]
    llm.sleep(level=1)
    llm.wake_up()
    n = len(seen)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy())] == before
    assert runner.prefill_graphs is graphs and len(seen) > n
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    llm.engine.load_weights(iterate_checkpoint(new_path))
    llm.wake_up(tags=["kv_cache"])
    assert [p.data_ptr() for p in llm.engine.model.parameters()] == addrs  # synced in place
    n = len(seen)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy())]
    assert runner.prefill_graphs is graphs and len(seen) > n
    assert got != before and got == hf_greedy(new_path, prompts, 8)


def _cuda(path, **kw):
    """float32 CUDA engine with the default setting; a fixed cache of 256 blocks of 16 (another engine of the
    test may still hold memory)."""
    return LLM(path, dtype="float32", device="cuda", block_size=16, num_kv_blocks=256, max_num_batched_tokens=64,
               **kw)


def test_sleep_wake_and_sync_keep_the_graphs(qwen3, tmp_path, monkeypatch):
    """Sleep mode on the arena path (tests/test_sleep_mode.py's host stand-in for the VMM arenas, as on CUDA)."""
    from rlserve.engine.worker.sleep_memory import WorkerSleep
    from tests.test_sleep_mode import HostArena
    from tests.tiny_models import make_tiny_model

    init = WorkerSleep.__init__
    monkeypatch.setattr(WorkerSleep, "__init__", lambda self, worker: init(self, worker, arena_factory=HostArena))
    check_sleep_wake_and_sync(qwen3, make_tiny_model("qwen3", tmp_path / "new", seed=1), monkeypatch)


class _Reads(TorchDispatchMode):
    """Every storage address an op reads or writes while active."""

    def __init__(self):
        super().__init__()
        self.ptrs = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for a in list(args) + list((kwargs or {}).values()):
            for t in (a if isinstance(a, (list, tuple)) else [a]):
                if isinstance(t, torch.Tensor):
                    self.ptrs.add(t.untyped_storage().data_ptr())
        return func(*args, **(kwargs or {}))


def test_pieces_read_the_live_parameters(qwen3, monkeypatch):
    """One emulated step of the pieces reads every decoder parameter at its own storage (embedding, norms, the
    four linears a layer, the q/k norms the fused KV-write kernel gets, the final norm): nothing the pieces run on is a copy taken at capture, so a weight sync
    (in place) reaches a captured graph. Checked against the same pieces' ops (a copy would show up as a storage
    outside the parameters')."""
    monkeypatch.setenv("RLSERVE_CPU_TEAM", "1")  # the CPU's own weight copies (the team's and oneDNN's packed
    monkeypatch.setenv("RLSERVE_CPU_PACKED_LINEAR", "0")  # layouts) off: CUDA's linears read the parameters
    llm = _emulated(qwen3)
    llm.generate([[5, 6, 7] * 6], _greedy(1))
    runner = llm.engine.executor.runner
    graphs = runner.prefill_graphs
    b = graphs.buckets[graphs.sizes[0]]
    reads = _Reads()
    from rlserve.layers import fused_ops

    fused = fused_ops.qkv_norm_rope_write  # a C / Triton kernel: its tensors reach no torch op, record them here

    def recorded(*args, **kw):
        reads.ptrs.update(t.untyped_storage().data_ptr() for t in [*args, *kw.values()] if isinstance(t, torch.Tensor))
        return fused(*args, **kw)

    monkeypatch.setattr(fused_ops, "qkv_norm_rope_write", recorded)
    with torch.inference_mode(), reads:
        for i in range(len(runner.model.model.layers) + 1):
            graphs._piece(b, i, graphs._state)
    model = runner.model.model
    params = {n: p for n, p in model.named_parameters()}
    assert params and all(p.untyped_storage().data_ptr() in reads.ptrs for p in params.values()), \
        [n for n, p in params.items() if p.untyped_storage().data_ptr() not in reads.ptrs]
