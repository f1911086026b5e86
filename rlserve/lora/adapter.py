"""Reading a PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``,
what ``PeftModel.save_pretrained`` writes) into per-module low-rank factors.

The config is read with PEFT's own ``LoraConfig.from_pretrained`` and the tensors with
``safetensors.torch.load_file`` (never ``torch.load``: a ``.bin`` adapter is pickle and is refused).
What a LoRA adapter may hold here is what TRL's ``validate_lora_for_vllm_sync`` lets through to
vLLM: ``lora_A`` / ``lora_B`` factors on the decoder's linear layers, ``bias="none"``, no DoRA, no
``modules_to_save``, no head or embedding targets; a per-module ``rank_pattern`` / ``alpha_pattern``
is refused too (one rank and one scale per adapter).

PEFT's forward is ``y = x W^T + scaling * (x A^T) B^T`` with ``A [r, in]``, ``B [out, r]`` and
``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``); :func:`read_adapter`
folds ``scaling`` into ``B`` once, as vLLM does, so serving computes ``(x A^T) B'^T``.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from rlserve.errors import LoRAAdapterError, LoRAAdapterNotFoundError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: the dtypes a factor may arrive in (a file's tensors, an adapter-only sync's wire)
FACTOR_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# "base_model.model.<module>.lora_A.weight" (PEFT's saved name; the adapter name is stripped)
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


@dataclass
class LoRAAdapter:
    """One adapter's factors, ready to serve.

    Attributes:
        rank: ``r`` of every module (PEFT's ``LoraConfig.r``).
        scaling: the factor folded into every ``B`` (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA).
        weights: ``{hf_module: (A [r, in], B [out, r] x scaling)}`` in ``dtype``, ``hf_module`` the
            checkpoint name of the base linear without ``.weight`` (``model.layers.0.self_attn.q_proj``).
    """

    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        """Bytes of every factor held."""
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def _config(path: str):
    """PEFT's ``LoraConfig`` of ``path``; raises :class:`LoRAAdapterError` for anything not servable."""
    from peft import LoraConfig

    with open(os.path.join(path, CONFIG_FILE), encoding="utf-8") as f:
        try:
            raw = json.load(f)
        except ValueError as e:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8
            raise LoRAAdapterError(f"{CONFIG_FILE} of {path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict) or raw.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{path} is not a LoRA adapter (peft_type {raw.get('peft_type')!r}, expected 'LORA')"
                               if isinstance(raw, dict) else f"{CONFIG_FILE} of {path} is not a JSON object")
    try:
        cfg = LoraConfig.from_pretrained(path)
    except (TypeError, ValueError) as e:
        raise LoRAAdapterError(f"{CONFIG_FILE} of {path} is not a valid LoraConfig: {e}") from None
    # PEFT keeps whatever JSON held: r "8", null or 8.5 and lora_alpha "x", NaN or inf reach here
    if isinstance(cfg.r, bool) or not isinstance(cfg.r, int):
        raise LoRAAdapterError(f"LoRA adapter {path}: r must be an integer, got {cfg.r!r}")
    alpha = cfg.lora_alpha
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoRAAdapterError(f"LoRA adapter {path}: lora_alpha must be a finite number, got {alpha!r}")
    return check_lora_config(cfg, f"LoRA adapter {path}")


def check_lora_config(cfg, where: str):
    """``cfg`` (PEFT's ``LoraConfig``) if rlserve can serve it, for a file's adapter and for the
    trainer SDK's adapter-only sync (:class:`rlserve.transfer.sdk.lora_source.LoRASource`).

    Raises:
        LoRAAdapterError: DoRA, a bias, ``modules_to_save``, per-module rank / alpha patterns,
            ``target_parameters``, ``fan_in_fan_out``, ``lora_bias`` (``where`` starts the message).
    """
    refused = [(bool(cfg.use_dora), "use_dora=true (DoRA)"), (cfg.bias != "none", f"bias={cfg.bias!r}"),
               (bool(cfg.modules_to_save), f"modules_to_save={cfg.modules_to_save}"),
               (bool(getattr(cfg, "rank_pattern", None)), "a rank_pattern"),
               (bool(getattr(cfg, "alpha_pattern", None)), "an alpha_pattern"),
               (bool(getattr(cfg, "target_parameters", None)), "target_parameters"),
               (bool(getattr(cfg, "fan_in_fan_out", False)), "fan_in_fan_out=true"),
               (bool(getattr(cfg, "lora_bias", False)), "lora_bias=true")]
    for bad, what in refused:
        if bad:
            raise LoRAAdapterError(f"{where}: {what} is not supported (only lora_A / lora_B factors of "
                                   "one rank on the decoder's linear layers)")
    return cfg


def read_adapter(path: str, targets: dict[str, tuple[int, int]], max_lora_rank: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 name: str | None = None) -> LoRAAdapter:
    """Read and check the PEFT adapter directory ``path``.

    Args:
        path: a directory holding ``adapter_config.json`` and ``adapter_model.safetensors``.
        targets: ``{hf_module: (out_features, in_features)}`` of every base linear an adapter may
            target (:meth:`rlserve.lora.layers.LoRAModel.targets`).
        max_lora_rank: the server's ``--max-lora-rank``.
        dtype / device: where the factors are kept (the model's dtype: vLLM's ``lora_dtype=auto``).
        name: the adapter's name, for the not-found message.

    Returns:
        a :class:`LoRAAdapter` with ``scaling`` folded into each ``B``.

    Raises:
        LoRAAdapterNotFoundError: no ``adapter_config.json`` in ``path`` (vLLM's message).
        LoRAAdapterError: an unsupported config, no safetensors file, a rank above
            ``max_lora_rank``, a tensor for a module the model does not have or of the wrong shape,
            a factor without its partner, or non-finite values. Nothing is loaded then.
    """
    if not isinstance(path, str) or not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        raise LoRAAdapterNotFoundError(f"Loading lora {name or path} failed: No adapter found for {path}")
    cfg = _config(path)
    rank = int(cfg.r)
    if rank < 1 or rank > max_lora_rank:
        raise LoRAAdapterError(f"LoRA rank {rank} is greater than max_lora_rank {max_lora_rank}" if rank > 0
                               else f"LoRA rank must be >= 1, got {rank}")
    scaling = lora_scaling(cfg.lora_alpha, rank, bool(cfg.use_rslora))
    wfile = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(wfile):
        raise LoRAAdapterError(f"LoRA adapter {path} has no {WEIGHTS_FILE} (only safetensors adapters are read)")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(wfile)
    except (SafetensorError, OSError) as e:
        raise LoRAAdapterError(f"{wfile} could not be read: {e}") from None
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAAdapterError(f"LoRA adapter {path}: tensor {key!r} is not a lora_A / lora_B factor")
        module = m.group("module")
        if module not in targets:
            raise LoRAAdapterError(f"LoRA adapter {path}: {key!r} targets {module!r}, which is not a LoRA-capable "
                                   "linear layer of this model (supported: q/k/v/o_proj, gate/up/down_proj)")
        parts.setdefault(module, {})[m.group("ab")] = t
    return adapter_from_parts(parts, rank, scaling, targets, dtype, device, f"LoRA adapter {path}")


def lora_scaling(lora_alpha: float, rank: int, use_rslora: bool = False) -> float:
    """PEFT's ``scaling``: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA."""
    return float(lora_alpha) / (math.sqrt(rank) if use_rslora else rank)


def adapter_from_parts(parts: dict[str, dict[str, torch.Tensor]], rank: int, scaling: float,
                       targets: dict[str, tuple[int, int]], dtype: torch.dtype, device,
                       where: str, check_finite: bool = True) -> LoRAAdapter:
    """A :class:`LoRAAdapter` from ``{hf_module: {"A": [r, in], "B": [out, r]}}`` (a file's
    tensors, or an adapter-only weight sync's received ones: :mod:`rlserve.lora.sync`).
    ``scaling`` is folded into ``B`` in float32, then both are cast to ``dtype`` on ``device``.
    ``where`` starts the error messages. ``check_finite=False``: the caller tested the values
    already (an adapter-only sync's receive does, in its checksum pass).

    Raises:
        LoRAAdapterError: no factor, a module not in ``targets``, a factor without its partner,
            shapes other than ``(rank, in)`` / ``(out, rank)``, a dtype not in :data:`FACTOR_DTYPES`,
            non-finite values.
    """
    check_parts(parts, rank, targets, where, check_finite)
    check_fold(parts, scaling, dtype, where)
    weights = {}
    for module, ab in parts.items():
        a, b = ab["A"], ab["B"]
        weights[module] = (a.to(device=device, dtype=dtype).contiguous(),
                           (b.to(torch.float32) * scaling).to(device=device, dtype=dtype).contiguous())
    return LoRAAdapter(rank, scaling, weights)


def check_parts(parts: dict[str, dict[str, torch.Tensor]], rank: int, targets: dict[str, tuple[int, int]],
                where: str, check_finite: bool = True) -> None:
    """:func:`adapter_from_parts`' checks of ``parts`` (see there); raises LoRAAdapterError."""
    if not parts:
        raise LoRAAdapterError(f"{where} holds no lora_A / lora_B tensors")
    for module, ab in parts.items():
        if module not in targets:
            raise LoRAAdapterError(f"{where}: {module!r} is not a LoRA-capable linear layer of this model")
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"{where}: {module} has no lora_{({'A', 'B'} - set(ab)).pop()}")
        out_f, in_f = targets[module]
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
            raise LoRAAdapterError(f"{where}: {module} has lora_A {tuple(a.shape)} and lora_B "
                                   f"{tuple(b.shape)}; expected {(rank, in_f)} and {(out_f, rank)} (r={rank})")
        if a.dtype not in FACTOR_DTYPES or b.dtype not in FACTOR_DTYPES:  # (float8: no isfinite / norm on CPU)
            raise LoRAAdapterError(f"{where}: {module} has lora_A of {a.dtype} and lora_B of {b.dtype}; factors "
                                   f"must be one of {', '.join(str(d) for d in FACTOR_DTYPES)}")
        if check_finite and not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAAdapterError(f"{where}: {module} has non-finite factors (NaN or inf)")


#: :func:`check_fold`'s margin below the served dtype's largest finite value: covers the float32
#: multiply's rounding (relative 2**-24) and the cast's round-to-nearest (2**-8 for bfloat16)
FOLD_MARGIN = 2.0 ** -7


def check_fold(parts: dict[str, dict[str, torch.Tensor]], scaling: float, dtype: torch.dtype, where: str) -> None:
    """Whether the served factors stay finite: every ``A`` cast to ``dtype`` and every ``B`` times
    ``scaling`` (folded in float32, then cast) within ``dtype``'s finite range (less
    :data:`FOLD_MARGIN`). Finite inputs can still overflow here (``lora_alpha`` 1e30, a factor
    of 1e5 served in float16), and a NaN (``--no-weight-check-finite``) fails it too. One
    ``torch._foreach_norm`` (max-abs) per dtype and device, one host read each.

    Raises:
        LoRAAdapterError: ``scaling`` not finite, or a factor that would leave the range (named).
    """
    if not math.isfinite(scaling):
        raise LoRAAdapterError(f"{where}: the LoRA scaling (lora_alpha / r) is {scaling}, not a finite number")
    top = torch.finfo(dtype).max * (1.0 - FOLD_MARGIN)
    groups: dict[tuple, list[tuple[str, str, torch.Tensor]]] = {}
    for module, ab in parts.items():
        for k in ("A", "B"):
            groups.setdefault((ab[k].dtype, ab[k].device), []).append((module, k, ab[k]))
    for items in groups.values():
        norms = torch.stack(torch._foreach_norm([t for _, _, t in items], ord=math.inf)).double().tolist()
        for (module, k, _), amax in zip(items, norms):
            served = amax * abs(scaling) if k == "B" else amax
            if not served <= top:  # NaN fails too
                raise LoRAAdapterError(
                    f"{where}: {module}'s lora_{k} would hold values of magnitude {served:.3g} once "
                    f"{'scaled by ' + format(scaling, '.3g') + ' and ' if k == 'B' else ''}served in {dtype} "
                    f"(its largest finite value: {torch.finfo(dtype).max:.3g})")
