"""``rlserve.models.llama_cpu``: the CPU float32 decode step calling the kernels directly must
equal the module path bit for bit (same kernels, same arguments), be taken on decode steps
only, and step aside when switched off or when the fused kernels are off."""

from __future__ import annotations

import pytest
import torch

from rlserve.layers import fused_ops
from rlserve.layers.attention import AttentionMetadata
from rlserve.models import llama_cpu


@pytest.fixture
def fast_calls(monkeypatch):
    """Counts the layers that took the fast path: :func:`llama_cpu.layer_forward` calls, and every
    layer of a :func:`llama_cpu.stack_forward` call that ran (a team step's whole stack in one C
    call); restores the on/off switch afterwards."""
    calls = []
    real, real_stack = llama_cpu.layer_forward, llama_cpu.stack_forward

    def counting(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    def counting_stack(ctx, layers, hidden):
        out = real_stack(ctx, layers, hidden)
        if out is not None:
            calls.extend(layers)
        return out

    monkeypatch.setattr(llama_cpu, "layer_forward", counting)
    monkeypatch.setattr(llama_cpu, "stack_forward", counting_stack)
    prev = llama_cpu.set_enabled(True)
    yield calls
    llama_cpu.set_enabled(prev)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_fast_decode_equals_module_path(arch, tiny_model, fast_calls, monkeypatch):
    """Greedy tokens and logprobs of a whole tiny model (prefill, prefix-cache hit, decode)
    are identical with the fast path on and off; on, every decode step's layers take it.
    (Prefills through the modules in both: ``RLSERVE_CPU_STACK_PREFILL=0``; the direct prefill's
    attention sums in another order, test_team_prefill_direct_kernels_match_module_path.)"""
    from rlserve import LLM, SamplingParams

    monkeypatch.setenv("RLSERVE_CPU_STACK_PREFILL", "0")
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6, logprobs=3)
    prompts = ["The capital of France is", "Hello world", "The capital of France is a"]
    path = tiny_model(arch)
    llama_cpu.set_enabled(False)  # a fresh engine each: a second generate would hit the prefix cache
    ref = LLM(path, dtype="float32", device="cpu", block_size=4).generate(prompts, params)
    assert fast_calls == []
    llama_cpu.set_enabled(True)
    llm = LLM(path, dtype="float32", device="cpu", block_size=4)
    got = llm.generate(prompts, params)
    n_layers = len(llm.engine.model.model.layers)
    assert fast_calls, "decode steps did not take the fast path"
    assert len(fast_calls) % n_layers == 0 and fast_calls[:n_layers] == list(llm.engine.model.model.layers)
    for a, b in zip(got, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # bit-equal, not close


def _decode_meta(batch: int) -> AttentionMetadata:
    return AttentionMetadata.build([1] * batch, [5] * batch, [[i] * 2 for i in range(batch)], 4)


def test_step_context_only_for_cpu_float32_decode(tiny_model, monkeypatch):
    """Decode steps get a context; steps with prefills only on a CPU team (every query token as a
    one-token sequence over its own context) with ``RLSERVE_CPU_STACK_PREFILL`` on."""
    from rlserve import LLM
    from rlserve.layers import cpu_gemm

    llm = LLM(tiny_model("llama"), dtype="float32", device="cpu", block_size=4, extra={"cpu_team": 2})
    llm.generate(["warm up"])  # binds the KV cache
    model = llm.engine.model.model
    layers = model.layers
    h = torch.zeros(2, model.embed_tokens.weight.shape[1])
    pos = torch.tensor([4, 4])
    ctx = llama_cpu.step_context(layers, h, pos, _decode_meta(2))
    assert ctx is not None and not ctx.prefill
    prefill = AttentionMetadata.build([2, 1], [5, 5], [[0, 1], [2, 3]], 4)
    h3, pos3 = torch.zeros(3, h.shape[1]), torch.tensor([3, 4, 4])
    with cpu_gemm.use(cpu_gemm.Team(2)):
        ctx = llama_cpu.step_context(layers, h3, pos3, prefill)
        assert ctx is not None and ctx.prefill and ctx.team
        assert ctx.sl.tolist() == [4, 5, 5] and ctx.bt.tolist() == [[0, 1], [0, 1], [2, 3]]
        monkeypatch.setenv("RLSERVE_CPU_STACK_PREFILL", "0")
        assert llama_cpu.step_context(layers, h3, pos3, prefill) is None
        monkeypatch.delenv("RLSERVE_CPU_STACK_PREFILL")
        monkeypatch.setattr(llama_cpu, "STACK_PREFILL_MAX_CTX", 13)  # the step's keys: 4 + 5 + 5
        assert llama_cpu.step_context(layers, h3, pos3, prefill) is not None  # no limit for query tiles
        monkeypatch.setenv("RLSERVE_CPU_PREFILL_TILES", "0")  # one decode query per token: limited
        assert llama_cpu.step_context(layers, h3, pos3, prefill) is None
    with cpu_gemm.use(cpu_gemm.Team(1)):  # no team: prefills through the modules
        assert llama_cpu.step_context(layers, h3, pos3, prefill) is None
    assert llama_cpu.step_context(layers, h.double(), pos, _decode_meta(2)) is None
    prev = llama_cpu.set_enabled(False)
    try:
        assert llama_cpu.step_context(layers, h, pos, _decode_meta(2)) is None
    finally:
        llama_cpu.set_enabled(prev)
    prev_fused = fused_ops.set_fused_kernels(False)
    try:
        assert llama_cpu.step_context(layers, h, pos, _decode_meta(2)) is None
    finally:
        fused_ops.set_fused_kernels(*prev_fused)



def test_fast_path_after_sleep_and_weight_sync(tiny_model, tmp_path, fast_calls, monkeypatch):
    """``_layer_ok`` is cached per layer at the first decode step: after a level-1 sleep/wake
    the fast path serves exactly what it served before, and after a level-2 sleep refilled by
    a weight sync (new packed copies) it serves the new weights bit-equal to a fresh module-path
    engine on them; decode steps take the fast path throughout (prefills through the modules:
    ``RLSERVE_CPU_STACK_PREFILL=0``, for the bit-equality)."""
    from rlserve import LLM, SamplingParams
    from rlserve.loader import iterate_checkpoint
    from tests.tiny_models import make_tiny_model

    monkeypatch.setenv("RLSERVE_CPU_STACK_PREFILL", "0")
    old, new = tiny_model("llama"), make_tiny_model("llama", tmp_path / "new", seed=1)
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6, logprobs=2)
    prompts = [[5, 9, 13, 2, 7], [3, 3, 8]]

    def run(llm):
        n = len(fast_calls)
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return [o.token_ids for o in outs], [o.logprobs for o in outs], len(fast_calls) - n

    llm = LLM(old, dtype="float32", device="cpu", block_size=4, kv_cache_bytes=4 << 20, enable_sleep_mode=True)
    ids0, lps0, n0 = run(llm)
    assert n0 > 0 and all(layer.__dict__["_cpu_fast_ok"] is True for layer in llm.engine.model.model.layers)
    llm.sleep(level=1)
    llm.wake_up()
    ids1, lps1, n1 = run(llm)
    assert (ids1, lps1, n1) == (ids0, lps0, n0)
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    llm.engine.load_weights(iterate_checkpoint(new))
    llm.wake_up(tags=["kv_cache"])
    ids2, lps2, n2 = run(llm)
    assert n2 == n0 and ids2 != ids0  # still the fast path, serving the synced weights
    llama_cpu.set_enabled(False)
    ref_ids, ref_lps, n_ref = run(LLM(new, dtype="float32", device="cpu", block_size=4))
    assert n_ref == 0
    assert ids2 == ref_ids and lps2 == ref_lps  # bit-equal, not close


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_team_stack_in_one_call_equals_layer_by_layer(arch, tiny_model, monkeypatch):
    """On a team of 2, a step's layers in one C call (:func:`llama_cpu.stack_forward`: q/k norms
    for qwen3, biases for qwen2) give the same greedy tokens and logprobs, bit for bit, as the
    same engine's layers called one by one, and every step took it (decode steps, and prefills of
    fewer and of more than 32 rows: from 32 rows the per-row kernels run on the team by blocks)."""
    from rlserve import LLM, SamplingParams
    from rlserve.layers import cpu_gemm

    used = []
    real = llama_cpu.stack_forward

    rows = []

    def recording(*args):
        out = real(*args)
        used.append(out is not None)
        rows.append(args[2].shape[0])
        return out

    monkeypatch.setattr(llama_cpu, "stack_forward", recording)
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6, logprobs=3)
    prompts = ["The capital of France is", "Hello world", "One two three four five six seven",
               "The quick brown fox jumps over the lazy dog, " * 4]
    path = tiny_model(arch)
    runs = {}
    for on in (False, True):
        prev = llama_cpu.set_stack_enabled(on)
        try:
            llm = LLM(path, dtype="float32", device="cpu", block_size=4, extra={"cpu_team": 2})
            assert cpu_gemm.size() == 2
            runs[on] = [o.outputs[0] for o in llm.generate(prompts, params)]
        finally:
            llama_cpu.set_stack_enabled(prev)
    assert used and all(used)  # on: every team step ran the stack in C (off: never called)
    assert max(rows) >= 32
    assert [o.token_ids for o in runs[True]] == [o.token_ids for o in runs[False]]
    assert [o.logprobs for o in runs[True]] == [o.logprobs for o in runs[False]]  # bit-equal, not close


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_team_prefill_direct_kernels_match_module_path(arch, tiny_model, monkeypatch):
    """On a team of 2, steps with prefills (a fresh prompt, a prefix-cache hit, chunks of a long
    prompt beside decode rows) run the direct kernels in one C call (the attention by causal query
    tiles, and with ``RLSERVE_CPU_PREFILL_TILES=0`` every query token through the paged decode
    kernel over its own context): the same greedy tokens as the module path
    (``RLSERVE_CPU_STACK_PREFILL=0``: gather + SDPA), logprobs within 2e-5, and every prefill
    step took the stack."""
    from rlserve import LLM, SamplingParams

    seen = []
    real = llama_cpu.stack_forward

    def recording(ctx, layers, hidden):
        out = real(ctx, layers, hidden)
        seen.append((ctx.prefill, out is not None))
        return out

    monkeypatch.setattr(llama_cpu, "stack_forward", recording)
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6, logprobs=3)
    long = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen"
    prompts = ["The capital of France is", "Hello world", "The capital of France is a", long]
    runs = {}
    for on in ("0", "1", "per-query"):
        monkeypatch.setenv("RLSERVE_CPU_STACK_PREFILL", "0" if on == "0" else "1")
        monkeypatch.setenv("RLSERVE_CPU_PREFILL_TILES", "0" if on == "per-query" else "1")
        seen.clear()
        llm = LLM(tiny_model(arch), dtype="float32", device="cpu", block_size=4, extra={"cpu_team": 2},
                  max_num_batched_tokens=8, enable_chunked_prefill=True)
        runs[on] = [o.outputs[0] for o in llm.generate(prompts, params)]
        prefills = [ran for pre, ran in seen if pre]
        assert (len(prefills) > 0 and all(prefills)) if on != "0" else prefills == []
    for direct in ("1", "per-query"):
        for a, b in zip(runs[direct], runs["0"]):
            assert a.token_ids == b.token_ids
            for da, db in zip(a.logprobs, b.logprobs):
                assert da.keys() == db.keys()
                assert max(abs(da[k] - db[k]) for k in da) < 2e-5

