"""LoRA on the GPU: the Triton kernels (rlserve.lora.triton_ops) compiled, against a float32
reference; the engine on the kernel path (base + three adapters in one batch) against PEFT's
merged model in float32, with decode CUDA graphs equal to eager; adapter-only sync over CUDA IPC
(and NCCL, which needs two GPUs) serving exactly the trainer's PEFT model."""

from __future__ import annotations

import pytest
import torch

from tests.lora_adapters import hf_greedy_logprobs, make_adapter, merged_model
from tests.test_lora_sync import NEW_TOKENS, _complete as _served

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

NEW = NEW_TOKENS
#: float32 on both sides (IEEE products in the LoRA kernels, rlserve's float32 GEMMs vs HF's):
#: summation order only; tests/test_lora.py's bound on logprobs
LP_ATOL = 1e-4


def _case(T, K, sizes, maxr, slots, dtype, seed):
    from rlserve.lora.layers import segments

    g = torch.Generator().manual_seed(seed)
    N = sum(sizes)
    x = torch.randn(T, K, generator=g).to(dtype)
    a = (torch.randn(slots, len(sizes) * maxr, K, generator=g) / K ** 0.5).to(dtype)
    b = torch.randn(slots, N, maxr, generator=g).to(dtype)
    row_slot = torch.randint(-1, slots, (T,), generator=g).tolist()
    row_slot[0] = T % slots  # at least one row on an adapter
    rows, seg_start, seg_slot = segments([s + 1 for s in row_slot], [1] * T, {s + 1: s for s in range(slots)})
    y0 = torch.randn(T, N, generator=g).to(dtype)
    ref = y0.double().clone()
    offs = [sum(sizes[:i]) for i in range(len(sizes))]
    for i, s in enumerate(row_slot):
        if s >= 0:
            t = a[s].double() @ x[i].double()
            for k, (o, n) in enumerate(zip(offs, sizes)):
                ref[i, o:o + n] += b[s, o:o + n].double() @ t[k * maxr:(k + 1) * maxr]
    meta = [torch.tensor(v, dtype=torch.int32, device="cuda") for v in (rows, seg_start, seg_slot)]
    longest = max(e - s for s, e in zip(seg_start, seg_start[1:]))
    return x.cuda(), a.cuda(), b.cuda(), y0.cuda(), ref, tuple(offs), meta, longest


@pytest.mark.parametrize("T", [1, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("maxr", [16, 64])
def test_kernels_match_float64_reference(T, dtype, maxr):
    from rlserve.lora.triton_ops import lora_expand, lora_shrink

    x, a, b, y0, ref, offs, meta, longest = _case(T, 1024, (1024, 256, 256), maxr, 4, dtype, T + maxr)
    y = y0.clone()
    lora_expand(lora_shrink(x, a, *meta, longest), b, y, offs, *meta, longest)
    # float32: IEEE products, float32 sums of 1024 (shrink) / maxr (expand) terms of O(1): ~1e-5
    # relative; bfloat16: y is stored in bfloat16 (2^-8 relative) and t is rounded to bfloat16
    # before the expand: 2 x 2^-8 of max |y|
    tol = 1e-4 if dtype == torch.float32 else 2 * 2 ** -8
    err = (y.double().cpu() - ref).abs().max().item()
    assert err <= tol * ref.abs().max().item(), (err, ref.abs().max().item())


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    base = tiny_model("llama")
    d = tmp_path_factory.mktemp("lora-gpu")
    return base, {1: make_adapter(base, d / "a1", seed=1, r=8, alpha=16),
                  2: make_adapter(base, d / "a2", seed=2, r=16, alpha=8, targets=["q_proj", "v_proj", "o_proj"],
                                  use_rslora=True),
                  3: make_adapter(base, d / "a3", seed=3, r=4, alpha=4, targets=["gate_proj", "down_proj"])}


def _run(base, paths, **kw):
    from rlserve import LLM, SamplingParams
    from rlserve.lora.model import lora_of

    llm = LLM(base, dtype="float32", device="cuda", enable_lora=True, max_loras=3, max_lora_rank=16,
              max_num_seqs=16, num_kv_blocks=64, **kw)  # a small cache: two engines in turn
    lora = lora_of(llm.engine.model)
    assert lora.kernel
    for i, p in paths.items():
        lora.load(i, p)
    prompts = [[5, 9, 13, 17, 21, 3], [7, 7, 8, 30, 2, 11, 12]]
    ids = [0, 1, 2, 3]
    params = [SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0, lora_int_id=a)
              for _ in prompts for a in ids]
    outs = llm.generate([p for p in prompts for _ in ids], params)
    runner = llm.engine.executor.runner
    res = [(o.prompt_token_ids, p.lora_int_id, list(o.outputs[0].token_ids),
            [o.outputs[0].logprobs[i][t] for i, t in enumerate(o.outputs[0].token_ids)]) for o, p in zip(outs, params)]
    replays = runner.lora_graphs.num_replays if runner.lora_graphs is not None else 0
    del llm, runner, lora
    torch.cuda.empty_cache()
    return res, replays


def test_engine_kernel_path_matches_peft_and_graphs_equal_eager(adapters):
    base, paths = adapters
    graphed, replays = _run(base, paths)
    assert replays >= NEW - 1  # decode steps with adapters replayed the LoRA graphs
    eager, none = _run(base, paths, enforce_eager=True)
    assert none == 0
    refs = {a: merged_model(base, paths.get(a)) for a in (0, 1, 2, 3)}
    seen = set()
    for (prompt, a, g_ids, g_lps), (_, _, e_ids, e_lps) in zip(graphed, eager):
        want_ids, want_lps = hf_greedy_logprobs(refs[a], prompt, NEW)
        assert g_ids == e_ids == want_ids, a
        # graphs vs eager: the same kernels on other grids (the static one splits the shrink's K otherwise)
        torch.testing.assert_close(torch.tensor(g_lps), torch.tensor(e_lps), atol=LP_ATOL, rtol=0)
        torch.testing.assert_close(torch.tensor(e_lps), torch.tensor(want_lps), atol=LP_ATOL, rtol=0)
        seen.add((tuple(prompt), tuple(g_ids)))
    assert len(seen) >= 6


def _peft_cuda(base, r, seed):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.lora_adapters import ALL_TARGETS

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=16, target_modules=ALL_TARGETS, lora_dropout=0.0,
                                                  init_lora_weights=False))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return peft_model.cuda()


def _sync_and_check(srv, init_info, base, tmp_path):
    from rlserve.transfer import HTTPWeightSyncClient, LoRASource, WeightTransferTrainerFactory

    trainer = _peft_cuda(base, 8, seed=5)
    eng = WeightTransferTrainerFactory.trainer_init(init_info=init_info, client=HTTPWeightSyncClient(srv.url),
                                                    source=LoRASource(trainer, "policy"))
    prompt = list(range(5, 45))
    try:
        for step in range(2):
            if step:
                with torch.no_grad():
                    for n, p in trainer.named_parameters():
                        if "lora_" in n:
                            p.add_(0.2 * torch.randn_like(p))
            fin = eng.send_weights()
            assert fin["lora_version"] == str(step + 1)
            factor_bytes = sum(p.numel() * 4 for n, p in trainer.named_parameters() if "lora_" in n)
            assert factor_bytes <= fin["bytes"] <= factor_bytes + 256 * 2 * 7 * 2  # slot alignment
            d = tmp_path / f"v{step}"
            trainer.save_pretrained(str(d))
            want = hf_greedy_logprobs(merged_model(base, str(d)), prompt, NEW)
            got = _served(srv.url, "policy", prompt)
            assert got[0] == want[0]
            assert max(abs(x - y) for x, y in zip(got[1], want[1])) < LP_ATOL
    finally:
        eng.shutdown()


def test_adapter_sync_over_ipc(adapters, tmp_path):
    from rlserve.transfer import IPCTrainerInitInfo
    from tests.transfer_harness import InProcessServer

    base, _ = adapters
    with InProcessServer(base, transfer_config={"backend": "ipc"}, device="cuda", dtype="float32",
                         load_format="auto", enable_lora=True, max_lora_rank=8) as srv:
        _sync_and_check(srv, IPCTrainerInitInfo(timeout_s=60), base, tmp_path)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (one rank per GPU: the trainer on "
                    "cuda:1, the server on cuda:0)")
def test_adapter_sync_over_nccl(adapters, tmp_path):
    from rlserve.transfer import NCCLTrainerInitInfo
    from tests.transfer_harness import InProcessServer

    base, _ = adapters
    with InProcessServer(base, transfer_config={"backend": "nccl"}, device="cuda:0", dtype="float32",
                         load_format="auto", enable_lora=True, max_lora_rank=8) as srv:
        torch.cuda.set_device(1)
        try:
            _sync_and_check(srv, NCCLTrainerInitInfo(world_size=2, timeout_s=60,
                                                     device="cuda:1"), base, tmp_path)
        finally:
            torch.cuda.set_device(0)


def _merged_matches_peft(base, paths, device, monkeypatch):
    """The one-adapter fast path (RLSERVE_LORA_MERGE=1) on ``device``, float32: two prompts all on
    adapter 1 long enough to merge part way; tokens and logprobs = PEFT's merged model."""
    from rlserve import LLM, SamplingParams
    from rlserve.lora.merge import AFTER_STEPS
    from rlserve.lora.model import lora_of

    monkeypatch.setenv("RLSERVE_LORA_MERGE", "1")
    n = AFTER_STEPS + 6
    llm = LLM(base, dtype="float32", device=device, enable_lora=True, max_loras=1, max_lora_rank=16,
              max_num_seqs=4, num_kv_blocks=64)
    lora = lora_of(llm.engine.model)
    lora.load(1, paths[1])
    prompts = [[5, 9, 13, 17, 21, 3], [7, 7, 8, 30, 2, 11, 12]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0,
                                                lora_int_id=1))
    assert lora.merge.merges == 1 and lora.merge.merged == 1
    ref = merged_model(base, paths[1])
    for p, o in zip(prompts, outs):
        want_ids, want_lps = hf_greedy_logprobs(ref, p, n)
        c = o.outputs[0]
        assert list(c.token_ids) == want_ids
        torch.testing.assert_close(torch.tensor([c.logprobs[i][t] for i, t in enumerate(c.token_ids)]),
                                   torch.tensor(want_lps), atol=LP_ATOL, rtol=0)
    del llm, lora


def test_merged_fast_path_matches_peft(adapters, monkeypatch):
    base, paths = adapters
    _merged_matches_peft(base, paths, "cuda", monkeypatch)
    torch.cuda.empty_cache()
