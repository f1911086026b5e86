"""The data plane's layout header (gloo, CPU, two ranks on threads): every update starts with one
int64 [8] broadcast describing the messages that follow; the receiver compares it with its own
update_info before it posts any bucket / tensor receive.

Why it exists: gloo's TCP transport aborts the whole process (``gloo::EnforceNotMet ...
op.preamble.length <= op.nbytes``, SIGABRT) when a message is longer than the posted receive
buffer, and silently accepts a shorter one. Each mismatch case therefore runs in a child process:
without the header several of them kill it, and they must not kill pytest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from rlserve.transfer.wire.packing import (
    FLAG_CHECKSUMS_AFTER,
    FLAG_PACKED,
    HEADER_MAGIC,
    HEADER_VERSION,
    HEADER_WORDS,
    as_bytes,
    layout_header,
    layout_message_sizes,
    pack,
    plan_buckets,
)
from rlserve.transfer.wire.protocol import UpdateInfo, dtype_to_name
from rlserve.transfer.wire.header import LayoutMismatchError, check_layout_header
from rlserve.transfer.sdk.sender import send_packed, send_unpacked
from tests.test_transfer_dataplane import info_for, make_tensors, run_pair

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _info(tensors, packed=True, size=600, after=False, dtype_names=None) -> UpdateInfo:
    info = UpdateInfo(names=[n for n, _ in tensors],
                      dtype_names=dtype_names or [dtype_to_name(t.dtype) for _, t in tensors],
                      shapes=[list(t.shape) for _, t in tensors], packed=packed,
                      packed_buffer_size_bytes=size, packed_num_buffers=2, checksums_after_data=after)
    info.validate()
    return info


def _recording(r) -> list[int]:
    """Wrap ``r.group.broadcast``: the byte size of every receive the receiver posts, in order."""
    posted: list[int] = []
    orig = r.group.broadcast

    def broadcast(t, src):
        posted.append(t.numel() * t.element_size())
        return orig(t, src)

    r.group.broadcast = broadcast
    return posted


# --------------------------------------------------------------------------- the header itself
def test_layout_header_words_and_digests():
    """Word by word; the same metadata gives the same words, and every kind of difference a
    trainer can have (bucket size, a dtype -- even one of the same width --, the order of two
    same-shaped tensors, packed / unpacked, checksums after the data, one tensor more) changes
    at least one word; the comparison names the fields and both layouts."""
    ts = make_tensors(0)
    info = _info(ts, after=True)
    plan = plan_buckets(info.names, info.dtypes(), info.shapes, 600)
    w = layout_header(info, plan)
    assert len(w) == HEADER_WORDS and all(-(1 << 63) <= x < (1 << 63) for x in w)
    assert w[0] == HEADER_MAGIC | HEADER_VERSION
    assert w[1] == FLAG_PACKED | FLAG_CHECKSUMS_AFTER
    assert w[2] == len(plan)
    sizes = layout_message_sizes(info, plan)
    assert sizes == [b.nbytes for b in plan if b.nbytes] + [8 * len(plan)]
    assert w[3] == len(sizes) and w[4] == sum(b.nbytes for b in plan) and w[5] == 600
    assert layout_header(_info(ts, after=True)) == w  # deterministic, plan computed or given
    check_layout_header(w, w)

    bf = [(n, t.to(torch.bfloat16) if t.dtype == torch.float16 else t) for n, t in ts]  # same width
    swapped = [ts[1], ts[0]] + ts[2:]
    variants = {
        "bucket size": _info(ts, size=601, after=True),
        "dtype of the same width": _info(bf, after=True),
        "order": _info(swapped, after=True),
        "unpacked": _info(ts, packed=False),
        "no checksums after": _info(ts),
        "one tensor more": _info(ts + [("extra", torch.zeros(3))], after=True),
    }
    for what, other in variants.items():
        o = layout_header(other)
        assert o != w, what
        with pytest.raises(LayoutMismatchError, match="does not match update_info: it announces"):
            check_layout_header(o, w)
    with pytest.raises(LayoutMismatchError, match=r"it announces packed, 1 bucket \(bucket size 1048576 B\).*"
                                                  r"where update_info gives packed, \d+ buckets \(bucket size 600 B\)"):
        check_layout_header(layout_header(_info(ts, size=1 << 20, after=True)), w)
    with pytest.raises(LayoutMismatchError, match="not an rlserve layout header"):
        check_layout_header([12345] + w[1:], w)
    with pytest.raises(LayoutMismatchError, match="version 7"):
        check_layout_header([HEADER_MAGIC | 7] + w[1:], w)


# --------------------------------------------------------------------------- normal updates
@pytest.mark.parametrize("packed,after", [(True, False), (True, True), (False, False)])
def test_updates_with_header_bit_identical(packed, after):
    """Packed (announced checksums / checksums after the data) and unpacked: bit-identical
    tensors; the receiver posts the header first (64 bytes), then exactly the messages it
    announces."""
    ts = make_tensors(11)
    info = info_for(ts, packed=packed, size=600)
    if after:
        info.checksums, info.checksums_after_data = None, True
    got, posted = {}, []

    def recv(r):
        rec = _recording(r)
        try:
            return r.receive(info, lambda p: got.update({n: t.clone() for n, t in p}))
        finally:
            posted.extend(rec)

    send = send_packed if packed else send_unpacked
    res, err = run_pair(lambda g: send(g, info, iter(ts), torch.device("cpu")), recv)
    assert not err, err
    for n, t in ts:
        assert got[n].dtype == t.dtype and torch.equal(as_bytes(got[n]), as_bytes(t)), n
    plan = plan_buckets(info.names, info.dtypes(), info.shapes, 600) if packed else None
    # gloo, 2 ranks: the header lands in a buffer as large as the largest message (bucket 0's)
    assert posted[0] >= 64
    assert posted[1:] == layout_message_sizes(info, plan)


def test_direct_receive_with_header():
    """The direct path (packed gloo straight into per-bucket memory): the header is received into
    scratch memory, never into the target, and the buckets arrive bit-identical."""
    ts = make_tensors(12)
    info = info_for(ts, size=600, checksums=False)
    info.checksums_after_data = True
    plan = plan_buckets(info.names, info.dtypes(), info.shapes, 600)
    views = [torch.full((b.nbytes,), 0xEE, dtype=torch.uint8) for b in plan]
    addrs = {v.data_ptr() for v in views}
    posted_ptrs = []

    def recv(r):
        orig = r.group.broadcast

        def broadcast(t, src):
            posted_ptrs.append(t.data_ptr())
            return orig(t, src)

        r.group.broadcast = broadcast
        return r.receive(info, lambda p: None, direct=lambda i: views[i])

    res, err = run_pair(lambda g: send_packed(g, info, iter(ts), torch.device("cpu")), recv)
    assert not err, err
    assert res["receiver"]["direct"] is True
    assert posted_ptrs[0] not in addrs  # the header: not into the parameters' memory
    by_name = dict(ts)
    for b, v in zip(plan, views):
        exp = pack(torch.empty(b.nbytes, dtype=torch.uint8), b, [by_name[s.name] for s in b.slots])
        assert torch.equal(v, exp), b.index


# --------------------------------------------------------------------------- mismatches (child process)
def _case(name: str):
    """``(sender_fn(group), receiver's info)`` of a mismatch case."""
    ts = make_tensors(21)
    if name == "bucket_size_longer":  # receiver: small buckets; trainer: one big one (the abort case)
        s, r = _info(ts, size=1 << 20), _info(ts, size=300)
    elif name == "bucket_size_shorter":  # receiver: one big bucket; trainer: small ones
        s, r = _info(ts, size=300), _info(ts, size=1 << 20)
    elif name == "dtype_packed":  # receiver thinks d.weight is float16 (half the bytes)
        s = _info(ts)
        r = _info(ts, dtype_names=[("float16" if n == "d.weight" else dtype_to_name(t.dtype)) for n, t in ts])
    elif name == "dtype_unpacked":  # the same, one broadcast per tensor
        s = _info(ts, packed=False)
        r = _info(ts, packed=False,
                  dtype_names=[("float16" if n == "a.weight" else dtype_to_name(t.dtype)) for n, t in ts])
    elif name == "dtype_same_width":  # bfloat16 announced as float16: same bytes, other meaning
        s = _info(ts)
        r = _info(ts, dtype_names=[("float16" if t.dtype == torch.bfloat16 else dtype_to_name(t.dtype))
                                   for n, t in ts])
    elif name == "packed_vs_unpacked":  # trainer packed (one bucket), receiver per tensor
        s, r = _info(ts, size=1 << 20), _info(ts, packed=False)
    elif name == "unpacked_vs_packed":
        s, r = _info(ts, packed=False), _info(ts, size=1 << 20)
    elif name == "extra_tensor":  # the trainer sends one tensor the receiver does not expect
        extra = ts + [("z.extra", torch.randn(40, 40))]
        s, r = _info(extra, size=1 << 20), _info(ts, size=1 << 20)
        ts = extra
    elif name == "missing_tensor":  # the receiver expects one the trainer does not send
        s, r = _info(ts[:-1], size=1 << 20), _info(ts, size=1 << 20)
        ts = ts[:-1]
    elif name == "checksums_after":  # the trainer sends checksums after the data, unannounced
        s, r = _info(ts, after=True), _info(ts)
    elif name == "no_header":  # code broadcasting on the group itself (vLLM style: torch.cat, no header)
        r = _info(ts, size=1 << 20)
        raw = torch.cat([as_bytes(t) for _, t in ts])

        def no_header(g):
            g.wait(g.broadcast(raw, 0), what="raw")

        return no_header, r
    else:
        raise KeyError(name)
    send = send_packed if s.packed else send_unpacked
    return (lambda g: send(g, s, iter(ts), torch.device("cpu"))), r


def _mismatch_case(name: str) -> dict:
    """Run case ``name`` (30 s group timeout) in this process; what the receiver saw."""
    sender_fn, rinfo = _case(name)
    out: dict = {}

    def recv(r):
        out["posted"] = _recording(r)
        loaded: list = []
        out["loaded"] = loaded
        t0 = time.monotonic()
        try:
            r.receive(rinfo, lambda p: loaded.extend(n for n, _ in p))
        finally:
            out["receiver_s"] = time.monotonic() - t0

    res, err = run_pair(sender_fn, recv, timeout_s=30)
    out.update({k: f"{type(e).__name__}: {e}" for k, e in err.items()})
    # the process lives on: a good update over a fresh group (a re-init) still works
    ts = make_tensors(22)
    good = info_for(ts, size=600)
    got: dict = {}
    res, err = run_pair(lambda g: send_packed(g, good, iter(ts), torch.device("cpu")),
                        lambda r: r.receive(good, lambda p: got.update({n: t.clone() for n, t in p})))
    out["next_update_ok"] = not err and all(torch.equal(as_bytes(got[n]), as_bytes(t)) for n, t in ts)
    return out


def _mismatch_child(*names: str) -> None:
    """Child process: run the cases ``names`` one after the other, printing one ``RESULT <name>
    <json>`` line each (a case that aborts the process ends the lines there)."""
    for name in names:
        print(f"RESULT {name} " + json.dumps(_mismatch_case(name)), flush=True)
    # Skip interpreter teardown: a gloo group whose operation failed (the trainer's pending
    # broadcasts here) can abort the process in its static destructors at exit ("terminate called
    # without an active exception"), with or without the header (test_source_must_match_announced_metadata
    # run as a script does the same).
    os._exit(0)


MISMATCH_CASES = ["bucket_size_longer", "bucket_size_shorter", "dtype_packed", "dtype_unpacked", "dtype_same_width",
                  "packed_vs_unpacked", "unpacked_vs_packed", "extra_tensor", "missing_tensor", "checksums_after",
                  "no_header"]


@pytest.fixture(scope="module")
def mismatch_results() -> tuple[dict, subprocess.CompletedProcess]:
    """Every mismatch case, run in ONE child process one after the other (a child process per
    case cost a torch import each, ~40 s of the suite): ``({case: what the receiver saw}, the
    process)``; a case that aborts the child leaves itself and the ones after it out."""
    code = f"from tests.test_transfer_layout_header import _mismatch_child; _mismatch_child(*{MISMATCH_CASES!r})"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": ROOT})
    out = {}
    for ln in p.stdout.splitlines():
        if ln.startswith("RESULT "):
            name, _, body = ln[len("RESULT "):].partition(" ")
            out[name] = json.loads(body)
    return out, p


@pytest.mark.parametrize("case", MISMATCH_CASES)
def test_mismatch_refused_before_any_bucket_receive(case, mismatch_results):
    """A trainer whose messages differ from what the receiver computed from its update_info:
    the receiver raises LayoutMismatchError well within the group timeout (30 s), having posted
    exactly one receive (the header) and loaded nothing, and the process lives on (the next case
    and rc 0; without the header "bucket_size_longer", "packed_vs_unpacked", "dtype_*" ... abort it)."""
    results, p = mismatch_results
    assert case in results, f"the child died before or in this case (rc {p.returncode}):\n{p.stderr[-3000:]}"
    out = results[case]
    assert out.get("receiver", "").startswith("LayoutMismatchError: the trainer's data does not match update_info"), out
    if case == "no_header":
        assert "not an rlserve layout header" in out["receiver"]
    else:
        assert "it announces" in out["receiver"] and "where update_info gives" in out["receiver"]
    assert out["receiver_s"] < 15, out  # from the header, not the 30 s timeout (~0.1 s idle; 15: a busy machine)
    assert len(out["posted"]) == 1, out  # the header only: no bucket / tensor receive was posted
    assert out["loaded"] == []
    assert "trainer" in out or case == "no_header", out  # its pending broadcasts failed: no hang
    assert out["next_update_ok"] is True, out
    assert p.returncode == 0 or case != MISMATCH_CASES[-1], f"child died (rc {p.returncode}):\n{p.stderr[-3000:]}"
