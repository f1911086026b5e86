"""The non-finite test folded into the checksum passes (rlserve.transfer.finite): host pieces
(numpy, host_ops) and the Triton chunk kernel (through Triton's interpreter on CPU), for every
tested dtype: one NaN / +inf / -inf in one element is found, in the element where it is, and
finite extremes (max, -max, smallest subnormal, -0.0) are not flagged."""

from __future__ import annotations

import pytest
import torch

import tests.triton_interp  # noqa: F401  (skips this module, or sets TRITON_INTERPRET=1 first)
from rlserve.transfer.finite import lane_masks, np_nonfinite, torch_nonfinite
from rlserve.transfer.host_ops import host_copy_scan, host_scan_spans
from rlserve.transfer.wire.packing import plan_buckets, tensor_checksum, checksum, pack

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2]
#: what each dtype can hold that is not finite (e4m3fn has no infinity: inf casts to NaN there)
BAD = {dt: [float("nan"), float("inf"), float("-inf")] for dt in DTYPES}
BAD[torch.float8_e4m3fn] = [float("nan"), -float("nan")]


def finite_extremes(dt: torch.dtype, n: int = 333) -> torch.Tensor:
    """``n`` finite values of ``dt``, its largest, most negative, tiniest and -0.0 among them."""
    fi = torch.finfo(dt)
    base = torch.linspace(-3, 3, n, dtype=torch.float32).to(dt)
    ext = torch.tensor([fi.max, -fi.max, fi.smallest_normal, -fi.tiny, 0.0, -0.0], dtype=torch.float64).to(dt)
    base[: ext.numel()] = ext  # (n >= 7)
    if dt.itemsize > 1:
        base[6] = torch.tensor(fi.smallest_normal / 4, dtype=torch.float64).to(dt)  # a subnormal
    return base


def with_bad(dt, value, at: int, n: int = 333) -> torch.Tensor:
    t = finite_extremes(dt, n)
    t[at] = torch.tensor(value, dtype=torch.float32).to(dt) if dt.itemsize > 1 else \
        torch.tensor([value], dtype=torch.float32).to(dt)[0]
    return t


def _bad_bits(t):
    """The bytes of ``t`` (NaN != NaN: compare bits)."""
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_host_and_torch_tests_find_one_bad_element(dt):
    good = finite_extremes(dt)
    assert not np_nonfinite(good.view(torch.uint8).numpy(), dt)
    assert not bool(torch_nonfinite(good))
    for value in BAD[dt]:
        for at in (0, 7, 332):
            t = with_bad(dt, value, at)
            assert np_nonfinite(t.view(torch.uint8).numpy(), dt), (value, at)
            assert bool(torch_nonfinite(t)), (value, at)
    # integers are not tested whatever their bits
    assert not np_nonfinite(torch.full((8,), -1, dtype=torch.int32).view(torch.uint8).numpy(), torch.int32)


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_host_copy_scan_flags_the_pair_and_copies_everything(dt, monkeypatch):
    monkeypatch.setattr("rlserve.transfer.host_ops.CHUNK_BYTES", 64)  # many pieces per tensor
    monkeypatch.setattr("rlserve.transfer.host_ops.TEST_BYTES", 16)  # and sub-pieces per piece
    srcs = [finite_extremes(dt), with_bad(dt, BAD[dt][-1], 200), finite_extremes(dt, 9)]
    dsts = [torch.empty_like(s) for s in srcs]
    sums, bad = host_copy_scan(list(zip(dsts, srcs)), s64sums=True, finite=True)
    assert bad == [False, True, False]
    assert sums == [tensor_checksum(s) for s in srcs]
    assert all(torch.equal(_bad_bits(d), _bad_bits(s)) for d, s in zip(dsts, srcs))
    assert host_copy_scan(list(zip(dsts, srcs)), s64sums=True, finite=False)[1] is None


@pytest.mark.parametrize("align", [256, 1])
def test_host_scan_spans_of_a_bucket(align, monkeypatch):
    """rlserve's aligned layout and vLLM's back-to-back one (slots at odd offsets): the bucket's
    s64sum equals checksum() of its bytes and exactly the slot holding the bad value is named,
    also when that value sits across a piece boundary."""
    monkeypatch.setattr("rlserve.transfer.host_ops.CHUNK_BYTES", 64)
    monkeypatch.setattr("rlserve.transfer.host_ops.TEST_BYTES", 24)  # elements across sub-piece ends
    tensors = [finite_extremes(torch.float8_e4m3fn, 37), finite_extremes(torch.bfloat16, 91),
               with_bad(torch.float16, float("-inf"), 45, 77), finite_extremes(torch.float32, 33),
               with_bad(torch.bfloat16, float("nan"), 90, 91)]
    plan = plan_buckets([f"t{i}" for i in range(5)], [t.dtype for t in tensors], [t.shape for t in tensors],
                        1 << 20, align=align)
    (b,) = plan
    buf = torch.zeros(b.nbytes, dtype=torch.uint8)
    for sl, t in zip(b.slots, tensors):
        buf[sl.offset: sl.offset + sl.nbytes] = t.reshape(-1).view(torch.uint8)
    spans = [(sl.offset, sl.nbytes, sl.dtype) for sl in b.slots]
    total, bad = host_scan_spans(buf, spans)
    assert total == checksum(buf)
    assert bad == [False, False, True, False, True]
    assert host_scan_spans(buf, spans, s64sum=False) == (None, bad)


def test_lane_masks_are_the_exponent_fields():
    assert lane_masks(torch.bfloat16)[0] == 0x7F807F807F807F80
    assert lane_masks(torch.float32) == (0x7F8000007F800000, 0x0000000100000001, -0x7FFFFFFF80000000)
    assert lane_masks(torch.int64) == (0, 0, 0)


@pytest.mark.parametrize("copy", [False, True])
def test_multi_tensor_sum_tests_every_element(copy):
    """The Triton kernel (chunks of 3 words: an element's word in any chunk; odd-sized tails):
    per-source flags, the sums unchanged, with the test off no flags."""
    from rlserve.transfer.multi_tensor import MultiTensorSum

    srcs, want = [], []
    for dt in DTYPES:
        srcs.append(finite_extremes(dt, 29))
        want.append(0)
        for value in BAD[dt]:
            for at in (0, 13, 28):  # 28: in the tail past the last whole word for 1- and 2-byte types
                srcs.append(with_bad(dt, value, at, 29))
                want.append(1)
    srcs.append(torch.full((9,), -1, dtype=torch.int32))  # all bits set: not a float, not tested
    want.append(0)
    dsts = [torch.zeros_like(s) for s in srcs] if copy else None
    op = MultiTensorSum.build(srcs, dsts, chunk_words=3, _allow_cpu=True, check_finite=True)
    sums = op.run().tolist()
    assert [int(b != 0) for b in op.bad.tolist()] == want
    assert sums == [tensor_checksum(s) for s in srcs]
    if copy:
        assert all(torch.equal(_bad_bits(d), _bad_bits(s)) for d, s in zip(dsts, srcs))
    plain = MultiTensorSum.build(srcs, chunk_words=3, _allow_cpu=True)
    assert plain.run().tolist() == sums and plain.bad is None
    # uint8 views of a bucket's slots, tested as the dtype they hold
    u8 = [s.reshape(-1).view(torch.uint8) for s in srcs[:5]]
    op = MultiTensorSum.build(u8, chunk_words=3, _allow_cpu=True, check_finite=True,
                              check_dtypes=[s.dtype for s in srcs[:5]])
    op.run()
    assert [int(b != 0) for b in op.bad.tolist()] == want[:5]


@pytest.mark.parametrize("align", [256, 1])
def test_device_bucket_scan_logic(align, monkeypatch):
    """The receiver's bucket scan for device bytes (rlserve.transfer.server.finite_scan), run on
    CPU through the interpreter: rlserve's aligned layout goes through one chunk-kernel launch
    (slot pieces to the next slot: the sum equals the bucket's s64sum), vLLM's raw layout through
    the per-slot fallback (misaligned slots copied); both name exactly the bad slots, never an
    integer slot whose bits would read as NaN in a float."""
    from functools import partial

    from rlserve.transfer.multi_tensor import MultiTensorSum
    from rlserve.transfer.server import finite_scan
    from rlserve.transfer.server.finite_scan import bucket_units, bad_names

    built = []
    real = partial(MultiTensorSum.build.__func__, MultiTensorSum, _allow_cpu=True, chunk_words=5)
    monkeypatch.setattr(MultiTensorSum, "build", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    tensors = [finite_extremes(torch.float8_e4m3fn, 37), torch.full((9,), -1, dtype=torch.int16),
               with_bad(torch.float16, float("-inf"), 45, 77), finite_extremes(torch.float32, 33),
               with_bad(torch.bfloat16, float("nan"), 90, 91)]
    (b,) = plan_buckets([f"t{i}" for i in range(5)], [t.dtype for t in tensors], [t.shape for t in tensors],
                        1 << 20, align=align)
    buf = torch.zeros(b.nbytes, dtype=torch.uint8)
    for sl, t in zip(b.slots, tensors):
        buf[sl.offset: sl.offset + sl.nbytes] = t.reshape(-1).view(torch.uint8)
    total, bad = finite_scan._device_scan(buf, bucket_units(b), want_sum=True)
    assert int(total) == checksum(buf)
    assert bad_names(bad) == ["t2", "t4"]
    assert bool(built and built[0] is not None) == (align == 256)  # one launch where the layout allows


def test_device_bucket_scan_of_a_layout_is_built_once_and_moved_to_each_address(monkeypatch):
    """A packed CUDA IPC bucket is mapped at a new address at every update: the scan's chunk
    table is built once per layout and moved to the bucket's address (MultiTensorSum.relocated,
    one add), not rebuilt per slot. The moved scan reads the NEW bytes: a NaN put into another
    slot of the second bucket is found there, and the sum is the second bucket's."""
    from functools import partial

    from rlserve.transfer.multi_tensor import MultiTensorSum
    from rlserve.transfer.server import finite_scan
    from rlserve.transfer.server.finite_scan import bucket_units, bad_names

    built = []
    real = partial(MultiTensorSum.build.__func__, MultiTensorSum, _allow_cpu=True, chunk_words=5)
    monkeypatch.setattr(MultiTensorSum, "build", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    monkeypatch.setattr(finite_scan, "_scan_ops", type(finite_scan._scan_ops)())
    tensors = [finite_extremes(torch.float32, 41), with_bad(torch.bfloat16, float("nan"), 3, 57),
               finite_extremes(torch.float16, 29)]
    (b,) = plan_buckets(["a", "b", "c"], [t.dtype for t in tensors], [t.shape for t in tensors], 1 << 20)
    first = torch.zeros(b.nbytes + 512, dtype=torch.uint8)[512:]
    pack(first, b, tensors)
    total, bad = finite_scan._device_scan(first, bucket_units(b), want_sum=True)
    assert int(total) == checksum(first) and bad_names(bad) == ["b"] and len(built) == 1
    tensors[1] = finite_extremes(torch.bfloat16, 57)
    tensors[2] = with_bad(torch.float16, float("inf"), 7, 29)
    second = torch.zeros(b.nbytes, dtype=torch.uint8)
    pack(second, b, tensors)
    assert second.data_ptr() != first.data_ptr()
    total, bad = finite_scan._device_scan(second, bucket_units(b), want_sum=True)
    assert int(total) == checksum(second) != checksum(first)
    assert bad_names(bad) == ["c"] and len(built) == 1  # moved, not built again


def test_one_launch_pack_equals_pack_at_every_new_buffer(monkeypatch):
    """The CUDA IPC packed sender's one-launch pack (rlserve.transfer.wire.pack_device), through
    the interpreter: the bytes of a fresh buffer at a new address (stale bytes in the padding)
    equal pack()'s, the returned sum is the bucket's checksum, the op is built once per layout
    and source addresses (a source at a new address: built again, reads it); a source of a size
    that is not a multiple of 8 bytes is left to pack()."""
    from functools import partial

    from rlserve.transfer.multi_tensor import MultiTensorSum
    from rlserve.transfer.wire.pack_device import DevicePacker

    built = []
    real = partial(MultiTensorSum.build.__func__, MultiTensorSum, chunk_words=5)
    monkeypatch.setattr(MultiTensorSum, "build", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    params = [finite_extremes(torch.bfloat16, 36).reshape(4, 9), finite_extremes(torch.float32, 50),
              torch.arange(12, dtype=torch.int64)]
    (b,) = plan_buckets(["x", "y", "z"], [t.dtype for t in params], [t.shape for t in params], 1 << 20)
    want = torch.zeros(b.nbytes, dtype=torch.uint8)
    pack(want, b, params)
    packer = DevicePacker(_allow_cpu=True)
    for _ in range(2):
        buf = torch.full((b.nbytes + 64,), 0xAB, dtype=torch.uint8)  # stale bytes everywhere
        total = packer.pack(buf, b, params)
        assert torch.equal(buf[: b.nbytes], want) and int(total) == checksum(want)
    assert len(built) == 1
    params[1].mul_(2)  # same addresses, new values: the cached op copies the new bytes
    pack(want, b, params)
    total = packer.pack(torch.empty(b.nbytes, dtype=torch.uint8), b, params)
    assert int(total) == checksum(want) and len(built) == 1
    moved = params[:2] + [params[2] + 5]  # a tensor made for this sync: another address
    pack(want, b, moved)
    buf = torch.empty(b.nbytes, dtype=torch.uint8)
    total = packer.pack(buf, b, moved)
    assert torch.equal(buf, want) and int(total) == checksum(want) and len(built) == 2
    odd = [torch.ones(3, dtype=torch.float16), torch.ones(4)]
    (ob,) = plan_buckets(["o", "p"], [t.dtype for t in odd], [t.shape for t in odd], 1 << 20)
    assert packer.pack(torch.empty(ob.nbytes, dtype=torch.uint8), ob, odd) is None


def test_bucket_plan_one_launch_replay_reads_the_new_address(tiny_model, monkeypatch):
    """The CUDA branch of a packed bucket's replay (rlserve.transfer.server.bucket_plan): the
    recorded copies as one MultiTensorSum launch whose source table is moved to the next bucket's
    address; run through the interpreter on the CPU. After the replay from a bucket at another
    address holding other values, the model holds exactly those values."""
    from rlserve.transfer.server import bucket_plan
    from rlserve.transfer.server.bucket_plan import BucketPairs, BucketPlan
    from rlserve.transfer.server.checksums import export_plan
    from rlserve.transfer.server.copy_plan import record_load
    from tests.test_models import _load

    monkeypatch.setattr(bucket_plan, "_ONE_LAUNCH_ON_CPU", True)
    model, _ = _load(tiny_model("qwen3_moe"))
    items, _ = export_plan(model)
    named = [(n, torch.randn(f().shape)) for n, f in items if ".experts." in n and n.endswith(".weight")]
    b = plan_buckets([n for n, _ in named], [t.dtype for _, t in named], [t.shape for _, t in named], 1 << 30)[0]
    first = torch.zeros(b.nbytes, dtype=torch.uint8)
    pack(first, b, [t for _, t in named])
    recorded, why = record_load(model.load_weights, list(BucketPairs(first, b)))
    bp = BucketPlan.from_plan(recorded, first)
    assert why is None and bp._op is not None and not bp._slow  # every copy in the one launch
    second = torch.zeros(b.nbytes + 1024, dtype=torch.uint8)[512:]
    pack(second, b, [t + 1 for _, t in named])
    bp.replay(second)
    got = {n: f() for n, f in export_plan(model)[0]}
    assert all(torch.equal(got[n], t + 1) for n, t in named)


def _worker_and_bucket(tiny_model, monkeypatch):
    """A tiny Qwen3-MoE as a CPU worker whose packed bucket plans take the one-launch (CUDA)
    replay through the interpreter, its transfer state and parameter signature, per-expert
    trainer tensors and the one bucket that holds them: ``(model, worker, st, sig, named, b)``."""
    from types import SimpleNamespace

    from rlserve.transfer.server import bucket_plan
    from rlserve.transfer.server.checksums import export_plan
    from rlserve.transfer.server.worker_load import _params_signature
    from rlserve.transfer.server.worker_state import WorkerTransferState
    from tests.test_models import _load

    monkeypatch.setattr(bucket_plan, "_ONE_LAUNCH_ON_CPU", True)
    model, _ = _load(tiny_model("qwen3_moe"))
    worker = SimpleNamespace(model=model, device=torch.device("cpu"))
    items, _ = export_plan(model)
    named = [(n, torch.randn(f().shape)) for n, f in items if ".experts." in n and n.endswith(".weight")]
    b = plan_buckets([n for n, _ in named], [t.dtype for _, t in named], [t.shape for _, t in named], 1 << 30)[0]
    return model, worker, WorkerTransferState(), _params_signature(worker), named, b


def test_a_wrong_one_launch_replay_is_caught_and_loaded_again(tiny_model, monkeypatch, caplog):
    """A packed bucket plan's first replay is checked against the bucket's bytes
    (BucketPlan.mismatch, from views rebuilt at the recorded offsets: independent of the
    one-launch op's relocated pointer table). A table that reads the wrong address -- here two
    copies' source pointers swapped, as a relocation bug on the GPU would -- is caught: the
    bucket is loaded with load_weights at once (the model holds exactly the trainer's values),
    the error is logged, the layout is not replayed again. Through the interpreter on the CPU.
    Fails on the code before the check (the model kept the swapped tensors)."""
    from rlserve.transfer.server.bucket_plan import BucketPairs
    from rlserve.transfer.server.checksums import export_plan
    from rlserve.transfer.server.worker_load import _load_replayable

    model, worker, st, sig, named, b = _worker_and_bucket(tiny_model, monkeypatch)

    def sync(values):
        buf = torch.zeros(b.nbytes + 1024, dtype=torch.uint8)[512:]  # a new address each time
        pack(buf, b, values)
        return _load_replayable(worker, st, BucketPairs(buf, b), sig)[0], buf

    assert sync([t for _, t in named])[0] is False  # recorded
    (key, bp), = st.bucket_plans.items()
    words = bp._op._words.tolist()
    i, j = next((i, j) for i in range(len(words)) for j in range(i + 1, len(words)) if words[i] == words[j])
    ptrs = bp._op._src_ptrs
    ptrs[[i, j]] = ptrs[[j, i]].clone()  # two same-size chunks read each other's bytes
    second = [t + 1 for _, t in named]
    with caplog.at_level("ERROR", logger="rlserve.transfer.server.worker_load"):
        replayed, _buf = sync(second)
    assert replayed is False and "differs from its bytes" in caplog.text
    got = {n: f() for n, f in export_plan(model)[0]}
    assert all(torch.equal(got[n], t) for (n, _), t in zip(named, second))
    assert st.bucket_plans[key] is None
    third = [t * 3 for _, t in named]
    assert sync(third)[0] is False  # load_weights from now on
    got = {n: f() for n, f in export_plan(model)[0]}
    assert all(torch.equal(got[n], t) for (n, _), t in zip(named, third))


def test_a_correct_one_launch_replay_is_checked_once(tiny_model, monkeypatch):
    """The check runs on a plan's first replay only (then ``verified``): the next replays are
    the one launch alone."""
    from rlserve.transfer.server.bucket_plan import BucketPairs, BucketPlan
    from rlserve.transfer.server.checksums import export_plan
    from rlserve.transfer.server.worker_load import _load_replayable

    checked = []
    real = BucketPlan.mismatch
    monkeypatch.setattr(BucketPlan, "mismatch", lambda self, buf: checked.append(1) or real(self, buf))
    model, worker, st, sig, named, b = _worker_and_bucket(tiny_model, monkeypatch)
    flags = []
    for k in range(4):
        buf = torch.zeros(b.nbytes + 1024, dtype=torch.uint8)[512:]
        pack(buf, b, [t + k for _, t in named])
        flags.append(_load_replayable(worker, st, BucketPairs(buf, b), sig)[0])
        got = {n: f() for n, f in export_plan(model)[0]}
        assert all(torch.equal(got[n], t + k) for n, t in named), k
    assert flags == [False, True, True, True] and len(checked) == 1
