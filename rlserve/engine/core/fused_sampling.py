"""Sampling in one pass over the logits (two small Triton kernels) for the common case.

The general :class:`rlserve.engine.core.sampler.Sampler` makes ~8 passes over the ``[B, V]``
float32 logits (log-softmax, a copy, temperature, softmax, the exponential draw, clamp,
division, argmax): at batch 256 and a 151,936-token vocabulary that is ~2.4 GB of traffic
and a dozen launches per step. When no row needs anything but temperature (no penalties,
no ``logit_bias`` / ``allowed_token_ids``, no ``min_tokens`` still active, no top-k / top-p / min-p, no top logprobs), a token is
``argmax(logits / T + Gumbel noise)`` (Gumbel-max, the same distribution as the sampler's
exponential race ``argmax(probs / Exp(1))``; ``T = 0``: plain argmax, the first index on
ties) and its raw logprob is ``logit - logsumexp(logits)``; both come out of one read of
the logits (:func:`rlserve.layers.fused_kernels._sample_partial_kernel` over vocabulary
chunks, then a per-row merge).

Randomness: Philox (``tl.randint4x``: four draws per counter; in each block of ``_BLOCK``
entries starting at ``v0``, entry ``v`` takes draw ``(v - v0) // (_BLOCK / 4)`` of counter
``offset + v0 / 4 + (v - v0) % (_BLOCK / 4)`` -- the kernel's docstring has the map). A row with a ``seed`` is keyed by :func:`~rlserve.engine.sampling_params.derive_seed`
``(seed, len(output_token_ids))`` at offset 0, so its token depends only on its own logits,
seed and position, as in the general path. Unseeded rows share a key drawn per call from a
``random.Random`` seeded with the sampler's ``generator_seed`` (reproducible per engine seed,
no device sync), at offset ``row * V`` (disjoint counters per row). Greedy rows draw
nothing. The draws differ from the general path's (another generator), not their
distribution.

The vocabulary chunk count (the partial kernel's grid, hence the order in which the chunks'
log-sum-exps merge) follows the batch size; in the batch-invariant mode it follows ``V`` only
(:mod:`rlserve.batch_invariant`; measured on the H100: a row's logprob moved by one float32 ulp
between batch 1 and batch 16 at V = 151,936).

Used on CUDA tensors (or CPU tensors where ``fused_ops`` runs kernels on CPU, for the
interpreter tests) unless ``RLSERVE_FUSED_SAMPLER=0`` (read at import) or
:func:`set_fused_sampler` turns it off.
"""

from __future__ import annotations

import random

import torch

from rlserve import envs
from rlserve.batch_invariant import mode as bi_mode
from rlserve.engine.core import lean_sampling
from rlserve.engine.sampling_params import SamplingParams, derive_seed
from rlserve.h2d import to_device
from rlserve.layers import fused_ops

_ENABLED = [envs.RLSERVE_FUSED_SAMPLER]
_BLOCK = 2048
# Programs per call: at least this many in all, and no program looping over more than
# _MAX_BLOCKS_PER_PROGRAM blocks. The partial kernel is bound by its per-element work (Philox,
# two logs, an exp) and by the latency of its loop, not by bytes: with ~2 programs per SM
# (the earlier plan) the whole offline workload spent 158 us per call in it (1041 calls,
# one H200, 2026-12-02) against ~20-40 us to read the logits once.
_TARGET_PROGRAMS = 2048
_MAX_BLOCKS_PER_PROGRAM = 4


def set_fused_sampler(on: bool) -> bool:
    """Switch the one-pass sampler on or off (A/B benchmarks, tests); returns the previous
    setting."""
    prev = _ENABLED[0]
    _ENABLED[0] = bool(on)
    return prev


def runs_on(logits: torch.Tensor) -> bool:
    """Whether :func:`sample` runs on these logits: switched on, and Triton runs on their device."""
    return _ENABLED[0] and fused_ops.triton_enabled(logits)


def eligible(logits: torch.Tensor, params: list, output_token_ids: list[list[int]], vocab_size: int) -> bool:
    """Whether every row can be sampled by :func:`sample` (see the module docstring)."""
    if not runs_on(logits) or logits.shape[0] != len(params):
        return False
    return all(eligible_rows(params, output_token_ids, vocab_size))


def eligible_rows(params: list, output_token_ids: list[list[int]], vocab_size: int) -> list[bool]:
    """Per row, whether its own parameters let :func:`sample` take it (the device and the
    switch are :func:`eligible`'s)."""
    return [_row_ok(p, out, vocab_size) for p, out in zip(params, output_token_ids)]


def _row_ok(p, out: list[int], vocab_size: int) -> bool:
    if p.logprobs or lean_sampling.processes(p, out):
        return False
    return p.greedy or not (0 < p.top_k < vocab_size or p.top_p < 1.0 or p.min_p > 0.0)


def sample(logits: torch.Tensor, params: list, output_token_ids: list[list[int]], vocab_size: int,
           rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row (rows must be :func:`eligible`).

    Args:
        logits: ``[B, >= vocab_size]`` float logits, any float dtype (read as float32 in the
            kernels; columns past ``vocab_size`` are ignored; last dim contiguous).
        params / output_token_ids: per row, as in ``SamplingMetadata``.
        vocab_size: ``V``.
        rng: the key source of unseeded rows (advanced once per call).

    Returns:
        ``(token_ids LongTensor [B], logprobs FloatTensor [B])`` on the logits' device: raw
        logprobs (``log_softmax`` of the logits) of the chosen tokens. No host sync.
    """
    B = logits.shape[0]
    dev = logits.device
    V = int(vocab_size)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    step_key = rng.getrandbits(63)
    temps, keys, offs = [], [], []
    for i, (p, out) in enumerate(zip(params, output_token_ids)):
        temps.append(0.0 if p.greedy else float(p.temperature))
        if p.seed is None:
            keys.append(step_key)
            offs.append((i * V) & 0xFFFFFFFF)
        else:
            keys.append(derive_seed(p.seed, len(out)))
            offs.append(0)
    temp_t = to_device(temps, torch.float32, dev)
    ko = to_device(keys + offs, torch.int64, dev)
    tok = torch.empty(B, dtype=torch.int64, device=dev)
    lp = torch.empty(B, dtype=torch.float32, device=dev)
    if B == 0:
        return tok, lp
    n_blocks = -(-V // _BLOCK)
    if bi_mode.enabled():  # --batch-invariant: the chunking (the log-sum-exp's merge order) by V only
        S = -(-n_blocks // _MAX_BLOCKS_PER_PROGRAM)
    else:
        S = max(1, min(n_blocks, max(-(-_TARGET_PROGRAMS // B), -(-n_blocks // _MAX_BLOCKS_PER_PROGRAM))))
    chunk = -(-n_blocks // S) * _BLOCK
    S = -(-V // chunk)
    part_f = torch.empty(B, S, 3, dtype=torch.float32, device=dev)
    part_i = torch.empty(B, S, dtype=torch.int32, device=dev)
    k = fused_ops._kernels()
    k._sample_partial_kernel[(B, S)](
        logits, logits.stride(0), V, chunk, temp_t, ko[:B], ko[B:], part_f, part_i, S,
        BLOCK=_BLOCK, FAST_LOG=dev.type == "cuda", num_warps=8,
    )
    # S_PAD is a compile-time size: one value for every batch (the chunk count of B = 1)
    # keeps this kernel to one compilation
    k._sample_reduce_kernel[(B,)](
        logits, logits.stride(0), part_f, part_i, S, tok, lp, S_PAD=max(2, 1 << (n_blocks - 1).bit_length()),
        num_warps=1,
    )
    return tok, lp


def warm_up(device: torch.device | str, vocab_size: int,
            dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """Compile the one-pass sampler's kernels now (engine startup) instead of in the first
    request's step: one greedy and one temperature row over zero logits of each of ``dtypes``
    (the logits' dtypes the engine will hand over: its model dtype) on ``device``.
    Returns whether the kernels ran (False where :func:`eligible` would be False)."""
    for dtype in dict.fromkeys(dtypes):
        logits = torch.zeros(2, int(vocab_size), dtype=dtype, device=device)
        if not (_ENABLED[0] and fused_ops.triton_enabled(logits)):
            return False
        sample(logits, [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)], [[], []], vocab_size,
               random.Random(0))
    return True
