"""Kill matrix on a GPU (issue 25): a trainer SIGKILLed at each point of a sync, with
``timeout_s`` = 300, is noticed through its TCPStore connection (rlserve.transfer.server.liveness) in
seconds, on every data plane:

- ``gloo-cuda``: the "nccl" backend's code built as gloo over CUDA tensors on one GPU
  (tests/gpu/nccl_over_gloo.py);
- ``nccl``: real NCCL, trainer on GPU 1 (needs two GPUs): NCCL never reports a dead peer, its
  kernels spin; the abort path (our wait raises, then the communicator is aborted) does it;
- ``ipc``: packed buckets, one update_weights call per bucket; the SDK's ipc engine hosts a
  TCPStore only for this watch.

Every cell asserts the failure came well under timeout_s (60 s), the outcome (in place with a
bucket loaded: 503 until a full update; otherwise, and staged, the old weights serve), that the
server lives and a fresh init + full sync works; the measured kill -> failure seconds are
printed and written to ``$RLSERVE_GPU_REPORT/liveness.json`` when that is set.

Run: ``python -m pytest -q tests/gpu/test_trainer_liveness_gpu.py -s``
"""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from rlserve.transfer import (  # noqa: E402
    HTTPWeightSyncClient,
    IPCTrainerInitInfo,
    ModuleSource,
    NCCLTrainerInitInfo,
    WeightTransferTrainerFactory,
)
from tests.gpu import nccl_over_gloo  # noqa: E402
from tests.gpu.report import gpu_report  # noqa: E402
from tests.gpu.transfer_gpu_common import ROOT, generate, load_hf, serve  # noqa: E402
from tests.transfer_harness import kill_trainer_script, killed_at  # noqa: E402

GROUP_POINTS = ("after_start", "first_bucket", "between_buckets", "after_update")
IPC_POINTS = ("after_start", "after_update")  # ipc: "after_update" = after the first bucket's call


def _report(key, value):
    gpu_report("liveness", key, value)


def _full_sync(url, path, backend, device):
    hf = load_hf(path, device, torch.bfloat16)
    if backend == "ipc":
        info = IPCTrainerInitInfo(timeout_s=60, device=device)
    else:
        info = NCCLTrainerInitInfo(world_size=2, device=device, timeout_s=60)
    eng = WeightTransferTrainerFactory.trainer_init(init_info=info, client=HTTPWeightSyncClient(url, timeout_s=120),
                                                    source=ModuleSource(hf))
    eng.send_weights()
    eng.shutdown()


def _wait_failure(url, t_kill, limit_s=60):
    deadline = time.monotonic() + limit_s
    info = None
    while time.monotonic() < deadline:
        info = httpx.get(url + "/weight_info", timeout=10).json()
        last = info.get("last_update") or {}
        if info["state"] == "uninitialized" and last.get("ok") is False and last.get("time", 0) > t_kill - 1:
            return last
        time.sleep(0.05)
    raise AssertionError(f"the dead trainer was not noticed within {limit_s} s (timeout_s is 300): {info}")


def _matrix(path, backend, transport, staging, points, device, launcher=("-m", "rlserve"), setup=""):
    wire_backend = "ipc" if backend == "ipc" else "nccl"
    with serve(path, wire_backend, staging=staging, launcher=launcher) as srv:
        for point in points:
            _full_sync(srv.url, path, wire_backend, device)
            script = kill_trainer_script(ROOT, path, srv.url, 0, timeout_s=300, scale=0.5, kill_at=point,
                                         backend=wire_backend, device=device, dtype="bfloat16", setup=setup)
            r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
            assert "KILLING" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
            t_kill = killed_at(r.stdout)
            last = _wait_failure(srv.url, t_kill)
            secs = round(last["time"] - t_kill, 3)
            _report(f"{transport}/{staging}/{point}", {"kill_to_failure_s": secs, "error": last["error"][:200]})
            assert secs < 60, (point, last)
            assert srv.proc.poll() is None, "the server died with the trainer"
            assert httpx.get(srv.url + "/is_paused", timeout=10).json().get("is_paused") is False
            loaded = staging == "none" and point in ("between_buckets", "after_update")
            assert generate(srv.url).status_code == (503 if loaded else 200), (point, last)
        _full_sync(srv.url, path, wire_backend, device)  # re-init and a full sync work
        assert generate(srv.url).status_code == 200


@pytest.mark.parametrize("staging", ["none", "device"])
def test_kill_matrix_nccl_over_gloo(tiny_model, staging, monkeypatch):
    import rlserve.transfer.backends.group as group

    monkeypatch.setattr(group, "new_backend", nccl_over_gloo.gloo_for_nccl(group.new_backend))  # this process
    _matrix(tiny_model("llama"), "nccl", "gloo-cuda", staging, GROUP_POINTS, "cuda:0",
            launcher=nccl_over_gloo.SERVER_LAUNCHER,
            setup="from tests.gpu.nccl_over_gloo import install; install()")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (one rank per GPU)")
@pytest.mark.parametrize("staging", ["none", "device"])
def test_kill_matrix_nccl(tiny_model, staging):
    _matrix(tiny_model("llama"), "nccl", "nccl", staging, GROUP_POINTS, "cuda:1")


@pytest.mark.parametrize("staging", ["none", "device"])
def test_kill_matrix_ipc(tiny_model, staging):
    _matrix(tiny_model("llama"), "ipc", "ipc", staging, IPC_POINTS, "cuda:0")
