"""Routed-experts replay (vLLM's ``--enable-return-routed-experts``) on tiny MoE models, float32
on CPU: every sample's ``routed_experts`` equals Hugging Face's router top-k
(``output_router_logits=True`` -> top-k of each MoE layer's router logits) for every forwarded
token, prompt and completion; offline ``LLM``, after a prefix-cache hit, after preemption, and
over HTTP (completions, chat, TRL's ``/generate/``) through the engine-core process, where a
stop string matched in the API process cuts the rows with the tokens.

Exact equality is expected: the ids are a top-k of float32 logits whose gaps (~1e-2 with these
random weights) are far above the ~1e-6 differences between the two implementations.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlserve.engine.llm import LLM
from rlserve.engine.routed_experts import decode_routed_experts, encode_routed_experts
from rlserve.engine.sampling_params import SamplingParams
from rlserve.errors import InvalidRequestError
from rlserve.server.testing import ServerProcess

PROMPTS = [[5, 17, 42, 9, 77, 3, 11, 12, 13, 14, 15, 16, 17], [100, 101, 7]]


def hf_routed(path: str, token_ids: list[int]) -> np.ndarray:
    """HF's routing of ``token_ids``: ``[len, num_hidden_layers, top_k]`` int64, each MoE layer's
    router top-k (largest first), zeros for dense layers (vLLM's convention)."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    cfg = hf.config
    with torch.no_grad():
        out = hf(torch.tensor([token_ids]), output_router_logits=True)
    sparse = [i for i, layer in enumerate(hf.model.layers) if type(layer.mlp).__name__.endswith("SparseMoeBlock")]
    assert len(out.router_logits) == len(sparse)
    ref = np.zeros((len(token_ids), cfg.num_hidden_layers, cfg.num_experts_per_tok), dtype=np.int64)
    for i, logits in zip(sparse, out.router_logits):
        ref[:, i] = torch.topk(logits.reshape(len(token_ids), -1), cfg.num_experts_per_tok, dim=-1).indices.numpy()
    return ref


def _check(path, out, start: int = 0):
    c = out.outputs[0]
    full = list(out.prompt_token_ids) + list(c.token_ids)
    arr = c.routed_experts
    assert arr.dtype == np.uint8 and arr.shape[0] == len(full) - 1 - start
    np.testing.assert_array_equal(arr.astype(np.int64), hf_routed(path, full[:-1])[start:])


@pytest.fixture(scope="module")
def moe_path(tiny_model):
    return tiny_model("qwen3_moe", decoder_sparse_step=2, num_hidden_layers=3)  # layer 1 sparse, 0 and 2 dense


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_offline_ids_equal_hf_router_topk(arch, tiny_model):
    path = tiny_model(arch)
    llm = LLM(path, dtype="float32", device="cpu", enable_return_routed_experts=True)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, min_tokens=6))
    for out in outs:
        _check(path, out)
    assert outs[0].outputs[0].routed_experts.shape == (len(PROMPTS[0]) + 5, 2, 2)


def test_replay_through_decode_graph_path_equals_hf(tiny_model):
    """Decode steps through the CUDA-graph path (``DecodeCUDAGraphs`` emulates replay on CPU:
    static buffers, batches padded to the captured sizes 1, 2, 4): the rows of padded batches
    come from the capture's reserved buffer (``RoutedExpertsCapture.replayed``) and still equal
    HF's router top-k; greedy tokens equal the eager engine's. Fails on the old main (no
    ``after_graph_replay``: the recorder found the padded batch's rows or none)."""
    path = tiny_model("qwen3_moe")
    prompts = PROMPTS + [[9, 8, 7, 6, 5]]  # 3 sequences: padded to the captured size 4
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6)
    eager = LLM(path, dtype="float32", device="cpu", enable_return_routed_experts=True).generate(prompts, params)
    llm = LLM(path, dtype="float32", device="cpu", enable_return_routed_experts=True, max_num_seqs=4)
    runner = llm.engine.executor.runner
    runner.use_cuda_graphs = True
    outs = llm.generate(prompts, params)
    assert runner.cuda_graphs is not None and runner.cuda_graphs.sizes == [1, 2, 4]
    assert runner.cuda_graphs.num_replays > 0
    for out, ref in zip(outs, eager):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        _check(path, out)
        np.testing.assert_array_equal(out.outputs[0].routed_experts, ref.outputs[0].routed_experts)


def test_dense_layers_zero_prompt_start_and_off_by_default(moe_path):
    llm = LLM(moe_path, dtype="float32", device="cpu", enable_return_routed_experts=True, block_size=4)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, min_tokens=5))[0]
    _check(moe_path, out)
    arr = out.outputs[0].routed_experts
    assert arr.shape == (len(PROMPTS[0]) + 4, 3, 2) and not arr[:, 0].any() and not arr[:, 2].any()
    assert (arr[:, 1, 0] != arr[:, 1, 1]).all()
    # routed_experts_prompt_start drops the first rows (vLLM's field); the prompt length is the bound
    cut = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, min_tokens=5,
                                                  routed_experts_prompt_start=4))[0]
    np.testing.assert_array_equal(cut.outputs[0].routed_experts, arr[4:])
    with pytest.raises(InvalidRequestError, match="routed_experts_prompt_start"):
        llm.generate(PROMPTS[1], SamplingParams(max_tokens=2, routed_experts_prompt_start=4))
    with pytest.raises(InvalidRequestError, match="routed_experts_prompt_start"):
        SamplingParams(routed_experts_prompt_start=-1)
    plain = LLM(moe_path, dtype="float32", device="cpu")
    assert plain.generate(PROMPTS[1], SamplingParams(max_tokens=2))[0].outputs[0].routed_experts is None


def test_prefix_cache_hit_keeps_prompt_routing(moe_path):
    """The second request reuses the first's full prompt blocks (KV not recomputed); its rows
    for those positions come from the slots beside them and still equal HF's."""
    llm = LLM(moe_path, dtype="float32", device="cpu", enable_return_routed_experts=True, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=4)
    llm.generate(PROMPTS[0], params)
    hits = llm.engine.stats["prefix_cache_hit_tokens"]
    out = llm.generate(PROMPTS[0][:12] + [60, 61], params)[0]
    assert llm.engine.stats["prefix_cache_hit_tokens"] - hits == 12  # three blocks of 4 reused
    _check(moe_path, out)


def test_preemption_recomputes_routing(moe_path):
    """A KV cache too small for both sequences: one is preempted and recomputed; its rows
    still equal HF's."""
    llm = LLM(moe_path, dtype="float32", device="cpu", enable_return_routed_experts=True, block_size=4,
              num_kv_blocks=10, max_model_len=40)
    outs = llm.generate([PROMPTS[0], PROMPTS[0][::-1]], SamplingParams(temperature=0, max_tokens=12, min_tokens=12))
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outs:
        _check(moe_path, out)


def test_tensor_parallel_2_replay(tiny_model):
    """TP=2 (two CPU processes over gloo): rank 0's replicated router sees every token; its
    capture alone gives the rows, equal to HF's, and the greedy tokens equal HF's."""
    from tests.test_engine import hf_greedy

    path = tiny_model("qwen3_moe")
    llm = LLM(path, dtype="float32", device="cpu", tensor_parallel_size=2, enable_return_routed_experts=True)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, min_tokens=6))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS, 6)
    for out in outs:
        _check(path, out)


def test_dense_model_refuses_replay(tiny_model):
    with pytest.raises(InvalidRequestError, match="mixture-of-experts"):
        LLM(tiny_model("llama"), dtype="float32", device="cpu", enable_return_routed_experts=True)


def test_encoding_is_vllm_numpy2base64():
    arr = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    s = encode_routed_experts(arr)
    got = decode_routed_experts(s)
    assert got.dtype == np.uint8 and np.array_equal(got, arr)
    import base64

    assert base64.b64decode(s)[:6] == b"\x93NUMPY"  # the .npy magic: np.load reads it
    import io

    buf = io.BytesIO()
    np.save(buf, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError):  # an object array needs pickle: refused
        decode_routed_experts(base64.b64encode(buf.getvalue()).decode())
    with pytest.raises(ValueError):  # not base64
        decode_routed_experts("!!" + s)


# ---- over HTTP, through the engine-core process ------------------------------------------
@pytest.fixture(scope="module")
def server(moe_path):
    with ServerProcess(moe_path, "--enable-return-routed-experts", "--max-model-len", "128", "--device", "cpu",
                       "--dtype", "float32", "--block-size", "4", "--disable-access-log") as srv:
        yield srv


def _post(server, route, body):
    r = httpx.post(server.url + route, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_http_completions_chat_and_trl(server, moe_path):
    body = {"model": moe_path, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    c = _post(server, "/v1/completions", body)["choices"][0]
    arr = decode_routed_experts(c["routed_experts"])
    assert arr.dtype == np.uint8
    np.testing.assert_array_equal(arr, hf_routed(moe_path, PROMPTS[0] + c["token_ids"][:-1]))
    cut = _post(server, "/v1/completions", dict(body, routed_experts_prompt_start=5))["choices"][0]
    np.testing.assert_array_equal(decode_routed_experts(cut["routed_experts"]), arr[5:])
    r = httpx.post(server.url + "/v1/completions", json=dict(body, routed_experts_prompt_start=-1), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "routed_experts_prompt_start"
    r = httpx.post(server.url + "/v1/completions", json=dict(body, routed_experts_prompt_start=99), timeout=60)
    assert r.status_code == 400 and "routed_experts_prompt_start" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "routed_experts_prompt_start", r.text

    chat = _post(server, "/v1/chat/completions", {
        "model": moe_path, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5,
        "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    ch = chat["choices"][0]
    full = chat["prompt_token_ids"] + ch["token_ids"]
    np.testing.assert_array_equal(decode_routed_experts(ch["routed_experts"]), hf_routed(moe_path, full[:-1]))

    trl = _post(server, "/generate/", {"prompt_ids": PROMPTS, "max_tokens": 4, "temperature": 0, "n": 2,
                                        "generation_kwargs": {"ignore_eos": True}})
    assert len(trl["routed_experts"]) == 4  # n=2 per prompt, prompt-major like completion_ids
    for j, s in enumerate(trl["routed_experts"]):
        full = trl["prompt_ids"][j // 2] + trl["completion_ids"][j]
        np.testing.assert_array_equal(decode_routed_experts(s), hf_routed(moe_path, full[:-1]))


def test_http_stop_string_cuts_rows_with_tokens(server, moe_path):
    """A stop string matched in the API process drops the tokens the core sampled past it; the
    rows are cut to the kept tokens (one row per forwarded token)."""
    tok = AutoTokenizer.from_pretrained(moe_path)
    body = {"model": moe_path, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    full = _post(server, "/v1/completions", body)["choices"][0]
    ids = full["token_ids"]
    # a stop string completed by token k: the text of tokens [k-1, k] not seen before in the output
    k = next(k for k in range(3, 10) if tok.decode(ids[k - 1:k + 1]).strip()
             and tok.decode(ids[k - 1:k + 1]) not in tok.decode(ids[:k]))
    stop = tok.decode(ids[k - 1:k + 1])
    c = _post(server, "/v1/completions", dict(body, stop=[stop]))["choices"][0]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == stop
    kept = c["token_ids"]
    assert kept == ids[:len(kept)] and len(kept) < len(ids)
    arr = decode_routed_experts(c["routed_experts"])
    assert arr.shape[0] == len(PROMPTS[0]) + len(kept) - 1
    np.testing.assert_array_equal(arr, decode_routed_experts(full["routed_experts"])[:arr.shape[0]])
