"""Trainer SDK, weight sources: what ``send_weights`` iterates (:class:`ModuleSource` for an
``nn.Module`` incl. DDP / torch.compile / FSDP2, :class:`TensorListSource` for named tensors)."""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch
from torch import nn

# ============================================================================ sources
_WRAPPER_PARTS = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def hf_name(name: str) -> str:
    """Strip wrapper components (``module.`` from DDP, ``_orig_mod.`` from torch.compile,
    ``_fsdp_wrapped_module.`` / ``_checkpoint_wrapped_module.``) from a parameter name."""
    parts = name.split(".")
    while parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(p for p in parts if p not in _WRAPPER_PARTS[1:])


class ModuleSource:
    """Yields ``(hf_name, full tensor)`` of a Hugging Face-style ``nn.Module``.

    Args:
        module: a plain module, DDP / torch.compile wrapped, or FSDP2 (DTensor parameters).
        dtype: cast floating tensors to this dtype before sending (e.g. ``torch.bfloat16`` to
            halve the bytes of a float32 trainer); ``None`` sends them as they are.
        include: optional predicate on the HF name (partial updates).

    Names are Hugging Face checkpoint names: wrapper prefixes are stripped, and a tied
    ``lm_head.weight`` is skipped (``named_parameters()`` already dedups the shared tensor; with
    ``tie_word_embeddings`` an explicitly listed head is dropped too). Buffers are not sent.

    DTensor parameters: :meth:`named_tensors` calls ``full_tensor()`` per parameter (a
    collective), so every rank of the trainer must iterate in the same order; metadata
    (:meth:`metadata`) needs no communication.
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype | None = None,
                 include: Callable[[str], bool] | None = None):
        self.module = module
        self.dtype = dtype
        self.include = include

    def _params(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        seen: set[str] = set()
        tied = bool(getattr(getattr(self.module, "config", None), "tie_word_embeddings", False))
        for raw, p in self.module.named_parameters():
            name = hf_name(raw)
            if name in seen:
                continue
            if tied and name == "lm_head.weight":
                continue
            if self.include is not None and not self.include(name):
                continue
            seen.add(name)
            out.append((name, p))
        return out

    def _out_dtype(self, t: torch.Tensor) -> torch.dtype:
        return self.dtype if (self.dtype is not None and t.is_floating_point()) else t.dtype

    def metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``[(hf_name, dtype on the wire, full shape)]`` in send order; no communication."""
        return [(n, self._out_dtype(p), tuple(p.shape)) for n, p in self._params()]

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full contiguous tensor)`` in :meth:`metadata` order."""
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # pragma: no cover
            DTensor = ()  # type: ignore[assignment]
        for name, p in self._params():
            t = p.detach()
            if DTensor and isinstance(t, DTensor):
                t = t.full_tensor()
            if self.dtype is not None and t.is_floating_point() and t.dtype != self.dtype:
                t = t.to(self.dtype)
            yield name, t.contiguous()


class TensorListSource:
    """A source over explicit ``(name, tensor)`` pairs (tests, benchmarks, custom exporters)."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]):
        self.items = [(n, t.detach()) for n, t in named]

    def metadata(self):
        return [(n, t.dtype, tuple(t.shape)) for n, t in self.items]

    def named_tensors(self):
        for n, t in self.items:
            yield n, t.contiguous()
