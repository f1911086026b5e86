"""Shared pieces of the weight-sync control-plane tests: ``test_transfer_manager.py`` (sync,
protocol, settings), ``test_transfer_manager_direct.py`` (direct receive, partial updates) and
``test_transfer_manager_failures.py`` (failed and hostile updates), and the tests that reuse them
(test_transfer_strict, test_tied_weights, test_server_newcomer).

Each test runs AsyncEngine + LLMEngine (tiny model, CPU, dummy weights) + the real FastAPI app on
a uvicorn thread in this process (:class:`tests.transfer_harness.InProcessServer`); the trainer
SDK talks HTTP to it and broadcasts over gloo from the test thread.

A server start is most of a test's time on 2 cores, so the tests share one server per (model,
staging) across those three files (:class:`SharedServers`, handed out by the session fixture
``shared`` of ``tests/conftest.py``, which closes them right after the last test that uses
them); a test with a server setting of its own (admin key, data parallelism, a transfer config)
starts its own. A test on a shared server reads the weight version and counters it starts from
and asserts relative to them, and makes the server's weights differ from its trainer's first
where it asserts that a sync changed them (:func:`scramble`).
"""

from __future__ import annotations

import contextlib
import re
import threading

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlserve.transfer import GlooTrainerInitInfo, HTTPWeightSyncClient, ModuleSource, WeightTransferTrainerFactory
from tests.transfer_harness import InProcessServer, greedy_continuation, load_hf

PROMPT_IDS = [[5, 17, 42, 9, 77, 3], [100, 101, 7]]
N_TOK = 6


def hf_greedy(model, prompt_ids, n=N_TOK):
    return greedy_continuation(model, prompt_ids, n)


def server_greedy(url, prompt_ids=PROMPT_IDS, n=N_TOK):
    r = httpx.post(url + "/generate/", json={"prompt_ids": prompt_ids, "max_tokens": n, "temperature": 0,
                                             "generation_kwargs": {"ignore_eos": True}}, timeout=60)
    return r


def checksums(url):
    r = httpx.post(url + "/weight_checker", json={}, timeout=60)
    r.raise_for_status()
    return r.json()["checksums"]


@pytest.fixture(scope="module")
def llama(tiny_model):
    path = tiny_model("llama")
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llama384(tiny_model):
    """A tiny llama whose vocabulary (384) needs no padding rows: its loads are byte copies, so
    packed updates can be received straight into the parameters (rlserve.transfer.server.direct)."""
    path = tiny_model("llama", vocab_size=384)
    return path, load_hf(path, seed=1)  # less degenerate greedy outputs


#: The shared servers' settings: max_model_len 256 for the request that runs through a failed
#: update (test_failed_in_place_update_ends_requests_in_flight), else InProcessServer's.
SHARED_KW = {"max_model_len": 256}


class SharedServers:
    """The shared :class:`InProcessServer` of each ``(path, staging)``, started on first use.

    Each hand-out (:meth:`get`) first shuts the transfer engine down (every test starts from
    ``state == "uninitialized"``, as on a new server); a server left paused or unavailable (a
    test that failed half way) is replaced by a new one, so one failure does not spread."""

    def __init__(self):
        self.started: dict = {}

    def get(self, path, staging="none", fresh=False):
        """``with shared.get(path, staging) as srv``: the server (the ``with`` does not stop it).
        ``fresh=True``: a server no test has used yet (a used one is replaced), for a test that
        needs a new server's state (weight version "0", no direct-receive layout)."""
        srv = self.started.get((path, staging))
        if srv is not None:
            HTTPWeightSyncClient(srv.url, timeout_s=30).shutdown_weight_transfer_engine()
            if fresh or srv.aengine.is_paused() or srv.aengine.unavailable_reason is not None:
                srv.close()
                srv = None
        if srv is None:
            srv = self.started[path, staging] = InProcessServer(path, staging=staging, **SHARED_KW)
        return contextlib.nullcontext(srv)

    def close(self) -> None:
        """Stop every server started (idempotent)."""
        while self.started:
            self.started.popitem()[1].close()


def version(url) -> str:
    """The server's current weight version."""
    return httpx.get(url + "/weight_info", timeout=30).json()["weight_version"]


def bumped(weight_version: str, n: int = 1) -> str:
    """``weight_version`` after ``n`` syncs that name no version: the server adds ``n`` to its
    trailing number (``"7"`` -> ``"8"``, ``"step-7"`` -> ``"step-8"``)."""
    head, num = re.fullmatch(r"(.*?)(\d+)", weight_version).groups()
    return f"{head}{int(num) + n}"


def scramble(url, path):
    """One full sync of other weights than any trainer model of this module pushes (the tiny
    checkpoint plus noise of a seed no test uses), so that a test's own sync visibly changes
    the server's outputs and checksums, as the dummy weights of a new server would. The
    trainer engine is shut down afterwards (``state == "uninitialized"``)."""
    eng = trainer(url, load_hf(path, scale=0.5, seed=1234))
    eng.send_weights()
    eng.shutdown()


def trl_synced(url, hf):
    """A TRL-protocol client (:class:`TRLWeightSyncClient`, gloo) that pushed ``hf``
    (``update_model_params``: one tensor per call) and landed it (``reset_prefix_cache``); the
    server's greedy tokens are checked to be ``hf``'s. Returns the client, communicator open."""
    from rlserve.transfer.sdk.trl import TRLWeightSyncClient

    c = TRLWeightSyncClient(url, group_port=0, timeout_s=20)
    c.init_communicator()
    c.update_model_params(hf)
    c.reset_prefix_cache()  # lands the queued tensors before it answers
    assert server_greedy(url).json()["completion_ids"] == [hf_greedy(hf, p) for p in PROMPT_IDS]
    return c


def direct_trainer(url, hf):
    """A trainer engine that has synced twice: the second sync was received directly."""
    eng = trainer(url, hf)
    eng.send_weights()
    eng.send_weights()
    assert eng.last_stats["server"]["direct_receive"] is True
    return eng


def trainer(url, model_or_source, **kw):
    src = model_or_source if hasattr(model_or_source, "named_tensors") else ModuleSource(model_or_source)
    kw.setdefault("timeout_s", 20)
    kw.setdefault("packed_buffer_size_bytes", 64 << 10)  # several buckets for the tiny model
    return WeightTransferTrainerFactory.trainer_init(
        init_info=GlooTrainerInitInfo(world_size=2, **kw),
        client=HTTPWeightSyncClient(url, timeout_s=30), source=src)


@contextlib.contextmanager
def synced_server(shared, path, hf):
    """The shared server after one full sync: ``(server, trainer engine, client, the version
    before that sync)``."""
    with shared(path) as srv:
        v0 = version(srv.url)
        eng = trainer(srv.url, hf)
        eng.send_weights()
        yield srv, eng, HTTPWeightSyncClient(srv.url, timeout_s=30), v0


class StallingSource:
    """The model's tensors; before yielding the ``stall_at``-th one it sets ``reached`` and waits
    for ``go`` (the trainer then has some buckets on the wire and the rest still to send). The
    wait's bound only catches a hang: a test sets ``go`` (in a ``finally``), never lets it expire
    (it used to be 30 s: a test starved that long would have had the sync go on and succeed)."""

    def __init__(self, hf, stall_at: int):
        self.inner = ModuleSource(hf)
        self.stall_at = stall_at
        self.reached, self.go = threading.Event(), threading.Event()

    def metadata(self):
        return self.inner.metadata()

    def named_tensors(self):
        for i, (n, t) in enumerate(self.inner.named_tensors()):
            if i == self.stall_at:
                self.reached.set()
                self.go.wait(600)
            yield n, t
