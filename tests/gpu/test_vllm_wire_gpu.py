"""vLLM's own trainer engines, unmodified, sync into ``rlserve serve`` (issue 18, the wire half).

The trainer runs in a subprocess of a Python that has vLLM (``$RLSERVE_VLLM_PYTHONPATH``: a
``PYTHONPATH`` with vLLM, e.g. ``/tmp/vsite`` after ``../shared/tools/device-vllm``'s install;
vLLM 0.24.0 there, 0.32's API is used when present). rlserve runs in this process's environment.

- ipc (one GPU): vLLM's IPC trainer engine sends ``ipc_handles_pickled`` (per-tensor handles,
  and packed); rlserve reads them through its restricted unpickler. Checksums equal the trainer's,
  greedy tokens equal the trainer model's (float32).
- NCCL (two GPUs): vLLM's NCCL trainer engine (rank 0, hosting its ``StatelessProcessGroup``
  store) against an NCCL server: rlserve joins vLLM's rendezvous, reads the unique id, builds the
  communicator through its ctypes binding and receives vLLM's raw buckets (packed and unpacked).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from rlserve.transfer import ModuleSource, hf_state_checksums  # noqa: E402
from tests.gpu.transfer_gpu_common import PROMPTS, _report, generate, hf_greedy, load_hf, serve  # noqa: E402

VLLM_PATH = os.environ.get("RLSERVE_VLLM_PYTHONPATH")
if VLLM_PATH and os.path.isdir(os.path.join(VLLM_PATH, "_raystub")):
    # device-vllm's stand-in for `ray`: vLLM 0.24's ipc_engine imports ray at module level
    VLLM_PATH = f"{VLLM_PATH}:{os.path.join(VLLM_PATH, '_raystub')}"


def _vllm_version() -> str | None:
    if not VLLM_PATH:
        return None
    r = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": VLLM_PATH}, timeout=600)
    return r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else None


VLLM_VERSION = _vllm_version()
needs_vllm = pytest.mark.skipif(VLLM_VERSION is None, reason="vLLM is not importable: set RLSERVE_VLLM_PYTHONPATH "
                                "(e.g. /tmp/vsite from ../shared/tools/device-vllm)")
needs_2 = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (one rank per GPU)")

# The trainer: the same perturbed HF model as tests.gpu.transfer_gpu_common.load_hf (seed 0, scale
# 0.3, float32), sent with vLLM's own engine. No rlserve import (vLLM's environment).
TRAINER = textwrap.dedent('''
    import json, sys, threading, torch, requests, vllm
    from transformers import AutoModelForCausalLM
    backend, path, url, packed, device, port = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1", sys.argv[5], int(sys.argv[6])
    torch.cuda.set_device(device)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    hf = hf.to(device)
    params = lambda: ((n, p.detach()) for n, p in hf.named_parameters())
    def post(route, body=None):
        r = requests.post(url + route, json=body, timeout=600)
        assert r.status_code == 200, (route, r.status_code, r.text)
        return r.json()
    def mk(cls, **kw):  # 0.32's TrainerInitInfo takes a keyword-only rank (0: the sender)
        try:
            return cls(rank=0, **kw)
        except TypeError:
            return cls(**kw)
    try:  # vLLM with the trainer factory (0.32's API)
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        api = "factory"
    except ImportError:
        api = "static"
    if api == "factory" and backend == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
        eng = WeightTransferTrainerFactory.trainer_init(mk(IPCTrainerInitInfo, packed=packed),
                                                        client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(hf))
        eng.send_weights()
    elif api == "factory":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
        eng = WeightTransferTrainerFactory.trainer_init(
            mk(NCCLTrainerInitInfo, master_address="127.0.0.1", master_port=port, world_size=2, packed=packed,
               packed_buffer_size_bytes=64 << 10),
            client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(hf))
        eng.send_weights()
    elif backend == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerSendWeightsArgs, IPCWeightTransferEngine
        post("/init_weight_transfer_engine", {"init_info": {}})
        post("/start_weight_update", {})
        fields = IPCTrainerSendWeightsArgs.__dataclass_fields__
        kw = {("send_mode" if "send_mode" in fields else "mode"): "http", "url": url}
        if "packed" in fields:
            # vLLM 0.24's packed IPC producer refuses a tensor larger than its buffer (run on the H200,
            # 2026-12-01: "model.embed_tokens.weight has size 86016 bytes, which exceeds
            # buffer_size_bytes=65536"), unlike its NCCL producer: 128 KiB holds the tiny model's largest
            # tensor and still cuts the model into several buffers
            kw.update(packed=packed, packed_buffer_size_bytes=128 << 10)
        elif packed:
            print(json.dumps({"skip": "this vLLM's IPC engine has no packed mode"})); sys.exit(0)
        IPCWeightTransferEngine.trainer_send_weights(params(), IPCTrainerSendWeightsArgs(**kw))
        post("/finish_weight_update", {})
    else:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine
        init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
        th = threading.Thread(target=post, args=("/init_weight_transfer_engine", {"init_info": init}))
        th.start()
        group = NCCLWeightTransferEngine.trainer_init(init)
        th.join()
        post("/start_weight_update", {})
        meta = [(n, str(p.dtype).split(".")[-1], list(p.shape)) for n, p in params()]
        info = {"names": [m[0] for m in meta], "dtype_names": [m[1] for m in meta], "shapes": [m[2] for m in meta],
                "packed": packed, "packed_buffer_size_bytes": 64 << 10}
        th = threading.Thread(target=post, args=("/update_weights", {"update_info": info}))
        th.start()
        NCCLWeightTransferEngine.trainer_send_weights(params(), NCCLTrainerSendWeightsArgs(
            group=group, packed=packed, packed_buffer_size_bytes=64 << 10))
        th.join()
        post("/finish_weight_update", {})
    torch.cuda.synchronize()
    print(json.dumps({"api": api, "vllm": vllm.__version__}), flush=True)
''')


def _run_trainer(tmp_path, backend, path, url, packed, device, port=0) -> dict:
    script = tmp_path / "vllm_trainer.py"
    script.write_text(TRAINER)
    env = {**os.environ, "PYTHONPATH": VLLM_PATH, "VLLM_ALLOW_INSECURE_SERIALIZATION": "0"}
    r = subprocess.run([sys.executable, str(script), backend, path, url, "1" if packed else "0", device, str(port)],
                       capture_output=True, text=True, timeout=900, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _check_synced(srv, path, device, tag):
    import httpx

    hf = load_hf(path, device, torch.float32)  # the trainer's model (same seed and perturbation)
    mine = hf_state_checksums(ModuleSource(hf).named_tensors(), torch.float32)
    rep = httpx.post(srv.url + "/weight_checker", json={"compare": mine}, timeout=300).json()
    assert rep["compare"]["match"], rep["compare"]
    got = generate(srv.url).json()["completion_ids"]
    ref = [hf_greedy(hf, p) for p in PROMPTS]
    _report(f"vllm_trainer_{tag}", {"server": got, "hf": ref})
    assert got == ref


@needs_vllm
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("packed", [False, True])
def test_vllm_ipc_trainer_syncs_qwen3(tiny_model, tmp_path, packed, arch):
    """vLLM's IPC trainer engine (``ipc_handles_pickled`` over HTTP) into an ipc server on the same
    GPU: the server's checksums equal the trainer's, greedy equals the trainer's model, the dummy
    weights' tokens differed. ``qwen3_moe``: the trainer's ``named_parameters()`` carry
    transformers 5's fused expert tensors (``mlp.experts.gate_up_proj [8, 64, 64]``, 128 KiB: the
    packed buffer's size), landed in the server's fused layout."""
    path = tiny_model(arch)
    with serve(path, "ipc", "--enforce-eager", dtype="float32") as srv:
        before = generate(srv.url).json()["completion_ids"]
        out = _run_trainer(tmp_path, "ipc", path, srv.url, packed, "cuda:0")
        if "skip" in out:
            pytest.skip(out["skip"])
        _report(f"vllm_ipc_trainer[{arch},packed={packed}]", out)
        _check_synced(srv, path, "cuda:0", f"ipc_{arch}_packed={packed}")
        assert generate(srv.url).json()["completion_ids"] != before


@needs_vllm
@needs_2
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("packed", [True, False])
def test_vllm_nccl_trainer_syncs_qwen3(tiny_model, tmp_path, packed, arch, reserve_port):
    """vLLM's NCCL trainer engine on GPU 1 (rank 0, hosting its StatelessProcessGroup store)
    into an NCCL server on GPU 0 (vLLM's wire: no layout header, raw buckets, no checksums);
    ``qwen3_moe``: fused expert tensors of 128 KiB, larger than the 64 KiB buckets."""
    path = tiny_model(arch)
    with serve(path, "nccl", "--enforce-eager", dtype="float32", device="cuda:0") as srv:
        out = _run_trainer(tmp_path, "nccl", path, srv.url, packed, "cuda:1", reserve_port())
        _report(f"vllm_nccl_trainer[{arch},packed={packed}]", out)
        _check_synced(srv, path, "cuda:0", f"nccl_{arch}_packed={packed}")
