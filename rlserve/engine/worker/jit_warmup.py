"""What the warm-up launches so that no Triton kernel compiles in the middle of serving (issue 37).

Triton compiles a kernel once per *key* of its launches: each ``tl.constexpr`` value, each integer
argument's being 1 or divisible by 16 and each pointer's 16-byte alignment (those the kernel does not list
in ``do_not_specialize`` / ``do_not_specialize_on_alignment``), and the launch options. A key first seen
after the server is ready compiles in the engine's step: 0.5-0.9 s during which every stream stalls
(BENCHMARKS.md H25, session 21's H100 c256 run). The kernels leave the per-step integers and per-step
pointers unspecialised (the comments above each kernel say which and why); what still follows the step
are constexprs chosen from its size, which the model runner's warm-up (:meth:`ModelRunner._warm_forwards`,
recorded and compiled in parallel by :mod:`rlserve.engine.worker.triton_precompile` first) launches here:

* :func:`forward_inputs`: one eager forward per launch class of the fused q/k-norm + rotary + KV-write
  kernels (``HEADS`` / ``TOKENS`` per program, PDL for one row: :func:`rlserve.layers.fused_ops.qkv_launch_class`),
  besides the 16- and 1,024-token forwards of before (now several sequences where ``max_model_len`` is shorter
  than the count: a step of more tokens than one sequence holds has them);
* :func:`warm_decode_attention`: the Triton decode attention in each variant of
  :func:`rlserve.layers.triton_attention.decode_variants` (split or not, ordered or not, each merge width),
  which the decode CUDA graphs' capture does not all reach (their split count is the one of
  ``max_model_len``; a mixed step's decode rows and eager decode steps plan theirs from the real lengths);
* :func:`warm_weight_sync`: the weight sync's one-launch copy + checksum kernel
  (:func:`rlserve.transfer.multi_tensor.warmup`), which the first weight update would otherwise compile;
* :func:`moe_layers`: the routed-experts layers whose fused-MoE kernels the warm-up compiles
  (:func:`rlserve.layers.moe_kernels.warm_up`), and :func:`routed_experts_off`, under which a MoE model's
  forwards can be recorded by the precompile (its routing would index with uninitialized ids).

``benchmarks/jit_misses.py`` and ``tests/gpu/test_jit_misses_gpu.py`` count what still compiles after ready.
"""

from __future__ import annotations

import contextlib

import torch


def _first_attention(model: torch.nn.Module):
    from rlserve.layers.attention import Attention

    return next((m for m in model.modules() if isinstance(m, Attention) and m.k_cache is not None), None)


def prefill_token_counts(model: torch.nn.Module, device: torch.device) -> list[int]:
    """Token counts of the warm-up's forwards, ascending: 16, 1,024, and the smallest count of each qkv
    launch class (:func:`rlserve.layers.fused_ops.qkv_warm_token_counts` for the first attention layer's
    query + key heads on ``device``)."""
    from rlserve.layers import fused_ops

    counts = {16, 1024}
    att = _first_attention(model)
    if att is not None:
        counts |= set(fused_ops.qkv_warm_token_counts(att.num_heads + att.num_kv_heads, device))
    return sorted(counts)


def forward_inputs(model: torch.nn.Module, max_len: int, max_tokens: int, block_size: int, device: torch.device):
    """``(input_ids [T] int64, positions [T] int64, meta)`` of each of the warm-up's forwards, one per
    :func:`prefill_token_counts` entry ``n`` (at most ``max_tokens``, the step budget): ``n`` tokens as
    sequences of at most ``max_len`` tokens (the cache's slots and ``max_model_len``; a step's tokens may
    come from several sequences), each a whole prompt over blocks ``0..``, every slot -1 (nothing written).
    One token is a decode forward (``max_query_len`` 1): the one-row decode path's kernels."""
    from rlserve.layers.attention import AttentionMetadata

    for n in sorted({min(n, max_tokens) for n in prefill_token_counts(model, device)}):
        lens = [max_len] * ((n - 1) // max_len) + [n - max_len * ((n - 1) // max_len)]
        meta = AttentionMetadata.build(lens, lens, [list(range(-(-m // block_size))) for m in lens], block_size, device)
        meta.slot_mapping.fill_(-1)
        pos = torch.cat([torch.arange(m, dtype=torch.long) for m in lens]).to(device)
        yield torch.zeros(n, dtype=torch.long, device=device), pos, meta


def warm_decode_attention(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """With the Triton attention backend: launch its decode attention on the first attention layer's cache
    once per :func:`rlserve.layers.triton_attention.decode_variants` entry (rows of context 1 in block 0,
    which the cache holds; queries of zeros in ``dtype``; nothing is written). Returns the launches (0 with
    another backend or no cache bound)."""
    from rlserve.layers.attention import AttentionMetadata, get_attention_backend

    att = _first_attention(model)
    if att is None or get_attention_backend() != "triton":
        return 0
    from rlserve.layers import triton_attention as ta

    page = att.k_cache.shape[1]
    n = 0
    for rows, splits in ta.decode_variants():
        meta = AttentionMetadata.build([1] * rows, [1] * rows, [[0]] * rows, page, device)
        q = torch.zeros(rows, att.num_heads, att.head_dim, dtype=dtype, device=device)
        ta.triton_paged_attention(q, att.k_cache, att.v_cache, meta, att.scale, num_splits=splits,
                                  **att.kv_scale_kwargs())
        n += 1
    return n


def warm_weight_sync(device: torch.device) -> int:
    """Launch the weight sync's copy + checksum kernel in each of its four variants on ``device``
    (:func:`rlserve.transfer.multi_tensor.warmup`: int64 chunk tables, ``COPY`` x ``CHECK``), so that
    the first weight update compiles nothing and the compile runs beside the model's in the parallel
    precompile (before, the receiver compiled them when it connected, one after the other, holding the
    GIL on the engine process). Returns the launches (0 without CUDA or Triton)."""
    from rlserve.transfer import multi_tensor

    return multi_tensor.warmup(device)


def moe_layers(model: torch.nn.Module, device: torch.device) -> list:
    """The routed-experts layers (:class:`rlserve.layers.moe.FusedMoE`) of ``model`` whose fused-MoE Triton kernels
    the warm-up compiles: on CUDA with Triton, where the experts run the Triton kernels (``RLSERVE_MOE_BACKEND``
    unset or ``triton``, or any fp8 experts); empty otherwise (a dense model, the CPU, the torch backend)."""
    from rlserve import envs
    from rlserve.layers import moe_kernels
    from rlserve.layers.moe import FusedMoE

    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    backend = envs.RLSERVE_MOE_BACKEND
    if (not layers or torch.device(device).type != "cuda" or not moe_kernels.triton_runs_on("cuda")
            or (backend not in (None, "triton") and not any(m.fp8 for m in layers))):
        return []
    return layers


def _no_experts(x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x)


@contextlib.contextmanager
def routed_experts_off(model: torch.nn.Module):
    """Within it every routed-experts layer (:class:`rlserve.layers.moe.FusedMoE`) of ``model`` returns zeros
    (``x [T, H]`` -> zeros ``[T, H]``, x's dtype and device) without routing, its experts or its TP all-reduce
    (on every rank alike); the rest of the forward runs as it does. For the precompile's recording pass
    (:meth:`rlserve.engine.worker.model_runner.ModelRunner._record_pass`), where no Triton kernel runs: the routing
    kernel's output would be uninitialized expert ids that torch ops then index with. What the experts compile is
    recorded apart (:func:`rlserve.layers.moe_kernels.warm_up`, whose ids torch builds). Each layer's own
    ``forward`` is back on exit (also on an exception). Yields the number of layers switched off."""
    from rlserve.layers.moe import FusedMoE

    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    for m in layers:
        m.forward = _no_experts  # an instance attribute: ahead of FusedMoE.forward for this module only
    try:
        yield len(layers)
    finally:
        for m in layers:
            del m.forward
