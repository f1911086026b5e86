"""One server worker's weight-sync state (``worker.extension_state["rlserve.transfer"]``): its
receiver, the background receive thread, staging tensors, recorded copy plans and the operations
in flight. Kept by :mod:`rlserve.transfer.server.worker_ext` (the RPC functions), read and
filled by :mod:`rlserve.transfer.server.worker_load` (the loads)."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import operator
import threading
import time
from collections import OrderedDict

import torch

from rlserve.transfer.server.bucket_plan import BucketPlan
from rlserve.transfer.server.copy_plan import CopyPlan, FixedPairs
from rlserve.transfer.server.direct import DirectLayout
from rlserve.transfer.server.receiver import WeightReceiver
from rlserve.transfer.wire.protocol import InitInfo


#: Packed-bucket plans kept per worker (:meth:`WorkerTransferState.set_bucket_plan`): a plan holds
#: views of the parameters and a small chunk table, no received memory; Qwen3-30B-A3B in 256 MiB
#: buckets is ~230 layouts.
MAX_BUCKET_PLANS = 4096


@dataclasses.dataclass(frozen=True)
class StageCall:
    """:func:`rlserve.transfer.server.worker_load._stage`'s last call with a :class:`FixedPairs`
    (one receive's set of mapped tensors): the same pairs into the same staging buffers again skip
    the per-tensor Python (18,867 per-expert names: ~30-100 ms of it per update on a loaded 2-core
    host)."""

    sources: FixedPairs  # the (name, source tensor) pairs staged, matched by identity
    dtype: torch.dtype | None  # the staging dtype asked (None: each source's own)
    device: torch.device
    pin: bool
    names: list[str]  # the pairs' names, in order
    dsts: list[torch.Tensor]  # their staging buffers, in the same order
    fused_key: tuple | None  # the fused copy + checksum's key (source / buffer pointers, numels, dtypes); None: none

    def matches(self, pairs, dtype: torch.dtype | None, device: torch.device, pin: bool, bufs: dict) -> bool:
        """Whether staging ``pairs`` now would be this call again: the same pairs object, dtype,
        device and pinning, and ``bufs`` (``staging_bufs``) still holds the same buffers."""
        return (self.sources is pairs and (self.dtype, self.device, self.pin) == (dtype, device, pin)
                and all(map(operator.is_, map(bufs.get, self.names), self.dsts)))


@dataclasses.dataclass(frozen=True)
class CommitPairs:
    """:func:`rlserve.transfer.server.worker_ext.commit`'s last staged dict as a :class:`FixedPairs`
    (its copy-plan key is computed once). Not the same cache as :class:`StageCall`: the staged
    dict is the union of every ``_stage`` call of the update (one per bucket), with any sources
    (reused staging buffers are the same objects whatever filled them)."""

    names: list[str]  # the staged names, in order
    ids: list[int]  # id() of each staged tensor
    pairs: FixedPairs

    def matches(self, staged: dict) -> bool:
        """Whether ``staged`` holds the same names, in order, bound to the same tensor objects."""
        return self.names == list(staged) and self.ids == list(map(id, staged.values()))


class _Op:
    """One operation of the worker (a rendezvous, an update) and its progress, as ``poll`` reports it."""

    def __init__(self, kind: str):
        self.kind = kind
        self.future: cf.Future | None = None
        self.applied = 0  # buckets loaded into the model in place (in-place mode)
        # set right BEFORE the op's first write into the live parameters (a load, or a direct
        # receive posting broadcasts into them): from then on the model may be part old, part
        # new until the update completes, even when no bucket finished (poll reports it)
        self.touched = False
        self.staged = 0
        self.replayed = 0  # in-place loads served by a recorded copy plan
        self.started = time.monotonic()


class WorkerTransferState:
    """Per-worker transfer state (receiver, background thread, staging, running ops)."""

    def __init__(self):
        self.receiver: WeightReceiver | None = None
        self.init: InitInfo | None = None
        self.pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlserve-transfer-recv")
        self.ops: dict[str, _Op] = {}
        self.staging: dict[str, torch.Tensor] = {}
        self.staging_bufs: dict[str, torch.Tensor] = {}  # reused by the next staged update
        self.stage_op: tuple | None = None  # (key, fused copy + checksum into staging_bufs) of the last update
        self.stage_fixed: StageCall | None = None  # worker_load._stage's last FixedPairs call
        self.commit_pairs: CommitPairs | None = None  # worker_ext.commit's last staged dict
        self.plans: dict[tuple, CopyPlan | None] = {}  # copy_plan key -> plan (None: not replayable)
        self.plans_used: set[tuple] = set()
        # packed buckets at new addresses (CUDA IPC packed, one call per bucket): layout -> plan
        # (None: not replayable), all for the parameters of bucket_plans_sig; kept across calls
        self.bucket_plans: OrderedDict[tuple, BucketPlan | None] = OrderedDict()
        self.bucket_plans_sig: tuple | None = None
        self.direct: DirectLayout | None = None  # CPU, packed gloo: parameters laid out like the buckets
        self.direct_tried: tuple | None = None  # (update key, params signature) of the last attempt
        self.lock = threading.Lock()

    def drop_unused_plans(self) -> None:
        """Keep only the plans the last update used (bounds what they keep alive)."""
        self.plans = {k: v for k, v in self.plans.items() if k in self.plans_used}
        self.plans_used = set()

    def _bucket_plans_for(self, params_sig: tuple) -> OrderedDict:
        if self.bucket_plans_sig != params_sig:  # the parameters moved: the plans wrote to the old ones
            self.bucket_plans = OrderedDict()
            self.bucket_plans_sig = params_sig
        return self.bucket_plans

    def bucket_plan(self, layout_key: tuple, params_sig: tuple) -> BucketPlan | None:
        """The replayable plan of a packed bucket layout for these parameters, or ``None``."""
        plans = self._bucket_plans_for(params_sig)
        plan = plans.get(layout_key)
        if plan is not None:
            plans.move_to_end(layout_key)
        return plan

    def bucket_plan_known(self, layout_key: tuple, params_sig: tuple) -> bool:
        """Whether this layout was recorded for these parameters (its plan may be ``None``)."""
        return layout_key in self._bucket_plans_for(params_sig)

    def set_bucket_plan(self, layout_key: tuple, params_sig: tuple, plan: BucketPlan | None) -> None:
        """Remember a layout's plan; at most :data:`MAX_BUCKET_PLANS` (least recently used go)."""
        plans = self._bucket_plans_for(params_sig)
        plans[layout_key] = plan
        while len(plans) > MAX_BUCKET_PLANS:
            plans.popitem(last=False)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.abort()
            self.receiver.close()
        self.receiver = None
        self.init = None
        self.staging = {}
        self.staging_bufs = {}
        self.stage_op = None
        self.stage_fixed = self.commit_pairs = None
        self.plans = {}
        self.plans_used = set()
        self.bucket_plans, self.bucket_plans_sig = OrderedDict(), None
        # self.direct / direct_tried stay: they describe where the parameters are, which a new
        # transfer engine does not change
        old = self.pool
        self.pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlserve-transfer-recv")
        old.shutdown(wait=False, cancel_futures=True)
