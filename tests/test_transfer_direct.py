"""Direct receive (rlserve.transfer.server.direct) and unpacked sends (packing.in_place_bucket): the
layout rules on hand-made loads, no server. The server path is covered in
test_transfer_manager_direct.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlserve.transfer.server.copy_plan import record_load
from rlserve.transfer.server.direct import build_direct_layout, update_key
from rlserve.transfer.wire.packing import BucketBuffers, max_bucket_bytes, pack, plan_buckets, unpack, in_place_bucket


class Fused(nn.Module):
    """``qk`` = cat(q [2, 32], k [4, 32]) on dim 0 (like qkv_proj), a norm ``n`` [64], and a
    ``pad`` table whose last row the load zero-fills (like vocabulary padding)."""

    def __init__(self, dtype=torch.float32, with_pad=False):
        super().__init__()
        self.qk = nn.Parameter(torch.randn(6, 32, dtype=dtype), requires_grad=False)
        self.n = nn.Parameter(torch.randn(64, dtype=dtype), requires_grad=False)
        self.pad = nn.Parameter(torch.randn(3, 64), requires_grad=False) if with_pad else None

    def load(self, pairs):
        for name, t in pairs:
            if name == "q":
                self.qk.data[:2].copy_(t)
            elif name == "k":
                self.qk.data[2:].copy_(t)
            elif name == "n":
                self.n.data.copy_(t)
            elif name == "pad":
                self.pad.data[:2].copy_(t)
                self.pad.data[2:].zero_()


def _stream(order=("q", "k", "n"), pad=False, bucket_bytes=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (2, 32), "k": (4, 32), "n": (64,), "pad": (2, 64)}
    names = list(order) + (["pad"] if pad else [])
    named = [(n, torch.randn(shapes[n], generator=g)) for n in names]
    plan = plan_buckets(names, [t.dtype for _, t in named], [t.shape for _, t in named], bucket_bytes)
    return named, plan


def _first_load(model, named, plan):
    """The first update as the server runs it: each bucket packed into a receive buffer, the load
    recorded. Returns the per-bucket ``(pairs, copies)``."""
    bufs = BucketBuffers().get(2, max_bucket_bytes(plan), torch.device("cpu"))
    by_name = dict(named)
    loads = []
    for i, b in enumerate(plan):
        buf = bufs[i % 2]
        pack(buf, b, [by_name[s.name] for s in b.slots])
        pairs = list(unpack(buf[: b.nbytes], b))
        cp, why = record_load(model.load, pairs)
        loads.append((pairs, cp.copies() if cp is not None else None))
    return loads


def test_layout_moves_parameters_and_receives_into_them():
    model = Fused()
    named, plan = _stream()
    assert [len(b.slots) for b in plan] == [1, 1, 1]  # q | k | n: the fused qk straddles two buckets
    loads = _first_load(model, named, plan)
    assert torch.equal(model.qk[:2], named[0][1]) and torch.equal(model.qk[2:], named[1][1])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = {n: id(p) for n, p in model.named_parameters()}
    key = update_key([n for n, _ in named], ["float32"] * 3, [t.shape for _, t in named], 200)
    layout, why = build_direct_layout(list(model.parameters()), plan, loads, key)
    assert why is None and layout.sizes == [b.nbytes for b in plan] and layout.bases == [0, 256, 768]
    lo, hi = layout.flat.data_ptr(), layout.flat.data_ptr() + layout.flat.numel()
    for n, p in model.named_parameters():
        assert id(p) == ids[n] and lo <= p.data_ptr() < hi  # same Parameter, new memory
        assert torch.equal(p, before[n])  # values unchanged by the move
    # a later identical update, received straight into layout.target(i), is the load
    new, _ = _stream(seed=1)
    by_name = dict(new)
    for i, b in enumerate(plan):
        layout.target(i).copy_(pack(torch.empty(b.nbytes, dtype=torch.uint8), b, [by_name[s.name] for s in b.slots]))
    assert torch.equal(model.qk, torch.cat([by_name["q"], by_name["k"]]))
    assert torch.equal(model.n, by_name["n"])
    # a failed receive moves the parameters out: bytes landing in the layout later change nothing
    now = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert layout.move_out(list(model.parameters())) == 2
    for n, p in model.named_parameters():
        assert not lo <= p.data_ptr() < hi and torch.equal(p, now[n]) and id(p) == ids[n]
    layout.flat.fill_(7)
    assert all(torch.equal(p, now[n]) for n, p in model.named_parameters())


def test_layout_adopts_the_buffer_the_update_was_received_into(monkeypatch):
    """The first update received bucket after bucket into one flat buffer (the receiver's
    ``targets``): that buffer becomes the layout, the parameters re-pointed into it, no byte
    copied; a buffer the pairs do not lie in at their stream offsets is refused, nothing moved."""
    import rlserve.transfer.server.direct as direct

    model = Fused()
    named, plan = _stream()
    by_name = dict(named)
    sizes = [b.nbytes for b in plan]
    flat = torch.empty(sum(sizes), dtype=torch.uint8)
    loads, base = [], 0
    for b in plan:
        view = flat[base: base + b.nbytes]
        pack(view, b, [by_name[s.name] for s in b.slots])
        pairs = list(unpack(view, b))
        cp, why = record_load(model.load, pairs)
        loads.append((pairs, cp.copies()))
        base += b.nbytes
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    key = update_key([n for n, _ in named], ["float32"] * 3, [t.shape for _, t in named], 200)
    elsewhere = torch.empty_like(flat)
    ptrs = [p.data_ptr() for p in model.parameters()]
    layout, why = build_direct_layout(list(model.parameters()), plan, loads, key, flat=elsewhere)
    assert layout is None and "not laid out like the update" in why
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    monkeypatch.setattr(direct, "host_copy_many", lambda *a, **k: pytest.fail("the layout copied bytes"))
    layout, why = build_direct_layout(list(model.parameters()), plan, loads, key, flat=flat)
    assert why is None and layout.flat.data_ptr() == flat.data_ptr() and layout.bases == [0, 256, 768]
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel()
    for n, p in model.named_parameters():
        assert lo <= p.data_ptr() < hi and torch.equal(p, before[n])
    assert torch.equal(model.qk, torch.cat([by_name["q"], by_name["k"]])) and torch.equal(model.n, by_name["n"])


def _assert_refused(model, reason: str, **stream_kw) -> None:
    """The first load of ``_stream(**stream_kw)`` into ``model`` gives no layout, with ``reason``
    in its explanation, and no parameter moved."""
    named, plan = _stream(**stream_kw)
    loads = _first_load(model, named, plan)
    ptrs = [p.data_ptr() for p in model.parameters()]
    layout, why = build_direct_layout(list(model.parameters()), plan, loads, ())
    assert layout is None and reason in why, (stream_kw, why)
    assert [p.data_ptr() for p in model.parameters()] == ptrs


def test_layout_refused_with_a_reason_and_nothing_moved():
    cases = {
        "converts": (Fused(dtype=torch.float64), dict()),  # the load casts float32 -> float64
        "stream order": (Fused(), dict(order=("k", "q", "n"))),  # k before q: qk's pieces out of order
        "more than byte copies": (Fused(with_pad=True), dict(pad=True)),  # zero-filled padding row
    }
    for reason, (model, kw) in cases.items():
        _assert_refused(model, reason, **kw)


def test_layout_refuses_parameters_not_covered_exactly_once():
    class Twice(Fused):
        def load(self, pairs):
            super().load(pairs)
            super().load([(n, t) for n, t in pairs if n == "n"])  # n written twice from the same bytes

    class Copied(Fused):  # n's bytes loaded into two parameters (an untied copy of a tied table)
        def __init__(self):
            super().__init__()
            self.n2 = nn.Parameter(torch.randn(64), requires_grad=False)

        def load(self, pairs):
            super().load(pairs)
            for n, t in pairs:
                if n == "n":
                    self.n2.data.copy_(t)

    cases = [(Copied(), ("q", "k", "n"), "two parameters"),
             (Fused(), ("q", "n"), "outside"),  # k never sent: qk would reach past the stream's end
             (Fused(), ("k", "n"), "outside"),  # q never sent: qk would start before the stream
             (Twice(), ("q", "k", "n"), "exactly once")]
    for model, order, reason in cases:
        _assert_refused(model, reason, order=order)


def test_in_place_bucket_only_for_memory_laid_out_like_the_bucket():
    flat = torch.randn(64 + 128)
    a, b = flat[:64], flat[64:].view(4, 32)  # 256 + 512 bytes, back to back
    plan = plan_buckets(["a", "b"], [torch.float32] * 2, [(64,), (4, 32)], 1 << 20)
    view = in_place_bucket(plan[0], [a, b], torch.device("cpu"))
    assert view is not None and view.data_ptr() == flat.data_ptr() and view.numel() == plan[0].nbytes == 768
    assert torch.equal(view, pack(torch.empty(768, dtype=torch.uint8), plan[0], [a, b]))
    assert in_place_bucket(plan[0], [a.clone(), b], torch.device("cpu")) is None  # not adjacent
    assert in_place_bucket(plan[0], [a, b.t().contiguous().t()], torch.device("cpu")) is None  # strided
    odd = torch.randn(10)  # 40 bytes: the bucket is 256 (zero padding the tensor does not have)
    plan1 = plan_buckets(["o"], [torch.float32], [(10,)], 1 << 20)
    assert in_place_bucket(plan1[0], [odd], torch.device("cpu")) is None
    big = torch.randn(128)  # 512 bytes, alone in its bucket
    plan2 = plan_buckets(["x"], [torch.float32], [(128,)], 256)
    v = in_place_bucket(plan2[0], [big], torch.device("cpu"))
    assert v is not None and torch.equal(v, big.view(torch.uint8))
