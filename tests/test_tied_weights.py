"""Tied weights and weight updates (issue 23): a model that ties ``lm_head.weight`` to its token
embedding serves the embedding as the head, so an update that carries a separate
``lm_head.weight`` (a trainer that untied them) is refused with a 400 naming both tensors before
anything changes, through every update path (SDK packed / per tensor, vLLM's raw calls, TRL's
per-tensor protocol). Every architecture's tied pairs are checked."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rlserve.config import EngineConfig
from rlserve.errors import WeightUpdateError
from rlserve.loader.model_loader import load_model
from rlserve.transfer import ModuleSource, WeightSyncHTTPError
from rlserve.transfer.wire.protocol import UpdateInfo, validate_against_spec
from rlserve.transfer.sdk.trl import TRLWeightSyncClient
from tests.transfer_sync import checksums, hf_greedy, server_greedy, trainer, PROMPT_IDS
from tests.tiny_models import ARCHS
from tests.transfer_harness import InProcessServer

_TIED_ARCHS = {"llama_tied": "model.embed_tokens.weight", "smollm": "model.embed_tokens.weight",
               "opt": "model.decoder.embed_tokens.weight", "opt_proj": "model.decoder.embed_tokens.weight"}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_names_its_tied_pairs_and_refuses_them(tiny_model, arch):
    path = tiny_model(arch)
    cfg = AutoConfig.from_pretrained(path)
    model = load_model(EngineConfig(model=path, device="cpu", dtype="float32", load_format="dummy"), cfg, "cpu",
                       torch.float32)
    tied = model.tied_checkpoint_names()
    assert tied == ({"lm_head.weight": _TIED_ARCHS[arch]} if arch in _TIED_ARCHS else {})
    spec, req = model.checkpoint_spec(), model.required_checkpoint_names()
    # the module really is shared, and the two names have one shape
    for head, emb in tied.items():
        assert model.lm_head is (model.model.embed_tokens if hasattr(model.model, "embed_tokens")
                                 else model.model.decoder.embed_tokens)
        assert spec[head] == spec[emb] and head not in req and emb in req
    # a full update of every name the model accepts: refused for a tied model, naming both
    names = sorted(spec)
    info = UpdateInfo(names=names, dtype_names=["float32"] * len(names), shapes=[list(spec[n]) for n in names])
    if not tied:
        validate_against_spec(info, spec, req, tied=tied)
        return
    with pytest.raises(WeightUpdateError) as ei:
        validate_against_spec(info, spec, req, tied=tied)
    msg = str(ei.value)
    assert "lm_head.weight" in msg and _TIED_ARCHS[arch] in msg and "ties" in msg and "no weights were changed" in msg
    # the same update without the head is fine
    keep = [n for n in names if n not in tied]
    validate_against_spec(UpdateInfo(names=keep, dtype_names=["float32"] * len(keep),
                                     shapes=[list(spec[n]) for n in keep]), spec, req, tied=tied)


@pytest.fixture(scope="module")
def tied_and_untied_trainer(tiny_model):
    """The tied tiny Llama, and a trainer copy of it that untied its head (and moved it)."""
    path = tiny_model("llama_tied")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    untied = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    untied.config.tie_word_embeddings = False
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone() * 3.0)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    return path, hf, untied


def _assert_refused_tied(e: WeightSyncHTTPError):
    assert e.status_code == 400, e
    msg = str(e)
    assert "lm_head.weight" in msg and "model.embed_tokens.weight" in msg and "ties" in msg, msg


@pytest.mark.parametrize("packed", [True, False])
def test_untied_trainer_into_tied_server_is_refused_before_any_change(tied_and_untied_trainer, packed):
    path, hf, untied = tied_and_untied_trainer
    names = [n for n, _, _ in ModuleSource(untied).metadata()]
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names  # the SDK sends both
    with InProcessServer(path) as srv:
        base = checksums(srv.url)
        before = server_greedy(srv.url).json()["completion_ids"]
        eng = trainer(srv.url, untied, packed=packed)
        with pytest.raises(WeightSyncHTTPError) as ei:
            eng.send_weights()
        _assert_refused_tied(ei.value)
        assert checksums(srv.url) == base
        assert httpx.get(srv.url + "/weight_info").json()["weight_version"] == "0"
        assert server_greedy(srv.url).json()["completion_ids"] == before  # serving, not paused
        assert not srv.aengine.is_paused()
        # the group still works: the tied trainer's update lands and serves exactly its outputs
        eng.source = ModuleSource(hf)
        assert eng.send_weights()["weight_version"] == "1"
        assert server_greedy(srv.url).json()["completion_ids"] == [hf_greedy(hf, p) for p in PROMPT_IDS]
        eng.shutdown()


def test_untied_head_refused_on_raw_and_trl_routes(tied_and_untied_trainer):
    path, hf, untied = tied_and_untied_trainer
    head = {"names": ["lm_head.weight"], "dtype_names": ["float32"],
            "shapes": [list(untied.lm_head.weight.shape)], "partial": True}
    with InProcessServer(path) as srv:
        base = checksums(srv.url)
        eng = trainer(srv.url, hf)
        r = httpx.post(srv.url + "/start_weight_update", json={"update_info": head}, timeout=30)
        assert r.status_code == 400 and "model.embed_tokens.weight" in r.text, r.text
        eng.shutdown()
        c = TRLWeightSyncClient(srv.url, group_port=0, timeout_s=20)
        c.init_communicator()
        with pytest.raises(WeightSyncHTTPError) as ei:
            c.http.update_named_param("lm_head.weight", "torch.float32", list(untied.lm_head.weight.shape))
        _assert_refused_tied(ei.value)
        c.close_communicator()
        assert checksums(srv.url) == base
        assert httpx.get(srv.url + "/weight_info").json()["weight_version"] == "0"

