"""The batched LoRA kernels (rlserve.lora.triton_ops) on CPU through Triton's interpreter: the
shrink / expand pair against a float32 per-row reference (slices, several slots, base rows,
unsorted rows, split-K planes and session 15's atomic form), the engine on the kernel path --
eager and with emulated decode CUDA graphs whose segment tensors are static buffers -- against
PEFT's merged model for the base model and three adapters in one batch, and a batch-1 decode
taking the GEMV unless an adapter runs. Skipped where tests/triton_interp.py says (CUDA present: the
compiled kernels run in tests/gpu/test_lora_gpu.py)."""

from __future__ import annotations

import pytest
import torch

import tests.triton_interp  # noqa: F401  (skips this module, or sets TRITON_INTERPRET=1 first)
from rlserve.lora.layers import segments  # noqa: E402
from rlserve.lora.triton_ops import lora_expand, lora_shrink  # noqa: E402
from tests.lora_adapters import hf_greedy_logprobs, make_adapter, merged_model  # noqa: E402

#: float32 throughout (the interpreter's dot is numpy's): the kernel and the reference differ in
#: summation order only; |y| ~ 10 here, so 1e-4 is ~1e-5 relative
ATOL = 1e-4
NEW_TOKENS = 6


def _reference(x, a_stack, b_stack, offsets, sizes, maxr, row_slot, y0):
    y = y0.clone()
    for i, s in enumerate(row_slot):
        if s < 0:
            continue
        t = a_stack[s] @ x[i]
        for k, (o, n) in enumerate(zip(offsets, sizes)):
            y[i, o:o + n] += b_stack[s, o:o + n] @ t[k * maxr:(k + 1) * maxr]
    return y


@pytest.mark.parametrize("split", [None, 3])
@pytest.mark.parametrize("sizes,maxr,K", [((40, 8, 8), 8, 48), ((24,), 16, 20), ((33, 31), 4, 70)])
def test_shrink_expand_match_per_row_reference(sizes, maxr, K, split):
    g = torch.Generator().manual_seed(sum(sizes) + K)
    slots, T = 3, 29
    N = sum(sizes)
    offsets = tuple(sum(sizes[:i]) for i in range(len(sizes)))
    x = torch.randn(T, K, generator=g)
    a = torch.randn(slots, len(sizes) * maxr, K, generator=g)
    b = torch.randn(slots, N, maxr, generator=g)
    row_slot = torch.randint(-1, slots, (T,), generator=g).tolist()  # -1: a base-model row
    rows, seg_start, seg_slot = segments([s + 1 for s in row_slot], [1] * T, {s + 1: s for s in range(slots)})
    meta = [torch.tensor(v, dtype=torch.int32) for v in (rows, seg_start, seg_slot)]
    longest = max(e - s for s, e in zip(seg_start, seg_start[1:]))
    y0 = torch.randn(T, N, generator=g)
    y = y0.clone()
    t = lora_shrink(x, a, *meta, longest, split=split)
    # split-K (K = 70: parts of 64 + 6 columns; 48 / 20 fit one 64-wide block: one part): one
    # plane per part, each written for every segment row; the expand sums them
    assert t.shape == ((2 if split and K > 64 else 1), T, len(sizes) * maxr)
    lora_expand(t, b, y, offsets, *meta, longest)
    torch.testing.assert_close(y, _reference(x, a, b, offsets, sizes, maxr, row_slot, y0), atol=ATOL, rtol=0)
    # session 15's form (benchmarks/lora_kernels.py's A/B): one zeroed plane, the parts added atomically
    t_atomic = lora_shrink(x, a, *meta, longest, split=split, atomic=True)
    assert t_atomic.shape[0] == 1
    seg_rows = meta[0].long()
    torch.testing.assert_close(t_atomic[0, seg_rows], t.sum(0)[seg_rows], atol=ATOL, rtol=0)
    # a static grid (one segment per slot, empty ones -1, max_rows = T) gives the same
    rows, seg_start, seg_slot = segments([s + 1 for s in row_slot], [1] * T, {s + 1: s for s in range(slots)},
                                         num_slots=slots + 1)
    meta = [torch.tensor(v, dtype=torch.int32) for v in (rows, seg_start, seg_slot)]
    y2 = y0.clone()
    lora_expand(lora_shrink(x, a, *meta, T, split=split), b, y2, offsets, *meta, T)
    torch.testing.assert_close(y2, y, atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def kernel_llm(tiny_model, tmp_path_factory):
    """The tiny Llama with its LoRA state on the kernel path (Triton's interpreter) and three
    adapters: rank 8 on everything, rank 16 rsLoRA on q/v/o, rank 4 on gate/down."""
    from rlserve import LLM
    from rlserve.lora.model import LoRAModel

    base = tiny_model("llama")
    d = tmp_path_factory.mktemp("lora-kernel")
    paths = {1: make_adapter(base, d / "a1", seed=1, r=8, alpha=16),
             2: make_adapter(base, d / "a2", seed=2, r=16, alpha=8, targets=["q_proj", "v_proj", "o_proj"],
                             use_rslora=True),
             3: make_adapter(base, d / "a3", seed=3, r=4, alpha=4, targets=["gate_proj", "down_proj"])}
    llm = LLM(base, dtype="float32", device="cpu", enable_lora=True, max_loras=3, max_lora_rank=16, block_size=4,
              max_num_seqs=8)
    model = llm.engine.model
    lora = LoRAModel.install(model, 16, torch.float32, "cpu", max_loras=3, kernel=True)
    for i, p in paths.items():
        lora.load(i, p)
    return base, paths, llm


@pytest.mark.parametrize("graphs", [False, True])
def test_engine_on_kernel_path_matches_peft_merged(kernel_llm, graphs):
    from rlserve import SamplingParams

    base, paths, llm = kernel_llm
    runner = llm.engine.executor.runner
    runner.use_cuda_graphs = graphs  # DecodeCUDAGraphs emulates replay on CPU (static segment buffers)
    prompts = [[5, 9, 13, 17, 21, 3], [7, 7, 8, 30, 2]]
    ids = [0, 1, 2, 3]
    params = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, lora_int_id=a)
              for _ in prompts for a in ids]
    outs = llm.generate([p for p in prompts for _ in ids], params)
    if graphs:
        assert runner.lora_graphs is not None and runner.lora_graphs.emulate and runner.lora_graphs.num_replays > 0
    refs = {a: merged_model(base, paths.get(a)) for a in ids}
    seen = set()
    for o, p in zip(outs, params):
        want_ids, want_lps = hf_greedy_logprobs(refs[p.lora_int_id], o.prompt_token_ids, NEW_TOKENS)
        c = o.outputs[0]
        assert list(c.token_ids) == want_ids, p.lora_int_id
        got = [c.logprobs[i][t] for i, t in enumerate(c.token_ids)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want_lps), atol=ATOL, rtol=0)
        seen.add((tuple(o.prompt_token_ids), tuple(c.token_ids)))
    assert len(seen) >= 6  # the adapters change the outputs
    runner.use_cuda_graphs = False


def test_batch_one_decode_takes_the_gemv_unless_an_adapter_runs(kernel_llm, monkeypatch):
    """The kernel path's LoRA hooks are permanent (graphs capture them); between steps with
    adapters they are idle, so a batch-1 decode on the base model takes the GEMV
    (rlserve.layers.gemv) as without --enable-lora (before session 16 it never did), and one on an
    adapter does not (the GEMV would skip the hook): both equal PEFT's (merged) model."""
    from rlserve import SamplingParams
    from rlserve.layers import fused_ops, gemv

    base, paths, llm = kernel_llm
    calls = {"n": 0}
    launch = gemv._launch
    monkeypatch.setattr(gemv, "_launch", lambda *a, **kw: calls.__setitem__("n", calls["n"] + 1) or launch(*a, **kw))
    prev, prev_g = fused_ops.set_fused_kernels(True, on_cpu=True), gemv.set_enabled(True)
    try:
        prompt = [5, 9, 13, 17, 21, 3]
        for a in (0, 1):
            calls["n"] = 0
            out = llm.generate([prompt], [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0,
                                                         lora_int_id=a)])[0].outputs[0]
            # 3 GEMV launches per layer per batch-1 decode step (qkv, o, gate_up + down fused)
            assert (calls["n"] > 0) == (a == 0), (a, calls["n"])
            want_ids, want_lps = hf_greedy_logprobs(merged_model(base, paths.get(a)), prompt, 4)
            assert list(out.token_ids) == want_ids
            got = [out.logprobs[i][t] for i, t in enumerate(out.token_ids)]
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want_lps), atol=ATOL, rtol=0)
    finally:
        gemv.set_enabled(prev_g)
        fused_ops.set_fused_kernels(*prev)
