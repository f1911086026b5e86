"""Piecewise CUDA graphs for prefill and mixed steps (vLLM's piecewise mode; issue 37).

An eager prefill step of Qwen3-0.6B launches 9 kernels a layer (``benchmarks/kernel_count.py
--prefill``: two add + RMSNorm, four GEMMs, the q/k-norm + rotary + KV-write kernel, SiLU-and-mul,
attention; no host sync), ~250 a step, each behind Python: the H100 traces of sessions 16-17 fit
such a step as ~10.7 ms + 0.74 us a token, most of it the host launching a step whose GPU work
(~4 ms for 2048 tokens) is shorter. Here everything but attention is replayed from CUDA graphs:

- token buckets (``RLSERVE_PREFILL_CUDA_GRAPHS``: ``auto``, the default since session 21, or ``1`` for
  :data:`DEFAULT_SIZES`, or a list; ``0``: off), capped at the step's token bound; a step of ``T`` tokens replays the smallest bucket ``Tb >= T``, rows
  ``T..Tb`` padding (token ids and positions left from earlier steps, KV slot -1: the fused KV write
  skips them; every op outside attention is row-wise, so they never reach a real row);
- per bucket ``L + 1`` graphs for ``L`` layers, all captured into one memory pool: piece 0 is the
  embedding, layer 0's input norm, its QKV projection and the fused q/k-norm + rotary + KV write
  (:meth:`rlserve.models.llama.LlamaAttention.norm_rope_write`); piece ``i`` is layer ``i - 1``'s
  ``o_proj``, post-attention norm and MLP, then layer ``i``'s input norm, QKV and KV write; piece
  ``L`` ends with the final norm. The same modules in the same order as ``LlamaDecoderLayer.forward``
  (its ``T > 1`` branch);
- between pieces the layer's attention runs eagerly (``Attention.forward_cached`` with the step's
  real metadata: prefill kernel, a mixed step's decode rows in the decode kernel) on the first
  ``T`` rows of the bucket's static query buffer, its output written into the static buffer the next
  piece reads (``out=``). A step launches ``L + 1`` graph replays and ``L`` attention calls instead of ~9 ``L``
  kernels.

What the graphs bake in (as the decode graphs, :mod:`rlserve.engine.worker.cuda_graph`): parameter
storage (weight updates copy in place), the KV-cache tensors (the runner drops these graphs when it
re-allocates the cache), the fused kernels' choices for ``Tb`` rows. Which models: dense Llama-family
decoders (:func:`supported`) on one GPU, unquantized linears, no LoRA, not ``--batch-invariant``;
the runner checks per step (:meth:`ModelRunner._prefill_with_graph`). Without CUDA (tests) the pieces
run as plain calls on the static buffers (``emulate``): the padding and buffer plumbing, not the capture.

What the default (``auto``) was checked against (session 21; :func:`why_off` says where they stay off):
sleep mode keeps them, as the decode graphs (the weights and the KV cache wake at the same addresses,
:mod:`rlserve.engine.worker.sleep_memory`; the graph pool is not in the sleep arenas, so it stays
allocated while asleep: :func:`reserve_bytes`' few hundred MiB); a weight sync copies into the
parameters in place, which the pieces read directly (no copy is captured); LoRA, MoE, quantized (fp8)
and tensor-parallel linears, ``--batch-invariant`` and ``--enforce-eager`` leave them off; an fp8 KV
cache leaves them off under ``auto`` until a GPU run checks it (``1`` turns them on there: the fused
KV write reads the scales from their tensors, which ``--calculate-kv-scales`` sets in place after an
eager first step); under ``auto`` nothing is reserved and they stay off where they would take more than
:data:`MAX_KV_SHARE` of the KV cache's budget (:func:`kv_reserve`); the buckets are capped at the most tokens a step can hold
(``max_num_batched_tokens``, ``max_num_seqs x max_model_len``).
"""

from __future__ import annotations

import logging
import math
import time

import torch
from torch import nn

from rlserve import envs
from rlserve.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)

#: token buckets of ``RLSERVE_PREFILL_CUDA_GRAPHS=auto`` (the default) and ``=1`` (vLLM's default compile
#: sizes are powers of two too)
DEFAULT_SIZES = (256, 512, 1024, 2048, 4096, 8192)


def parse_sizes(spec, max_tokens: int, what: str = "RLSERVE_PREFILL_CUDA_GRAPHS") -> list[int]:
    """The buckets of an ``RLSERVE_PREFILL_CUDA_GRAPHS`` value (``what``: where it was set, for errors):
    ``None`` / ``""`` / ``"0"`` / ``[]``: none (off); ``"1"`` / ``"auto"``: :data:`DEFAULT_SIZES`; else the counts, a
    list or a comma-separated string (:func:`rlserve.envs.positive_int_list`). Capped at ``max_tokens``
    (which is added when a bucket was above it), sorted, unique.

    Raises:
        ValueError: a count that is not a positive integer (the message names ``what``)."""
    if not spec or (isinstance(spec, str) and spec.strip() == "0"):
        return []
    if isinstance(spec, str) and spec.strip() in ("1", "auto"):
        sizes = list(DEFAULT_SIZES)
    else:
        sizes = envs.positive_int_list(what, spec)
    return sorted({min(n, max_tokens) for n in sizes})


def supported(model: nn.Module) -> str | None:
    """Why ``model`` cannot run piecewise (None: it can): a Llama-family model whose layers are plain
    ``LlamaDecoderLayer`` with a dense ``LlamaMLP``, unquantized linears on one rank, no module hooks."""
    from rlserve.layers.linear import UnquantizedLinearMethod
    from rlserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel

    if not isinstance(model, LlamaForCausalLM) or type(model.model) is not LlamaModel:
        return f"{type(model).__name__} is not a dense Llama-family model"
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        if type(layer) is not LlamaDecoderLayer or type(m) is not LlamaMLP:
            return "a layer that is not a dense LlamaDecoderLayer"
        lins = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
        if any(type(lin.quant_method) is not UnquantizedLinearMethod or lin.tp_size != 1 for lin in lins):
            return "quantized or tensor-parallel linears"
        mods = (layer, a, m, a.attn, a.rotary_emb, m.act_fn, layer.input_layernorm, layer.post_attention_layernorm,
                *lins)
        if any(x._forward_hooks or x._forward_pre_hooks for x in mods):
            return "module hooks"
    return None


def why_off(runner, sizes: list[int], kv_cache: bool = True) -> str | None:
    """Why a :class:`~rlserve.engine.worker.model_runner.ModelRunner` runs its prefill steps eagerly
    (None: it may capture piecewise graphs of ``sizes``): no buckets (``RLSERVE_PREFILL_CUDA_GRAPHS=0``),
    CUDA graphs off (not CUDA, ``enforce_eager``, a backend or TP size without them;
    ``config.extra["prefill_cuda_graphs_emulate"]``, for tests, stands in for them off CUDA),
    ``--batch-invariant``, LoRA, no KV cache yet, fused kernels off, an fp8 KV cache without the
    Triton kernels (the CPU's fused KV write has no fp8) or, under the default ``auto``
    (``runner._prefill_graphs_auto()``), any fp8 KV cache, a model :func:`supported` refuses.
    ``kv_cache=False``: whether they will be captured once the KV cache is there (the KV sizing's
    question, :func:`reserve_bytes`)."""
    from rlserve.layers import fused_ops, kv_quant

    cfg = runner.config
    emulate = bool((getattr(cfg, "extra", None) or {}).get("prefill_cuda_graphs_emulate"))
    if not sizes:
        return "off (RLSERVE_PREFILL_CUDA_GRAPHS=0)"
    if not (runner.use_cuda_graphs or (emulate and cfg is not None and not cfg.enforce_eager)):
        return "CUDA graphs are off" + (" (--enforce-eager)" if getattr(cfg, "enforce_eager", False) else "")
    if runner.batch_invariant:
        return "--batch-invariant"
    if getattr(cfg, "enable_lora", False):
        return "LoRA adapters"
    if kv_cache and not runner.kv_caches:
        return "no KV cache yet"
    probe = torch.empty(0, dtype=runner.dtype, device=runner.device)
    if not fused_ops.fused_enabled(probe):
        return "fused kernels off"
    if kv_quant.is_fp8(runner.kv_cache_dtype):
        if not fused_ops.triton_enabled(probe):
            return "an fp8 KV cache without the Triton kernels"
        if runner._prefill_graphs_auto():
            return ("an fp8 KV cache (not yet checked on a GPU with the graphs: RLSERVE_PREFILL_CUDA_GRAPHS=1 "
                    "turns them on)")
    return supported(runner.model)


def bucket_buffers(size: int, q_size: int, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype, int]]:
    """The static buffers of one :class:`_Bucket` of ``size`` rows, ``{name: (shape, dtype, fill)}``: what
    the bucket allocates and what :func:`bucket_buffer_bytes` counts (one description, so the two cannot
    drift). Token ids, positions and KV slots ``[size]`` int64 (slots -1: the fused KV write skips padding
    rows); the attention's input ``q`` and output ``attn`` ``[size, q_size]`` in the model's ``dtype``; the
    pieces' :class:`AttentionMetadata`'s ``query_start_loc`` int32 ``[2]``, ``seq_lens`` int32 ``[1]`` and
    ``block_tables`` int32 ``[1, 1]`` (only its ``slot_mapping``, the slots, is read in a piece)."""
    return {"input_ids": ((size,), torch.long, 0), "positions": ((size,), torch.long, 0),
            "slots": ((size,), torch.long, -1),
            "q": ((size, q_size), dtype, 0), "attn": ((size, q_size), dtype, 0),
            "query_start_loc": ((2,), torch.int32, 0), "seq_lens": ((1,), torch.int32, 0),
            "block_tables": ((1, 1), torch.int32, 0)}


def bucket_buffer_bytes(size: int, q_size: int, dtype: torch.dtype) -> int:
    """Bytes of one :class:`_Bucket`'s static buffers (:func:`bucket_buffers`): for ``q_size`` 2048 in
    bfloat16, ``size * (3 * 8 + 2 * 2048 * 2) + 16``."""
    return sum(math.prod(shape) * dt.itemsize for shape, dt, _ in bucket_buffers(size, q_size, dtype).values())


def reserve_bytes(runner) -> int:
    """Device bytes the prefill graphs of a :class:`~rlserve.engine.worker.model_runner.ModelRunner`
    will hold once captured (after the KV cache), which the KV sizing leaves free
    (``Worker.determine_num_blocks``); 0 when they will stay off (:func:`why_off` without its KV-cache
    check). An upper bound computed from the tensors, not a measurement (the capture needs a GPU):

    - every bucket's static buffers (:func:`bucket_buffer_bytes`: what :class:`_Bucket` allocates, :func:`bucket_buffers`);
    - every bucket's output ``[size, hidden]``, kept in the graph pool;
    - the pool's working set at the largest bucket ``Tb``: every tensor one piece makes, as if all were
      alive at once -- ``o_proj``'s output, the post-attention norm's output and residual, gate_up
      ``[Tb, 2 x intermediate]``, SiLU-and-mul ``[Tb, intermediate]``, ``down_proj``'s output, the input
      norm's output and residual, qkv ``[Tb, q_size + 2 x kv_size]``, the rotated queries ``[Tb, q_size]``
      (the smaller buckets, captured after it, reuse its memory).

    Qwen3-0.6B in bfloat16 with the default buckets (256..8192, 16,128 rows):
    126 MiB of buffers + 32 MiB of outputs + 336 MiB of working set = 494 MiB (session 18's estimate
    of what the capture takes: ~300 MB). Measured on an H100 (session 19, ``benchmarks/device/s19_fix19.sh``,
    BENCHMARKS.md): the capture allocated 190 MiB but the caching allocator reserved 608 MiB (the warm
    runs' blocks, given back after the capture since session 21, :meth:`PrefillCUDAGraphs.capture`, and
    segment rounding); the KV sizing's 512 MiB headroom covered the difference. The capture logs its reserved
    growth against this number (:meth:`PrefillCUDAGraphs.capture`)."""
    sizes = runner._prefill_graph_sizes()
    if why_off(runner, sizes, kv_cache=False) is not None:
        return 0
    model = runner.model
    a, m = model.model.layers[0].self_attn, model.model.layers[0].mlp
    hidden = model.model.embed_tokens.weight.shape[-1]
    inter = m.down_proj.input_size
    dtype = model.model.embed_tokens.weight.dtype
    item = dtype.itemsize
    buffers = sum(bucket_buffer_bytes(s, a.q_size, dtype) for s in sizes)
    outputs = sum(sizes) * hidden * item
    tb = max(sizes)
    working = tb * item * (6 * hidden + 3 * inter + 2 * a.q_size + 2 * a.kv_size)
    return int(buffers + outputs + working)


#: the default (``auto``) leaves the graphs off where they would take more than this share of the KV cache's
#: budget (:func:`kv_reserve`; a judgment, not a measurement: at most a tenth of the cache for prefill steps
#: ~3x faster, BENCHMARKS.md)
MAX_KV_SHARE = 0.10


def reserve_once(runner) -> int:
    """:func:`reserve_bytes` of ``runner``, computed at its first call and kept on it
    (``runner._prefill_graphs_reserve``): the GPU KV sizing (:func:`kv_reserve`) and the capture's log line (and a
    recapture after the cache was re-allocated) read the one number of a start."""
    kept = getattr(runner, "_prefill_graphs_reserve", None)
    if kept is None:
        kept = runner._prefill_graphs_reserve = reserve_bytes(runner)
    return kept


def kv_reserve(runner, budget: int) -> int:
    """The bytes the GPU KV sizing (``Worker.determine_num_blocks``) leaves free for the prefill graphs out of
    ``budget``, the bytes it has for the cache and them: :func:`reserve_bytes` (:func:`reserve_once`), or 0 where, under the default
    ``auto``, that is more than :data:`MAX_KV_SHARE` of ``budget`` (a small ``--gpu-memory-utilization``, e.g.
    a trainer on the same GPU, keeps its KV cache): the graphs are then off for this runner
    (``runner._prefill_graphs_off``), said in the log. An explicit setting (``1``, a list) is always reserved."""
    need = reserve_once(runner)
    if need and runner._prefill_graphs_auto() and need > MAX_KV_SHARE * max(budget, 0):
        why = (f"they would take {need / 2**20:.0f} MiB of the KV cache's {max(budget, 0) / 2**20:.0f} MiB (more than "
               f"{MAX_KV_SHARE:.0%}; RLSERVE_PREFILL_CUDA_GRAPHS=1 or a bucket list forces them)")
        runner._prefill_graphs_off = why
        logger.info("prefill piecewise CUDA graphs off: %s", why)
        return 0
    return need


class _Bucket:
    """Static buffers, pieces and graphs of one token bucket of ``size`` rows."""

    def __init__(self, size: int, model: nn.Module, device: torch.device, dtype: torch.dtype):
        a = model.model.layers[0].self_attn
        self.size = size
        #: every static buffer, by its :func:`bucket_buffers` name
        self.buffers = {name: torch.full(shape, fill, dtype=dt, device=device)
                        for name, (shape, dt, fill) in bucket_buffers(size, a.q_size, dtype).items()}
        bufs = self.buffers
        self.input_ids, self.positions, self.slots = bufs["input_ids"], bufs["positions"], bufs["slots"]
        self.q = bufs["q"]  # the attention's input
        self.attn = bufs["attn"]  # the attention's output
        # the metadata the pieces see: only slot_mapping is read there (the fused KV write)
        self.meta = AttentionMetadata(self.slots, bufs["query_start_loc"], bufs["seq_lens"], bufs["block_tables"],
                                      size, size, 1, [0, size], [size])
        self.graphs: list = []
        self.hidden: torch.Tensor | None = None  # the last piece's output [size, hidden]


class PrefillCUDAGraphs:
    """Piecewise graphs of one model for token buckets ``sizes`` (see the module docstring).

    Args:
        model: a model :func:`supported` accepts, its KV caches bound.
        device: its device; not CUDA: ``emulate`` (pieces run as calls, nothing captured).
        sizes: token buckets (``parse_sizes``).
    """

    def __init__(self, model: nn.Module, device: torch.device, sizes: list[int]):
        self.model = model
        self.device = device
        self.sizes = sorted(sizes)
        self.emulate = device.type != "cuda"
        if not self.emulate:  # (free cached blocks out first: the growth below is then the graphs' own)
            torch.cuda.empty_cache()
        self._mem0 = (0, 0) if self.emulate else (torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device))
        dtype = model.model.embed_tokens.weight.dtype
        self.buckets = {s: _Bucket(s, model, device, dtype) for s in self.sizes}
        self.captured = False
        self.capture_seconds = 0.0
        #: CUDA: growth of the caching allocator's reserved / allocated bytes from the buffers' allocation
        #: to the end of :meth:`capture` (0 emulating)
        self.reserved_growth = self.allocated_growth = 0
        self._pool = None
        self._state: dict = {}  # emulate: the residual handed from one piece to the next

    def bucket_for(self, T: int) -> int | None:
        """The smallest bucket holding ``T`` tokens, or None (larger than every bucket)."""
        return next((s for s in self.sizes if s >= T), None)

    # ---- the pieces: LlamaDecoderLayer.forward's T > 1 branch, cut at each attention
    def _piece(self, b: _Bucket, i: int, state: dict) -> None:
        """Piece ``i`` of bucket ``b`` (see the module docstring): reads ``state["residual"]`` (the
        residual stream, from piece ``i - 1``) and ``b.attn``; writes ``b.q`` (pieces ``< L``) or
        ``b.hidden`` (piece ``L``) and ``state["residual"]``."""
        model = self.model.model
        layers = model.layers
        L = len(layers)
        if i == 0:
            h = model.embed_tokens(b.input_ids)
            residual = h
            h = layers[0].input_layernorm(h)
        else:
            prev = layers[i - 1]
            h = prev.self_attn.o_proj(b.attn)
            h, residual = prev.post_attention_layernorm(h, state["residual"])
            h = prev.mlp(h)
            if i == L:
                b.hidden = model.norm(h, residual)[0]
                state["residual"] = None
                return
            h, residual = layers[i].input_layernorm(h, residual)
        a = layers[i].self_attn
        b.q.copy_(a.norm_rope_write(b.positions, a.qkv_proj(h), b.meta))
        state["residual"] = residual

    def capture(self, reserve: int = 0) -> None:
        """Capture every bucket's pieces, largest bucket first, into one memory pool (on CUDA; a no-op
        when emulating). Each piece runs once eagerly first (Triton compiles outside the capture), on the
        capture's side stream, outside the pool: the caching allocator keeps those blocks for that stream,
        which never runs again, so they are given back (``torch.cuda.empty_cache``, as ``torch.cuda.graph``
        does before a capture) -- the likely part of session 19's reserved growth of 608 MiB beyond the
        190 MiB allocated (the warm run's working set at 8,192 tokens is ~336 MiB for Qwen3-0.6B).
        ``reserve``: the bytes the KV sizing left for them (:func:`reserve_bytes`), logged beside the
        measured growth of the allocator's reserved memory since the buffers were allocated
        (``reserved_growth``)."""
        t0 = time.perf_counter()
        if not self.emulate:
            self._pool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for size in reversed(self.sizes):
                    self._capture_bucket(self.buckets[size])
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            self.reserved_growth = torch.cuda.memory_reserved(self.device) - self._mem0[0]
            self.allocated_growth = torch.cuda.memory_allocated(self.device) - self._mem0[1]
        self.captured = True
        self.capture_seconds = time.perf_counter() - t0
        logger.info("prefill piecewise CUDA graphs: %d buckets %s, %d pieces each, captured in %.2fs; memory "
                    "reserved +%.0f MiB (allocated +%.0f) against the KV sizing's %.0f MiB for them",
                    len(self.sizes), self.sizes, len(self.model.model.layers) + 1, self.capture_seconds,
                    self.reserved_growth / 2**20, self.allocated_growth / 2**20, reserve / 2**20)

    def _capture_bucket(self, b: _Bucket) -> None:
        L = len(self.model.model.layers)
        state: dict = {}
        for i in range(L + 1):  # warm (compile), then capture, each piece with its input residual live
            warm = dict(state)
            self._piece(b, i, warm)
            g = torch.cuda.CUDAGraph()
            # thread_local, as the decode graphs' capture: other engine threads (data-parallel replicas)
            # may keep running
            g.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                self._piece(b, i, state)
            finally:
                g.capture_end()
            b.graphs.append(g)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of a step of ``T = len(input_ids)`` tokens (``T`` at most the
        largest bucket): the inputs copied into the bucket's static buffers, the pieces replayed, the
        attention of each layer run eagerly with ``meta`` (the step's real metadata) between them.
        The result is a view of the bucket's output, valid until the next step."""
        T = input_ids.shape[0]
        b = self.buckets[self.bucket_for(T)]
        b.input_ids[:T].copy_(input_ids)
        b.positions[:T].copy_(positions)
        b.slots[:T].copy_(meta.slot_mapping)
        if T < b.size:
            b.slots[T:].fill_(-1)
        layers = self.model.model.layers
        state = self._state
        for i in range(len(layers) + 1):
            if self.emulate:
                self._piece(b, i, state)
            else:
                b.graphs[i].replay()
            if i < len(layers):
                layers[i].self_attn.attn.forward_cached(b.q[:T], meta, out=b.attn[:T])
        return b.hidden[:T]
