"""Adapter-only weight sync (rlserve.lora.sync) over gloo on CPU: a trainer's PEFT model sends its
LoRA factors through the trainer SDK (``LoRASource``) into a running server; the served adapter's
outputs then equal the trainer's PEFT merged model (float32 greedy tokens, logprobs within 1e-4),
every sync is a new version with its own prefix-cache entries, and a refused or broken sync leaves
the served adapter as it was."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.lora_adapters import ALL_TARGETS, hf_greedy_logprobs, merged_model
from tests.transfer_harness import InProcessServer

#: float32 logprobs of two implementations of the same float32 model (HF eager vs rlserve's
#: kernels) differ by summation order only: ~1e-6 seen; 1e-4 is tests/test_lora.py's bound
LOGPROB_TOL = 1e-4
NEW_TOKENS = 6


def _peft(base: str, r: int, seed: int, alpha: int = 16):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=ALL_TARGETS, lora_dropout=0.0, init_lora_weights=False)
    peft_model = get_peft_model(model, cfg)
    _train_step(peft_model, seed, 0.3, set_=True)
    return peft_model


def _train_step(peft_model, seed: int, scale: float, set_: bool = False) -> None:
    """A stand-in for an optimizer step: every factor += (or =) scale x N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                noise = torch.randn(p.shape, generator=g) * scale
                p.copy_(noise) if set_ else p.add_(noise)


def _reference(peft_model, base: str, tmp_path, prompt: list[int]) -> tuple[list[int], list[float]]:
    """The trainer's model now: PEFT's merged model of its current factors."""
    d = tmp_path / f"ref-{id(peft_model)}-{torch.randint(1 << 30, ()).item()}"
    peft_model.save_pretrained(str(d))
    return hf_greedy_logprobs(merged_model(base, str(d)), prompt, NEW_TOKENS)


def _complete(url: str, model: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS,
                                                  "temperature": 0, "ignore_eos": True, "logprobs": 0,
                                                  "return_token_ids": True}, timeout=120)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    return ch["token_ids"], ch["logprobs"]["token_logprobs"]


def _assert_same(got, want):
    assert got[0] == want[0]
    assert max(abs(a - b) for a, b in zip(got[1], want[1])) < LOGPROB_TOL


def _engine(srv, source):
    from rlserve.transfer import GlooTrainerInitInfo, HTTPWeightSyncClient, WeightTransferTrainerFactory

    return WeightTransferTrainerFactory.trainer_init(
        init_info=GlooTrainerInitInfo(world_size=2, timeout_s=60),
        client=HTTPWeightSyncClient(srv.url), source=source)


@pytest.fixture(scope="module")
def base(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def prompt(base):
    # 40 tokens: two full KV blocks (16 tokens each) that the prefix cache could share
    return list(range(5, 45))


@pytest.mark.parametrize("staging", ["none", "device"])
def test_adapter_sync_serves_the_trainers_adapter(base, prompt, tmp_path, staging):
    from rlserve.transfer import LoRASource

    trainer = _peft(base, r=8, seed=1)
    with InProcessServer(base, staging=staging, load_format="auto", enable_lora=True, max_loras=2,
                         max_lora_rank=16, enable_prefix_caching=True) as srv:
        engine = _engine(srv, LoRASource(trainer, "policy"))
        try:
            base_out = _complete(srv.url, base, prompt)
            fin = engine.send_weights()
            assert fin["lora_name"] == "policy" and fin["lora_version"] == "1"
            # bytes moved: the factors (float32) and nothing else -- 256-byte slot alignment at most
            factor_bytes = sum(p.numel() * 4 for n, p in trainer.named_parameters() if "lora_" in n)
            n_factors = sum(1 for n, _ in trainer.named_parameters() if "lora_" in n)
            assert factor_bytes <= fin["bytes"] <= factor_bytes + 256 * n_factors
            assert fin["adapter_bytes"] == factor_bytes  # held in the model's float32, scaling folded in
            first = _reference(trainer, base, tmp_path, prompt)
            _assert_same(_complete(srv.url, "policy", prompt), first)
            # a training step, a second sync: a new version and a new id, the trainer's outputs again,
            # though the same prompt's KV of version 1 sits in the prefix cache
            _train_step(trainer, seed=2, scale=0.2)
            fin2 = engine.send_weights()
            assert fin2["lora_version"] == "2" and fin2["lora_int_id"] != fin["lora_int_id"]
            second = _reference(trainer, base, tmp_path, prompt)
            assert second[0] != first[0]  # the step changed the greedy tokens (else the test shows little)
            _assert_same(_complete(srv.url, "policy", prompt), second)
            _assert_same(_complete(srv.url, "policy", prompt), second)  # and from its own cache entries
            assert _complete(srv.url, base, prompt) == base_out  # the base model never changed
            models = [m["id"] for m in httpx.get(f"{srv.url}/v1/models").json()["data"]]
            assert models == [base, "policy"]
            held = httpx.get(f"{srv.url}/server_info").json()["lora_adapters"]
            assert [(a["name"], a["version"], a["rank"]) for a in held] == [("policy", "2", 8)]
            # the base weights' version did not move
            assert httpx.get(f"{srv.url}/weight_info").json()["weight_version"] == "0"
        finally:
            engine.shutdown()


def test_prefix_cache_entries_are_per_adapter_version(base, prompt, tmp_path):
    """The prefix cache is keyed by the adapter's id; every sync gets a new id. Version 2's first
    request computes its prompt (no cached token), its second reuses version 2's own blocks."""
    from rlserve.transfer import LoRASource

    trainer = _peft(base, r=8, seed=3)
    with InProcessServer(base, load_format="auto", enable_lora=True, max_lora_rank=8,
                         enable_prefix_caching=True) as srv:
        engine = _engine(srv, LoRASource(trainer, "policy"))
        try:
            engine.send_weights()
            _complete(srv.url, "policy", prompt)
            hits0 = _prefix_hits(srv)
            _complete(srv.url, "policy", prompt)
            assert _prefix_hits(srv) - hits0 == 32  # version 1 reuses its own two blocks
            _train_step(trainer, seed=4, scale=0.2)
            engine.send_weights()
            hits1 = _prefix_hits(srv)
            _assert_same(_complete(srv.url, "policy", prompt), _reference(trainer, base, tmp_path, prompt))
            assert _prefix_hits(srv) == hits1  # none of version 1's blocks
            _complete(srv.url, "policy", prompt)
            assert _prefix_hits(srv) - hits1 == 32
        finally:
            engine.shutdown()


def _prefix_hits(srv) -> int:
    """Prompt tokens served from the prefix cache so far (``/metrics``)."""
    text = httpx.get(f"{srv.url}/metrics").text
    line = [ln for ln in text.splitlines() if ln.startswith("vllm:prefix_cache_hits_total")]
    assert line, "no vllm:prefix_cache_hits_total in /metrics"
    return int(float(line[0].split()[-1]))


def test_refused_syncs_change_nothing(base, prompt, tmp_path):
    """Refused before a byte moves (400): a rank above --max-lora-rank, a base model's name, a
    name loaded without load_inplace. Refused after the data (400 non_finite_weights): a NaN;
    (400) factors that overflow once scaled.
    The served adapter keeps its outputs through all of them."""
    from rlserve.transfer import LoRASource, WeightSyncHTTPError

    trainer = _peft(base, r=8, seed=5)
    with InProcessServer(base, load_format="auto", enable_lora=True, max_loras=1, max_lora_rank=8) as srv:
        engine = _engine(srv, LoRASource(trainer, "policy"))
        try:
            engine.send_weights()
            want = _reference(trainer, base, tmp_path, prompt)
            _assert_same(_complete(srv.url, "policy", prompt), want)
            cases = [(LoRASource(_peft(base, r=16, seed=6), "policy"), 400, "greater than max_lora_rank 8"),
                     (LoRASource(_peft(base, r=8, seed=6), base), 400, "conflicts with a served base model"),
                     (LoRASource(_peft(base, r=8, seed=6), "policy", load_inplace=False), 400, "already been loaded"),
                     (LoRASource(_peft(base, r=8, seed=6), "other"), 400, "--max-loras 1")]
            for source, status, words in cases:
                engine.source = source
                with pytest.raises(WeightSyncHTTPError) as ei:
                    engine.send_weights()
                assert ei.value.status_code == status and words in ei.value.message, ei.value.message
                _assert_same(_complete(srv.url, "policy", prompt), want)
            bad = _peft(base, r=8, seed=7)
            with torch.no_grad():
                next(p for n, p in bad.named_parameters() if "lora_B" in n)[0, 0] = float("nan")
            engine.source = LoRASource(bad, "policy")
            with pytest.raises(WeightSyncHTTPError) as ei:
                engine.send_weights()
            assert ei.value.status_code == 400 and "non_finite" in (ei.value.code or ""), ei.value.message
            _assert_same(_complete(srv.url, "policy", prompt), want)
            # finite factors and a finite lora_alpha whose fold B x lora_alpha / r overflows float32
            # (scaling 1.25e307): refused at the commit, nothing served changes (the old code
            # served it: every logprob NaN)
            engine.source = LoRASource(_peft(base, r=8, seed=7, alpha=1e308), "policy")
            with pytest.raises(WeightSyncHTTPError) as ei:
                engine.send_weights()
            assert ei.value.status_code == 400 and "once scaled by 1.25e+307" in ei.value.message, ei.value.message
            _assert_same(_complete(srv.url, "policy", prompt), want)
            held = httpx.get(f"{srv.url}/server_info").json()["lora_adapters"]
            assert [(a["name"], a["version"]) for a in held] == [("policy", "1")]
            # the group is usable again: a good sync lands as version 2
            engine.source = LoRASource(trainer, "policy")
            _train_step(trainer, seed=8, scale=0.2)
            assert engine.send_weights()["lora_version"] == "2"
            _assert_same(_complete(srv.url, "policy", prompt), _reference(trainer, base, tmp_path, prompt))
        finally:
            engine.shutdown()


def test_adapter_sync_needs_enable_lora(base):
    from rlserve.transfer import LoRASource, WeightSyncHTTPError

    with InProcessServer(base, load_format="auto") as srv:
        engine = _engine(srv, LoRASource(_peft(base, r=8, seed=9), "policy"))
        try:
            with pytest.raises(WeightSyncHTTPError) as ei:
                engine.send_weights()
            assert ei.value.status_code == 400 and "--enable-lora" in ei.value.message
        finally:
            engine.shutdown()


def test_adapter_sync_reaches_every_data_parallel_replica(base, prompt, tmp_path):
    """-dp 2: one gloo group of the trainer and both replicas' workers; the sync commits the new
    adapter on both (one engine command each) before finish answers, so requests spread over the
    replicas all get the trainer's outputs."""
    import concurrent.futures

    from rlserve.transfer import GlooTrainerInitInfo, HTTPWeightSyncClient, LoRASource, WeightTransferTrainerFactory

    trainer = _peft(base, r=8, seed=11)
    with InProcessServer(base, load_format="auto", enable_lora=True, max_lora_rank=8, data_parallel_size=2) as srv:
        engine = WeightTransferTrainerFactory.trainer_init(
            init_info=GlooTrainerInitInfo(world_size=3, timeout_s=60),
            client=HTTPWeightSyncClient(srv.url), source=LoRASource(trainer, "policy"))
        try:
            fin = engine.send_weights()
            assert fin["lora_version"] == "1"
            want = _reference(trainer, base, tmp_path, prompt)
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                got = list(pool.map(lambda _: _complete(srv.url, "policy", prompt), range(4)))
            for g in got:
                _assert_same(g, want)
        finally:
            engine.shutdown()


def test_undeclared_adapter_update_takes_lora_from_update_weights(base, prompt, tmp_path):
    """A trainer that declares nothing at start_weight_update (vLLM's style; the ipc one-call
    /sync_weights path is the same on the server) sends ``lora`` with update_weights: the session
    becomes an adapter-only one there, validated before the receive, and finish commits it. A
    second undeclared sync that sends only lora_A factors is refused at finish (a module without
    its B) and changes nothing served."""
    from rlserve.transfer import LoRASource, WeightSyncHTTPError

    trainer = _peft(base, r=8, seed=13)
    with InProcessServer(base, load_format="auto", enable_lora=True, max_lora_rank=8) as srv:
        engine = _engine(srv, LoRASource(trainer, "policy"))
        real_start = engine.client.start_weight_update
        engine.client.start_weight_update = lambda update_info=None: real_start(None)
        try:
            fin = engine.send_weights()
            assert fin["lora_name"] == "policy" and fin["lora_version"] == "1"
            want = _reference(trainer, base, tmp_path, prompt)
            _assert_same(_complete(srv.url, "policy", prompt), want)
            only_a = LoRASource(_peft(base, r=8, seed=14), "policy")
            params = only_a._params
            only_a._params = lambda: [(n, p) for n, p in params() if ".lora_A." in n]
            engine.source = only_a
            with pytest.raises(WeightSyncHTTPError) as ei:
                engine.send_weights()
            assert ei.value.status_code == 400 and "without lora_B" in ei.value.message, ei.value.message
            _assert_same(_complete(srv.url, "policy", prompt), want)
        finally:
            engine.shutdown()


def test_lora_fields_and_pairs_are_checked():
    from rlserve.errors import WeightUpdateError
    from rlserve.lora.sync import check_pairs, lora_fields, update_spec

    ok = lora_fields({"lora_name": "p", "r": 8, "lora_alpha": 16}, max_lora_rank=16)
    assert ok == {"lora_name": "p", "r": 8, "lora_alpha": 16.0, "use_rslora": False, "load_inplace": True,
                  "version": None}
    assert lora_fields({"lora_name": "p", "r": 8, "lora_alpha": 1, "version": 7})["version"] == "7"
    bad = [({"lora_name": "p", "r": 32, "lora_alpha": 1}, "greater than max_lora_rank 16"),
           ({"lora_name": "p", "r": True, "lora_alpha": 1}, "r must be an integer"),
           ({"lora_name": "", "r": 8, "lora_alpha": 1}, "lora_name must be"),
           ({"lora_name": "p", "r": 8, "lora_alpha": float("nan")}, "finite number"),
           ({"lora_name": "p", "r": 8, "lora_alpha": 1, "use_rslora": "yes"}, "use_rslora must be true or false"),
           ({"lora_name": "p", "r": 8, "lora_alpha": 1, "version": True}, "version must be"),
           ({"lora_name": "p", "r": 8, "lora_alpha": 1, "dropout": 0.1}, "unknown key(s) ['dropout']"),
           ([], "must be an object")]
    for raw, words in bad:
        with pytest.raises(WeightUpdateError) as ei:
            lora_fields(raw, max_lora_rank=16)
        assert words in str(ei.value), (raw, str(ei.value))
    assert update_spec({"m.q_proj": (12, 8)}, 4) == {"m.q_proj.lora_A.weight": (4, 8), "m.q_proj.lora_B.weight": (12, 4)}
    check_pairs(["m.q_proj.lora_A.weight", "m.q_proj.lora_B.weight"])
    with pytest.raises(WeightUpdateError, match="m.v_proj has lora_B without lora_A"):
        check_pairs(["m.q_proj.lora_A.weight", "m.q_proj.lora_B.weight", "m.v_proj.lora_B.weight"])
    with pytest.raises(WeightUpdateError, match="needs lora_A / lora_B factors"):
        check_pairs([])


_SLICES = [[("l.q_proj", 0, 12), ("l.k_proj", 12, 4), ("l.v_proj", 16, 4)], [("l.o_proj", 0, 16)]]


@pytest.mark.parametrize("model_dtype,wire_dtype,rank,targets", [
    (torch.float32, torch.float32, 8, "all"), (torch.bfloat16, torch.float32, 8, "all"),
    (torch.bfloat16, torch.float32, 3, "all"), (torch.bfloat16, torch.bfloat16, 8, "all"), (torch.float16, torch.float32, 3, "some"),
    (torch.float32, torch.float32, 5, "some")])
def test_batched_slot_commit_equals_module_by_module(model_dtype, wire_dtype, rank, targets):
    """The kernel path's batched commit (rlserve.lora.slots) writes the slot buffers bit for bit as
    adapter_from_parts + LoRALinear.add do -- scaling folded in float32 and rounded once, short ranks
    and untargeted slices zeroed over a slot a previous adapter filled -- and leaves the other slot alone."""
    from rlserve.lora.adapter import adapter_from_parts
    from rlserve.lora.layers import LoRALinear
    from rlserve.lora.slots import slot_plan, slots_ok, write_slots

    g = torch.Generator().manual_seed(rank)

    def layers():
        out = []
        for slices, fin in zip(_SLICES, (16, 20)):
            lin = LoRALinear(slices, fin)
            lin.use_slots(2, 8, model_dtype, "cpu")
            out.append(lin)
        return out

    ref, new = layers(), layers()
    for a, b in zip(ref, new):  # a previous adapter's values in both slots
        fill = torch.Generator().manual_seed(7)
        for x, y in ((a.a_stack, b.a_stack), (a.b_stack, b.b_stack)):
            x.copy_(torch.randn(x.shape, generator=fill))
            y.copy_(x)
    modules = [(m, fin, n) for slices, fin in zip(_SLICES, (16, 20)) for m, _, n in slices
               if targets == "all" or m in ("l.q_proj", "l.v_proj")]
    parts = {m: {"A": torch.randn(rank, fin, generator=g).to(wire_dtype),
                 "B": torch.randn(n, rank, generator=g)} for m, fin, n in modules}  # PEFT's B: float32
    tmap = {m: (n, fin) for m, fin, n in modules}
    scaling = 16 / rank  # PEFT's lora_alpha / r: not a power of two for r = 3, 5 (rounding shows)
    adapter = adapter_from_parts({m: dict(ab) for m, ab in parts.items()}, rank, scaling, tmap, model_dtype, "cpu",
                                 "test")
    for lin in ref:
        lin.add(9, adapter.weights, slot=1)
    assert slots_ok(parts, model_dtype, torch.device("cpu"))
    plan = slot_plan(new, parts, 1)
    write_slots(plan, scaling)
    for a, b in zip(ref, new):
        assert torch.equal(a.a_stack, b.a_stack) and torch.equal(a.b_stack, b.b_stack)
    assert [t for _, t in plan.layers] == [True, targets == "all"]
    assert (len(plan.zero) > 0) == (rank < 8 or targets != "all")


def test_batched_slot_commit_refuses_what_it_would_round_twice():
    from rlserve.lora.slots import slots_ok

    cpu = torch.device("cpu")
    low = {"m": {"A": torch.zeros(2, 2, dtype=torch.bfloat16), "B": torch.zeros(2, 2, dtype=torch.bfloat16)}}
    assert not slots_ok(low, torch.bfloat16, cpu)  # a bf16 B scaled in place rounds otherwise on a CPU
    low["m"]["B"] = torch.zeros(2, 2)
    assert slots_ok(low, torch.bfloat16, cpu)  # a bf16 A is only copied
    assert not slots_ok(low, torch.float16, cpu)
    assert not slots_ok({"m": {"A": torch.zeros(2, 2, dtype=torch.float64), "B": torch.zeros(2, 2)}},
                        torch.float32, cpu)
    assert not slots_ok({"m": {"A": torch.zeros(2, 2), "B": torch.zeros(2, 2)}}, torch.float64, cpu)


def _stage_factors(worker, rank: int, seed: int) -> int:
    """An rpc target: random factors of every LoRA-capable module, as an adapter sync's receive
    leaves them in the worker's staging dict. Returns how many."""
    from rlserve.lora.model import lora_of
    from rlserve.transfer.server.worker_ext import _state

    g = torch.Generator().manual_seed(seed)
    st = _state(worker)
    for module, (out_f, in_f) in lora_of(worker.model).targets.items():
        st.staging[f"{module}.lora_A.weight"] = torch.randn(rank, in_f, generator=g)
        st.staging[f"{module}.lora_B.weight"] = torch.randn(out_f, rank, generator=g)
    return len(st.staging)


def test_a_synced_version_takes_the_slot_of_a_finished_retired_one(base):
    """Kernel path (slot buffers: --max-loras 1 gives two slots): version 1 was unloaded while requests
    still ran on it (retired), they finished since; version 3's commit frees it first and takes its slot.
    The old commit did not sweep: 'all 2 LoRA slots hold adapters', and every retry failed alike."""
    from types import SimpleNamespace

    from rlserve import LLM
    from rlserve.lora.engine_ops import unload_lora
    from rlserve.lora.model import LoRAModel
    from rlserve.lora.sync import commit_synced

    llm = LLM(base, dtype="float32", device="cpu", enable_lora=True, max_loras=1, max_lora_rank=8)
    lora = LoRAModel.install(llm.engine.model, 8, torch.float32, "cpu", max_loras=1, kernel=True)
    core = SimpleNamespace(engine=llm.engine)
    for version in (1, 2):
        assert llm.engine.collective_rpc("tests.test_lora_sync:_stage_factors", 4, version)[0] > 0
        assert commit_synced(core, version, 4, 2.0, 30.0)["rank"] == 4
    lora.retired.add(1)  # unloaded while a request ran on it (unload_lora keeps it then)
    assert sorted(lora.slot_of.items()) == [(1, 0), (2, 1)]
    llm.engine.collective_rpc("tests.test_lora_sync:_stage_factors", 4, 3)
    assert commit_synced(core, 3, 4, 2.0, 30.0)["rank"] == 4
    assert sorted(lora.slot_of.items()) == [(2, 1), (3, 0)] and 1 not in lora.adapters
    assert unload_lora(core, 2) is True and sorted(lora.slot_of) == [3]


def test_adapter_fields_beyond_the_engine_wire_are_not_a_500(base, prompt, tmp_path):
    """``update_info.lora.version`` an int above 2**64 (valid JSON; an int label is accepted and
    read as its digits): before (adv20) the raw dict crossed the engine-core wire and
    /update_weights answered 500 OverflowError (the undeclared path) and tore the group down. Now
    the checked fields travel: the sync lands under that label, declared at start or not."""
    from rlserve.transfer import LoRASource

    trainer = _peft(base, r=8, seed=21)
    with InProcessServer(base, load_format="auto", enable_lora=True, max_lora_rank=8) as srv:
        engine = _engine(srv, LoRASource(trainer, "policy"))
        real_start = engine.client.start_weight_update
        try:
            for k, declared in enumerate((True, False)):
                engine.client.start_weight_update = real_start if declared else \
                    (lambda update_info=None: real_start(None))
                source = LoRASource(trainer, "policy")
                source.lora["version"] = 2**70 + k
                engine.source = source
                fin = engine.send_weights()
                assert fin["lora_version"] == str(2**70 + k), fin
                _assert_same(_complete(srv.url, "policy", prompt), _reference(trainer, base, tmp_path, prompt))
        finally:
            engine.shutdown()
