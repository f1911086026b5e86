"""The Llama decoder layer's CPU float32 decode step with as little host work as possible.

At batch 1 a SmolLM2-135M decode step is memory-bound: its linears stream 538 MB of float32
weights (~20 ms of the step on the 2-core Zen 5 machine). Everything else is host work around
small kernels: per layer nine module calls, the fused-kernel dispatch of
:mod:`rlserve.layers.fused_ops` (an environment read and device checks per call), the
wrappers of :mod:`rlserve.layers.cpu_fused` / :mod:`rlserve.layers.cpu_attention` (views,
dtype/contiguity checks, ctypes argument conversion) and the linear layers' method chain to
oneDNN. Measured with one thread (2026-12-02): an RMSNorm call costs 13-30 us of CPU for 576
floats of which the C kernel call is ~2 us; ~6-8 ms per step over 30 layers all told.

:func:`layer_forward` runs the same kernels, in the same order, with the same arguments as
``LlamaDecoderLayer.forward`` does on this path (fused (residual add +) RMSNorm, the packed
oneDNN linear, the fused q/k-norm + rotary + KV write, the paged decode attention kernel,
SiLU-and-mul), so its results are bit-equal; it only calls them directly. Per-step inputs
(positions, slots, block tables, context lengths, the thread count) are prepared once per
step by :func:`step_context` and shared by every layer. :func:`forward_layers` runs the
whole layer stack (this path or the modules), split into micro-batches of sequences on
several threads where the step's :mod:`rlserve.engine.cpu.cpu_microbatch` says so.

When it applies (:func:`step_context` returns ``None`` otherwise and the model runs its
modules): a pure decode step (one token per sequence), or on the CPU team a step with prefills
(:func:`_prefill_tables`: every query token a row over its own context, the attention by causal
query tiles, ``csrc/paged_prefill.c``; ``RLSERVE_CPU_STACK_PREFILL``), on float32 CPU tensors, the
fused C kernels and the paged decode kernel available and switched on, the ``torch`` attention
backend, a row count that runs on the team (:func:`rlserve.layers.cpu_gemm.takes`) or else on
the packed linear copy (:func:`rlserve.layers.cpu_linear.packed_rows`), and per layer (:func:`_layer_ok`, checked once): tensor parallel size 1,
unquantized linears with a packed copy (re-read every call, since weight updates rebuild it),
float32 contiguous norm weights, no module hooks. A layer whose attention kernel refuses the
shapes (non-zero return code) takes :meth:`rlserve.layers.attention.Attention.forward_cached`.
``RLSERVE_CPU_FAST_LAYER=0`` turns the fast path off (A/B runs).

With a CPU team in the process (:mod:`rlserve.layers.cpu_gemm`) and at most
:data:`rlserve.layers.cpu_gemm.MAX_ROWS` rows, the linears run on the team's packed copies and
the attention on the team (one sequence per chunk; the same per-sequence kernel, same bits),
the whole step on the calling thread with the team's workers (no micro-batches), and the whole
layer stack runs in one C call (:func:`stack_forward`, ``csrc/cpu_stack.c``: the same kernels in
the same order, so the same bits, without ~270 Python -> C calls per step; batch 1 / 16 decode
step 58.9 / 137.8 -> 48.5 / 121.1 ms of CPU, BENCHMARKS.md, issue 37, s16). With
``--batch-invariant`` the linears run the team's kernel at every row count (on the team when
one runs, else on this thread: :func:`rlserve.batch_invariant.cpu.fma_weight`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rlserve import envs
from rlserve.batch_invariant import cpu as bi_cpu, mode as bi_mode
from rlserve.batch_invariant.per_query import per_query_tables
from rlserve.engine.cpu import cpu_microbatch
from rlserve.layers import cpu_attention, cpu_fused, cpu_gemm, fused_ops
from rlserve.layers.activation import SiluAndMul
from rlserve.layers.attention import ATTENTION_BACKENDS, AttentionMetadata, get_attention_backend, \
    torch_paged_attention
from rlserve.layers.cpu_linear import packed_rows
from rlserve.layers.linear import ColumnParallelLinear, RowParallelLinear, UnquantizedLinearMethod

_ENABLED = [envs.RLSERVE_CPU_FAST_LAYER]
_STACK = [True]  # stack_forward on team decode steps (set_stack_enabled)


@dataclass
class StepContext:
    """Per-step inputs shared by every layer: kernel entry points, pointers and sizes.

    ``pos`` / ``slots``: ``[T]`` int64; ``bt``: ``[T, max_blocks]`` int32; ``sl``: ``[T]`` int32
    (held so the pointers stay valid for the step); ``nthreads``: torch's intra-op threads.
    """

    lib: object
    attn_fn: object
    pos: torch.Tensor
    slots: torch.Tensor
    bt: torch.Tensor
    sl: torch.Tensor
    nthreads: int
    team: bool = False  # linears and attention on the CPU team (rlserve.layers.cpu_gemm)
    prefill: bool = False  # a step with prefills: bt / sl per query token (_prefill_tables)

    def rows(self, a: int, b: int) -> "StepContext":
        """The context of rows ``a:b`` of this step (views, no copies)."""
        return StepContext(self.lib, self.attn_fn, self.pos[a:b], self.slots[a:b], self.bt[a:b], self.sl[a:b],
                           self.nthreads, self.team, self.prefill)


def set_enabled(on: bool) -> bool:
    """Switch the fast path on or off for this process; returns the previous setting."""
    prev = _ENABLED[0]
    _ENABLED[0] = bool(on)
    return prev


def _no_hooks(*mods: nn.Module) -> bool:
    return not any(m._forward_hooks or m._forward_pre_hooks for m in mods)


def _layer_ok(layer: nn.Module) -> bool:
    """Static conditions on one decoder layer, checked at its first decode step and cached on it
    as ``_cpu_fast_ok``.

    Nothing after model build changes them: a weight sync (every path ends in
    ``load_weights`` + ``process_weights_after_loading``) copies into the parameters in place,
    and sleep mode (:mod:`rlserve.engine.worker.sleep_memory`) copies in place or re-points
    ``param.data`` to a contiguous view of the same dtype and shape (a CPU level-1 sleep points
    it at a NaN broadcast while asleep, when no step runs, and back at the same tensor), so module types, quant
    methods, TP size, dtypes and contiguity stay as checked (tests/test_cpu_fast_layer.py
    checks sleep levels 1 and 2 and a sync). The packed weight copies, which each load
    rebuilds, are not cached here: :func:`layer_forward` reads them per call. Not seen: forward
    hooks registered after the first decode step (rlserve registers none); to hook a layer
    later, switch the path off (:func:`set_enabled`) or delete ``_cpu_fast_ok`` from its
    ``__dict__``."""
    ok = layer.__dict__.get("_cpu_fast_ok")
    if ok is None:
        a, m = layer.self_attn, layer.mlp
        cols, rows = (a.qkv_proj, m.gate_up_proj), (a.o_proj, m.down_proj)
        norms = [layer.input_layernorm, layer.post_attention_layernorm] + ([a.q_norm, a.k_norm] if a.qk_norm else [])
        ok = (all(type(lin).forward is ColumnParallelLinear.forward and not lin.gather_output for lin in cols)
              and all(type(lin).forward is RowParallelLinear.forward for lin in rows)
              and all(type(lin.quant_method) is UnquantizedLinearMethod and lin.tp_size == 1
                      and (lin.bias is None or lin.bias.dtype == torch.float32) for lin in cols + rows)
              and all(n.weight.dtype == torch.float32 and n.weight.is_contiguous() for n in norms)
              and type(m.act_fn) is SiluAndMul and a.head_dim <= 1024
              and _no_hooks(layer, a, m, a.attn, a.rotary_emb, m.act_fn, *cols, *rows, *norms))
        layer.__dict__["_cpu_fast_ok"] = ok
    return ok


def _prefill_tiles() -> bool:
    """Whether a direct step with prefills runs its attention by causal query tiles
    (``csrc/paged_prefill.c``, ``RLSERVE_CPU_PREFILL_TILES``) rather than one paged decode query
    per prompt token: not under ``--batch-invariant``, where a prompt token's attention must be
    a decoded token's, bit for bit."""
    return envs.RLSERVE_CPU_PREFILL_TILES and not bi_mode.enabled()


def _prefill_tables(meta: AttentionMetadata, T: int):
    """``(block_tables [T, max_blocks] int32, context lengths [T] int32)``: every query token of a
    step with prefills as a one-token sequence over its own context (position + 1), for the
    paged kernels (:func:`rlserve.batch_invariant.per_query.per_query_tables`), or ``None``
    where the knob ``RLSERVE_CPU_STACK_PREFILL`` is off, the step has more than
    :data:`rlserve.layers.cpu_gemm.MAX_ROWS` rows, or (without query tiles: :func:`_prefill_tiles`)
    its attention is too long for one decode query per token (:data:`STACK_PREFILL_MAX_CTX`)."""
    if not envs.RLSERVE_CPU_STACK_PREFILL or T > cpu_gemm.MAX_ROWS:
        return None
    if not _prefill_tiles():
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        # sum over query tokens of their context lengths: the keys the per-query kernel reads
        work = sum(q * s - q * (q - 1) // 2 for q, s in ((qsl[b + 1] - qsl[b], s) for b, s in enumerate(lens)))
        if work > STACK_PREFILL_MAX_CTX:
            return None
    return per_query_tables(meta)


# Without query tiles (RLSERVE_CPU_PREFILL_TILES=0, --batch-invariant), steps with prefills take
# the direct kernels (and, on the team, stack_forward) while the sum of
# their query tokens' context lengths is at most this (a 512-token prompt from scratch): each
# query token runs the paged decode kernel over its own context, which reads every key once per
# query token instead of once per block of queries. One layer of SmolLM2-135M (9 heads, 3 KV
# heads), one thread, CPU ms against the module path's gather + repeat + SDPA (flash) (AMD EPYC
# Zen 3, load 6-8, 2026-12-07 s18): 128 / 256 / 512 / 1,024 tokens 1.3-1.4 / 8.0 / 20.6 / 101 vs
# 1.0-1.1 / 6.0 / 14.6 / 37: up to 1.4x the CPU but on both cores of the team, not the calling
# thread alone; 2.7x at 1,024.
STACK_PREFILL_MAX_CTX = 512 * 513 // 2


def step_context(layers, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
    """A :class:`StepContext` when this step can take :func:`layer_forward` (see the module
    docstring), else ``None``. ``hidden``: the embeddings ``[T, hidden]``. A step with prefills
    only on the CPU team (:func:`_prefill_tables`: every query token as a one-token sequence)."""
    if not _ENABLED[0] or hidden.device.type != "cpu" or hidden.dtype != torch.float32 or hidden.dim() != 2:
        return None
    T = hidden.shape[0]
    team = cpu_gemm.takes(hidden)
    lo, hi = (1, cpu_gemm.MAX_ROWS) if team else packed_rows()  # the team's kernel at any row count it takes
    if T == 0 or not lo <= T <= hi:
        return None
    tables = None
    if meta.max_query_len != 1:
        tables = _prefill_tables(meta, T) if team else None
        if tables is None:
            return None
    elif T != meta.num_seqs:
        return None
    if not fused_ops.fused_enabled(hidden) or fused_ops.triton_enabled(hidden) or not cpu_fused.available():
        return None
    if ATTENTION_BACKENDS.get(get_attention_backend()) is not torch_paged_attention or not cpu_attention.available():
        return None
    if not all(_layer_ok(layer) for layer in layers):
        return None
    bt, sl = tables if tables is not None else (meta.block_tables, meta.seq_lens)
    return StepContext(cpu_fused._lib(), cpu_attention._load(), positions.to(torch.int64).contiguous(),
                       meta.slot_mapping.to(torch.int64).contiguous(), bt.to(torch.int32).contiguous(),
                       sl.to(torch.int32).contiguous(), torch.get_num_threads(), team, tables is not None)


# Relative cost of a row's linears and of one context token's attention, for balancing
# micro-batches: one core's float32 GEMM rate (~200 GFLOPS) over its rate of reading a paged
# KV cache (~12 GB/s) on the 2-core Zen 5 machine (BENCHMARKS.md, issue 22, ninth session).
_FLOPS_PER_KV_BYTE = 200e9 / 12e9


def _row_cost_tokens(layer) -> float:
    """A token's linears in context tokens of attention (the ``c0`` of ``q * c0 + seq_len``)."""
    a, m = layer.self_attn, layer.mlp
    numel = sum(lin.weight.numel() for lin in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj))
    kv_bytes = 2 * a.num_kv_heads * a.head_dim * 4  # float32 K and V of one token
    return 2.0 * numel / _FLOPS_PER_KV_BYTE / kv_bytes


def forward_layers(ctx: StepContext | None, layers, norm, positions: torch.Tensor, hidden: torch.Tensor,
                   meta: AttentionMetadata) -> torch.Tensor:
    """Every decoder layer and the final ``norm``: ``hidden`` ``[T, hidden]`` embeddings ->
    ``[T, hidden]`` normed hidden states, through :func:`layer_forward` when :func:`step_context`
    gave a ``ctx``, else through the layer modules.

    With a current :class:`rlserve.engine.cpu.cpu_microbatch.CPUMicroBatches` that splits this
    step, each micro-batch of whole sequences (their query tokens) runs the whole stack on its
    own thread with :meth:`AttentionMetadata.sequences` as its metadata (not when a block this
    step writes is shared with another sequence: :meth:`AttentionMetadata.writes_shared_block`), balanced by
    ``query_len * c0 + seq_len`` per sequence (``c0``: a token's linears in context tokens of
    attention, :func:`_row_cost_tokens`). Sequences never meet inside a layer, so the result
    is that of the whole step (bit-equal on the fast decode path, tests/test_cpu_microbatch.py).
    """
    def stack(sub: StepContext | None, pos: torch.Tensor, h: torch.Tensor, sub_meta: AttentionMetadata):
        residual = None
        for layer in layers:
            if sub is not None:
                h, residual = layer_forward(sub, layer, pos, h, residual, sub_meta)
            else:
                h, residual = layer(pos, h, residual, sub_meta)
        return norm(h, residual)[0]

    if hidden.device.type == "cpu" and len(layers) and cpu_microbatch.current() is not None:
        qsl = meta.query_start_loc_cpu

        def run(a: int, b: int) -> torch.Tensor:
            t0, t1 = qsl[a], qsl[b]
            return stack(None if ctx is None else ctx.rows(t0, t1), positions[t0:t1], hidden[t0:t1],
                         meta.sequences(a, b))

        c0 = _row_cost_tokens(layers[0])
        out = cpu_microbatch.split(run, [(qsl[i + 1] - qsl[i]) * c0 + n for i, n in enumerate(meta.seq_lens_cpu)],
                                   hidden.shape[0], veto=meta.writes_shared_block)
        if out is not None:
            return out
    if (ctx is not None and ctx.team) or (ctx is None and cpu_gemm.takes(hidden)):
        # inline on this thread while another program holds a core (pure decode steps and the
        # rest back off apart: cpu_gemm.GUARD_KINDS)
        with cpu_gemm.step_guard("decode" if ctx is not None and not ctx.prefill else "other"):
            out = _STACK[0] and ctx is not None and ctx.team and stack_forward(ctx, layers, hidden)
            if out:
                return norm(*out)[0]
            return stack(ctx, positions, hidden, meta)
    return stack(ctx, positions, hidden, meta)


def set_stack_enabled(on: bool) -> bool:
    """Switch :func:`stack_forward` (the whole layer stack in one C call) on or off for this
    process (A/B runs, tests); returns the previous setting."""
    prev = _STACK[0]
    _STACK[0] = bool(on)
    return prev


def _stack_static(layers):
    """``(ints [L, 6] int64, flts [L, 4] float32)`` of ``csrc/cpu_stack.c`` for ``layers`` (sizes,
    epsilons, the attention scale: fixed once the model is built), cached on the first layer."""
    cached = layers[0].__dict__.get("_cpu_stack_static")
    if cached is not None and cached[0] == len(layers):
        return cached[1], cached[2]
    ints, flts = [], []
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        ints.append([a.qkv_proj.weight.shape[0], m.gate_up_proj.weight.shape[0], a.num_heads, a.num_kv_heads,
                     a.head_dim, a.rotary_emb.cos_cache.shape[-1]])
        flts.append([layer.input_layernorm.eps, layer.post_attention_layernorm.eps,
                     a.q_norm.eps if a.qk_norm else 0.0, a.attn.scale])
    out = (torch.tensor(ints, dtype=torch.int64), torch.tensor(flts, dtype=torch.float32))
    layers[0].__dict__["_cpu_stack_static"] = (len(layers), *out)
    return out


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def stack_forward(ctx: StepContext, layers, hidden: torch.Tensor):
    """Every decoder layer of a team decode step (:func:`step_context` gave ``ctx`` with
    ``ctx.team``) in one C call (``csrc/cpu_stack.c``: the kernels :func:`layer_forward` calls, in
    its order, with its arguments, so the same bits): ``hidden`` ``[T, hidden]`` embeddings ->
    ``(last layer's MLP output, residual)``, each ``[T, hidden]`` float32, for the final norm;
    ``None`` where :func:`layer_forward` would not run the team's kernels on every layer (a
    linear without a team copy, a KV cache that is not contiguous float32) or the attention
    kernel refuses the step (the layers then run one by one).

    Raises:
        MemoryError: the C code could not allocate its work rows.
    """
    if _linear is None or not len(layers):
        return None
    ptrs = []
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        packs = _team_packs(a, m)
        kc, vc = a.attn.k_cache, a.attn.v_cache
        if packs is None or kc is None or not (kc.is_contiguous() and vc.is_contiguous() and kc.dtype == torch.float32
                                               and vc.dtype == torch.float32):
            return None
        rope = a.rotary_emb
        cos_sin = (rope.cos_cache.data_ptr(), rope.sin_cache.data_ptr())
        ptrs.append([layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                     a.q_norm.weight.data_ptr() if a.qk_norm else 0, a.k_norm.weight.data_ptr() if a.qk_norm else 0,
                     packs[0][0].data_ptr(), _ptr(a.qkv_proj.bias), packs[1][0].data_ptr(), _ptr(a.o_proj.bias),
                     packs[2][0].data_ptr(), _ptr(m.gate_up_proj.bias), packs[3][0].data_ptr(),
                     _ptr(m.down_proj.bias), kc.data_ptr(), vc.data_ptr(), *cos_sin])
    ints, flts = _stack_static(layers)
    hidden = hidden.contiguous()
    h, res = torch.empty(hidden.shape, dtype=torch.float32), torch.empty(hidden.shape, dtype=torch.float32)
    rc = cpu_gemm.decode_stack_call(cpu_fused.kernel_table(), torch.tensor(ptrs, dtype=torch.int64), ints, flts,
                                    hidden, h, res, ctx.pos, ctx.slots, ctx.bt, ctx.sl, kc.shape[1], ctx.nthreads,
                                    prefill=ctx.prefill and _prefill_tiles())
    if rc == 2:
        raise MemoryError("llama_cpu.stack_forward: no memory for the step's work rows")
    return (h, res) if rc == 0 else None


_linear = torch.ops.mkldnn._linear_pointwise.default if hasattr(torch.ops.mkldnn, "_linear_pointwise") else None


def _norm(ctx: StepContext, norm, x: torch.Tensor, residual: torch.Tensor | None):
    """The fused (residual add +) RMSNorm kernel: ``(norm(x + residual), x + residual)``."""
    out = torch.empty(x.shape, dtype=torch.float32)
    res_out = None if residual is None else torch.empty(x.shape, dtype=torch.float32)
    cpu_fused.rms_norm_rows(ctx.lib, x, residual, norm.weight, out, res_out, norm.eps, ctx.nthreads)
    if residual is None:
        return out, x
    return out, res_out


def _team_packs(attn, mlp):
    """``((team copy, out features), ...)`` of the layer's qkv, o, gate_up and down projections,
    or None when one has no team copy (built at load only while a team runs)."""
    out = []
    for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        w = cpu_gemm.team_weight(lin)
        if w is None:
            return None
        out.append((w, lin.weight.shape[0]))
    return out


def _fma_packs(lins):
    """``((FMA-chain copy, out features), ...)`` of ``lins`` for --batch-invariant
    (:func:`rlserve.batch_invariant.cpu.fma_weight`: the team's copies, or the mode's own), or
    None when the kernel does not apply."""
    out = []
    for lin in lins:
        w = bi_cpu.fma_weight(lin)
        if w is None:
            return None
        out.append((w, lin.weight.shape[0]))
    return out


def layer_forward(ctx: StepContext, layer, positions: torch.Tensor, hidden: torch.Tensor,
                  residual: torch.Tensor | None, meta: AttentionMetadata):
    """``LlamaDecoderLayer.forward(positions, hidden, residual, meta)`` for a step that
    :func:`step_context` accepted: ``hidden``, ``residual`` ``[T, hidden]`` float32 (residual
    ``None`` for the first layer) -> ``(mlp output, residual)``, bit-equal to the module path.
    Falls back to the module call when a linear has no packed copy (e.g. packing off).
    (``None in packs`` would compare tensors with ``None``: torch raises and catches a
    TypeError with a C++ backtrace, ~5% of a batch-1 step; hence the ``is None`` test.)"""
    a, m = layer.self_attn, layer.mlp
    qkv_l, o_l, gu_l, down_l = a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj
    team = ctx.team and _team_packs(a, m)
    fma = team or (bi_mode.enabled() and _fma_packs((qkv_l, o_l, gu_l, down_l)))
    if fma:  # a step on the CPU team, or --batch-invariant: the team's FMA-chain kernel (rlserve.layers.cpu_gemm)
        packs = fma
    else:
        packed = UnquantizedLinearMethod.packed_weight
        packs = (packed(qkv_l), packed(o_l), packed(gu_l), packed(down_l))
    attn = a.attn
    kc, vc = attn.k_cache, attn.v_cache
    if _linear is None or any(p is None for p in packs) or kc is None or not (kc.is_contiguous() and vc.is_contiguous()
                                                               and kc.dtype == torch.float32 and vc.dtype == kc.dtype):
        return layer(positions, hidden, residual, meta)
    hidden = hidden.contiguous()
    if fma:

        def lin(x, p, b, *_):
            return cpu_gemm.linear(x, p[0], p[1], b)
    elif bi_mode.enabled():  # --batch-invariant without the C kernel: one row runs as two (rlserve.batch_invariant.cpu)
        def lin(x, p, b, *_):
            return bi_cpu.packed_linear(x, p, b)
    else:
        lin = _linear
    h, residual = _norm(ctx, layer.input_layernorm, hidden, residual)
    qkv = lin(h, packs[0], qkv_l.bias, "none", [], "")
    T = qkv.shape[0]
    H, Hkv, D = a.num_heads, a.num_kv_heads, a.head_dim
    rope = a.rotary_emb
    q = torch.empty((T, H * D), dtype=torch.float32)
    qkn = (a.q_norm.weight, a.k_norm.weight, a.q_norm.eps) if a.qk_norm else (None, None, 0.0)
    cpu_fused.qkv_rope_write_rows(ctx.lib, qkv, ctx.pos, rope.cos_cache, rope.sin_cache, qkn[0], qkn[1], q, kc, vc,
                                  ctx.slots, H, Hkv, D, qkn[2], ctx.nthreads)
    o = torch.empty((T, H * D), dtype=torch.float32)
    if team:
        rc = cpu_gemm.paged_decode_call(q, kc, vc, ctx.bt, ctx.sl, o, H, Hkv, D, attn.scale,
                                        prefill=ctx.prefill and _prefill_tiles())
    else:
        rc = cpu_attention.call(ctx.attn_fn, q, kc, vc, ctx.bt, ctx.sl, o, H, Hkv, D, attn.scale, ctx.nthreads)
    if rc != 0:
        o = attn.forward_cached(q, meta)
    hidden = lin(o, packs[1], o_l.bias, "none", [], "")
    h, residual = _norm(ctx, layer.post_attention_layernorm, hidden, residual)
    gu = lin(h, packs[2], gu_l.bias, "none", [], "")
    d = gu.shape[1] // 2
    s = torch.empty((T, d), dtype=torch.float32)
    cpu_fused.silu_mul_rows(ctx.lib, gu, s, ctx.nthreads)
    return lin(s, packs[3], down_l.bias, "none", [], ""), residual
