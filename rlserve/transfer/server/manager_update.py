"""The manager's vLLM-style update routes (``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``, ``/sync_weights``)."""

from __future__ import annotations

import logging
import time

from rlserve.errors import NoTransferEngineError, StaleSessionError, WeightUpdateError, WeightUpdateStateError
from rlserve.loader.weight_utils import expand_expert_names
from rlserve.lora.sync import check_pairs
from rlserve.transfer import errors as terr
from rlserve.transfer.wire.protocol import UpdateInfo, validate_against_spec
from rlserve.transfer.wire.header import check_transport_fields, expected_checksum_count
from rlserve.transfer.wire.vllm_ipc import translate_update_info
from rlserve.transfer.server.session import _Session, check_weight_version

logger = logging.getLogger(__name__)


class UpdateRoutes:
    """vLLM's weight-sync routes: start / update / finish and the one-call ``sync_weights`` (init and
    shutdown: :class:`~rlserve.transfer.server.manager_group.GroupRoutes`). Mixed into :class:`~rlserve.transfer.server.manager.WeightTransferManager`
    (its state and helpers live there)."""

    async def start_update(self, update_info: dict | None = None, pause: bool = True) -> dict:
        """``POST /start_weight_update``: open an update session.

        Args:
            update_info: optional declaration of the whole update (rlserve extension; the SDK
                sends it): validated now, so bad metadata is refused before any data moves;
                later ``update_weights`` calls must stay within it, and ``finish`` checks that all
                of it arrived.
            pause: in place, keep-pause generation until finish (``False``: the one-call path
                that commits in the engine command, :meth:`sync_weights`).
        Raises:
            WeightUpdateStateError (409): no transfer engine, or a session is already open.
            WeightUpdateError (400): the declared metadata is invalid.
        """
        if self._init is None:
            raise NoTransferEngineError("start_weight_update: no transfer engine; call "
                                        "/init_weight_transfer_engine first")
        if self._session is not None:
            raise WeightUpdateStateError("start_weight_update called twice: an update is already in progress; "
                                         "call /finish_weight_update (or /shutdown_weight_transfer_engine) first")
        self._check_not_busy("start_weight_update")
        self._busy = "start"
        try:
            return await self._start_update(update_info, pause)
        finally:
            self._busy = None

    def check_session(self, session: str | None) -> None:
        """Refuse an update call (start / update / finish / sync) that names the transfer group
        incarnation it belongs to (``session``: its ``init_info.session``) when another init has
        replaced that group since: its data would go to a group the server no longer listens
        on, and the current trainer's session would be the one to fail. ``None`` (vLLM-style
        clients): not checked.

        Raises:
            WeightUpdateStateError: (HTTP 409, code ``stale_session``).
        """
        if session is None:
            return
        if not isinstance(session, str):
            raise WeightUpdateError("session must be a string")
        current = None if self._init is None else self._init.session
        if current is not None and session != current:
            raise StaleSessionError(f"session {session[:40]!r} is not the transfer engine's current one: another "
                                    "/init_weight_transfer_engine replaced it; initialise again")

    async def _start_update(self, update_info: dict | None, pause: bool = True) -> dict:
        declared = lora = None
        if update_info:
            declared = UpdateInfo.from_dict(update_info).resolved(self._init)
            if declared.lora is not None:  # adapter-only (rlserve.lora.sync): its factors, staged
                lora = declared.lora = await self._lora_fields(declared.lora)
                check_pairs(declared.names)
            spec, req = await self._spec_for(lora)
            validate_against_spec(declared, spec, req, tied=None if lora else self._tied)
            declared.checksums = None
            declared.ipc_handles = None
        if self.sleep_mode is not None and lora is None:  # 409 into weights a level-1 sleep holds
            await self.sleep_mode.before_weight_sync()
        def open_session(auto: bool) -> None:
            self._session = _Session(declared=declared, auto_paused=auto, lora=lora)

        if self.staging == "none" and lora is None and pause:
            # the pause and the session under one hold of the pause lock: a /resume (or a wake)
            # that comes after the pause sees the session (409, or left to its end)
            auto = await self.aengine.pause_unless_paused("keep", open_session)
        else:
            open_session(False)
            auto = False
        self._arm_watchdog()
        return {"status": "started", "staging": self.staging, "paused_by_server": auto,
                "declared_tensors": None if declared is None else len(declared.names)}

    async def update_weights(self, update_info: dict) -> dict:
        """``POST /update_weights``: validate, then receive and load (or stage) this update's
        tensors; returns when every worker has them.

        Raises:
            WeightUpdateStateError (409): no session / engine, or another call running.
            WeightUpdateError (400): metadata refused (nothing changed, the group stays usable).
            WeightTransferFailedError / ChecksumMismatchError / TransferTimeoutError: the transfer
                broke; the group was torn down (re-init needed).
        """
        # vLLM's ipc_handles_pickled: read (restricted) before anything else, so a refused pickle
        # is a 400 in any state and nothing it names runs
        update_info = translate_update_info(update_info)
        if self._init is None:
            raise NoTransferEngineError("update_weights: no transfer engine; call /init_weight_transfer_engine first")
        s = self._session
        if s is None:
            raise WeightUpdateStateError("update_weights without start_weight_update: call /start_weight_update first")
        self._check_not_busy("update_weights")
        self._busy = "update"  # claimed before the first await: a concurrent call gets 409
        try:
            return await self._update_weights(s, update_info)
        finally:
            self._busy = None
            s.last_activity = time.monotonic()

    async def _update_weights(self, s: _Session, update_info: dict) -> dict:
        s.last_activity = time.monotonic()
        t_in = time.perf_counter()
        try:
            info = UpdateInfo.from_dict(update_info).resolved(self._init)
            meta = None
            if info.by_ref:  # the tensors of a known ipc handle list: its record has the metadata
                meta = self._ipc_refs.get(info.ipc_handles_ref)
                if meta is None:
                    raise WeightUpdateError(f"update_info.ipc_handles_ref {info.ipc_handles_ref!r} is unknown to this "
                                            "server: send names, dtype_names, shapes and ipc_handles with it")
                info.names, info.dtype_names, info.shapes = meta["names"], meta["dtype_names"], meta["shapes"]
            if info.lora is not None and s.lora is None:
                if s.received or s.declared is not None or s.trl:
                    raise WeightUpdateError("update_info.lora comes with the session's first update_weights or its "
                                            "start_weight_update declaration")
                s.lora = await self._lora_fields(info.lora)  # (pairs checked at finish)
            info.lora = s.lora  # the checked fields travel (a raw int > 2**64 broke the engine wire: 500)
            spec, req = await self._spec_for(s.lora)
            if not (meta is not None and s.declared is None and not s.received and info.partial == meta["partial"]
                    and (s.lora or {}).get("r") == meta.get("lora_rank")):
                # (the same tensors with the same coverage rule were validated when the ref was given;
                # an adapter's again when its rank differs from the registration's)
                validate_against_spec(info, spec, req,
                                      allowed_names=None if s.declared is None else set(s.declared.names),
                                      already_received=frozenset() if s.trl else s.received,
                                      check_coverage=s.declared is None and s.lora is None,
                                      tied=None if s.lora else self._tied)
            check_transport_fields(info, self._init.backend, self._ipc_refs)
        except WeightUpdateError as e:
            # The trainer may already be broadcasting (it calls update_weights concurrently with
            # its collective): leave the group so both ends re-initialise cleanly. No parameter
            # changed in this call.
            if self._init.backend != "ipc":
                await self._fail(s, e)
                raise WeightUpdateError(f"{e} (the transfer group was torn down: re-initialise with "
                                        "/init_weight_transfer_engine)") from None
            raise
        n_steps = expected_checksum_count(info)
        t0 = time.perf_counter()
        try:
            wire = info.to_dict()
            if meta is not None:  # the workers fill the metadata from their own record of the ref
                wire.update(names=[], dtype_names=[], shapes=[])
            # in place: assume the parameters change from here on until every worker's op was
            # seen to end without writing (an error before that, e.g. a poll that timed out,
            # counts as a changed model)
            staging = self._staging_of(s)
            s.in_doubt = staging == "none"
            s.buckets_done = 0
            results = await self._run_op("start_receive", [wire, staging, self.direct_receive, self.check_finite],
                                         self._init.timeout_s * (n_steps + 2) + 30, "update_weights", session=s)
        except terr.NonFiniteWeightsError as e:
            if not s.trl:
                await self._fail(s, e)
                raise
            # TRL's trainer broadcasts its next tensors without waiting for an answer: the group
            # stays, the rest of the batch is received (nothing of this tensor was loaded) and
            # the batch is refused at its flush (/reset_prefix_cache/, trl_flush)
            s.refused = s.refused or e
            return {"status": "refused", "tensors": 0, "error": str(e)}
        except BaseException as e:
            await self._fail(s, e if isinstance(e, WeightUpdateError) else terr.WeightTransferFailedError(str(e)))
            raise
        secs = time.perf_counter() - t0
        nbytes = int(results[0].get("bytes", 0)) if results and isinstance(results[0], dict) else 0
        s.received |= set(info.names)
        if info.ipc_handles_ref is not None:
            s.ipc_refs.add(info.ipc_handles_ref)
            self._ipc_refs[info.ipc_handles_ref] = meta or {
                "names": info.names, "dtype_names": info.dtype_names, "shapes": info.shapes, "partial": info.partial,
                "lora_rank": None if s.lora is None else s.lora["r"]}
        s.bytes += nbytes
        s.seconds += secs
        s.calls += 1
        if self._staging_of(s) == "none" and info.names:
            s.applied = True
        first = results[0] if results and isinstance(results[0], dict) else {}
        replayed = int(first.get("replayed_loads", 0))
        out = {"status": "ok", "tensors": len(info.names), "bytes": nbytes, "seconds": round(secs, 6),
               "gbps": round(nbytes / secs / 1e9, 4) if secs > 0 else None, "staged": self._staging_of(s) != "none",
               "replayed_loads": replayed, "validate_seconds": round(t0 - t_in, 6),
               "worker_seconds": round(float(first.get("seconds", 0.0)), 6),
               "worker_op_seconds": round(float(first.get("op_seconds", 0.0)), 6)}
        if "checksums_fused" in first:
            out["checksums_fused"] = bool(first["checksums_fused"])
        # every worker received straight into its parameters (rlserve.transfer.server.direct)
        out["direct_receive"] = bool(results) and all(isinstance(r, dict) and r.get("direct") for r in results)
        if first.get("phases_s"):
            out["worker_phases_s"] = {k: round(v, 6) for k, v in first["phases_s"].items()}
        return out

    async def finish_update(self, weight_version: str | None = None) -> dict:
        """``POST /finish_weight_update``: commit. Staged: one local copy, run by the engine thread
        between two steps (one replica) or under a brief keep-pause of every replica (DP); always:
        prefix-cache reset and the new weight version (``weight_version`` or the current one
        incremented).

        Raises:
            WeightUpdateStateError (409): no session, or a call still running;
                WeightVersionInUseError (409, ``weight_version_in_use``): ``weight_version`` already
                named other weights (the session stays open).
            WeightUpdateError (400): the declared update did not fully arrive (staged: nothing
                committed; in place: the model is marked unavailable if anything was loaded).
        """
        weight_version = check_weight_version(weight_version)  # a bad one leaves the session open
        self.aengine.weights.check_label(weight_version)  # 409 weight_version_in_use, as well
        s = self._session
        if s is None:
            raise WeightUpdateStateError("finish_weight_update without start_weight_update")
        self._check_not_busy("finish_weight_update")
        self._busy = "finish"
        try:
            return await self._finish_update(s, weight_version)
        finally:
            self._busy = None

    async def _finish_update(self, s: _Session, weight_version: str | None) -> dict:
        if s.declared is not None:
            missing = [n for n in s.declared.names if n not in s.received]
            if missing:
                err = WeightUpdateError(self._incomplete_message(s, missing))
                await self._fail(s, err, teardown=False)
                raise err
        if s.lora is not None:
            return await self._finish_lora(s, weight_version)
        _spec, req = await self._model_spec()
        paused_here = False
        pause_t0 = None
        phases: dict[str, float] = {}
        commit_replayed = None
        version = weight_version if weight_version is not None else self.aengine.weights.next_label()
        staged = self.staging != "none" and bool(s.received)
        # One replica: a single engine-thread command runs between two steps by itself, so commit +
        # prefix-cache reset + version need no pause/resume round trips; the next step already runs
        # (and is stamped) with the new weights. Several replicas switch together, all frozen.
        in_engine = staged and len(self.aengine.engines) == 1 and not self.aengine.is_paused()
        try:
            if staged:
                if not in_engine:
                    # under the pause lock: an operator's wait-pause ends its draining first, and a
                    # /resume from here on is refused (409) or left to the end, so no step runs on
                    # the new weights under the old version
                    pause_t0 = time.perf_counter()
                    paused_here = await self.aengine.pause_unless_paused(
                        "keep", lambda _: setattr(s, "committing", True))
                    if paused_here:
                        phases["pause_s"] = time.perf_counter() - pause_t0
                    else:
                        pause_t0 = None
                t_c = time.perf_counter()
                workers = await self._commit_staged(version if in_engine else None)
                phases["commit_in_engine_thread_s" if in_engine else "commit_s"] = time.perf_counter() - t_c
                phases["worker_commit_s"] = max((r.get("seconds", 0.0) for r in workers), default=0.0)
                for k in ("load", "post_load", "device_sync"):
                    phases[f"worker_{k}_s"] = max((r.get("phases_s", {}).get(k, 0.0) for r in workers), default=0.0)
                commit_replayed = all(r.get("replayed") for r in workers)
            if s.committed_version is not None:  # the receive's engine command committed
                version = s.committed_version
            elif not in_engine:
                t_r = time.perf_counter()
                await self.aengine.reset_prefix_cache()
                phases["reset_prefix_cache_s"] = time.perf_counter() - t_r
            written = expand_expert_names(s.received, _spec)  # MoE: a fused name covers many
            full = req.issubset(written)
            # lost weights (a failed update, a level-2 sleep, a restart) are served again once the
            # syncs since have written every required parameter
            valid = self.aengine.commit_weights(version, written, req)
        except BaseException as e:
            s.committing = False
            await self._fail(s, e, teardown=False)
            if paused_here:
                await self.aengine.resume()
            raise
        s.committing = False
        if paused_here:
            await self.aengine.resume()
            phases["paused_s"] = time.perf_counter() - pause_t0
        await self._end_session(s)
        self.num_updates += 1
        total = time.monotonic() - s.started
        self._record(ok=True, weight_version=version, tensors=len(s.received), bytes=s.bytes,
                     transfer_seconds=round(s.seconds, 6), total_seconds=round(total, 6), full=full,
                     staging=self.staging, backend=self._init.backend if self._init else self.backend,
                     **({"protocol": "trl"} if s.trl else {}))
        return {"status": "ok", "weight_version": version, "tensors": len(s.received), "full": full,
                "weights_valid": valid,
                "bytes": s.bytes, "transfer_seconds": round(s.seconds, 6), "total_seconds": round(total, 6),
                "commit_phases_s": {k: round(v, 6) for k, v in phases.items()}, "commit_replayed": commit_replayed,
                "committed_in_engine_command": s.committed_version is not None}

    def _incomplete_message(self, s: _Session, missing: list[str]) -> str:
        """What ``finish_weight_update`` of a declared update that did not fully arrive did."""
        head = (f"finish_weight_update: {len(missing)} of the {len(s.declared.names)} declared tensors never "
                f"arrived (e.g. {missing[:3]})")
        if self._staging_of(s) != "none":
            return f"{head}; nothing was committed: the staged tensors were dropped and the old weights keep serving"
        if s.applied:
            return (f"{head}; the {len(s.received)} that arrived were loaded in place, so the model is part old, "
                    "part new: generation answers 503 until a full weight update lands")
        return f"{head}; nothing was loaded: the old weights keep serving"

    async def _commit_staged(self, version: str | None) -> list[dict]:
        """Every worker loads its staging dict into the model (worker_ext ``commit``). With
        ``version`` (one replica), as one engine-thread command that also resets the prefix cache
        and sets the weight version. Returns the workers' answers.

        Raises:
            WeightTransferFailedError: a commit failed; the model is marked unavailable (some
                workers may have loaded, others not).
        """
        t = max(self.rpc_timeout_s, self._timeout())
        try:
            # some workers may have loaded when a commit fails: the command quarantines the replica
            # so that no step runs before the failure path below ends the requests
            res, _ = await self._rpc_commit("commit", timeout_s=t, commit=None if version is None else {
                "version": version, "when": "always", "failure": "committing staged weights failed"})
        except BaseException as e:
            await self._mark_unavailable(f"committing staged weights failed ({type(e).__name__}: {e}); "
                                         "generation resumes once a full weight update lands")
            raise terr.WeightTransferFailedError(f"commit failed: {e}") from e
        return [r for r in res if isinstance(r, dict)]

    async def sync_weights(self, update_info: dict, weight_version: str | None = None) -> dict:
        """``POST /sync_weights`` (rlserve extension): ``start_weight_update`` +
        ``update_weights(update_info)`` + ``finish_weight_update(weight_version)`` in one call,
        for a trainer whose whole update is one ``update_weights`` call (ipc with per-tensor
        handles). Same validation (everything checked before any byte moves: 400), same failure
        handling and answers as the three calls; saves two HTTP round trips and the declaration.
        A refused call leaves no session open (the trainer may retry at once). ipc in place on
        one replica: no pause / resume; the receive, prefix-cache reset and new version are one
        engine-thread command (:meth:`_commits_in_engine`).

        Returns:
            ``finish_weight_update``'s answer plus ``"update"``: ``update_weights``' answer, and
            ``"sync_phases_s"``: seconds in the start, update and finish steps.
        Raises:
            What the three calls raise.
        """
        t0 = time.perf_counter()
        weight_version = check_weight_version(weight_version)  # before anything starts
        self.aengine.weights.check_label(weight_version)
        update_info = translate_update_info(update_info)
        # (an adapter-only update is staged and committed as a new adapter: never in the receive)
        lora = isinstance(update_info, dict) and update_info.get("lora") is not None
        in_engine = self._commits_in_engine() and not lora
        await self.start_update(None, pause=not in_engine and not lora)  # an adapter never pauses
        s = self._session
        if s is not None and in_engine:  # the engine stamps the label the front chose
            s.commit_in_engine = True
            s.commit_version = weight_version or self.aengine.weights.next_label()
        t1 = time.perf_counter()
        try:
            upd = await self.update_weights(update_info)
        except BaseException as e:
            if s is not None and self._session is s:  # refused before anything moved (ipc 400)
                await self._fail(s, e, teardown=False)
            raise
        t2 = time.perf_counter()
        fin = await self.finish_update(weight_version)
        fin["update"] = upd
        fin["sync_phases_s"] = {"start": round(t1 - t0, 6), "update": round(t2 - t1, 6),
                                "finish": round(time.perf_counter() - t2, 6)}
        return fin
