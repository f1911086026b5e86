"""Issue 24 on a GPU: the kill-at-every-phase matrix (``tests/kill_matrix.py``) for the CUDA IPC
and NCCL data planes against a real ``rlserve serve`` process (float32, eager). Each cell runs
a trainer process that dies at one phase (``tests/kill_trainer.py``) and checks
``/weight_checker``, ``/health``, ``/weight_info`` and greedy tokens against the last good
version: the server must serve exactly those weights or answer 503 until a complete update
lands (or, where one call is the whole update, serve the dead trainer's complete update).

- ipc (trainer and server on GPU 0): packed (one ``update_weights`` per bucket) and per tensor
  (one ``/sync_weights``: receive + commit as one engine command; a wrong checksum there is
  detected after the copy, so the replica is quarantined in that command), in place and staged;
- NCCL: on two GPUs with real NCCL (a message cannot be cut: the trainer dies right after
  queueing it), and on one GPU with the group built as gloo over CUDA tensors
  (``tests/gpu/nccl_over_gloo.py``; messages are cut in half as on the CPU).

The table is printed and, with ``$RLSERVE_GPU_REPORT``, written to
``$RLSERVE_GPU_REPORT/kill_matrix.json`` (``{configuration: {"verdicts": {phase: verdict},
"kill_to_failure_s": {phase: seconds from the trainer's last message to the failure the server
recorded, or null where it recorded none}}}``; reported, not asserted: the killed trainers'
``timeout_s`` is 5 s here, the liveness watch's own bound is ``test_trainer_liveness_gpu.py``'s).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from rlserve.server.testing import ServerProcess  # noqa: E402
from tests.gpu import nccl_over_gloo  # noqa: E402
from tests.kill_matrix import Config, expected, model_meta, run_config  # noqa: E402

TIMEOUT_S = 5.0  # a dead peer is noticed when a receive times out (or by the session watchdog)
needs_2 = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (one rank per GPU)")
EMULATION = "from tests.gpu.nccl_over_gloo import install; install()"

IPC_CONFIGS = [
    Config("ipc packed, in place", "sdk", True, "none", False, "ipc"),
    Config("ipc packed, staged", "sdk", True, "device", False, "ipc"),
    Config("ipc per-tensor, in place", "sdk", False, "none", False, "ipc"),
    Config("ipc per-tensor, staged", "sdk", False, "device", False, "ipc"),
]
NCCL_CONFIGS = [
    Config("nccl packed, in place", "sdk", True, "none", False, "nccl"),
    Config("nccl packed, staged", "sdk", True, "device", False, "nccl"),
    Config("nccl unpacked, in place", "sdk", False, "none", False, "nccl"),
    Config("TRL per-tensor (nccl), in place", "trl", False, "none", False, "nccl"),
]


def _server(launcher):
    def make(path, cfg, timeout_s):
        return ServerProcess(path, "--device", "cuda:0", "--dtype", "float32", "--enforce-eager", "--load-format",
                             "dummy", "--max-model-len", "128", "--num-kv-blocks", "256", "--max-num-seqs", "8",
                             "--weight-transfer-config", json.dumps({"backend": cfg.backend, "timeout_s": timeout_s}),
                             "--weight-staging", cfg.staging, startup_timeout_s=300, launcher=launcher)
    return make


def _report(name: str, out: dict, times: dict) -> None:
    print(f"[kill-matrix-gpu] {name}: {out} kill -> failure s: {times}")
    d = os.environ.get("RLSERVE_GPU_REPORT")
    if d:
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, "kill_matrix.json")
        table = json.load(open(path)) if os.path.exists(path) else {}
        table[name] = {"verdicts": out, "kill_to_failure_s": times}
        with open(path, "w") as f:
            json.dump(table, f, indent=2)


def _check(name: str, cfg: Config, out: dict, cut: bool, times: dict) -> None:
    _report(name, out, times)
    wrong = {p: v for p, v in out.items() if v not in expected(cfg, p, cut)}
    assert not wrong, (out, {p: sorted(expected(cfg, p, cut)) for p in wrong})


@pytest.fixture(scope="module")
def model(tiny_model):
    path = tiny_model("llama")
    return path, model_meta(path)


@pytest.mark.parametrize("cfg", IPC_CONFIGS, ids=lambda c: c.name)
def test_ipc_trainer_killed_at_every_phase(model, cfg):
    path, meta = model
    times: dict = {}
    out = run_config(path, meta, cfg, TIMEOUT_S, server=_server(("-m", "rlserve")), device="cuda:0", timings=times)
    _check(cfg.name, cfg, out, cut=False, times=times)


@pytest.mark.parametrize("transport", [pytest.param("nccl", marks=needs_2), "gloo-cuda"])
@pytest.mark.parametrize("cfg", NCCL_CONFIGS, ids=lambda c: c.name)
def test_nccl_trainer_killed_at_every_phase(model, cfg, transport, monkeypatch):
    path, meta = model
    emulated = transport == "gloo-cuda"
    if emulated:  # this process's good-weights trainer builds its "nccl" group as gloo too
        import rlserve.transfer.backends.group as group

        monkeypatch.setattr(group, "new_backend", nccl_over_gloo.gloo_for_nccl(group.new_backend))
    times: dict = {}
    out = run_config(path, meta, cfg, TIMEOUT_S,
                     server=_server(nccl_over_gloo.SERVER_LAUNCHER if emulated else ("-m", "rlserve")),
                     device="cuda:0" if emulated else "cuda:1", setup=EMULATION if emulated else "", timings=times)
    _check(f"{cfg.name} [{transport}]", cfg, out, cut=emulated, times=times)
