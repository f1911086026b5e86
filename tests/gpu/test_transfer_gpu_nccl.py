"""Weight sync on GPUs over NCCL (trainer on its own GPU; needs two or more, else the
``gloo-cuda`` transport: the same code with the group emulated by gloo over CUDA tensors): a real
``rlserve serve`` process plus the trainer SDK in this process. IPC: test_transfer_gpu.py;
helpers: tests/gpu/transfer_gpu_common.py.

- a sync gives checksums equal to the trainer's; a checksum after the data that disagrees is
  refused; a trainer killed mid-update is noticed within ``timeout_s`` (our deadline +
  communicator abort: the server process survives), re-init works; TP=2 server + trainer on a
  third GPU when there are >= 3;
- the CUDA side of ``send_packed`` (in-place and packed buckets) against a recording group.
Timings: ``transfer_gpu_common._report`` (``$RLSERVE_GPU_REPORT/transfer.json``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import httpx
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from rlserve.transfer import (  # noqa: E402
    HTTPWeightSyncClient,
    ModuleSource,
    NCCLTrainerInitInfo,
    WeightTransferTrainerFactory,
    hf_state_checksums,
)
from rlserve.transfer.sdk.trainer import WeightSyncHTTPError  # noqa: E402
from tests.gpu import nccl_over_gloo  # noqa: E402
from tests.gpu.transfer_gpu_common import (PROMPTS, ROOT, _report, generate, hf_greedy, load_hf,  # noqa: E402
                                            needs_2, needs_3, serve)
from tests.transfer_harness import wrong_second_bucket_sum  # noqa: E402


# --------------------------------------------------------------------------- NCCL
class Transport:
    """Where the NCCL-backend tests run: ``nccl`` (real NCCL, trainer on GPU 1, needs two GPUs) or
    ``gloo-cuda`` (one GPU for both ranks, the "nccl" group built as gloo over CUDA tensors:
    :mod:`tests.gpu.nccl_over_gloo`; everything but NCCL itself)."""

    def __init__(self, name: str):
        self.name = name
        self.emulated = name == "gloo-cuda"
        self.trainer_device = "cuda:0" if self.emulated else "cuda:1"
        self.launcher = nccl_over_gloo.SERVER_LAUNCHER if self.emulated else ("-m", "rlserve")
        # the trainer subprocess of the kill test
        self.child_setup = "from tests.gpu.nccl_over_gloo import install; install()" if self.emulated else ""


@pytest.fixture(params=[pytest.param("nccl", marks=needs_2), "gloo-cuda"])
def transport(request, monkeypatch):
    t = Transport(request.param)
    if t.emulated:
        import rlserve.transfer.backends.group as group

        monkeypatch.setattr(group, "new_backend", nccl_over_gloo.gloo_for_nccl(group.new_backend))
    return t


@pytest.mark.parametrize("packed,staging", [(True, "none"), (False, "none"), (True, "device")])
def test_nccl_sync_equal_checksums(tiny_model, transport, packed, staging):
    """Three syncs into a float32 server (packed: checksums after the data; unpacked: announced
    per tensor), in place or staged; the server's per-parameter checksums then equal the
    trainer's, and its greedy tokens the trainer model's (they differed on the dummy weights)."""
    path = tiny_model("qwen3")
    hf = load_hf(path, transport.trainer_device, torch.float32)
    with serve(path, "nccl", "--enforce-eager", dtype="float32", device="cuda:0", staging=staging,
               launcher=transport.launcher) as srv:
        before = generate(srv.url).json()["completion_ids"]
        client = HTTPWeightSyncClient(srv.url, timeout_s=120)
        eng = WeightTransferTrainerFactory.trainer_init(
            init_info=NCCLTrainerInitInfo(world_size=2, device=transport.trainer_device,
                                          packed=packed, packed_buffer_size_bytes=64 << 10, timeout_s=60),
            client=client, source=ModuleSource(hf))
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            eng.send_weights()
            times.append(time.perf_counter() - t0)
        if packed:
            assert eng.last_stats["buckets"] > 2
        rep = client.weight_checker(compare=hf_state_checksums(ModuleSource(hf).named_tensors(), torch.float32))
        assert rep["compare"]["match"], rep["compare"]
        got = generate(srv.url).json()["completion_ids"]
        ref = [hf_greedy(hf, p) for p in PROMPTS]
        assert got == ref and before != ref
        _report(f"nccl_sync_seconds[{transport.name},packed={packed},staging={staging}]",
                [round(t, 4) for t in times])
        eng.shutdown()


@pytest.mark.parametrize("staging", ["none", "device"])
def test_nccl_after_data_checksum_mismatch_refused(tiny_model, transport, staging, monkeypatch):
    """A packed update whose second bucket sum (queued on the trainer's GPU, sent after the
    data) is off by one fails on the server's one comparison per update: 500 naming the
    checksum; in place the server then answers 503, staged it keeps the weights it had; the
    next full sync restores the trainer's weights."""
    import rlserve.transfer.sdk.sender as sender

    path = tiny_model("llama")
    hf = load_hf(path, transport.trainer_device, torch.bfloat16)
    want = hf_state_checksums(ModuleSource(hf).named_tensors(), torch.bfloat16)
    with serve(path, "nccl", device="cuda:0", staging=staging, launcher=transport.launcher) as srv:
        client = HTTPWeightSyncClient(srv.url, timeout_s=120)
        eng = WeightTransferTrainerFactory.trainer_init(
            init_info=NCCLTrainerInitInfo(world_size=2, device=transport.trainer_device,
                                          packed_buffer_size_bytes=64 << 10, timeout_s=60),
            client=client, source=ModuleSource(hf))
        eng.send_weights()
        real = sender.pack_checksummed
        calls = wrong_second_bucket_sum(monkeypatch)
        with pytest.raises(WeightSyncHTTPError) as ei:
            eng.send_weights()
        assert ei.value.status_code == 500 and "checksum" in str(ei.value), str(ei.value)
        assert len(calls) > 2
        r = generate(srv.url)
        if staging == "none":
            assert r.status_code == 503, r.text
        else:
            assert r.status_code == 200, r.text
            assert client.weight_checker(compare=want)["compare"]["match"]
        monkeypatch.setattr(sender, "pack_checksummed", real)
        eng.send_weights()  # re-initialises the group (the failed update tore it down)
        assert client.weight_checker(compare=want)["compare"]["match"]
        assert generate(srv.url).status_code == 200
        eng.shutdown()


NCCL_KILL = textwrap.dedent("""
    import os, signal, sys, time, torch
    sys.path.insert(0, {root!r})
    {setup}
    from tests.gpu.test_transfer_gpu import load_hf
    from rlserve.transfer import HTTPWeightSyncClient, NCCLTrainerInitInfo, ModuleSource, WeightTransferTrainerFactory
    hf = load_hf({path!r}, {device!r}, torch.bfloat16)
    class KillSource(ModuleSource):
        # packed with checksums after the data (the SDK's default): the send is the one pass
        # over the source, so tensor 8 comes after the first buckets went out
        passes = 0
        def named_tensors(self):
            self.passes += 1
            for i, item in enumerate(super().named_tensors()):
                if self.passes == 1 and i == 8:
                    torch.cuda.synchronize()
                    time.sleep(1.0)
                    print("KILLING", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                yield item
    eng = WeightTransferTrainerFactory.trainer_init(
        init_info=NCCLTrainerInitInfo(world_size=2, device={device!r}, timeout_s=10,
                                      packed_buffer_size_bytes=16 << 10),
        client=HTTPWeightSyncClient({url!r}), source=KillSource(hf))
    eng.send_weights()
    print("NOT KILLED", eng.last_stats, flush=True)
""")


def test_nccl_trainer_killed_mid_update(tiny_model, transport):
    path = tiny_model("llama")
    with serve(path, "nccl", device="cuda:0", launcher=transport.launcher) as srv:
        t0 = time.monotonic()
        code = NCCL_KILL.format(root=ROOT, path=path, url=srv.url, device=transport.trainer_device,
                                setup=transport.child_setup)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert "KILLING" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
        deadline = time.monotonic() + 90
        info = None
        while time.monotonic() < deadline:
            info = httpx.get(srv.url + "/weight_info", timeout=10).json()
            if info["state"] == "uninitialized":
                break
            time.sleep(0.2)
        _report(f"nccl_kill_noticed_after_s[{transport.name}]", round(time.monotonic() - t0, 2))
        assert info["state"] == "uninitialized", info
        assert srv.proc.poll() is None, "the server died with the trainer"
        assert generate(srv.url).status_code == 503
        hf = load_hf(path, transport.trainer_device, torch.bfloat16)
        eng = WeightTransferTrainerFactory.trainer_init(
            init_info=NCCLTrainerInitInfo(world_size=2, device=transport.trainer_device,
                                          timeout_s=60),
            client=HTTPWeightSyncClient(srv.url), source=ModuleSource(hf))
        eng.send_weights()
        assert generate(srv.url).status_code == 200
        eng.shutdown()


@needs_3
def test_nccl_tp2_server_trainer_on_third_gpu(tiny_model):
    path = tiny_model("qwen3")
    hf = load_hf(path, "cuda:2", torch.bfloat16)
    with serve(path, "nccl", "--tensor-parallel-size", "2", "--device-ids", "0,1", device="cuda") as srv:
        client = HTTPWeightSyncClient(srv.url, timeout_s=120)
        ws = client.get_world_size() + 1
        assert ws == 3
        eng = WeightTransferTrainerFactory.trainer_init(
            init_info=NCCLTrainerInitInfo(world_size=ws, device="cuda:2", timeout_s=60),
            client=client, source=ModuleSource(hf))
        eng.send_weights()
        rep = client.weight_checker(compare=hf_state_checksums(ModuleSource(hf).named_tensors(), torch.bfloat16))
        assert rep["compare"]["match"], rep["compare"]
        eng.shutdown()


class _RecordingGroup:
    """A stand-in for a one-receiver NCCL group: ``broadcast`` snapshots the bytes it is given
    (after the stream's earlier work, as NCCL would read them) and completes at once."""

    rank = 0

    def __init__(self):
        self.sent: list[torch.Tensor] = []

    def broadcast(self, t, src):
        torch.cuda.current_stream().synchronize()
        self.sent.append(t.detach().cpu().clone())
        return object()

    def order(self, work, what=""):
        pass

    def wait(self, work, what="", check=None):
        pass


@pytest.mark.parametrize("after", [False, True])
def test_send_packed_cuda_in_place_and_packed_buckets(after):
    """The CUDA side of ``send_packed`` without a second GPU: a bucket whose tensors lie back to
    back in one CUDA tensor goes out of that memory, the others are packed on the GPU; every
    bucket's bytes equal what packing gives, and with checksums after the data the last
    broadcast holds each bucket's s64sum."""
    from rlserve.transfer.wire.packing import BucketBuffers, checksum, pack, plan_buckets
    from rlserve.transfer.wire.protocol import UpdateInfo, dtype_to_name
    from rlserve.transfer.sdk.sender import send_packed

    g = torch.Generator(device="cuda").manual_seed(0)
    flat = torch.randn(3 * 64, device="cuda", generator=g)
    named = [(f"flat{i}", flat[64 * i: 64 * (i + 1)]) for i in range(3)]  # 256 bytes each, adjacent
    named += [(f"own{i}", torch.randn(10 + i, device="cuda", generator=g, dtype=torch.bfloat16)) for i in range(3)]
    info = UpdateInfo(names=[n for n, _ in named], dtype_names=[dtype_to_name(t.dtype) for _, t in named],
                      shapes=[list(t.shape) for _, t in named], packed=True, packed_buffer_size_bytes=700,
                      packed_num_buffers=2, checksums_after_data=after)
    plan = plan_buckets(info.names, info.dtypes(), info.shapes, 700)
    assert [len(b.slots) for b in plan] == [3, 3]
    grp, bufs = _RecordingGroup(), BucketBuffers()
    send_packed(grp, info, iter(named), torch.device("cuda"), buffers=bufs)
    by_name = dict(named)
    expected = [pack(torch.empty(b.nbytes, dtype=torch.uint8), b, [by_name[s.name].cpu() for s in b.slots])
                for b in plan]
    from rlserve.transfer.wire.packing import layout_header

    assert grp.sent[0].tolist() == layout_header(info, plan)  # the layout header goes first
    sent = grp.sent[1:]
    assert len(sent) == len(plan) + (1 if after else 0)
    for got, exp in zip(sent, expected):
        assert torch.equal(got, exp)
    assert len(bufs._bufs) == 2 and bufs._bufs[0].is_cuda  # bucket 1 was packed; bucket 0 was not
    if after:
        assert sent[-1].tolist() == [checksum(e) for e in expected]
