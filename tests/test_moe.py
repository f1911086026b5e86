"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE) and the MoE layer against Hugging Face,
float32 on CPU: logits of prefill + decode steps on a paged KV cache, the engine's greedy tokens,
the loader's two naming schemes (per expert / transformers 5 fused), and the CPU expert path
against the dense float32 reference.

Tolerances: logits ``atol = rtol = 1e-4`` as tests/test_models.py (float32 on both sides; the
sums run in another order: differences seen ~1e-6).
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig

from rlserve.engine.llm import LLM
from rlserve.engine.sampling_params import SamplingParams
from rlserve.layers.moe import experts_grouped, experts_reference, route
from rlserve.loader.weight_utils import parse_expert_name
from rlserve.models.qwen_moe import SparseMoeBlock
from tests.test_engine import hf_greedy
from tests.test_models import _bind_cache, _check_prefill_and_decode, _hf, _load, _prompts, _run_step, \
    check_tp2_equals_tp1
from tests.tiny_models import MOE_ARCHS

# (arch, config overrides): norm_topk_prob both ways; decoder_sparse_step / mlp_only_layers make
# dense layers among the sparse ones.
VARIANTS = [
    ("qwen3_moe", {}),
    ("qwen2_moe", {}),
    ("qwen3_moe", {"norm_topk_prob": False, "decoder_sparse_step": 2}),
    ("qwen2_moe", {"norm_topk_prob": True, "mlp_only_layers": [0]}),
]


def _id(v):
    arch, ov = v
    return arch + "".join(f"-{k}={val}" for k, val in ov.items())


@pytest.mark.parametrize("variant", VARIANTS, ids=_id)
def test_prefill_and_decode_logits_match_hf(variant, tiny_model):
    arch, ov = variant
    path = tiny_model(arch, **ov)
    model, cfg = _load(path)
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    hf = _hf(path)
    assert sparse == [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    assert any(sparse)
    _check_prefill_and_decode(path)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_engine_greedy_matches_hf(arch, tiny_model):
    path = tiny_model(arch)
    llm = LLM(path, dtype="float32", device="cpu")
    prompts = [[5, 17, 42, 9, 77, 3], [100, 101, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, min_tokens=16))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 16)


def _disk(path: str) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_spec_names_per_expert_and_fused(arch, tiny_model):
    path = tiny_model(arch)
    model, cfg = _load(path, load_format="dummy")
    disk = _disk(path)
    spec = model.checkpoint_spec()
    assert model.required_checkpoint_names() == set(disk)  # save_pretrained writes experts one by one
    assert all(spec[n] == tuple(t.shape) for n, t in disk.items())
    E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    fused = {n: s for n, s in spec.items() if n not in disk}
    assert fused == {f"model.layers.{i}.mlp.experts.{p}": s for i in range(cfg.num_hidden_layers)
                     for p, s in (("gate_up_proj", (E, 2 * I, H)), ("down_proj", (E, H, I)))}
    # the HF model's own parameters (transformers 5: fused experts) are all names the spec knows
    hf = _hf(path)
    assert {n: tuple(p.shape) for n, p in hf.named_parameters()}.items() <= spec.items()


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_fused_names_load_like_per_expert_names(arch, tiny_model):
    """transformers 5's ``named_parameters()`` (fused experts) and the checkpoint's per-expert
    names land in the same fused weights, bit for bit; in place (same storage)."""
    path = tiny_model(arch)
    ref, _ = _load(path)
    model, _ = _load(path, load_format="dummy")
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    hf = _hf(path)
    named = list(hf.named_parameters())
    assert model.load_weights((n, p.detach()) for n, p in named) == {n for n, _ in named}
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    got = dict(model.named_parameters())
    for n, p in ref.named_parameters():
        assert torch.equal(got[n], p), n


def test_expert_load_errors_change_nothing(tiny_model):
    path = tiny_model("qwen3_moe", decoder_sparse_step=2)  # layer 0 dense, layer 1 sparse
    model, cfg = _load(path)
    w13 = model.model.layers[1].mlp.experts.w13_weight
    before = w13.detach().clone()
    I, H = cfg.moe_intermediate_size, cfg.hidden_size
    for name, t, exc in [
        ("model.layers.1.mlp.experts.3.gate_proj.weight", torch.ones(I + 1, H), ValueError),
        ("model.layers.1.mlp.experts.8.up_proj.weight", torch.ones(I, H), ValueError),  # 8 experts: 0..7
        ("model.layers.1.mlp.experts.gate_up_proj", torch.ones(cfg.num_experts, 2 * I, H + 1), ValueError),
        ("model.layers.1.mlp.experts.2.down_proj.weight", torch.ones(H, I, dtype=torch.int64), ValueError),
        ("model.layers.0.mlp.experts.0.gate_proj.weight", torch.ones(I, H), KeyError),  # a dense layer
    ]:
        with pytest.raises(exc):
            model.load_weights([(name, t)])
        assert torch.equal(w13, before), name


def test_expert_name_parsing():
    assert parse_expert_name("model.layers.3.mlp.experts.17.down_proj.weight") == \
        ("model.layers.3.mlp.experts", 17, "down_proj")
    assert parse_expert_name("model.layers.3.mlp.experts.gate_up_proj") == ("model.layers.3.mlp.experts", None,
                                                                            "gate_up_proj")
    for other in ("model.layers.3.mlp.gate.weight", "model.layers.3.mlp.shared_expert.gate_proj.weight",
                  "model.layers.3.mlp.experts.1.gate_up_proj.weight"):
        assert parse_expert_name(other) is None


@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_experts_equal_dense_reference(renormalize):
    """The CPU grouped path against the dense float32 reference on 64 experts / top-8 (the
    Qwen3-30B-A3B ratio), 9 tokens: some experts get no token, some several. float32 sums of
    at most 8 terms in another order: ``atol 1e-6`` on outputs of ~1e-2."""
    g = torch.Generator().manual_seed(0)
    T, E, K, H, I = 9, 64, 8, 48, 24
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    weights, ids = route(torch.randn(T, E, generator=g), K, renormalize)
    counts = torch.bincount(ids.flatten(), minlength=E)
    assert ids.shape == (T, K) and counts.min() == 0 and counts.max() > 1
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(T))
    got = experts_grouped(x, w13, w2, weights, ids)
    ref = experts_reference(x, w13, w2, weights, ids)
    assert ref.abs().max() > 1e-2
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
    # one token by hand: its experts' weighted sum
    t = 5
    by_hand = sum(weights[t, k] * (w2[e] @ (torch.nn.functional.silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])))
                  for k, e in enumerate(ids[t].tolist()))
    torch.testing.assert_close(got[t], by_hand, atol=1e-6, rtol=1e-5)
    assert experts_grouped(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, H)


def test_dummy_weights_cover_experts(tiny_model):
    path = tiny_model("qwen2_moe")
    model, cfg = _load(path, load_format="dummy", seed=3)
    for name, p in model.named_parameters():
        if "norm" not in name:
            assert 0 < p.abs().max() <= 1e-3, name
    _bind_cache(model)
    logits = _run_step(model, _prompts(cfg.vocab_size, lens=(4, 6)), [4, 6], [[0, 1], [2, 3]])
    assert logits.shape == (10, cfg.vocab_size) and torch.isfinite(logits).all()
    assert AutoConfig.from_pretrained(path).architectures == ["Qwen2MoeForCausalLM"]


def test_tensor_parallel_2_matches_tp1(tiny_model):
    """TP=2 over gloo: every expert's intermediate dim split in two (w13 rows / w2 columns of
    each rank), the routed and shared experts' partial sums all-reduced; the router replicated."""
    check_tp2_equals_tp1([tiny_model("qwen2_moe"), tiny_model("qwen3_moe", decoder_sparse_step=2)])


def test_qwen3_30b_a3b_shape_on_meta():
    """The real Qwen3-30B-A3B config (benchmarks/model_shapes.py: 48 layers, 128 experts, top-8)
    built on the meta device: the same parameter count as Hugging Face's model (30.5 B), every HF
    parameter name and shape in the spec, 48 x 128 x 3 per-expert names required."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from model_shapes import shape_config
    from transformers import AutoModelForCausalLM

    from rlserve.loader.model_loader import build_model

    cfg = shape_config("qwen3-30b-a3b")
    ours = build_model(cfg, "meta", torch.bfloat16)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in ours.parameters())
    assert n == sum(p.numel() for p in hf.parameters()) and 30.4e9 < n < 30.6e9
    assert {k: tuple(p.shape) for k, p in hf.named_parameters()}.items() <= ours.checkpoint_spec().items()
    required = ours.required_checkpoint_names()
    assert sum(".experts." in k for k in required) == 48 * 128 * 3
    assert ours.model.layers[0].mlp.experts.w13_weight.shape == (128, 2 * 768, 2048)


def test_qwen3_30b_a3b_shape_holds_one_rotary_cache():
    """The non-parameter buffers of the real Qwen3-30B-A3B shape (meta device) are ONE shared
    rotary cos/sin table: 2 x 40,960 positions x 128 x float32 = 40 MiB. Each of the 48 layers
    held its own before (1.875 GiB that the KV cache did not get: session 13's H100 run held
    58.75 GiB at KV sizing for 56.88 GiB of weights)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from model_shapes import shape_config

    from rlserve.loader.model_loader import build_model

    cfg = shape_config("qwen3-30b-a3b")
    ours = build_model(cfg, "meta", torch.bfloat16)
    layers = ours.model.layers
    assert all(layer.self_attn.rotary_emb.cos_cache is layers[0].self_attn.rotary_emb.cos_cache for layer in layers)
    assert all(layer.self_attn.rotary_emb.sin_cache is layers[0].self_attn.rotary_emb.sin_cache for layer in layers)
    table = cfg.max_position_embeddings * 128 * 4
    assert table == 20 * 2**20
    assert sum(b.numel() * b.element_size() for b in ours.buffers()) == 2 * table
    # on another device: a table of its own, shared by the layers there, with HF's values
    from rlserve.layers.rotary import get_rope

    with torch.device("cpu"):
        a, b = get_rope(128, cfg.max_position_embeddings, cfg), get_rope(128, cfg.max_position_embeddings, cfg)
    assert a.cos_cache is b.cos_cache and a.cos_cache.device.type == "cpu" and a.cos_cache.dtype == torch.float32
    theta = cfg.rope_parameters["rope_theta"]
    inv = 1.0 / (theta ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128))
    assert torch.equal(a.cos_cache[7, :64], torch.cos(7.0 * inv)) and torch.equal(a.sin_cache[7, 64:], torch.sin(7.0 * inv))
