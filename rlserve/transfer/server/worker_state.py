"""One server worker's weight-sync state (``worker.extension_state["rlserve.transfer"]``): its
receiver, the background receive thread, staging tensors, recorded copy plans and the operations
in flight. Kept by :mod:`rlserve.transfer.server.worker_ext` (the RPC functions), read and
filled by :mod:`rlserve.transfer.server.worker_load` (the loads)."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections import OrderedDict

import torch

from rlserve.transfer.server.bucket_plan import BucketPlan
from rlserve.transfer.server.copy_plan import CopyPlan
from rlserve.transfer.server.direct import DirectLayout
from rlserve.transfer.server.receiver import WeightReceiver
from rlserve.transfer.wire.protocol import InitInfo


#: Packed-bucket plans kept per worker (:meth:`WorkerTransferState.set_bucket_plan`): a plan holds
#: views of the parameters and a small chunk table, no received memory; Qwen3-30B-A3B in 256 MiB
#: buckets is ~230 layouts.
MAX_BUCKET_PLANS = 4096


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
        # worker_load._stage's last FixedPairs call: (pairs, dtype, device, pin, names, dsts, fused-op key or None)
        self.stage_fixed: tuple | None = None
        # worker_ext.commit's last staged set as FixedPairs (its plan key computed once): (names, ids, pairs)
        self.commit_pairs: tuple | None = None
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
