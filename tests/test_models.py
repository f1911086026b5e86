"""Our model implementations against Hugging Face transformers (float32, eager attention).

Each architecture in ``ARCHS`` is loaded through ``rlserve.loader.load_model``, run on a
paged KV cache (prefill of several prompts, then token-by-token decode), and compared with
``AutoModelForCausalLM`` on the same checkpoint.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from rlserve.config import EngineConfig
from rlserve.errors import UnsupportedArchitectureError
from rlserve.layers.attention import Attention, AttentionMetadata
from rlserve.loader import load_model
from rlserve.models.registry import get_model_class, supported_architectures
from tests.tiny_models import ARCHS, make_tiny_model

ATOL = 1e-4
BLOCK = 4


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    cache: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in cache:
            cache[arch] = make_tiny_model(arch, tmp_path_factory.mktemp(arch))
        return cache[arch]

    return get


def _load(path: str, load_format: str = "auto", seed: int = 0):
    cfg = AutoConfig.from_pretrained(path)
    model = load_model(EngineConfig(model=path, device="cpu", dtype="float32", load_format=load_format, seed=seed),
                       cfg, "cpu", torch.float32)
    return model, cfg


def _bind_cache(model, num_blocks: int = 32) -> None:
    for m in model.modules():
        if isinstance(m, Attention):
            m.k_cache = torch.zeros(num_blocks, BLOCK, m.num_kv_heads, m.head_dim)
            m.v_cache = torch.zeros(num_blocks, BLOCK, m.num_kv_heads, m.head_dim)


def _hf(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


def _prompts(vocab: int, lens=(5, 11, 3), seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def _run_step(model, seqs, query_lens, block_tables):
    """One forward over the last ``query_lens[i]`` tokens of each sequence. Returns logits [T, V]."""
    ids, pos = [], []
    for s, q in zip(seqs, query_lens):
        ids += s[len(s) - q:]
        pos += list(range(len(s) - q, len(s)))
    meta = AttentionMetadata.build(query_lens, [len(s) for s in seqs], block_tables, BLOCK)
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.tensor(pos), meta)
        return model.compute_logits(hidden)


def _split(logits: torch.Tensor, query_lens):
    out, start = [], 0
    for q in query_lens:
        out.append(logits[start:start + q])
        start += q
    return out


def _check_prefill_and_decode(path: str, decode_steps: int = 3):
    model, cfg = _load(path)
    _bind_cache(model)
    hf = _hf(path)
    seqs = _prompts(cfg.vocab_size)
    # non-contiguous, interleaved block ids: exercises the block tables
    tables = [[7, 2, 30, 11], [5, 9, 1, 20, 3, 14], [0, 25, 17]]
    qlens = [len(s) for s in seqs]
    logits = _run_step(model, seqs, qlens, tables)
    assert logits.dtype == torch.float32 and logits.shape == (sum(qlens), cfg.vocab_size)
    for s, got in zip(seqs, _split(logits, qlens)):
        ref = _hf_logits(hf, s)
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=1e-4)
        s.append(int(ref[-1].argmax()))
    for _ in range(decode_steps):
        logits = _run_step(model, seqs, [1, 1, 1], tables)
        for i, s in enumerate(seqs):
            ref = _hf_logits(hf, s)[-1]
            torch.testing.assert_close(logits[i], ref, atol=ATOL, rtol=1e-4)
            assert int(logits[i].argmax()) == int(ref.argmax())
            s.append(int(ref.argmax()))


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_match_hf(arch, tiny_dirs):
    _check_prefill_and_decode(tiny_dirs(arch))


def test_llama3_rope_scaling_matches_hf(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    path = make_tiny_model("llama", tmp_path / "l3", rope_parameters=rope, num_hidden_layers=1)
    model, _ = _load(path)
    assert model.model.layers[0].self_attn.rotary_emb.rope_type == "llama3"
    _check_prefill_and_decode(path, decode_steps=1)


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_chunked_prefill_mixed_with_decode(arch, tiny_dirs):
    """A prompt prefilled in two chunks while another sequence decodes in the same steps."""
    path = tiny_dirs(arch)
    model, cfg = _load(path)
    _bind_cache(model)
    hf = _hf(path)
    a, b = _prompts(cfg.vocab_size, lens=(4, 10), seed=1)
    tables = [[3, 8], [1, 6, 12]]
    _run_step(model, [a], [len(a)], [tables[0]])  # prefill a
    a.append(5)
    b_first = b[:6]
    out = _run_step(model, [a, b_first], [1, 6], tables)  # decode a + first chunk of b
    torch.testing.assert_close(out[0], _hf_logits(hf, a)[-1], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(out[1:], _hf_logits(hf, b_first), atol=ATOL, rtol=1e-4)
    a.append(9)
    out = _run_step(model, [a, b], [1, 4], tables)  # decode a + rest of b (query_len < seq_len)
    torch.testing.assert_close(out[0], _hf_logits(hf, a)[-1], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(out[1:], _hf_logits(hf, b)[6:], atol=ATOL, rtol=1e-4)


def test_unknown_architecture_raises():
    cfg = AutoConfig.for_model("gpt2")
    cfg.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(UnsupportedArchitectureError) as exc:
        get_model_class(cfg)
    assert "GPT2LMHeadModel" in str(exc.value)
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "OPTForCausalLM"):
        assert name in str(exc.value)
        assert name in supported_architectures()
    cfg.architectures = None
    with pytest.raises(UnsupportedArchitectureError):
        get_model_class(cfg)


def _safetensors_shapes(path: str) -> dict[str, tuple[int, ...]]:
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_spec_matches_safetensors(arch, tiny_dirs):
    path = tiny_dirs(arch)
    model, cfg = _load(path, load_format="dummy")
    spec = model.checkpoint_spec()
    on_disk = _safetensors_shapes(path)
    assert model.required_checkpoint_names() == set(on_disk)
    for name, shape in on_disk.items():
        assert spec[name] == shape, name
    extra = set(spec) - set(on_disk)
    assert extra == ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    if extra:
        assert spec["lm_head.weight"] == (cfg.vocab_size, getattr(cfg, "word_embed_proj_dim", cfg.hidden_size))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "opt_proj"])
def test_load_weights_returns_names_and_keeps_storage(arch, tiny_dirs):
    """Reloading (a weight sync) copies in place: same storage, new values."""
    path = tiny_dirs(arch)
    model, _ = _load(path, load_format="dummy")
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        weights = {k: f.get_tensor(k) for k in f.keys()}
    consumed = model.load_weights(weights.items())
    assert consumed == set(weights)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    # the values really landed: the embedding matches the checkpoint
    emb_name = "model.decoder.embed_tokens.weight" if arch.startswith("opt") else "model.embed_tokens.weight"
    emb = dict(model.named_parameters())[emb_name]
    torch.testing.assert_close(emb[: weights[emb_name].shape[0]], weights[emb_name], atol=0, rtol=0)


def test_load_weights_errors_leave_params_untouched(tiny_dirs):
    path = tiny_dirs("llama")
    model, cfg = _load(path, load_format="dummy")
    with pytest.raises(KeyError):
        model.load_weights([("model.layers.0.self_attn.nonexistent.weight", torch.zeros(3))])
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    before = qkv.detach().clone()
    bad = torch.ones(cfg.hidden_size + 1, cfg.hidden_size)  # q_proj is [64, 64]
    with pytest.raises(ValueError):
        model.load_weights([("model.layers.0.self_attn.q_proj.weight", bad)])
    assert torch.equal(qkv, before)
    with pytest.raises(ValueError):
        model.load_weights([("model.norm.weight", torch.ones(cfg.hidden_size + 2))])
    assert torch.equal(model.model.norm.weight, torch.ones(cfg.hidden_size))  # dummy norms are 1
    with pytest.raises(ValueError):
        model.load_weights([("model.norm.weight", torch.ones(cfg.hidden_size, dtype=torch.int64))])
    # rotary inv_freq buffers are skipped, not an error
    assert model.load_weights([("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8))]) == set()


def test_tied_lm_head_weight_is_optional_and_ignored(tiny_dirs):
    path = tiny_dirs("llama_tied")
    model, cfg = _load(path)
    assert model.lm_head is model.model.embed_tokens
    before = model.model.embed_tokens.weight.detach().clone()
    consumed = model.load_weights([("lm_head.weight", torch.zeros(cfg.vocab_size, cfg.hidden_size))])
    assert consumed == {"lm_head.weight"}
    assert torch.equal(model.model.embed_tokens.weight, before)
    assert "lm_head.weight" not in model.required_checkpoint_names()


def test_load_weights_accepts_other_dtypes(tiny_dirs):
    path = tiny_dirs("qwen2")
    model, _ = _load(path, load_format="dummy")
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        weights = [(k, f.get_tensor(k).to(torch.bfloat16)) for k in f.keys()]
    model.load_weights(weights)
    bias = model.model.layers[1].self_attn.qkv_proj.bias
    assert bias.dtype == torch.float32
    q_bias = dict(weights)["model.layers.1.self_attn.q_proj.bias"]
    torch.testing.assert_close(bias[: q_bias.shape[0]], q_bias.float(), atol=0, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_dummy_load_shapes_and_finite_outputs(arch, tiny_dirs):
    path = tiny_dirs(arch)
    model, cfg = _load(path, load_format="dummy", seed=3)
    ref = _hf(path)
    hf_shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    spec = model.checkpoint_spec()
    for name, shape in spec.items():
        assert hf_shapes[name] == shape, name
    _bind_cache(model)
    seqs = _prompts(cfg.vocab_size, lens=(4, 6))
    logits = _run_step(model, seqs, [4, 6], [[0, 1], [2, 3]])
    assert logits.shape == (10, cfg.vocab_size) and torch.isfinite(logits).all()
    for name, p in model.named_parameters():
        if "norm" in name:
            assert torch.all(p == 1) or torch.all(p == 0), name  # LayerNorm weight 1 / bias 0
        else:
            assert p.abs().max() <= 1e-3 and p.abs().max() > 0, name
    again, _ = _load(path, load_format="dummy", seed=3)
    other, _ = _load(path, load_format="dummy", seed=4)
    p0 = dict(model.named_parameters())
    assert all(torch.equal(p0[n], p) for n, p in again.named_parameters())
    assert not all(torch.equal(p0[n], p) for n, p in other.named_parameters())


# ---- tensor parallelism over gloo (2 CPU processes) -------------------------------------

def _prefill_and_decode(path):
    """The logits of a 2-sequence prefill (5 and 3 tokens) and of one decode step after it, of
    the model at ``path`` under the calling thread's TP state: ``(prefill, decode)``."""
    model, cfg = _load(path)
    _bind_cache(model)
    seqs = _prompts(cfg.vocab_size, lens=(5, 3))
    logits = _run_step(model, seqs, [5, 3], [[0, 1], [2]])
    seqs[0].append(7)
    seqs[1].append(9)
    return logits, _run_step(model, seqs, [1, 1], [[0, 1], [2]])


def _tp_worker(rank: int, world: int, port: int, paths: list[str], results: dict) -> None:
    from rlserve.distributed.group import StandaloneGroup
    from rlserve.distributed.parallel_state import tp_context

    group = StandaloneGroup("gloo", "127.0.0.1", port, rank, world, timeout_s=60)
    try:
        with tp_context(rank, world, group):
            for i, path in enumerate(paths):
                results[(i, rank)] = _prefill_and_decode(path)
    except BaseException as e:  # surfaced by the test
        results[("error", rank)] = e
        raise
    finally:
        group.destroy()


def test_tensor_parallel_2_matches_tp1(tmp_path, tiny_dirs):
    """TP=2 over gloo (one thread per rank; the TP state is per thread) gives the TP=1
    logits: q/k/v bias + untied head (qwen2), replicated KV heads (1 KV head over 2 ranks),
    tied vocab-parallel head with project_in/out (opt_proj), uneven GQA groups (SmolLM2's 9
    heads / 3 KV heads: 6+3 query and 2+1 KV heads, o_proj rows split 6:3)."""
    check_tp2_equals_tp1([
        tiny_dirs("qwen2"),
        make_tiny_model("llama_tied", tmp_path / "kv1", num_hidden_layers=1, num_key_value_heads=1),
        tiny_dirs("opt_proj"),
        make_tiny_model("smollm", tmp_path / "h9kv3", num_hidden_layers=1, num_attention_heads=9,
                        num_key_value_heads=3, hidden_size=144),
    ])


def check_tp2_equals_tp1(paths: list[str]) -> None:
    """The prefill and decode logits of each model in ``paths`` under TP=2 over gloo (one thread
    per rank) equal TP=1's at 1e-5 (float32; only the all-reduce's summation order differs)."""
    import threading

    from rlserve.distributed.group import get_open_port

    results: dict = {}
    port = get_open_port()
    threads = [threading.Thread(target=_tp_worker, args=(r, 2, port, paths, results), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "TP worker threads hung"
    errors = [v for k, v in results.items() if k[0] == "error"]
    if errors:
        raise errors[0]
    for i, path in enumerate(paths):
        ref, ref_dec = _prefill_and_decode(path)
        for rank in range(2):
            got, got_dec = results[(i, rank)]
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got_dec, ref_dec, atol=1e-5, rtol=1e-5)
