"""Loader specifics: checkpoint discovery / iteration, load_model errors, the quantization
seam, dtype handling, and per-rank slicing of the parallel layers' weight loaders."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig

from rlserve.config import EngineConfig
from rlserve.distributed.parallel_state import tp_context
from rlserve.errors import UnsupportedArchitectureError
from rlserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from rlserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from rlserve.layers.rotary import get_rope, rope_parameters
from rlserve.loader import checkpoint_files, iterate_checkpoint, load_model
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"), num_hidden_layers=1)


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _copy_meta(src, dst):
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{src}/{name}", dst / name)


def _load(path, **kw):
    cfg = AutoConfig.from_pretrained(path)
    dtype = kw.pop("torch_dtype", torch.float32)
    qc = kw.pop("qc", None)
    return load_model(EngineConfig(model=str(path), device="cpu", **kw), cfg, "cpu", dtype, qc)


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---- checkpoint discovery ------------------------------------------------------------

def test_iterate_safetensors_yields_every_tensor(llama_dir):
    ref = _tensors(f"{llama_dir}/model.safetensors")
    got = dict(iterate_checkpoint(llama_dir))
    assert set(got) == set(ref) and len(ref) == 12
    for k in ref:
        assert torch.equal(got[k], ref[k])


def test_bin_fallback_loads_same_model(llama_dir, tmp_path):
    ref = _tensors(f"{llama_dir}/model.safetensors")
    d = tmp_path / "bin"
    _copy_meta(llama_dir, d)
    torch.save(ref, d / "pytorch_model.bin")
    kind, files = checkpoint_files(d)
    assert kind == "pt" and [f.name for f in files] == ["pytorch_model.bin"]
    got = dict(iterate_checkpoint(d, "pt"))
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    a = _params(_load(d))  # auto -> .bin
    b = _params(_load(llama_dir))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(FileNotFoundError):
        checkpoint_files(d, "safetensors")


def test_sharded_index_is_followed(llama_dir, tmp_path):
    ref = _tensors(f"{llama_dir}/model.safetensors")
    d = tmp_path / "sharded"
    _copy_meta(llama_dir, d)
    names = sorted(ref)
    half = len(names) // 2
    save_file({k: ref[k] for k in names[:half]}, str(d / "model-00001-of-00002.safetensors"))
    save_file({k: ref[k] for k in names[half:]}, str(d / "model-00002-of-00002.safetensors"))
    save_file({"junk": torch.zeros(1)}, str(d / "consolidated.safetensors"))  # not in the index
    weight_map = {k: ("model-00001-of-00002.safetensors" if i < half else "model-00002-of-00002.safetensors")
                  for i, k in enumerate(names)}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    got = list(iterate_checkpoint(d))
    assert sorted(n for n, _ in got) == names  # each once, no "junk"
    _load(d)  # loads fine


def test_missing_directory_and_empty_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        iterate_checkpoint(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no weights"):
        iterate_checkpoint(tmp_path)


# ---- load_model ----------------------------------------------------------------------

def test_missing_tensors_are_listed(llama_dir, tmp_path):
    ref = _tensors(f"{llama_dir}/model.safetensors")
    d = tmp_path / "partial"
    _copy_meta(llama_dir, d)
    drop = ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    save_file({k: v for k, v in ref.items() if k not in drop}, str(d / "model.safetensors"))
    with pytest.raises(ValueError) as exc:
        _load(d)
    msg = str(exc.value)
    assert "missing 2 required tensor(s)" in msg and all(n in msg for n in drop)


def test_unknown_tensor_in_checkpoint_raises(llama_dir, tmp_path):
    ref = _tensors(f"{llama_dir}/model.safetensors")
    d = tmp_path / "extra"
    _copy_meta(llama_dir, d)
    save_file({**ref, "model.layers.0.mystery.weight": torch.zeros(2)}, str(d / "model.safetensors"))
    with pytest.raises(KeyError, match="mystery"):
        _load(d)


def test_unsupported_architecture_from_load_model(llama_dir):
    cfg = AutoConfig.from_pretrained(llama_dir)
    cfg.architectures = ["FalconForCausalLM"]
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM"):
        load_model(EngineConfig(model=llama_dir, device="cpu"), cfg, "cpu", torch.float32)


def test_bfloat16_build_keeps_float32_rope_cache(llama_dir):
    model = _load(llama_dir, torch_dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    rope = model.model.layers[0].self_attn.rotary_emb
    assert rope.cos_cache.dtype == torch.float32
    ref = _tensors(f"{llama_dir}/model.safetensors")["model.norm.weight"]
    assert torch.equal(model.model.norm.weight, ref.to(torch.bfloat16))
    assert torch.get_default_dtype() == torch.float32  # restored


class _RecordingMethod(UnquantizedLinearMethod):
    def __init__(self, log):
        self.log = log

    def weight_loader(self, layer, param, loaded_weight, shard_id=None):
        self.log.append(("load", layer.prefix, shard_id))
        super().weight_loader(layer, param, loaded_weight, shard_id)

    def apply(self, layer, x, bias=None):
        self.log.append(("apply", layer.prefix))
        return super().apply(layer, x, bias)

    def process_weights_after_loading(self, layer):
        self.log.append(("process", layer.prefix))


class _RecordingQuantConfig:
    def __init__(self):
        self.log = []

    def get_quant_method(self, layer, prefix):
        return None if prefix.endswith("o_proj") else _RecordingMethod(self.log)


def test_quant_method_seam(llama_dir):
    qc = _RecordingQuantConfig()
    model = _load(llama_dir, qc=qc)
    processed = sorted(p for kind, p, *_ in qc.log if kind == "process")
    assert processed == ["model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_up_proj",
                         "model.layers.0.self_attn.qkv_proj"]
    loads = [(p, s) for kind, p, *rest in qc.log if kind == "load" for s in rest]
    assert ("model.layers.0.self_attn.qkv_proj", "k") in loads and ("model.layers.0.mlp.gate_up_proj", 1) in loads
    assert type(model.model.layers[0].self_attn.o_proj.quant_method) is UnquantizedLinearMethod
    qc.log.clear()
    model.model.layers[0].mlp(torch.zeros(2, 64))
    assert [e for e in qc.log if e[0] == "apply"] == [("apply", "model.layers.0.mlp.gate_up_proj"),
                                                      ("apply", "model.layers.0.mlp.down_proj")]


# ---- rotary config -------------------------------------------------------------------

def test_rope_parameters_both_config_styles():
    from types import SimpleNamespace

    new = SimpleNamespace(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0})
    assert rope_parameters(new)["rope_theta"] == 5e5 and rope_parameters(new)["rope_type"] == "llama3"
    old = SimpleNamespace(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0})
    p = rope_parameters(old)
    assert p["rope_theta"] == 1e6 and p["rope_type"] == "linear" and p["factor"] == 2.0
    per_layer = SimpleNamespace(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 7.0}})
    assert rope_parameters(per_layer)["rope_theta"] == 7.0
    assert rope_parameters(SimpleNamespace())["rope_theta"] == 10000.0
    with pytest.raises(UnsupportedArchitectureError, match="yarn"):
        get_rope(16, 32, SimpleNamespace(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}))
    lin = get_rope(16, 32, SimpleNamespace(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}))
    dflt = get_rope(16, 32, SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    torch.testing.assert_close(lin.cos_cache[10], dflt.cos_cache[5])  # positions scaled by 1/factor


# ---- per-rank slicing of the parallel layers (TP state set, no collectives) ---------

_FAKE_GROUP = object()


def _arange(*shape):
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


def test_qkv_slicing_per_rank():
    hd, H, KV, hidden = 2, 4, 2, 3
    q, k, v = _arange(H * hd, hidden), 100 + _arange(KV * hd, hidden), 200 + _arange(KV * hd, hidden)
    with tp_context(1, 2, _FAKE_GROUP):
        layer = QKVParallelLinear(hidden, hd, H, KV, bias=False)
    assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
    for sid, t in (("q", q), ("k", k), ("v", v)):
        layer.weight.weight_loader(layer.weight, t, sid)
    w = layer.weight
    assert w.shape == (2 * hd + 2 * hd, hidden)
    assert torch.equal(w[:4], q[4:8]) and torch.equal(w[4:6], k[2:4]) and torch.equal(w[6:8], v[2:4])
    assert layer.checkpoint_shapes("weight") == {"q": (8, 3), "k": (4, 3), "v": (4, 3)}
    # the fused full tensor gives the same result
    with tp_context(1, 2, _FAKE_GROUP):
        fused = QKVParallelLinear(hidden, hd, H, KV, bias=False)
    fused.weight.weight_loader(fused.weight, torch.cat([q, k, v]))
    assert torch.equal(fused.weight, w)


def test_kv_heads_replicated_when_fewer_than_ranks():
    hd, H, KV, hidden = 2, 4, 2, 3
    k = _arange(KV * hd, hidden)
    got = []
    for rank in range(4):
        with tp_context(rank, 4, _FAKE_GROUP):
            layer = QKVParallelLinear(hidden, hd, H, KV, bias=True)
        assert (layer.num_heads, layer.num_kv_heads, layer.num_kv_head_replicas) == (1, 1, 2)
        layer.weight.weight_loader(layer.weight, k, "k")
        layer.bias.weight_loader(layer.bias, torch.arange(KV * hd, dtype=torch.float32), "k")
        got.append((layer.weight[hd:2 * hd].clone(), layer.bias[hd:2 * hd].clone()))
    assert torch.equal(got[0][0], k[:2]) and torch.equal(got[1][0], k[:2])
    assert torch.equal(got[2][0], k[2:]) and torch.equal(got[3][0], k[2:])
    assert got[3][1].tolist() == [2.0, 3.0]
    with tp_context(0, 4, _FAKE_GROUP), pytest.raises(ValueError, match="divisible"):
        QKVParallelLinear(hidden, hd, 4, 3)


def test_merged_column_and_row_slicing():
    gate, up = _arange(8, 3), 100 + _arange(8, 3)
    with tp_context(1, 2, _FAKE_GROUP):
        mc = MergedColumnParallelLinear(3, [8, 8], bias=False)
        row = RowParallelLinear(8, 3, bias=True)
        col = ColumnParallelLinear(3, 8, bias=True)
    mc.weight.weight_loader(mc.weight, gate, 0)
    mc.weight.weight_loader(mc.weight, up, 1)
    assert torch.equal(mc.weight, torch.cat([gate[4:], up[4:]]))
    full_row = _arange(3, 8)
    row.weight.weight_loader(row.weight, full_row)
    row.bias.weight_loader(row.bias, torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(row.weight, full_row[:, 4:]) and row.bias.tolist() == [1.0, 2.0, 3.0]
    col.weight.weight_loader(col.weight, gate)
    col.bias.weight_loader(col.bias, torch.arange(8.0))
    assert torch.equal(col.weight, gate[4:]) and col.bias.tolist() == [4.0, 5.0, 6.0, 7.0]
    # an already-sliced per-rank tensor is accepted as is
    col.weight.weight_loader(col.weight, up[:4])
    assert torch.equal(col.weight, up[:4])
    # wrong shape / bad shard id: ValueError and nothing copied
    before = mc.weight.clone()
    with pytest.raises(ValueError):
        mc.weight.weight_loader(mc.weight, torch.zeros(7, 3), 1)
    with pytest.raises(ValueError):
        mc.weight.weight_loader(mc.weight, up, 2)
    with pytest.raises(ValueError):
        row.weight.weight_loader(row.weight, torch.zeros(3, 9))
    assert torch.equal(mc.weight, before)
    with tp_context(0, 4, _FAKE_GROUP), pytest.raises(ValueError, match="divisible"):
        ColumnParallelLinear(3, 6)


def test_vocab_parallel_embedding_slicing_and_padding():
    V, D = 100, 4
    full = 1 + _arange(V, D)
    with tp_context(1, 2, _FAKE_GROUP):
        emb = VocabParallelEmbedding(V, D)
        head = ParallelLMHead(V, D, bias=True)
    assert (emb.num_embeddings_padded, emb.num_embeddings_per_partition) == (128, 64)
    assert (emb.vocab_start, emb.vocab_end) == (64, 100)
    emb.weight.weight_loader(emb.weight, full)
    assert torch.equal(emb.weight[:36], full[64:]) and torch.all(emb.weight[36:] == 0)
    assert emb.checkpoint_shapes("weight") == {None: (V, D)}
    head.bias.weight_loader(head.bias, torch.arange(float(V)))
    assert head.bias[:36].tolist() == list(range(64, 100)) and torch.all(head.bias[36:] == 0)
    with pytest.raises(ValueError):
        emb.weight.weight_loader(emb.weight, torch.zeros(V + 1, D))
    with tp_context(0, 1):
        single = VocabParallelEmbedding(V, D)
    single.weight.weight_loader(single.weight, full)
    ids = torch.tensor([0, 99, 5])
    assert torch.equal(single(ids), full[ids])
    assert single.compute_logits(torch.ones(2, D)).shape == (2, V)


def test_opt_checkpoint_without_model_prefix(tmp_path_factory, tmp_path):
    src = make_tiny_model("opt", tmp_path_factory.mktemp("opt"), num_hidden_layers=1)
    ref = _tensors(f"{src}/model.safetensors")
    d = tmp_path / "bare"
    _copy_meta(src, d)
    save_file({k.removeprefix("model."): v for k, v in ref.items()}, str(d / "model.safetensors"))
    a, b = _params(_load(d)), _params(_load(src))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
