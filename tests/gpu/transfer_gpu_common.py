"""Helpers of the GPU weight-sync tests (``test_transfer_gpu.py``: the CUDA IPC data plane;
``test_transfer_gpu_nccl.py``: NCCL; and ``test_vllm_wire_gpu.py``, ``test_trainer_liveness_gpu.py``,
``test_multi_server_gpu.py``): the perturbed trainer model, Hugging Face's greedy tokens, a
``rlserve serve`` process with a weight-transfer backend, and the timing report (printed and,
when ``$RLSERVE_GPU_REPORT`` is set, written to ``$RLSERVE_GPU_REPORT/transfer.json``: one
report for all of them)."""

from __future__ import annotations

import json
import os

import httpx
import pytest
import torch

from rlserve.server.testing import ServerProcess
from tests.gpu.report import gpu_report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = [[5, 17, 42, 9, 77, 3], [100, 101, 7, 8]]
N_TOK = 6
needs_2 = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (one rank per GPU)")
needs_3 = pytest.mark.skipif(torch.cuda.device_count() < 3, reason="TP=2 server + trainer needs three GPUs")


def _report(key: str, value) -> None:
    """:func:`tests.gpu.report.gpu_report` into ``transfer.json``."""
    gpu_report("transfer", key, value)


def load_hf(path, device, dtype=torch.float32, scale=0.3):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return hf.to(device=device, dtype=dtype)


def hf_greedy(model, prompt_ids, n=N_TOK):
    dev = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=dev)
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]], device=dev)], dim=1)
    return out


def generate(url, prompts=PROMPTS):
    return httpx.post(url + "/generate/", json={"prompt_ids": prompts, "max_tokens": N_TOK, "temperature": 0,
                                                "generation_kwargs": {"ignore_eos": True}}, timeout=120)


def serve(path, backend, *extra, dtype="bfloat16", staging="none", device="cuda:0", launcher=("-m", "rlserve")):
    return ServerProcess(path, "--device", device, "--dtype", dtype, "--load-format", "dummy",
                         "--max-model-len", "128", "--num-kv-blocks", "256", "--max-num-seqs", "8",
                         "--weight-transfer-config", json.dumps({"backend": backend}),
                         "--weight-staging", staging, *extra, startup_timeout_s=300, launcher=launcher)

