"""Expert weight sync of a tiny MoE policy over gloo through the trainer SDK (in-process server,
engine-core process, :mod:`tests.transfer_sync`'s helpers): the trainer's per-expert Hugging Face
names (``mlp.experts.{e}.gate_proj.weight`` ..., what checkpoints and most trainers name) and
transformers 5's fused names (``mlp.experts.gate_up_proj``, what ``ModuleSource`` of a
transformers 5 model sends) both land in the fused layout: the server's greedy tokens then equal
the trainer's and ``/weight_checker`` matches, in place and staged, with packed buckets smaller
than one expert tensor; TRL's protocol (one ``update_named_param`` per tensor, the model's
``named_parameters()``: fused names) too. A bad expert tensor is refused before anything changes.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from rlserve.loader.weight_utils import split_fused_experts
from rlserve.transfer import ModuleSource, TensorListSource, WeightSyncHTTPError, hf_state_checksums
from tests.transfer_harness import InProcessServer, load_hf, run_script
from tests.transfer_sync import PROMPT_IDS, bumped, checksums, hf_greedy, scramble, server_greedy, trainer, \
    trl_synced, version

# 8 experts x [32, 64] float32 = 8 KiB per expert projection; the packed buckets are 4 KiB
BUCKET = 4 << 10


def per_expert(hf) -> list[tuple[str, torch.Tensor]]:
    """The trainer's tensors with transformers 5's fused experts split into the per-expert names
    (:func:`split_fused_experts`; cloned: each name its own storage, as a trainer's per-expert
    parameters are)."""
    return [(n, t.clone()) for n, t in split_fused_experts(ModuleSource(hf).named_tensors())]


def assert_checker_matches(url: str, hf) -> None:
    """``/weight_checker`` of the server at ``url`` matches ``hf``'s tensors (float32 checksums)
    under both namings: per expert and transformers 5's fused."""
    for named in (per_expert(hf), list(ModuleSource(hf).named_tensors())):
        mine = hf_state_checksums(named, torch.float32)
        rep = httpx.post(url + "/weight_checker", json={"compare": mine}, timeout=120).json()["compare"]
        assert rep["match"] and rep["compared"] == len(mine), rep


def test_split_fused_experts_names_and_values():
    """Each fused expert tensor becomes E per-expert tensors with the checkpoint names, in
    order, equal to the fused rows; other tensors pass through."""
    E, I, H = 3, 4, 5
    gu, down, norm = torch.randn(E, 2 * I, H), torch.randn(E, H, I), torch.randn(H)
    out = split_fused_experts([("m.layers.0.mlp.experts.gate_up_proj", gu), ("m.norm.weight", norm),
                               ("m.layers.0.mlp.experts.down_proj", down)])
    names = [n for n, _ in out]
    assert names[:2] == ["m.layers.0.mlp.experts.0.gate_proj.weight", "m.layers.0.mlp.experts.0.up_proj.weight"]
    assert names[2 * E] == "m.norm.weight" and len(out) == 3 * E + 1
    d = dict(out)
    for e in range(E):
        assert torch.equal(d[f"m.layers.0.mlp.experts.{e}.gate_proj.weight"], gu[e, :I])
        assert torch.equal(d[f"m.layers.0.mlp.experts.{e}.up_proj.weight"], gu[e, I:])
        assert torch.equal(d[f"m.layers.0.mlp.experts.{e}.down_proj.weight"], down[e])
        assert d[f"m.layers.0.mlp.experts.{e}.up_proj.weight"].is_contiguous()
    assert d["m.norm.weight"] is norm


@pytest.fixture(scope="module")
def moe(tiny_model):
    path = tiny_model("qwen2_moe")  # routed + shared experts
    return path, load_hf(path, seed=1)


@pytest.fixture(scope="module")
def servers(moe):
    """``servers(staging)``: this module's in-process server of each staging mode (started on first use)."""
    started: dict = {}

    def get(staging: str):
        if staging not in started:
            started[staging] = InProcessServer(moe[0], staging=staging, max_model_len=128)
        return started[staging]

    yield get
    for srv in started.values():
        srv.close()


@pytest.fixture(scope="module")
def server(servers):
    return servers("none")


@pytest.mark.parametrize("names", ["per_expert", "fused"])
@pytest.mark.parametrize("staging", ["none", "device"])
def test_sync_equals_trainer(moe, servers, names, staging):
    path, hf = moe
    srv = servers(staging)
    src = TensorListSource(per_expert(hf)) if names == "per_expert" else ModuleSource(hf)
    if names == "per_expert":
        assert any(".experts.7.down_proj.weight" in n for n, _ in src.items)
        assert max(t.numel() * 4 for n, t in src.items if ".experts." in n) > BUCKET
    scramble(srv.url, path)  # other weights than the trainer's first
    v0 = version(srv.url)
    before = server_greedy(srv.url).json()["completion_ids"]
    eng = trainer(srv.url, src, packed_buffer_size_bytes=BUCKET)
    fin = eng.send_weights()
    assert fin["weight_version"] == bumped(v0) and fin["full"] is True
    after = server_greedy(srv.url).json()["completion_ids"]
    assert after == [hf_greedy(hf, p) for p in PROMPT_IDS] and after != before
    assert_checker_matches(srv.url, hf)  # the server's tensors equal the trainer's, under either naming
    eng.shutdown()


@pytest.mark.parametrize("case", ["shape", "expert_id", "missing_expert"])
def test_bad_expert_tensor_refused_before_any_change(moe, server, case):
    path, hf = moe
    named = per_expert(hf)
    i = next(k for k, (n, _) in enumerate(named) if n.endswith("experts.3.up_proj.weight"))
    name, t = named[i]
    if case == "shape":
        named[i] = (name, torch.zeros(t.shape[0] + 1, t.shape[1]))
    elif case == "expert_id":
        named[i] = (name.replace("experts.3.", "experts.8."), t)  # 8 experts: ids 0..7
    else:
        del named[i]
    v0, base = version(server.url), checksums(server.url)
    eng = trainer(server.url, TensorListSource(named), packed_buffer_size_bytes=BUCKET)
    with pytest.raises(WeightSyncHTTPError) as ei:
        eng.send_weights()
    assert ei.value.status_code == 400
    msg = str(ei.value)
    assert {"shape": "shape [33, 64] != expected [32, 64]", "expert_id": "unknown parameter",
            "missing_expert": "missing 1 required"}[case] in msg, msg
    assert "experts.3.up_proj" in msg or "experts.8.up_proj" in msg
    assert checksums(server.url) == base and version(server.url) == v0
    assert server_greedy(server.url).status_code == 200
    eng.shutdown()
    assert httpx.get(server.url + "/weight_info").json()["state"] == "uninitialized"


def test_trl_protocol_fused_names(moe, server):
    """TRL's ``update_model_params`` sends ``named_parameters()`` one tensor at a time (fused
    expert names with transformers 5); the close commits a full update."""
    path, hf = moe
    scramble(server.url, path)  # other weights than hf's first
    base = checksums(server.url)
    c = trl_synced(server.url, hf)
    assert checksums(server.url) != base
    c.close_communicator()
    info = httpx.get(server.url + "/weight_info").json()
    assert info["state"] == "uninitialized" and info["last_update"]["ok"] and info["last_update"]["full"], info


def test_fsdp2_trainer_experts(moe, server, tmp_path):
    """A 2-rank FSDP2 trainer of the Qwen2-MoE (DTensor parameters: transformers 5's fused
    ``[E, ...]`` expert tensors sharded over the ranks on the expert dim; buckets of 64 KiB, half a
    fused ``gate_up_proj``): every rank gathers (``full_tensor``), rank 0 sends; the server then
    holds the unsharded model's weights under both namings and greedy-decodes as it does."""
    import sys

    from tests.test_transfer_e2e import FSDP_TRAINER, ROOT
    from tests.transfer_harness import load_hf

    path, _ = moe
    want = load_hf(path, seed=3)  # what FSDP_TRAINER loads
    scramble(server.url, path)
    v0 = version(server.url)
    script = tmp_path / "fsdp_trainer.py"
    script.write_text(FSDP_TRAINER.format(root=ROOT, rendezvous=str(tmp_path / "fsdp_rendezvous"), path=path,
                                          url=server.url))
    r = run_script([sys.executable, str(script)], 300, cwd=ROOT)  # starved: longer
    assert f"0 DONE {bumped(v0)}" in r.stdout and "1 DONE None" in r.stdout, (r.stdout[-2000:], r.stderr[-3000:])
    assert_checker_matches(server.url, want)
    assert server_greedy(server.url).json()["completion_ids"] == [hf_greedy(want, p) for p in PROMPT_IDS]


def test_sync_into_tp2_server(moe):
    """A tensor-parallel server (TP=2, two CPU ranks over gloo): every rank receives the full
    per-expert tensors (packed buckets smaller than one expert tensor) and keeps its half of each
    expert's intermediate dim (w13 rows, w2 columns); the shared expert likewise. Greedy tokens
    then equal the trainer's and ``/weight_checker`` (the shards gathered back) matches."""
    from rlserve.transfer import GlooTrainerInitInfo, HTTPWeightSyncClient, WeightTransferTrainerFactory

    path, hf = moe
    with InProcessServer(path, max_model_len=128, tensor_parallel_size=2) as srv:
        assert httpx.get(srv.url + "/get_world_size").json()["world_size"] == 2
        before = server_greedy(srv.url).json()["completion_ids"]
        eng = WeightTransferTrainerFactory.trainer_init(
            init_info=GlooTrainerInitInfo(world_size=3, timeout_s=60,
                                          packed_buffer_size_bytes=BUCKET),
            client=HTTPWeightSyncClient(srv.url, timeout_s=120), source=TensorListSource(per_expert(hf)))
        assert eng.send_weights()["full"] is True
        after = server_greedy(srv.url).json()["completion_ids"]
        assert after == [hf_greedy(hf, p) for p in PROMPT_IDS] and after != before
        assert_checker_matches(srv.url, hf)
        eng.shutdown()


@pytest.mark.parametrize("staging", ["none", "device"])
def test_checksum_after_the_data_never_half_updates(moe, servers, staging, monkeypatch):
    """A packed per-expert update (buckets smaller than one expert tensor, other values than the
    served ones) whose second bucket checksum, sent after the data, is off by one fails with 500.
    Staged, the server keeps what it had (checksums, version, greedy tokens); in place it answers
    503 until a full update lands. The next full update gives the trainer's weights."""
    from tests.transfer_harness import wrong_second_bucket_sum

    path, hf = moe
    srv = servers(staging)
    eng = trainer(srv.url, TensorListSource(per_expert(hf)), packed_buffer_size_bytes=BUCKET)
    eng.send_weights()
    good, v0 = checksums(srv.url), version(srv.url)
    expected = server_greedy(srv.url).json()["completion_ids"]
    eng.shutdown()
    other = trainer(srv.url, TensorListSource([(n, 1.5 * t) for n, t in per_expert(hf)]),
                    packed_buffer_size_bytes=BUCKET)
    calls = wrong_second_bucket_sum(monkeypatch)
    with pytest.raises(WeightSyncHTTPError) as ei:
        other.send_weights()
    assert ei.value.status_code == 500 and "after the data" in str(ei.value), str(ei.value)
    assert len(calls) >= 2 and version(srv.url) == v0
    r = server_greedy(srv.url)
    if staging == "none":
        assert r.status_code == 503 and "full weight update" in r.json()["error"]["message"]
    else:
        assert r.json()["completion_ids"] == expected and checksums(srv.url) == good
    other.shutdown()
    monkeypatch.undo()
    eng = trainer(srv.url, TensorListSource(per_expert(hf)), packed_buffer_size_bytes=BUCKET)
    eng.send_weights()
    assert checksums(srv.url) == good and server_greedy(srv.url).json()["completion_ids"] == expected
    eng.shutdown()
