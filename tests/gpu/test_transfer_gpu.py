"""Weight sync on GPUs through the CUDA IPC data plane (trainer and server on one GPU): a real
``rlserve serve`` process plus the trainer SDK in this process. NCCL: test_transfer_gpu_nccl.py;
helpers: tests/gpu/transfer_gpu_common.py.

- IPC handles round-trip through JSON into another process (no pickle);
- an ipc sync (packed buckets and per-tensor handles, in place and staged) gives checksums equal
  to the trainer's, several times in a row (buffers and IPC bookkeeping reused / freed);
- float32 serving: greedy output equals the trainer's HF model after the sync;
- a trainer killed mid-update (ipc): the session times out, the server stays up, marks the model
  unavailable (in place) and a re-init + full sync work;
- per-tensor handles sent once then by reference, the fused copy + checksum, one-call syncs
  under load; the Triton multi-tensor checksum.
Timings: ``transfer_gpu_common._report`` (``$RLSERVE_GPU_REPORT/transfer.json``).
"""

from __future__ import annotations

import json
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
    IPCTrainerInitInfo,
    ModuleSource,
    WeightTransferTrainerFactory,
    hf_state_checksums,
)
from rlserve.transfer.wire.ipc import export_handle  # noqa: E402
from rlserve.transfer.wire.packing import checksum  # noqa: E402
from tests.gpu.transfer_gpu_common import (N_TOK, PROMPTS, ROOT, _report, generate, hf_greedy,  # noqa: E402
                                            load_hf, serve)


# --------------------------------------------------------------------------- IPC
CHILD = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, {root!r})
    from rlserve.transfer.wire.ipc import import_handle
    from rlserve.transfer.wire.packing import checksum
    h = json.loads(sys.stdin.read())
    t = import_handle(h)
    print(json.dumps({{"checksum": checksum(t), "numel": t.numel(), "dtype": str(t.dtype)}}))
""")


def test_ipc_handle_json_roundtrip_other_process():
    buf = torch.arange(1 << 20, dtype=torch.int32, device="cuda").view(torch.uint8)
    h = export_handle(buf)
    wire = json.dumps(h)  # JSON only
    assert "handle" in json.loads(wire)
    r = subprocess.run([sys.executable, "-c", CHILD.format(root=ROOT)], input=wire, capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"checksum": checksum(buf), "numel": buf.numel(), "dtype": "torch.uint8"}


@pytest.mark.parametrize("packed,staging", [(True, "none"), (False, "none"), (True, "device"), (False, "host")])
def test_ipc_sync_equal_checksums(tiny_model, packed, staging):
    path = tiny_model("llama")
    hf = load_hf(path, "cuda:0", torch.bfloat16)
    with serve(path, "ipc", staging=staging) as srv:
        client = HTTPWeightSyncClient(srv.url, timeout_s=120)
        eng = WeightTransferTrainerFactory.trainer_init(
            init_info=IPCTrainerInitInfo(packed=packed, packed_buffer_size_bytes=64 << 10, timeout_s=60),
            client=client, source=ModuleSource(hf))
        mine = hf_state_checksums(ModuleSource(hf).named_tensors(), torch.bfloat16)
        times = []
        for v in range(1, 4):
            t0 = time.perf_counter()
            fin = eng.send_weights()
            times.append(time.perf_counter() - t0)
            assert fin["weight_version"] == str(v) and fin["full"]
            rep = client.weight_checker(compare=mine)
            assert rep["compare"]["match"] and rep["dtype"] == "bfloat16", rep["compare"]
            assert generate(srv.url).status_code == 200
            with torch.no_grad():  # next round sends different weights
                for p in hf.parameters():
                    p.mul_(0.99)
            mine = hf_state_checksums(ModuleSource(hf).named_tensors(), torch.bfloat16)
        _report(f"ipc_sync_seconds[packed={packed},staging={staging}]", [round(t, 4) for t in times])
        eng.shutdown()


def test_ipc_sync_float32_greedy_equals_hf(tiny_model):
    path = tiny_model("qwen3")
    hf = load_hf(path, "cuda:0", torch.float32)
    with serve(path, "ipc", "--enforce-eager", dtype="float32") as srv:
        prompts = PROMPTS + [list(range(3, 40))]  # two full KV blocks: prefix-cached
        before = generate(srv.url, prompts).json()["completion_ids"]  # dummy weights; fills the prefix cache
        eng = WeightTransferTrainerFactory.trainer_init(
            init_info=IPCTrainerInitInfo(timeout_s=60), client=HTTPWeightSyncClient(srv.url), source=ModuleSource(hf))
        fin = eng.send_weights()
        # in place on one replica: one /sync_weights call, committed inside one engine command
        # (no pause / resume), which also reset the prefix cache (else the cached dummy-weight
        # KV of the prompts would be reused)
        assert eng.last_stats.get("one_call") and fin["committed_in_engine_command"], fin
        got = generate(srv.url, prompts).json()["completion_ids"]
        ref = [hf_greedy(hf, p) for p in prompts]
        _report("ipc_fp32_greedy", {"server": got, "hf": ref})
        assert got == ref and before != ref
        eng.shutdown()


IPC_KILL = textwrap.dedent("""
    import os, signal, sys, time, torch
    sys.path.insert(0, {root!r})
    from tests.gpu.test_transfer_gpu import load_hf
    from rlserve.transfer import HTTPWeightSyncClient, IPCTrainerInitInfo, ModuleSource, WeightTransferTrainerFactory
    hf = load_hf({path!r}, "cuda:0", torch.bfloat16)
    class KillSource(ModuleSource):
        def named_tensors(self):
            for i, item in enumerate(super().named_tensors()):
                if i == 8:
                    time.sleep(1.0)
                    print("KILLING", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                yield item
    eng = WeightTransferTrainerFactory.trainer_init(
        init_info=IPCTrainerInitInfo(packed=True, timeout_s=5, packed_buffer_size_bytes=16 << 10),
        client=HTTPWeightSyncClient({url!r}), source=KillSource(hf))
    eng.send_weights()
""")


def test_ipc_trainer_killed_mid_update(tiny_model):
    path = tiny_model("llama")
    with serve(path, "ipc") as srv:
        r = subprocess.run([sys.executable, "-c", IPC_KILL.format(root=ROOT, path=path, url=srv.url)],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert "KILLING" in r.stdout, r.stderr[-3000:]
        deadline = time.monotonic() + 60  # the idle session watchdog fires after timeout_s (5 s)
        info = None
        while time.monotonic() < deadline:
            info = httpx.get(srv.url + "/weight_info").json()
            if info["state"] == "uninitialized":
                break
            time.sleep(0.2)
        assert info["state"] == "uninitialized", info
        assert generate(srv.url).status_code == 503  # buckets before the kill were loaded in place
        hf = load_hf(path, "cuda:0", torch.bfloat16)
        eng = WeightTransferTrainerFactory.trainer_init(
            init_info=IPCTrainerInitInfo(timeout_s=60), client=HTTPWeightSyncClient(srv.url), source=ModuleSource(hf))
        eng.send_weights()
        assert generate(srv.url).status_code == 200
        rep = eng.client.weight_checker(compare=hf_state_checksums(ModuleSource(hf).named_tensors(), torch.bfloat16))
        assert rep["compare"]["match"]
        eng.shutdown()



# --------------------------------------------------------------------------- one-launch checksums, handle refs
def test_multi_tensor_sum_gpu_equals_per_tensor():
    """The Triton chunk-table kernel gives every tensor's s64sum exactly (odd byte tails, chunks
    spanning tensors) and copies every byte; misaligned tensors are refused."""
    from rlserve.transfer.multi_tensor import MultiTensorSum
    from rlserve.transfer.wire.packing import as_bytes, checksum_tensor

    g = torch.Generator(device="cuda").manual_seed(0)
    srcs = [torch.randn(n, device="cuda", generator=g).to(dt) for n, dt in
            [(3 << 20, torch.bfloat16), (4097, torch.float32), (13, torch.float16), (3, torch.bfloat16),
             (1 << 21, torch.float32), (1, torch.float32)]]
    srcs.append(torch.randint(-2**62, 2**62, (1 << 20,), device="cuda", dtype=torch.int64, generator=g))
    dsts = [torch.zeros_like(s) for s in srcs]
    want = [int(checksum_tensor(as_bytes(s))) for s in srcs]
    for chunk in (1 << 20, 1000):
        op = MultiTensorSum.build(srcs, dsts, chunk_words=chunk)
        assert op is not None
        assert op.run().tolist() == want
        assert all(torch.equal(as_bytes(s), as_bytes(d)) for s, d in zip(srcs, dsts))
        assert MultiTensorSum.build(srcs, chunk_words=chunk).run().tolist() == want
    buf = torch.zeros(64, dtype=torch.uint8, device="cuda")
    assert MultiTensorSum.build([buf[4:36]]) is None


class _RecordingClient(HTTPWeightSyncClient):
    """Records, per update_weights call, whether it carried handles and the server's answer."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.calls = []

    def _record(self, update_info, ans):
        self.calls.append({"handles": update_info.get("ipc_handles") is not None,
                           "ref": update_info.get("ipc_handles_ref"), "answer": ans})

    def update_weights(self, update_info, timeout_s=None):
        ans = super().update_weights(update_info, timeout_s)
        self._record(update_info, ans)
        return ans

    def sync_weights(self, update_info, weight_version=None, timeout_s=None):
        try:
            ans = super().sync_weights(update_info, weight_version, timeout_s)
        except Exception:
            self._record(update_info, None)
            raise
        self._record(update_info, ans["update"])
        return ans


@pytest.mark.parametrize("staging,checksums", [("none", True), ("device", True), ("none", False)])
def test_ipc_handles_sent_once_then_by_ref(tiny_model, staging, checksums):
    """Per-tensor ipc, one /sync_weights call per sync: the first registers names, handles, the
    trainer's checksum tensor and event under a ref, later ones send only the ref (no names, no
    handles, no host checksums) and the server copies + checksums in one fused pass, compared on
    the GPU; a ref the server does not hold is refused and the SDK registers again; the
    server's weights equal the trainer's every time."""
    path = tiny_model("llama")
    hf = load_hf(path, "cuda:0", torch.bfloat16)
    with serve(path, "ipc", staging=staging) as srv:
        client = _RecordingClient(srv.url, timeout_s=120)
        eng = WeightTransferTrainerFactory.trainer_init(
            init_info=IPCTrainerInitInfo(packed=False, timeout_s=60, checksums=checksums), client=client,
            source=ModuleSource(hf))
        for v in range(3):
            eng.send_weights()
            rep = client.weight_checker(compare=hf_state_checksums(ModuleSource(hf).named_tensors(), torch.bfloat16))
            assert rep["compare"]["match"], rep["compare"]
            with torch.no_grad():
                for p in hf.parameters():
                    p.mul_(0.99)
        assert [c["handles"] for c in client.calls] == [True, False, False]
        assert len({c["ref"] for c in client.calls}) == 1
        assert eng.last_stats["one_call"] is True
        _report(f"ipc_ref_answers[{staging},{checksums}]", [c["answer"] for c in client.calls])
        assert client.calls[-1]["answer"]["checksums_fused"] is checksums
        eng._fast["ref"] = "not-a-ref-the-server-holds"
        eng.send_weights()
        assert [c["handles"] for c in client.calls[3:]] == [False, True]  # refused (400), resent with handles
        rep = client.weight_checker(compare=hf_state_checksums(ModuleSource(hf).named_tensors(), torch.bfloat16))
        assert rep["compare"]["match"]
        eng.shutdown()


def test_ipc_fused_checksum_mismatch_refuses_update(tiny_model):
    """A checksum that disagrees with what the fused copy read fails the update: in place the
    server answers 503 until a full update lands; the next correct sync restores service."""
    from rlserve.transfer.sdk.trainer import WeightSyncHTTPError

    path = tiny_model("llama")
    hf = load_hf(path, "cuda:0", torch.bfloat16)
    with serve(path, "ipc") as srv:
        client = _RecordingClient(srv.url, timeout_s=120)
        eng = WeightTransferTrainerFactory.trainer_init(
            init_info=IPCTrainerInitInfo(packed=False, timeout_s=60), client=client, source=ModuleSource(hf))
        eng.send_weights()
        eng.send_weights()
        assert client.calls[-1]["answer"]["checksums_fused"] is True
        op = eng._fast["op"]
        good = op.run

        def bad(out=None):  # the trainer announces a wrong sum for tensor 3
            r = good(out=out)
            r[3] += 1
            return r

        op.run = bad
        with pytest.raises(WeightSyncHTTPError) as ei:
            eng.send_weights()
        assert "checksum" in str(ei.value) and "(4/" in str(ei.value)
        assert generate(srv.url).status_code == 503
        eng.send_weights()  # re-initialises (fresh registration, a fresh op)
        assert generate(srv.url).status_code == 200
        rep = client.weight_checker(compare=hf_state_checksums(ModuleSource(hf).named_tensors(), torch.bfloat16))
        assert rep["compare"]["match"]
        eng.shutdown()


def test_ipc_one_call_syncs_under_load(tiny_model):
    """In place on one replica, each /sync_weights runs as one engine command (receive, prefix-cache
    reset, new version) without pause / resume: under concurrent generation no request fails, the
    weight versions on every answer are in order, and right after each sync the greedy tokens of
    prefix-cached prompts equal Hugging Face's with those weights (no stale KV)."""
    import threading

    path = tiny_model("llama")
    hf = load_hf(path, "cuda:0", torch.float32)
    probes = [list(range(3, 25)) + [11], list(range(3, 25)) + [13, 14]]  # share a full 16-token block
    results, errors = [], []
    stop = threading.Event()

    def load(url):
        with httpx.Client(timeout=120) as c:
            i = 0
            while not stop.is_set():
                try:
                    r = c.post(url + "/generate/", json={"prompt_ids": [probes[i % 2]], "max_tokens": N_TOK,
                                                         "temperature": 0, "generation_kwargs": {"ignore_eos": True}})
                    results.append((r.status_code, r.json()))
                except Exception as e:  # noqa: BLE001 - asserted below
                    errors.append(repr(e))
                i += 1

    with serve(path, "ipc", "--enforce-eager", dtype="float32") as srv:
        eng = WeightTransferTrainerFactory.trainer_init(
            init_info=IPCTrainerInitInfo(timeout_s=60), client=HTTPWeightSyncClient(srv.url), source=ModuleSource(hf))
        th = threading.Thread(target=load, args=(srv.url,), daemon=True)
        th.start()
        base = {n: p.detach().clone() for n, p in hf.named_parameters()}
        g = torch.Generator(device="cuda:0").manual_seed(0)
        answers = []
        for v in range(1, 6):
            with torch.no_grad():
                for n, p in hf.named_parameters():
                    p.copy_(base[n] + 0.05 * torch.randn(p.shape, generator=g, device=p.device))
            ref = [hf_greedy(hf, p) for p in probes]
            fin = eng.send_weights(weight_version=str(v))
            answers.append(fin.get("sync_phases_s"))
            assert fin["weight_version"] == str(v) and fin["committed_in_engine_command"], fin
            got = generate(srv.url, probes).json()
            assert got["weight_versions"] == [str(v)], got
            assert got["completion_ids"] == ref, (v, got["completion_ids"], ref)
        stop.set()
        th.join(60)
        eng.shutdown()
    _report("ipc_one_call_under_load", {"requests": len(results), "sync_phases_s": answers})
    assert not errors, errors[:3]
    assert len(results) > 5
    order = [str(v) for v in range(6)]
    for status, body in results:
        assert status == 200, body  # no request lost
        idx = [order.index(x) for x in body["weight_versions"]]
        assert idx == sorted(idx), body["weight_versions"]
        assert body["weight_version"] == body["weight_versions"][-1]
