"""Adapter-only weight sync: a trainer's PEFT adapter pushed through the weight-sync data planes
(gloo, NCCL, CUDA IPC) into a new adapter version, no files involved.

The update is an ordinary weight update (``rlserve.transfer``: same routes, bucket plan,
checksums, NaN / inf test, liveness, failure handling) whose ``update_info`` carries a ``lora``
object (PEFT's names)::

    "lora": {"lora_name": "policy",      # what requests put in "model"
             "r": 16, "lora_alpha": 32,  # PEFT's LoraConfig: scaling = lora_alpha / r
             "use_rslora": false,        # (lora_alpha / sqrt(r))
             "load_inplace": true,       # replace an adapter of that name (false: 400 if loaded)
             "version": "7"}             # optional label of this adapter version

and whose tensors are the adapter's factors, named ``<hf_module>.lora_A.weight`` ``[r, in]`` and
``<hf_module>.lora_B.weight`` ``[out, r]`` (PEFT's saved keys without ``base_model.model.``), e.g.
``model.layers.0.self_attn.q_proj.lora_A.weight``. Bytes moved: the factors only.

Server side, before a byte moves (400, nothing changed): ``lora`` is checked (:func:`lora_fields`:
rank within ``--max-lora-rank``), every name, shape and dtype against the adapter's expected
factors (:func:`update_spec`, through the full sync's ``validate_against_spec``), each module's A
and B both present (:func:`check_pairs`). The workers receive into staging tensors whatever
``--weight-staging`` says (an adapter is megabytes; the served adapters are never written), with
the checksum and NaN / inf checks of a staged update. ``finish`` then makes the factors a new
adapter on every replica in one engine command each (:func:`commit_worker`, between two steps)
under a new ``lora_int_id``, and points the name at it (:meth:`rlserve.lora.registry.LoRARegistry.
add_synced`); the previous version's requests finish on it. A failure anywhere leaves the served
adapters as they were (never half-updated), and the prefix cache, keyed by ``lora_int_id``, never
serves KV of one adapter version to another.
"""

from __future__ import annotations

import math
import re

import torch

from rlserve.errors import LoRAAdapterError, WeightUpdateError
from rlserve.lora.adapter import adapter_from_parts, check_fold, check_parts, lora_scaling
from rlserve.lora.model import lora_of

#: a factor's name on the wire: ``<hf_module>.lora_A.weight`` / ``.lora_B.weight``
_NAME = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_LORA_KEYS = {"lora_name", "r", "lora_alpha", "use_rslora", "load_inplace", "version"}
#: longest adapter name / version label (characters)
MAX_LABEL_CHARS = 256


def _label(value, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_LABEL_CHARS or \
            any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise WeightUpdateError(f"update_info.lora.{what} must be 1 to {MAX_LABEL_CHARS} printable characters")
    return value


def lora_fields(raw, max_lora_rank: int | None = None) -> dict:
    """``update_info.lora`` checked and completed (``use_rslora`` false, ``load_inplace`` true,
    ``version`` None by default).

    Raises:
        WeightUpdateError (400): not an object, an unknown key, a missing or empty ``lora_name``,
            ``r`` not an integer in ``1 .. max_lora_rank``, ``lora_alpha`` not a finite number,
            a non-boolean flag, a bad ``version`` label.
    """
    if not isinstance(raw, dict):
        raise WeightUpdateError("update_info.lora must be an object")
    unknown = set(raw) - _LORA_KEYS
    if unknown:
        raise WeightUpdateError(f"update_info.lora: unknown key(s) {sorted(unknown)}; known: {sorted(_LORA_KEYS)}")
    out = {"lora_name": _label(raw.get("lora_name"), "lora_name")}
    r = raw.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise WeightUpdateError(f"update_info.lora.r must be an integer >= 1, got {r!r}")
    if max_lora_rank is not None and r > max_lora_rank:
        raise WeightUpdateError(f"LoRA rank {r} is greater than max_lora_rank {max_lora_rank}")
    alpha = raw.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise WeightUpdateError(f"update_info.lora.lora_alpha must be a finite number, got {alpha!r}")
    for key, default in (("use_rslora", False), ("load_inplace", True)):
        v = raw.get(key, default)
        if not isinstance(v, bool):
            raise WeightUpdateError(f"update_info.lora.{key} must be true or false, got {v!r}")
        out[key] = v
    version = raw.get("version")
    if version is not None:
        version = _label(str(version) if isinstance(version, (str, int)) and not isinstance(version, bool)
                         else None, "version")
    out.update(r=r, lora_alpha=float(alpha), version=version)
    return out


def update_spec(targets: dict[str, tuple[int, int]], rank: int) -> dict[str, tuple[int, int]]:
    """The names and shapes an adapter of rank ``rank`` may send: for every LoRA-capable module
    (``targets``: ``{hf_module: (out, in)}``, :attr:`rlserve.lora.model.LoRAModel.targets`)
    ``<module>.lora_A.weight`` ``(rank, in)`` and ``<module>.lora_B.weight`` ``(out, rank)``."""
    spec = {}
    for module, (out_f, in_f) in targets.items():
        spec[f"{module}.lora_A.weight"] = (rank, int(in_f))
        spec[f"{module}.lora_B.weight"] = (int(out_f), rank)
    return spec


def check_pairs(names: list[str]) -> None:
    """Every module sent has both its ``lora_A`` and its ``lora_B``, and at least one is sent.

    Raises:
        WeightUpdateError (400): naming the first module with one factor only.
    """
    seen: dict[str, set] = {}
    for n in names:
        m = _NAME.match(n)
        if m is not None:
            seen.setdefault(m.group("module"), set()).add(m.group("ab"))
    if not seen:
        raise WeightUpdateError("update_info rejected, no weights were changed: an adapter-only update needs "
                                "lora_A / lora_B factors")
    lone = [(mod, ab) for mod, ab in seen.items() if ab != {"A", "B"}]
    if lone:
        mod, ab = lone[0]
        have, missing = next(iter(ab)), next(iter({"A", "B"} - ab))
        raise WeightUpdateError(f"update_info rejected, no weights were changed: {mod} has lora_{have} "
                                f"without lora_{missing} ({len(lone)} module(s) with one factor)")


# ---------------------------------------------------------------- engine side
def lora_targets(core) -> dict:
    """Engine call: ``{"targets": {hf_module: [out, in]}, "max_lora_rank": int}`` of this
    replica's model, or ``{}`` without ``--enable-lora``."""
    lora = lora_of(core.engine.model)
    if lora is None:
        return {}
    return {"targets": {k: list(v) for k, v in lora.targets.items()}, "max_lora_rank": lora.max_lora_rank}


def commit_worker(worker, adapter_id: int, rank: int, scaling: float) -> dict:
    """Worker RPC (engine thread, between two steps): the factors this worker received into its
    staging tensors become adapter ``adapter_id`` (``scaling`` folded into ``B`` as a file's
    adapter, :func:`rlserve.lora.adapter.adapter_from_parts`); the staging dict is cleared.
    Returns ``{"rank", "modules", "bytes"}``.

    Raises:
        LoRAAdapterError: LoRA not enabled, nothing staged, a factor the checks let through but
            that cannot be served (nothing is added then).
    """
    from rlserve.transfer.server.worker_ext import _state

    st = _state(worker)
    lora = lora_of(worker.model)
    if lora is None:
        raise LoRAAdapterError("LoRA is not enabled: start the server with --enable-lora")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in st.staging.items():
        m = _NAME.match(name)
        if m is None:
            raise LoRAAdapterError(f"adapter sync: staged tensor {name!r} is not a lora_A / lora_B factor")
        parts.setdefault(m.group("module"), {})[m.group("ab")] = t
    st.staging = {}
    # (NaN / inf were tested in the receive's checksum pass, unless --no-weight-check-finite)
    check_parts(parts, int(rank), lora.targets, "synced LoRA adapter", check_finite=False)
    check_fold(parts, float(scaling), lora.dtype, "synced LoRA adapter")  # lora_alpha 1e30 overflows B
    info = lora.add_staged(int(adapter_id), parts, int(rank), float(scaling))  # kernel path: a few launches
    if info is not None:
        return info
    adapter = adapter_from_parts(parts, int(rank), float(scaling), lora.targets, lora.dtype, lora.device,
                                 "synced LoRA adapter", check_finite=False)
    return lora.add(int(adapter_id), adapter, path="")


def commit_synced(core, adapter_id: int, rank: int, scaling: float, timeout_s: float) -> dict:
    """Engine call: :func:`commit_worker` on this replica's worker(s); its answer. Adapters
    unloaded earlier whose last requests have finished since are freed first (as a file load
    does): their slots are what the new version takes (with ``--max-loras 1`` there are two)."""
    from rlserve.lora.engine_ops import sweep

    lora = lora_of(core.engine.model)
    if lora is not None:
        sweep(core.engine, lora)
    res = core.engine.collective_rpc(f"{__name__}:commit_worker", adapter_id, rank, scaling, timeout_s=timeout_s)
    return res[0] if res else {}


def scaling_of(fields: dict) -> float:
    """PEFT's scaling of checked :func:`lora_fields`."""
    return lora_scaling(fields["lora_alpha"], fields["r"], fields["use_rslora"])
