"""The checks a :class:`~rlserve.transfer.server.receiver.WeightReceiver` makes on what arrives, before
anything received may be committed: the trainer's layout header (before any receive is posted), each bucket's
``s64sum`` checksum and the NaN / inf scan of its floats (:mod:`rlserve.transfer.server.finite_scan`).

Layout header: every gloo / NCCL update whose trainer is rank 0 (``rank_offset`` 1: the SDK's
layout; TRL's trainer is the last rank and sends none) starts with one int64 ``[8]`` broadcast
from the trainer (:func:`rlserve.transfer.wire.packing.layout_header`: magic + version, packed /
checksum flags, bucket or tensor count, message count, data bytes, bucket size, a blake2b-64
digest of the message sizes and one of the names / dtypes / shapes). The receiver takes it before it posts any bucket or
tensor receive, waits for it with the group's deadline and compares it with the header of its
own ``update_info``; on any difference :class:`LayoutMismatchError` is raised and nothing else
is posted. This matters because gloo's TCP transport aborts the whole process when a message is
longer than the posted receive buffer (``op.preamble.length <= op.nbytes``) and silently accepts
a shorter one. gloo with at most 3 ranks receives the header into a buffer as large as the
largest message this receiver expects (a 64-byte header costs 64 bytes on the wire whatever the
buffer), so a trainer that sends no header (an older SDK, code broadcasting on the group itself)
gets a clean "no layout header" error instead of killing the server when its first message fits
there; with 4+ ranks gloo's broadcast tree forwards whole receive buffers, so the buffer is
exactly 64 bytes. NCCL needs equal counts on every rank: exactly int64 ``[8]``. ipc has no group
and no header.
"""

from __future__ import annotations

import torch

from rlserve.transfer.backends.group import TransferGroup
from rlserve.transfer.errors import ChecksumMismatchError
from rlserve.transfer.host_ops import wrap64
from rlserve.transfer.server.finite_scan import bucket_units, raise_if_bad, scan, scan_result
from rlserve.transfer.wire.header import check_layout_header
from rlserve.transfer.wire.packing import (
    HEADER_BYTES,
    HEADER_WORDS,
    checksum_values,
    combine,
    layout_header,
    layout_message_sizes,
    uses_layout_header,
)
from rlserve.transfer.wire.protocol import InitInfo, UpdateInfo


class ReceiveChecks:
    """Mixin of :class:`~rlserve.transfer.server.receiver.WeightReceiver`: uses its ``init``
    (:class:`InitInfo`), ``check_finite``, ``wire_device()`` and ``_plan(info)``."""

    init: InitInfo
    check_finite: bool

    def _receive_header(self, g: TransferGroup, src: int, info: UpdateInfo, plan=None,
                        buf: torch.Tensor | None = None) -> None:
        """Receive the trainer's layout header (the first broadcast of the update), wait for it
        with the group's deadline and compare it with ``info``'s (:func:`check_layout_header`).
        Called before any bucket / tensor receive is posted. A no-op when the trainer is not
        rank 0 (:func:`~rlserve.transfer.wire.packing.uses_layout_header`: TRL's layout, no header).

        Args:
            plan: ``info``'s bucket plan (packed; computed when ``None``).
            buf: gloo with at most 3 ranks receives the header into a 1-D uint8 host buffer of
                ``max(64, largest expected message)`` bytes (a shorter message is accepted, a
                longer one would abort the process: a header-less trainer whose first message
                fits gets a clean error); ``buf`` when it is that large (e.g. the first bucket
                buffer), else a scratch one (only its first 64 bytes are written by a good
                trainer). 4+ ranks or NCCL: an int64 ``[8]`` of its own.
        Raises:
            LayoutMismatchError; TransferTimeoutError / WeightTransferFailedError /
            TransferAbortedError (no header in time, the group broke).
        """
        if not uses_layout_header(src) or self.init.wire == "vllm":
            return  # TRL's layout (trainer on the last rank) and vLLM's wire: no header
        if info.packed and plan is None:
            plan = self._plan(info)
        expected = layout_header(info, plan)
        what = "the layout header of the update"
        if self.init.backend == "gloo" and g.world_size <= 3:
            # gloo's binomial broadcast tree only forwards (whole receive buffers) from 4 ranks up
            n = max(HEADER_BYTES, max(layout_message_sizes(info, plan), default=0))
            if buf is None or buf.numel() < n or buf.device.type != "cpu":
                buf = torch.empty(n, dtype=torch.uint8)
            head = buf[:HEADER_BYTES]
            head.zero_()  # a message shorter than 64 bytes must not leave an old header behind
            g.wait(g.broadcast(buf[:n], src), what=what)
            got = head.view(torch.int64).tolist()
        else:
            t = torch.zeros(HEADER_WORDS, dtype=torch.int64, device=self.wire_device())
            g.wait(g.broadcast(t, src), what=what)  # NCCL: then ordered on this stream; tolist syncs it
            got = t.tolist()
        check_layout_header(got, expected)

    def _verify(self, u8: torch.Tensor, expected: list[int] | None, i: int, what: str,
                deferred: list | None = None, units=()) -> None:
        """Check ``u8``'s checksum against ``expected[i]`` and -- with :attr:`check_finite` -- the
        ``units`` in it (:data:`~rlserve.transfer.server.finite_scan.Unit`) for NaN / inf, in the
        same pass: at once on the host (nothing from a bad bucket is loaded), or -- CUDA bytes
        with a ``deferred`` list -- queued on the stream and compared by :meth:`_check_deferred`
        at the end of the receive (no host sync per bucket; a bad bucket then fails the update
        before it can be committed). Raises ChecksumMismatchError, NonFiniteWeightsError."""
        check = self.check_finite and bool(units)
        if expected is None and not check:
            return
        got, bad = scan(u8, units, expected is not None, check)
        if deferred is not None and u8.is_cuda:
            deferred.append((got, i, what, u8.numel(), bad))
            return
        if expected is not None:
            got = got if isinstance(got, int) else wrap64(int(got.item()))
            if got != expected[i]:
                raise ChecksumMismatchError(f"{what}: checksum {got} != announced {expected[i]} "
                                            f"({u8.numel()} bytes); nothing from it was loaded")
        raise_if_bad(bad, what + "; nothing from it was loaded")

    @staticmethod
    def _check_deferred(deferred: list, expected: list[int] | None, after_data: bool = False) -> None:
        """Compare the checksums taken during the receive -- ``(sum, index, what, bytes, bad)``, the
        sum a queued 0-dim device tensor, an int or ``None`` -- with ``expected`` (one host sync
        for the device ones), then refuse any non-finite tensor ``bad`` names. Raises
        ChecksumMismatchError, NonFiniteWeightsError."""
        if not deferred:
            return
        if expected is not None:
            queued = iter(checksum_values([d[0] for d in deferred if isinstance(d[0], torch.Tensor)]))
            for got, i, what, n, _ in deferred:
                got = next(queued) if isinstance(got, torch.Tensor) else got
                if got != expected[i]:
                    when = "sent after the data" if after_data else "announced"
                    raise ChecksumMismatchError(f"{what}: checksum {got} != {when} {expected[i]} ({n} bytes); the "
                                                "update is refused (not committed)")
        for _, _, what, _, bad in deferred:
            raise_if_bad(bad, what)

    def _bucket_sum(self, buf: torch.Tensor, bucket, pairs: list, ret, want_sum: bool = True):
        """A received bucket's ``s64sum`` (an int, or a 0-dim int64 tensor queued on the GPU) and its
        non-finite tensors (:data:`~rlserve.transfer.server.finite_scan.Bad`). From what the
        sink took while copying when it returned a :class:`~rlserve.transfer.finite.Scan` per
        slot (the sums' wrapping total is the bucket's: slots start 8-byte aligned and the
        trainer zeroes the padding), else from one more pass over ``buf`` (it is still intact:
        the buffer is reposted only after this)."""
        sums, bad = scan_result(ret, [n for n, _ in pairs])
        if sums is not None and (bad is not None or not self.check_finite):
            if sums.device == buf.device:
                return (sums.sum() if sums.is_cuda else combine(sums.tolist())), bad or []
        return scan(buf, bucket_units(bucket), want_sum, self.check_finite)

    def _receive_checksums(self, g: TransferGroup, src: int, n: int) -> list[int]:
        """The trainer's ``checksums_after_data``: one broadcast of an int64 ``[n]`` tensor after
        the last bucket, waited for with the group's deadline."""
        t = torch.empty(n, dtype=torch.int64, device=self.wire_device())
        if n:
            g.wait(g.broadcast(t, src), what="the bucket checksums sent after the data")
        return [int(v) for v in t.tolist()]
