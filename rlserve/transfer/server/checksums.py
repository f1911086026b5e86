"""sha256 per Hugging Face tensor: what ``/weight_checker`` reports and compares.

What is hashed (so that a trainer computes the same numbers): for every Hugging Face checkpoint
name the server's model holds, the full (unsharded, unfused, unpadded) tensor, cast to the
server's dtype (``GET /weight_info`` → ``dtype``), made contiguous, moved to the CPU; the hash
is ``sha256`` of its raw bytes (native little-endian, row-major). Shape and dtype are not part
of the hash. Use :func:`hf_state_checksums` on both sides::

    # trainer
    from rlserve.transfer import hf_state_checksums, ModuleSource
    mine = hf_state_checksums(ModuleSource(model).named_tensors(), dtype=torch.bfloat16)
    report = client.weight_checker(compare=mine)     # {"match": true, ...}

Server side, :func:`export_hf_tensors` rebuilds each HF tensor from the model's parameters, the
inverse of ``load_weights``: fused ``qkv_proj`` / ``gate_up_proj`` are split back into
``q/k/v_proj`` / ``gate/up_proj``, fused MoE experts are reported under both their per-expert
names and transformers 5's fused ``experts.gate_up_proj`` / ``experts.down_proj``; tensor-parallel shards are all-gathered over the TP group
(column-parallel along the output dim, row-parallel along the input dim, vocabulary rows with
the padding dropped; replicated KV heads once each). A tied ``lm_head.weight`` is the embedding
and is not reported separately (trainers' ``named_parameters()`` skip it too). Parameters of
quantized layers (fp8) cannot be turned back into the checkpoint tensor bit for bit; they are
listed as ``skipped``.
"""

from __future__ import annotations

import hashlib
from functools import partial
from typing import Callable, Iterable, Iterator

import torch


def tensor_sha256(t: torch.Tensor, dtype: torch.dtype | None = None) -> str:
    """Hex sha256 of ``t``'s bytes after ``t.to(dtype)`` (floating tensors only), contiguous, on
    the CPU."""
    t = t.detach()
    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        t = t.to(dtype)
    t = t.contiguous().cpu()
    if t.numel() == 0:
        return hashlib.sha256(b"").hexdigest()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def hf_state_checksums(named_tensors: Iterable[tuple[str, torch.Tensor]],
                       dtype: torch.dtype | None = None) -> dict[str, str]:
    """``{hf_name: sha256 hex}`` for ``(name, tensor)`` pairs (see the module doc for what is
    hashed). ``dtype``: the server's dtype (``None`` hashes tensors as they are)."""
    return {name: tensor_sha256(t, dtype) for name, t in named_tensors}


def compare_checksums(server: dict[str, str], other: dict[str, str]) -> dict:
    """Compare two ``{name: sha256}`` maps.

    Returns:
        ``{"match": bool, "compared": int, "mismatched": [names], "missing_on_server": [names in
        other only], "not_in_compare": [names on the server only]}``. ``match`` is true when
        every name in ``other`` exists on the server with the same hash and nothing mismatched.
    """
    mism = sorted(n for n in other if n in server and server[n] != other[n])
    missing = sorted(n for n in other if n not in server)
    extra = sorted(n for n in server if n not in other)
    return {"match": not mism and not missing, "compared": sum(1 for n in other if n in server),
            "mismatched": mism, "missing_on_server": missing, "not_in_compare": extra}


# ------------------------------------------------------------------ server: model -> HF tensors
def _tp():
    try:
        from rlserve.distributed.parallel_state import get_tp_group, get_tp_size
    except ImportError:  # pragma: no cover
        return 1, None
    return get_tp_size(), get_tp_group()


def _gather(local: torch.Tensor, dim: int) -> list[torch.Tensor]:
    """Every TP rank's ``local`` in rank order; sizes along ``dim`` may differ between ranks
    (uneven head partitions): sizes are exchanged first and shards padded to the largest."""
    size, group = _tp()
    if size == 1:
        return [local]
    n = torch.tensor([local.shape[dim]], dtype=torch.int64, device=local.device)
    sizes = [int(x.item()) for x in group.all_gather(n)]
    m = max(sizes)
    if local.shape[dim] < m:
        pad_shape = list(local.shape)
        pad_shape[dim] = m - local.shape[dim]
        local = torch.cat([local, local.new_zeros(pad_shape)], dim=dim)
    parts = group.all_gather(local.contiguous())
    return [p.narrow(dim, 0, k) for p, k in zip(parts, sizes)]


def _plain(param) -> torch.Tensor:
    return param.data


def _gather_cat(local: torch.Tensor, dim: int) -> torch.Tensor:
    """Every TP rank's ``local`` concatenated along ``dim``."""
    return torch.cat(_gather(local, dim), dim=dim)


def _split_dim(param, dim: int) -> torch.Tensor:
    return torch.cat(_gather(param.data, dim), dim=dim)


def _merged_piece(module, param, idx: int) -> torch.Tensor:
    dim = param.output_dim
    sizes = list(module.output_partition_sizes)
    local = param.data.narrow(dim, sum(sizes[:idx]), sizes[idx])
    parts = _gather(local, dim)
    replicas = int(getattr(module, "num_kv_head_replicas", 1) or 1)
    if idx > 0 and replicas > 1 and hasattr(module, "num_kv_head_replicas"):
        parts = parts[::replicas]  # rank r holds KV head r // replicas: keep one copy of each
    return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]


def _vocab(module, param) -> torch.Tensor:
    parts = _gather(param.data, 0)
    full = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
    return full[: module.num_embeddings]


def _is_quantized(module) -> bool:
    qm = getattr(module, "quant_method", None)
    return qm is not None and type(qm).__name__ != "UnquantizedLinearMethod"


def export_plan(model) -> tuple[list[tuple[str, Callable[[], torch.Tensor]]], list[str]]:
    """``([(hf_name, thunk)], skipped)``: a thunk returns the full HF tensor (TP ranks must call
    the thunks together, in order: they all-gather). Names follow ``model.checkpoint_spec()``."""
    mapping = list(getattr(model, "stacked_params_mapping", []) or [])
    spec = model.checkpoint_spec() if hasattr(model, "checkpoint_spec") else None
    items: list[tuple[str, Callable[[], torch.Tensor]]] = []
    skipped: list[str] = []
    for mod_name, module in model.named_modules():  # a tied head is the same module: listed once
        if hasattr(module, "export_checkpoint_tensors"):  # fused MoE experts: per-expert and fused names
            items += module.export_checkpoint_tensors(mod_name, _gather_cat)
            continue
        for pname, param in module.named_parameters(recurse=False):
            full = f"{mod_name}.{pname}" if mod_name else pname
            if getattr(param, "not_in_checkpoint", False):
                continue
            if _is_quantized(module) or not param.is_floating_point():
                skipped.append(full)
                continue
            out_dim = getattr(param, "output_dim", None)
            if hasattr(module, "_shard_ids") and out_dim is not None and hasattr(module, "output_partition_sizes"):
                for idx, sid in enumerate(module._shard_ids()):
                    name = None
                    for param_part, weight_part, s in mapping:
                        if s == sid and param_part in full:
                            name = full.replace(param_part, weight_part)
                            break
                    if name is None:
                        skipped.append(f"{full}[{sid}]")
                        continue
                    items.append((name, partial(_merged_piece, module, param, idx)))
            elif hasattr(module, "vocab_start") and hasattr(module, "num_embeddings"):
                items.append((full, partial(_vocab, module, param)))
            else:
                # the sharded dim is where this rank's shape differs from the checkpoint's (the
                # same dim on every rank); none: replicated
                want = tuple(spec[full]) if spec is not None and full in spec else \
                    tuple(getattr(param, "full_shape", param.shape))
                dims = [i for i, (a, b) in enumerate(zip(param.shape, want)) if a != b]
                if len(param.shape) != len(want) or len(dims) > 1:
                    skipped.append(full)
                elif dims:
                    items.append((full, partial(_split_dim, param, dims[0])))
                else:
                    items.append((full, partial(_plain, param)))
    if spec is not None:
        known = set(spec)
        skipped += [n for n, _ in items if n not in known]
        items = [(n, f) for n, f in items if n in known]
    return items, skipped


def export_hf_tensors(model) -> tuple[Iterator[tuple[str, torch.Tensor]], list[str]]:
    """``(iterator of (hf_name, full tensor), skipped names)`` rebuilt from ``model``'s parameters.
    Call inside the worker's TP context; every TP rank must consume the iterator fully."""
    items, skipped = export_plan(model)
    return ((n, f()) for n, f in items), skipped
