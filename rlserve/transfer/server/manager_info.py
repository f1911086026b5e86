"""The manager's read-only routes: ``/weight_info`` (version, state, last update) and
``/weight_checker`` (sha256 per Hugging Face tensor)."""

from __future__ import annotations

import logging

from rlserve.errors import WeightUpdateError
from rlserve.transfer.server.checksums import compare_checksums

logger = logging.getLogger(__name__)


class InfoRoutes:
    """Read-only routes: ``/weight_info`` and ``/weight_checker``. Mixed into :class:`~rlserve.transfer.server.manager.WeightTransferManager`
    (its state and helpers live there)."""

    def weight_info(self) -> dict:
        """``GET /weight_info``: version, transfer state, the last update."""
        s = self._session
        if self._busy:
            state = self._busy
        elif s is not None:
            state = "updating"
        elif self._init is not None:
            state = "ready"
        else:
            state = "uninitialized"
        eng = getattr(self.aengine, "engine", None)
        dtype = str(getattr(eng, "dtype", "")).removeprefix("torch.") if eng is not None else None
        return {
            "weight_version": self.aengine.weight_version,
            # the label the next sync without one gets (labels are unique: past every one used)
            "next_weight_version": self.aengine.weights.next_label() if hasattr(self.aengine, "weights") else None,
            "state": state,
            "backend": self._init.backend if self._init else self.backend,
            "initialized": self._init is not None,
            "staging": self.staging,
            "dtype": dtype,
            "num_workers": self.num_workers,
            "world_size": self.num_workers + 1,
            "init_info": None if self._init is None else {k: v for k, v in self._init.to_dict().items()},
            "session": None if s is None else {"received_tensors": len(s.received), "calls": s.calls,
                                               "buckets_done": s.buckets_done,
                                               "declared_tensors": None if s.declared is None else len(s.declared.names),
                                               "paused_by_server": s.auto_paused},
            "unavailable": getattr(self.aengine, "unavailable_reason", None),
            "unavailable_code": getattr(self.aengine, "unavailable_code", None),
            "trl": {"pending": self._trl_pending,
                    "uncommitted_tensors": len(s.received) if s is not None and s.trl else 0,
                    "error": None if self._trl_error is None else str(self._trl_error)},
            "num_updates": self.num_updates,
            "num_failures": self.num_failures,
            "last_update": self.last_update,
        }

    async def checksums(self, compare: dict[str, str] | None = None) -> dict:
        """``POST /weight_checker``: sha256 per HF tensor of the served weights (replica 0; every
        replica is hashed and checked equal), optionally compared with ``compare``.

        Raises:
            WeightUpdateError (400): ``compare`` is not ``{name: hex}``.
        """
        if compare is not None and (not isinstance(compare, dict) or
                                    not all(isinstance(k, str) and isinstance(v, str) for k, v in compare.items())):
            raise WeightUpdateError("compare must be an object {hf_name: sha256 hex}")
        results = [r for r in await self._rpc("model_checksums", None, timeout_s=max(self.rpc_timeout_s, 300.0))
                   if r is not None]
        first = results[0]
        out = {
            "weight_version": self.aengine.weight_version,
            "algorithm": "sha256",
            "dtype": first.get("dtype"),
            "num_tensors": len(first["checksums"]),
            "checksums": first["checksums"],
            "skipped": first.get("skipped", []),
            "replicas": len(results),
            "replicas_consistent": all(r["checksums"] == first["checksums"] for r in results),
        }
        if compare is not None:
            out["compare"] = compare_checksums(first["checksums"], compare)
        return out
