"""The engine on a CUDA GPU: CUDA-graph decode vs eager vs Hugging Face.

- float32: greedy tokens with CUDA graphs == eager (Triton backend) == eager torch backend
  == Hugging Face ``generate``, on every tiny architecture; batches that need padding to
  the captured ladder; prefix-cache hits; an in-place weight update between generations
  (graphs must see the new weights).
- bfloat16: greedy agreement with Hugging Face (bf16 and fp32 references) is *reported*
  (printed, and written as JSON to ``$RLSERVE_GPU_REPORT`` when set), with a loose floor.
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from rlserve import LLM, SamplingParams  # noqa: E402
from rlserve.layers.attention import get_attention_backend, set_attention_backend  # noqa: E402
from tests.gpu.report import write_report  # noqa: E402
from tests.tiny_models import ARCHS  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "Hello world! Hello there, how are you today? I am fine",
    "Once",
    "def main():\n    print('hello')",
    "Reinforcement learning from human feedback trains a policy with rollouts.",
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "I am fine, thank you.",
    "Once upon a time there was a tiny model",
    "[ ] { } ( ) + - * / =",
    "Berlin",
    "The capital of Germany is Berlin. The capital of France is",
]
NEW = 32
KW = dict(device="cuda", num_kv_blocks=512, max_num_seqs=16, block_size=16)


def hf_greedy(path, prompt_ids, new_tokens, dtype=torch.float32, model=None):
    from transformers import AutoModelForCausalLM

    if model is None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").cuda().eval()
    outs = []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids], device="cuda")
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


def greedy(n=NEW):
    return SamplingParams(temperature=0, max_tokens=n, min_tokens=n)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture
def restore_backend():
    name = get_attention_backend()
    yield
    set_attention_backend(name)


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_graphs_equal_eager_and_hf(arch, tiny_model, restore_backend, monkeypatch):
    path = tiny_model(arch)
    graphed = LLM(path, dtype="float32", **KW)
    runner = graphed.engine.executor.runner
    assert get_attention_backend() == "triton" and runner.use_cuda_graphs
    g_res = graphed.generate(PROMPTS, greedy())
    g_out, ids = tokens(g_res), [o.prompt_token_ids for o in g_res]
    assert runner.cuda_graphs is not None and runner.cuda_graphs.num_replays >= NEW - 1
    del graphed
    eager = LLM(path, dtype="float32", enforce_eager=True, **KW)
    assert eager.engine.executor.runner.cuda_graphs is None
    e_out = tokens(eager.generate(PROMPTS, greedy()))
    assert eager.engine.executor.runner.cuda_graphs is None
    del eager
    monkeypatch.setenv("RLSERVE_ATTENTION_BACKEND", "torch")
    t_out = tokens(LLM(path, dtype="float32", enforce_eager=True, **KW).generate(PROMPTS, greedy()))
    assert g_out == e_out, "CUDA graphs changed greedy outputs"
    assert e_out == t_out, "Triton backend differs from the torch backend"
    assert g_out == hf_greedy(path, ids, NEW)


def test_graphs_with_prefix_hits_preemption_and_odd_batches(tiny_model):
    path = tiny_model("qwen3")
    llm = LLM(path, dtype="float32", **dict(KW, block_size=4))
    ref = LLM(path, dtype="float32", enforce_eager=True, **dict(KW, block_size=4))
    for n in (1, 3, 5, 9, 11):  # pads to 1, 4, 8, 16, 16
        assert tokens(llm.generate(PROMPTS[:n], greedy(12))) == tokens(ref.generate(PROMPTS[:n], greedy(12)))
    before = llm.engine.stats["prefix_cache_hit_tokens"]
    again = tokens(llm.generate(PROMPTS, greedy(12)))
    assert llm.engine.stats["prefix_cache_hit_tokens"] > before
    assert again == tokens(ref.generate(PROMPTS, greedy(12)))
    small = LLM(path, dtype="float32", **dict(KW, block_size=4, num_kv_blocks=40, max_model_len=160,
                                              enable_prefix_caching=False))
    outs = tokens(small.generate(PROMPTS, greedy(40)))
    assert small.engine.stats["num_preemptions"] > 0
    assert outs == tokens(ref.generate(PROMPTS, greedy(40)))


def test_weight_update_in_place_keeps_graphs_valid(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    path = tiny_model("llama")
    llm = LLM(path, dtype="float32", **KW)
    first = tokens(llm.generate(PROMPTS[:4], greedy(16)))
    graphs = llm.engine.executor.runner.cuda_graphs
    assert graphs is not None
    torch.manual_seed(123)
    new = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").cuda().eval()
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    llm.engine.load_weights((n, t.detach().clone()) for n, t in new.state_dict().items())
    second = tokens(llm.generate(PROMPTS[:4], greedy(16)))
    assert llm.engine.executor.runner.cuda_graphs is graphs  # same graphs, replayed on new weights
    assert second != first
    ids = [o.prompt_token_ids for o in llm.generate(PROMPTS[:4], greedy(1))]
    assert second == hf_greedy(path, ids, 16, model=new)


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    seq = sum(x == y for x, y in zip(a, b)) / len(a)
    prefix = []
    for x, y in zip(a, b):
        k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
        prefix.append(k / len(x))
    return {"sequences_identical": seq, "mean_matching_prefix": sum(prefix) / len(prefix)}


def _teacher_forced(path, prompts_ids, outs, dtype) -> float:
    """Fraction of rlserve's tokens that are HF's argmax given rlserve's own prefix."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").cuda().eval()
    hit = tot = 0
    with torch.no_grad():
        for p, o in zip(prompts_ids, outs):
            x = torch.tensor([p + o], device="cuda")
            pred = model(x).logits[0, len(p) - 1 : -1].argmax(-1).tolist()
            hit += sum(int(a == b) for a, b in zip(pred, o))
            tot += len(o)
    return hit / tot


def test_bf16_agreement_with_hf(tiny_model):
    report = {}
    for arch in ("llama", "qwen3", "smollm"):
        # a wider init than HF's default 0.02 so the tiny random models have peaked, not flat,
        # next-token distributions (flat ones make any bf16 comparison a coin toss)
        path = tiny_model(arch, initializer_range=0.2)
        llm = LLM(path, dtype="bfloat16", **KW)
        outs = llm.generate(PROMPTS, greedy())
        ids = [o.prompt_token_ids for o in outs]
        ours = tokens(outs)
        row = {}
        for name, dt in (("hf_bf16", torch.bfloat16), ("hf_fp32", torch.float32)):
            row[name] = _agreement(ours, hf_greedy(path, ids, NEW, dtype=dt))
            row[name]["teacher_forced_top1"] = _teacher_forced(path, ids, ours, dt)
        report[arch] = row
    print("bf16 agreement:", json.dumps(report, indent=1))
    write_report("bf16_agreement", report)
    for row in report.values():
        assert row["hf_fp32"]["teacher_forced_top1"] > 0.8
