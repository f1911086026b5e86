"""Engine-side halves of the weight-sync manager's calls (:mod:`rlserve.transfer.server.manager`).

The manager runs in the API process; the model lives with the engine (an engine-core process
by default). Each function here runs there, between two engine steps, as
``AsyncEngine.call_engines("rlserve.transfer.server.engine_calls:<fn>", ...)``; it gets the replica's
:class:`~rlserve.engine.core.engine_core.EngineCore` and returns plain data (MessagePack crosses the process
boundary: tuples and sets arrive as lists).
"""

from __future__ import annotations

TARGET = __name__ + ":"


def worker_rpc(core, target: str, args: list, timeout_s: float, commit: dict | None = None) -> dict:
    """``target(worker, *args)`` on every TP worker of this replica (``engine.collective_rpc``).

    Args:
        commit: None (nothing more), or ``{"version": str | None, "when": "all_ok" | "always",
            "failure": str}``: in the same engine command, once every worker's result reads
            ``done`` and ``ok`` (``"all_ok"``; ``"always"``: once the call returned), reset the
            prefix cache and stamp the new weight version (the one given, else the current one
            + 1) on the outputs of every later step. When instead the call raised, or (``all_ok``)
            a worker failed or is not done after having possibly written into the parameters
            (``touched`` / ``applied`` / not done), quarantine the replica
            (:meth:`~rlserve.engine.core.engine_core.EngineCore.quarantine`, reason ``failure``): it steps
            nothing until the requests in flight were ended.

    Returns:
        ``{"results": [per worker, TP rank order], "committed_version": str | None,
        "quarantined": the reason or None}``.
    Raises:
        what the call raised (after quarantining, with ``commit``).
    """
    try:
        res = list(core.engine.collective_rpc(target, *args, timeout_s=timeout_s))
    except BaseException as e:
        if commit is not None:
            core.quarantine(f"{commit.get('failure', 'a weight update failed')} ({type(e).__name__}: {e}); "
                            "generation resumes once a full weight update lands")
        raise
    committed = quarantined = None
    if commit is not None:
        ok = all(isinstance(r, dict) and r.get("done") and r.get("ok") for r in res)
        if commit.get("when") == "always" or ok:
            from rlserve.transfer.server.session import next_version

            core.engine.reset_prefix_cache()
            committed = commit.get("version") or next_version(core.weight_version)
            core.weight_version = committed
        elif any(r.get("touched") or r.get("applied") or not r.get("done") for r in res if isinstance(r, dict)):
            failed = next((r for r in res if isinstance(r, dict) and r.get("done") and not r.get("ok")), {})
            quarantined = (f"{commit.get('failure', 'a weight update failed')} ({failed.get('error_type')}: "
                           f"{failed.get('error')}); generation resumes once a full weight update lands")
            core.quarantine(quarantined)
    return {"results": res, "committed_version": committed, "quarantined": quarantined}


def model_spec(core) -> list:
    """``[checkpoint_spec() as {name: shape}, sorted required checkpoint names,
    tied_checkpoint_names() as a dict]``."""
    e = core.engine
    spec = {k: list(v) for k, v in e.checkpoint_spec().items()}
    return [spec, sorted(e.required_checkpoint_names()), dict(e.tied_checkpoint_names())]


def device_uuids(core) -> list[str]:
    """UUIDs of the GPUs this replica's engine runs on (empty on CPU)."""
    import torch

    dev = getattr(core.engine, "device", None)
    if dev is None or torch.device(dev).type != "cuda":
        return []
    return [str(torch.cuda.get_device_properties(torch.device(dev)).uuid)]
