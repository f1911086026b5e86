"""One trainer, two servers, one NCCL group (issue 20) on three GPUs: servers on cuda:0 and
cuda:1 (float32, staged on the device), the trainer on cuda:2; ``MultiServerTrainer`` syncs both
with one broadcast per bucket. Both servers then hold exactly the trainer's tensors, report one
version and generate its greedy tokens. Not yet run on GPUs (written in a CPU-only session); the
same code runs on CPU over gloo in ``tests/test_scaleout.py``."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 3,
                                reason="two NCCL servers + a trainer need three GPUs (one rank per GPU)")


def test_two_servers_one_nccl_group(tiny_model, monkeypatch):
    from rlserve.demo import NCCL_SAFE_ENV
    from rlserve.transfer import HTTPWeightSyncClient, ModuleSource, hf_state_checksums
    from rlserve.transfer.sdk.multi_server import MultiServerTrainer
    from tests.gpu.transfer_gpu_common import PROMPTS, generate, hf_greedy, load_hf, serve

    for k, v in NCCL_SAFE_ENV.items():  # NVLink multicast off here and in the servers (they inherit it)
        monkeypatch.setenv(k, v)
    path = tiny_model("qwen3")
    hf = load_hf(path, "cuda:2", torch.float32)
    ref = [hf_greedy(hf, p) for p in PROMPTS]
    with serve(path, "nccl", "--enforce-eager", dtype="float32", device="cuda:0", staging="device") as s0, \
            serve(path, "nccl", "--enforce-eager", dtype="float32", device="cuda:1", staging="device") as s1:
        urls = [s0.url, s1.url]
        trainer = MultiServerTrainer.create(urls, ModuleSource(hf), backend="nccl", device="cuda:2", timeout_s=120,
                                            packed_buffer_size_bytes=64 << 10)
        try:
            assert trainer.client.rank_offsets() == {urls[0]: 1, urls[1]: 2}
            for _ in range(2):
                v = trainer.send_weights()["weight_version"]
                assert trainer.weight_versions() == {u: v for u in urls}
            want = hf_state_checksums(ModuleSource(hf).named_tensors(), torch.float32)
            for u in urls:
                rep = HTTPWeightSyncClient(u).weight_checker(compare=want)
                assert rep["compare"]["match"], (u, rep["compare"])
                assert generate(u).json()["completion_ids"] == ref
            print(f"[multi-server-gpu] sync seconds: {trainer.last_stats.get('total_seconds')}")
        finally:
            trainer.shutdown()
