"""Small helpers shared by layers and models for loading Hugging Face tensors in place.

Kept free of model / layer imports so that every layer module can import it.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import torch


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any] | None) -> None:
    """Attach attributes (``weight_loader``, ``output_dim``, ``full_shape`` ...) to a parameter.

    Raises:
        AttributeError: if an attribute is already set (catches double registration).
    """
    for key, value in (attrs or {}).items():
        if hasattr(param, key):
            raise AttributeError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


def check_float(loaded: torch.Tensor, name: str = "tensor") -> None:
    """Raises ValueError unless ``loaded`` is a floating-point tensor."""
    if not torch.is_floating_point(loaded):
        raise ValueError(f"{name}: expected a floating-point tensor, got {loaded.dtype}")


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
    """Copy a replicated (unsharded) tensor into ``param`` in place, converting dtype.

    Args:
        param: destination parameter (any shape; the data is overwritten, never re-assigned).
        loaded_weight: a tensor of exactly ``param``'s shape, any float dtype, any device.
        shard_id: must be None (replicated parameters have no shards).

    Raises:
        ValueError: on a shape mismatch, a non-float tensor or a shard id (nothing is copied).
    """
    if shard_id is not None:
        raise ValueError(f"replicated parameter takes no shard id, got {shard_id!r}")
    check_float(loaded_weight)
    if tuple(loaded_weight.shape) != tuple(param.shape):
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs loaded {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The full (unsharded, unpadded) Hugging Face shape of ``param``: its ``full_shape``
    attribute when a parallel layer set one, else its own shape."""
    return tuple(getattr(param, "full_shape", param.shape))


# (model param part, checkpoint part, shard_id): e.g. (".qkv_proj.", ".q_proj.", "q")
StackedMapping = list[tuple[str, str, object]]


def _named_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """``dict(model.named_parameters())``, built once per model and kept on it: ``Parameter``
    objects are never replaced after construction (docs/INTERFACES.md), and a weight update that
    loads tensor by tensor (gloo unpacked, TRL) calls this once per tensor. SmolLM2-135M on the
    2-core machine: 272 one-tensor loads took 151-167 ms with a fresh dict per call and 39-42 ms
    with this one (one call with all 272 tensors: 31-45 ms)."""
    params = model.__dict__.get("_rlserve_named_params")
    if params is None:
        params = model.__dict__["_rlserve_named_params"] = dict(model.named_parameters())
    return params


def load_mapped_weights(
    model: torch.nn.Module,
    weights,
    stacked_params_mapping: StackedMapping,
    *,
    rename=None,
    skip=None,
    ignore: set[str] | frozenset = frozenset(),
) -> set[str]:
    """Load HF ``(name, full tensor)`` pairs into ``model``'s parameters in place.

    Args:
        model: a module whose parameter names equal the HF names except for fused modules.
        weights: iterable of ``(hf_name, tensor)``.
        stacked_params_mapping: fused-module mapping (dotted parts, see ``StackedMapping``).
        rename: ``hf_name -> name`` normalization (e.g. add a ``model.`` prefix).
        skip: ``name -> bool``: tensors to drop silently and NOT report (rotary ``inv_freq``).
        ignore: names accepted and reported as consumed without loading (a tied ``lm_head.weight``).

    Returns:
        The set of HF names consumed.

    Raises:
        KeyError: a name that maps onto no parameter (earlier tensors stay loaded).
        ValueError: a wrong shape / dtype (raised by the parameter's loader before it copies).
    """
    params = _named_parameters(model)
    loaded: set[str] = set()
    for hf_name, tensor in weights:
        name = rename(hf_name) if rename else hf_name
        if skip is not None and skip(name):
            continue
        if name in ignore:
            loaded.add(hf_name)
            continue
        for param_part, weight_part, shard_id in stacked_params_mapping:
            if weight_part not in name:
                continue
            target = name.replace(weight_part, param_part)
            if target not in params:
                raise KeyError(f"checkpoint tensor {hf_name!r} maps onto unknown parameter {target!r}")
            param = params[target]
            param.weight_loader(param, tensor, shard_id)
            break
        else:
            if name not in params:
                raise KeyError(f"unknown checkpoint tensor {hf_name!r} for {type(model).__name__}")
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        loaded.add(hf_name)
    return loaded


def mapped_checkpoint_spec(model: torch.nn.Module, stacked_params_mapping: StackedMapping) -> dict[str, tuple[int, ...]]:
    """``{hf_name: full shape}`` for every parameter of ``model`` (inverse of
    :func:`load_mapped_weights`). Modules may define ``checkpoint_shapes(param_name) ->
    {shard_id: shape}`` (fused / sharded layers); other parameters report their own shape."""
    spec: dict[str, tuple[int, ...]] = {}
    for mod_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            full_name = f"{mod_name}.{pname}" if mod_name else pname
            if hasattr(module, "checkpoint_shapes"):
                shapes = module.checkpoint_shapes(pname)
            elif getattr(param, "not_in_checkpoint", False):
                shapes = {}
            else:
                shapes = {None: full_shape(param)}
            for sid, shape in shapes.items():
                if sid is None:
                    spec[full_name] = tuple(shape)
                    continue
                for param_part, weight_part, s in stacked_params_mapping:
                    if s == sid and param_part in full_name:
                        spec[full_name.replace(param_part, weight_part)] = tuple(shape)
                        break
                else:
                    raise KeyError(f"no checkpoint mapping for shard {sid!r} of {full_name!r}")
    return spec


# ---- mixture-of-experts names ------------------------------------------------------------------
_EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_FUSED_NAME = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def parse_expert_name(name: str) -> tuple[str, int | None, str] | None:
    """``(experts module name, expert id or None for a fused tensor, projection)`` of a Hugging
    Face expert tensor name -- per expert ``...mlp.experts.3.gate_proj.weight`` (checkpoints,
    trainers) or fused ``...mlp.experts.gate_up_proj`` (transformers 5's parameters) -- else
    ``None``."""
    m = _EXPERT_NAME.match(name)
    if m:
        return m["prefix"], int(m["expert"]), m["proj"]
    m = _FUSED_NAME.match(name)
    if m:
        return m["prefix"], None, m["proj"]
    return None


def split_fused_experts(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``named`` with transformers 5's fused expert tensors split into the per-expert Hugging Face
    names that checkpoints and most trainers use: ``...experts.gate_up_proj [E, 2I, H]`` ->
    ``...experts.{e}.gate_proj.weight [I, H]`` + ``up_proj.weight [I, H]`` (the first / second
    half of rows); ``...experts.down_proj [E, H, I]`` -> ``...experts.{e}.down_proj.weight [H, I]``.
    The pieces are views of the fused tensor (no copy; each is contiguous); other tensors pass
    unchanged, in order."""
    out = []
    for name, t in named:
        parsed = parse_expert_name(name)
        if parsed is None or parsed[1] is not None:
            out.append((name, t))
            continue
        prefix, _, proj = parsed
        for e in range(t.shape[0]):
            if proj == "gate_up_proj":
                gate, up = t[e].chunk(2, dim=0)
                out += [(f"{prefix}.{e}.gate_proj.weight", gate), (f"{prefix}.{e}.up_proj.weight", up)]
            else:
                out.append((f"{prefix}.{e}.down_proj.weight", t[e]))
    return out


def expand_expert_names(names: Iterable[str], spec: dict[str, tuple[int, ...]]) -> set[str]:
    """``names`` plus, for each fused expert name among them (``...experts.gate_up_proj`` /
    ``...experts.down_proj``, a key of ``spec`` whose first dim is the expert count), the
    per-expert names it holds (``...experts.{e}.gate_proj.weight`` + ``up_proj`` / ``down_proj``):
    what a load or an update of ``names`` covers, to count against the required (per-expert)
    names. Other names pass unchanged."""
    out = set(names)
    for name in list(out):
        parsed = parse_expert_name(name)
        if parsed is None or parsed[1] is not None or name not in spec:
            continue
        prefix, _, proj = parsed
        projs = ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",)
        out |= {f"{prefix}.{e}.{q}.weight" for e in range(spec[name][0]) for q in projs}
    return out
