"""Batch-invariant, deterministic rollouts (``--batch-invariant``, ``VLLM_BATCH_INVARIANT=1``,
``LLM(batch_invariant=True)``): a request's tokens and logprobs are bitwise the same whatever
else shares its steps (batch size, neighbours, their place), with or without a prefix-cache
hit, after a recompute, with CPU micro-batches or overlap on or off; seeded sampling
(temperature > 0) draws from a per-request, per-position generator, so a seeded request
repeats across runs and restarts at the same weights.

- :mod:`.mode`: the switch (the model runner sets it per step from its config).
- :mod:`.cpu`: the CPU forms (where a CPU step depended on its batch and what replaced it).
- :mod:`.gpu`: the CUDA forms (a Triton GEMM with a reduction order fixed per (N, K)).
- :mod:`.per_query`: prefill query tokens as decode rows (the attention of both devices).
- :mod:`.ops`: the device dispatch the layers call.
- :mod:`.reference`: :func:`reference_logprobs`, the trainer-side reference (HF weights in,
  rlserve's kernels in this mode): bitwise the server's logprobs; :func:`mismatch` measures
  KL over a rollout batch.

Docs: ``docs/batch_invariant.md``.
"""

from __future__ import annotations

__all__ = ["BatchInvariantReference", "reference_logprobs", "mismatch"]


def __getattr__(name: str):
    if name in __all__:
        from rlserve.batch_invariant import reference

        return getattr(reference, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
