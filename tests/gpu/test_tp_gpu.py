"""Tensor parallelism over NCCL on two GPUs (skipped with fewer).

- float32, CUDA graphs off and on: TP=2 greedy tokens == TP=1 on one GPU == Hugging Face,
  including SmolLM2's uneven 9-head / 3-KV-head split and the mixture-of-experts models (each
  expert's intermediate dim split over the ranks, the fused-MoE kernel on each), logprobs within 1e-3.
- routed-experts replay with TP=2 and decode graphs: the ids equal TP=1's.
- fp8 (``_scaled_mm``) with TP=2: runs, and its greedy agreement with TP=1 fp8 is reported
  (the two differ only in all-reduce summation order, so agreement must be high but need not be
  exact).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP=2 over NCCL needs two GPUs")

from rlserve import LLM, SamplingParams  # noqa: E402
from tests.gpu.test_gpu_engine import PROMPTS, hf_greedy, tokens  # noqa: E402

# NVLink multicast off in this process and the TP followers it spawns (they inherit os.environ).
for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_k, _v)

NEW = 24
KW = dict(device="cuda", num_kv_blocks=512, max_num_seqs=16, block_size=16)
SMOLLM_9_HEADS = dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=144)


def _run(path, params, **kw):
    llm = LLM(path, **KW, **kw)
    try:
        return llm.generate(PROMPTS, params)
    finally:
        if hasattr(llm.engine.executor, "shutdown"):  # TP>1: stop the spawned ranks
            llm.engine.executor.shutdown()


@pytest.mark.parametrize("arch,overrides", [("qwen3", {}), ("smollm", SMOLLM_9_HEADS), ("opt", {}), ("qwen3_moe", {}),
                                            ("qwen2_moe", {})],
                         ids=["qwen3", "smollm_9h_3kv", "opt", "qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_tp2_nccl_float32_equals_tp1_and_hf(arch, overrides, eager, tiny_model):
    path = tiny_model(arch, **overrides)
    params = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, logprobs=2)
    out2 = _run(path, params, dtype="float32", tensor_parallel_size=2, device_ids=[0, 1], enforce_eager=eager)
    out1 = _run(path, params, dtype="float32", enforce_eager=True)
    ref = hf_greedy(path, [o.prompt_token_ids for o in out1], NEW)
    assert tokens(out2) == tokens(out1) == ref
    worst = 0.0
    for a, b in zip(out2, out1):
        for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in db:
                worst = max(worst, abs(da[t] - db[t]))
    print(f"[tp2-nccl {arch} eager={eager}] max |logprob TP2 - TP1| = {worst:.2e}")
    assert worst < 1e-3


def test_tp2_fp8_runs_and_agrees_with_tp1_fp8(tiny_model):
    path = tiny_model("qwen3")
    params = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW)
    out2 = _run(path, params, dtype="bfloat16", quantization="fp8", tensor_parallel_size=2, device_ids=[0, 1])
    out1 = _run(path, params, dtype="bfloat16", quantization="fp8")
    same = sum(x == y for a, b in zip(tokens(out2), tokens(out1)) for x, y in zip(a, b))
    total = sum(len(a) for a in tokens(out1))
    print(f"[tp2-fp8] greedy agreement TP2 vs TP1 (fp8, bf16): {same}/{total} = {same / total:.1%}")
    assert all(len(a) == NEW for a in tokens(out2))
    assert same / total >= 0.8


def test_tp2_moe_replay_equals_tp1(tiny_model):
    """Qwen3-MoE, float32, decode CUDA graphs, ``enable_return_routed_experts``: TP=2's greedy
    tokens and routed-expert ids (rank 0's replicated router) equal TP=1's on one GPU."""
    path = tiny_model("qwen3_moe")
    params = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW)
    out2 = _run(path, params, dtype="float32", tensor_parallel_size=2, device_ids=[0, 1],
                enable_return_routed_experts=True)
    out1 = _run(path, params, dtype="float32", enable_return_routed_experts=True)
    assert tokens(out2) == tokens(out1)
    for a, b in zip(out2, out1):
        ra, rb = a.outputs[0].routed_experts, b.outputs[0].routed_experts
        assert ra is not None and ra.shape == rb.shape and (ra == rb).all()
