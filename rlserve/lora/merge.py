"""The one-adapter fast path: when every sequence of the steps runs on one adapter, that adapter
is merged into the base weights and the steps run as the base model (its CUDA graphs, the CPU
fast decode layer and micro-batches), with no per-token LoRA cost.

Policy (:meth:`MergedAdapter.prepare`, called by the model runner before each step):

- a step whose sequences all run on adapter ``X`` (no base-model row): after ``after_steps``
  such steps in a row (a burst of mixed steps never merges), ``X`` is merged: every linear ``X``
  targets gets ``W += B' A`` (``B'`` with PEFT's scaling folded; the product in float32, added
  to ``W`` in float32 and rounded once to ``W``'s dtype, as PEFT's ``merge_and_unload``);
  then the step runs on the base path;
- any other step (base rows, another adapter, several adapters) while ``X`` is merged first puts
  the base weights back: they are copied from a copy taken at the merge (``W`` itself, never
  ``W - B' A``: subtracting would not give the base bits back), and the copy is dropped;
- every worker call (weight syncs, checksums, sleep, adapter loads: :meth:`rlserve.engine.worker.
  worker.Worker.call` and ``load_weights``) first puts the base weights back, so nothing outside a
  step ever sees or overwrites merged weights, and a later merge copies the weights as they are
  then (a synced base model included).

Each merge or restore also rebuilds the layer's derived state (``quant_method.
process_weights_after_loading``: the CPU packed copy) as a weight load does. Cost: one copy of
the targeted linears' weights while an adapter is merged (on CUDA the worker's KV-cache sizing
leaves room for it, :meth:`MergedAdapter.reserve_bytes`), per merge ``sum(out x in x r)``
multiply-adds and that copy, per restore a copy back; an RL run serves one adapter version at a time, so it pays
one restore and one merge per version. Prefix-cache entries stay keyed by the adapter's
``lora_int_id``: KV computed merged or not differs only by rounding.

Only layers whose ``quant_method`` is the unquantized one are merged; a model with any other
(fp8) never merges (:func:`mergeable`). ``RLSERVE_LORA_MERGE`` (``rlserve/envs.py``) switches
the path: ``auto`` (default) on CUDA where the KV cache can spare the copy (:func:`kv_budget`: it
still holds ``max_num_seqs`` full-length sequences), ``1`` on, ``0`` off. On CUDA it measured
+23-28% decode with one adapter on Qwen3-8B (BENCHMARKS.md) but takes the room of a copy of the
weights, which would cap the batch of a server whose KV cache is the limit; on a CPU a short A/B
(64 tokens, the merge included, a loaded machine) did not show it faster (``auto``: off).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

#: steps in a row all on one adapter before it is merged: mixed batches while a new adapter version
#: takes over must not merge and restore every other step, and a merge costs about what some tens
#: of decode steps do on a CPU (SmolLM2-135M's shape, rank 16/64: merge 1.8 s, restore 0.8-1.4 s on
#: a loaded 2-core machine, benchmarks/lora_gpu.py --device cpu)
AFTER_STEPS = 16


def mergeable(linears) -> bool:
    """Whether every ``(module, LoRALinear)`` pair's module has an unquantized, floating weight."""
    from rlserve.layers.linear import UnquantizedLinearMethod

    return all(isinstance(getattr(mod, "quant_method", None), UnquantizedLinearMethod)
               and mod.weight.dtype.is_floating_point for mod, _ in linears)


def policy(device: torch.device) -> str:
    """``RLSERVE_LORA_MERGE``'s answer for a model on ``device``: ``"on"`` (``1``), ``"off"``
    (``0``; ``auto`` off CUDA: on a CPU it has not measured faster) or ``"auto"`` (CUDA: on when
    the KV cache can spare the copy, decided by :func:`kv_budget`).

    Raises:
        ValueError: a value other than ``auto``, ``0``, ``1``.
    """
    from rlserve import envs

    setting = envs.RLSERVE_LORA_MERGE
    if setting not in ("auto", "0", "1"):
        raise ValueError(f"RLSERVE_LORA_MERGE must be 'auto', '0' or '1', got {setting!r}")
    if setting == "auto":
        return "auto" if torch.device(device).type == "cuda" else "off"
    return "on" if setting == "1" else "off"


def kv_budget(lora, budget: int, per_block: int, blocks_needed: int | None) -> int:
    """The KV cache's byte budget once the fast path's memory is set aside, deciding ``auto``.

    Args:
        lora: the replica's :class:`rlserve.lora.model.LoRAModel` (its ``merge``: ``None`` when
            the path is off; set to ``None`` here when ``auto`` decides off).
        budget: bytes the KV cache would get without the fast path.
        per_block: bytes of one KV block.
        blocks_needed: the most blocks the server can ever use at once (``max_num_seqs`` full
            sequences of ``max_model_len`` tokens), ``None`` when unbounded.

    ``auto`` keeps the path only when the KV cache left after the copy
    (:meth:`MergedAdapter.reserve_bytes`) still holds ``blocks_needed``: then the copy costs no
    request its place (the blocks beyond would never all be used), and the path is free speed
    (+28% decode with one adapter on Qwen3-8B, BENCHMARKS.md). Otherwise the KV cache keeps the
    memory: a smaller cache would cap the batch, which costs more than the path gains when
    requests queue. ``on`` (``RLSERVE_LORA_MERGE=1``) always sets the memory aside. The decision
    is logged (info).
    """
    m = lora.merge
    if m is None:
        return budget
    reserve = m.reserve_bytes()
    if not m.auto:
        logger.info("LoRA one-adapter fast path on (RLSERVE_LORA_MERGE=1): %.2f GiB set aside from the KV cache",
                    reserve / 2**30)
        return budget - reserve
    left = (budget - reserve) // per_block if per_block > 0 else 0
    if blocks_needed is not None and left >= blocks_needed:
        logger.info("LoRA one-adapter fast path on (RLSERVE_LORA_MERGE=auto): the KV cache keeps %d blocks, more "
                    "than max_num_seqs x max_model_len need (%d), beside the base weights' copy (%.2f GiB)",
                    left, blocks_needed, reserve / 2**30)
        return budget - reserve
    lora.merge = None
    logger.info("LoRA one-adapter fast path off (RLSERVE_LORA_MERGE=auto): a copy of the base weights (%.2f GiB) "
                "would leave the KV cache %d blocks, fewer than max_num_seqs x max_model_len need (%s); "
                "RLSERVE_LORA_MERGE=1 takes the memory anyway", reserve / 2**30, max(left, 0), blocks_needed)
    return budget


class MergedAdapter:
    """Merge state of one model replica (module docstring).

    Args:
        lora: the replica's :class:`rlserve.lora.model.LoRAModel` (its ``_linears``,
            ``slot_of`` on the kernel path).
        after_steps: :data:`AFTER_STEPS`.

    Attributes:
        merged: the adapter id merged into the weights now, 0 for none.
        merges / restores: counts since start (tests and logs).
    """

    def __init__(self, lora, after_steps: int = AFTER_STEPS, auto: bool = False):
        self.lora = lora
        self.after_steps = int(after_steps)
        self.auto = bool(auto)  # RLSERVE_LORA_MERGE=auto: kept or dropped by kv_budget
        self.merged = 0
        self.merges = self.restores = 0
        self._streak = (0, 0)  # (adapter id, steps in a row all on it)
        self._base: dict[nn.Module, torch.Tensor] = {}  # module -> its base weight while merged

    def prepare(self, seq_adapters: list[int] | None) -> bool:
        """Set the weights for a step whose sequence ``i`` runs on ``seq_adapters[i]`` (0 or
        ``None`` for all: the base model). Returns True when the step must run as the base model
        because its one adapter is (now) merged."""
        ids = set(seq_adapters or ())
        one = next(iter(ids)) if len(ids) == 1 else 0
        if not one:
            self._streak = (0, 0)
            self.restore()
            return False
        if one == self.merged:
            return True
        n = self._streak[1] + 1 if self._streak[0] == one else 1
        self._streak = (one, n)
        if n < self.after_steps:
            self.restore()
            return False
        self.restore()
        self._merge(one)
        return True

    def reserve_bytes(self) -> int:
        """Memory a merge may hold at once, for the worker's KV-cache sizing on CUDA: the copies of
        every LoRA-capable linear's weight (an adapter may target them all) and the largest
        layer's float32 ``B' A``."""
        weights = [mod.weight for mod, _ in self.lora._linears]
        return sum(w.numel() * w.element_size() for w in weights) + 4 * max(w.numel() for w in weights)

    @torch.no_grad()
    def _merge(self, adapter_id: int) -> None:
        for mod, lin in self.lora._linears:
            delta = self._delta(lin, adapter_id)
            if delta is None:
                continue
            w = mod.weight.data
            self._base[mod] = w.clone()
            w.copy_(delta.add_(w))  # float32 sum, one rounding to w's dtype; no other temporary
            self._after_write(mod)
        self.merged = adapter_id
        self.merges += 1
        # taken / left: info the first time each (an RL run merges once per adapter version)
        (logger.info if self.merges == 1 else logger.debug)(
            "LoRA: every sequence ran on adapter %d for %d steps: merged into the base weights, steps run as the "
            "base model (the one-adapter fast path; later merges are logged at debug)", adapter_id, self.after_steps)

    def _delta(self, lin, adapter_id: int) -> torch.Tensor | None:
        """``[out, in]`` float32: the adapter's ``B' A`` over the layer's slices, or None when it
        does not target the layer."""
        held = lin.adapters.get(adapter_id)
        if held is None:
            return None
        if lin.a_stack is None:  # dense path: (A_cat [sum r, in], B_cat [out, sum r])
            a_cat, b_cat = held
            return b_cat.float() @ a_cat.float()
        a, b, r = lin.a_stack[held].float(), lin.b_stack[held].float(), lin.max_rank
        delta = torch.empty((lin.out_features, lin.in_features), dtype=torch.float32, device=a.device)
        for i, (_, offset, size) in enumerate(lin.slices):
            torch.matmul(b[offset:offset + size], a[i * r:(i + 1) * r], out=delta[offset:offset + size])
        return delta

    @torch.no_grad()
    def restore(self) -> None:
        """Put the base weights back (nothing to do when no adapter is merged)."""
        if not self.merged:
            return
        for mod, base in self._base.items():
            mod.weight.data.copy_(base)
            self._after_write(mod)
        self._base = {}
        left = self.merged
        self.merged = 0
        self.restores += 1
        (logger.info if self.restores == 1 else logger.debug)(
            "LoRA: adapter %d taken out of the base weights (a step with the base model or another adapter, or a "
            "worker call): the per-row LoRA path runs until one adapter has the steps again (later: debug)", left)

    @staticmethod
    def _after_write(mod: nn.Module) -> None:
        mod.quant_method.process_weights_after_loading(mod)
