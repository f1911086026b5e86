"""Batch-invariant CUDA forms (Triton), used when the mode is on.

- GEMM (:func:`linear`): cuBLAS picks its kernel, tiling and split-K by the row count M, so a
  row's bits change with the batch (``benchmarks/batch_invariant.py probe --device cuda``; on
  the H100, rows of a bf16 3072 x 1024 GEMM differed from M = 1 at M = 255, 300 and 2048). vLLM
  runs cuBLASLt with split-K forbidden on Hopper (``allow_bf16_reduced_precision_reduction =
  (False, False)``); measured on the H100 (torch 2.11, session 13) that is not M-invariant
  either: the rows of that 3072 x 1024 GEMM differ between M = 1 and every M >= 2 tried
  (:func:`no_split_k`, kept as :data:`GEMM` ``"cublaslt"`` for A/B runs). So one Triton kernel
  computes every ``x [M, K] @ W[N, K].T``: each output tile sums K in ``BLOCK_K`` = 64 steps
  from 0 upwards with ``tl.dot`` into a float32 accumulator, no split-K, the bias added in
  float32, one rounding to the output dtype. A row's value depends on its own inputs and that
  order only. Persistent: ``min(tiles, SMs)`` programs walk the tiles (grouped by ``GROUP_M``
  rows of tiles for L2 reuse), as Thinking Machines' ``batch_invariant_ops`` matmul does.
- The tile shape (:data:`GEMM` ``"triton_m"``, the default; :func:`tile`): a fixed tile per
  (N, K) (``"triton"``, session 13's, :func:`config`) left most SMs idle in decode steps (Qwen3-8B's
  o_proj / down_proj at M = 64: 32 tiles of 64 x 128 on 132 SMs; +40.6% for the whole mode). Now
  the tile follows M from :data:`TILES` (the largest whose tile count fills ~3/4 of the SMs):
  128 x 128 for prefills, down to 64 x 16 for small decode batches. Every tile of :data:`TILES` has
  ``BLOCK_K`` = 64 and ``BLOCK_M`` a multiple of 64 with 4 warps per 64 rows, so every output
  element is reduced by the same sequence of Hopper ``wgmma m64nNk16`` steps (K 0..15, 16..31, ...
  into the same float32 accumulator); only the instruction's N (the columns computed side by
  side) changes with the tile. That the bits do not depend on it is a property of the hardware,
  checked on the GPU (``tests/gpu/test_batch_invariant_gpu.py``: every tile of :data:`TILES` gives
  the same bits on seven shapes, rows at M = 1..2048 equal), not derived.
- Per-device tables (:mod:`rlserve.batch_invariant.gemm_table`, session 15): where this GPU has a
  table (``gemm_tuned.TUNED`` by device name, or ``gemm_table.use``), the launch for (N, K, M) is
  the table's, one of ``gemm_table.CANDIDATES`` (BLOCK_K 64 / 128, tiles up to 128 x 256, stages,
  programs per SM), each checked on the device to give the reference launch's bits; the kernel's
  loads are unmasked (rows / columns past M / N read row / column 0 and are never stored; K is
  masked only when BLOCK_K does not divide it).
- Attention: :mod:`rlserve.layers.triton_attention` runs its decode kernel with one KV split
  (the split count otherwise follows the batch size), and the query tokens of steps with
  prefills through :mod:`rlserve.batch_invariant.query_tiles` (the decode kernel's operations,
  several tokens of one sequence per program), so a token's attention is the same in a prompt,
  a prefix-cache hit and a decode step, eager or replayed from a CUDA graph.
- Sampling: each row by its own parameters (:mod:`rlserve.engine.core.sample_split`): the
  one-pass fused sampler for the rows it takes (vocabulary chunks fixed by V), the general one
  for the others; every row's logprob from ``log_softmax`` as the general sampler's.
- RMSNorm, SiLU-mul, q/k norm + rotary (Triton, :mod:`rlserve.layers.fused_ops`): one row
  (token) per program with a block size from the hidden size only: unchanged.
"""

from __future__ import annotations

import logging

import torch

from rlserve.batch_invariant import gemm_table, gemm_tma

logger = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl

    from rlserve.batch_invariant.gemm_tma import tile_coords

    HAS_TRITON = True
except ImportError:  # pragma: no cover - CPU-only installs
    HAS_TRITON = False


def available() -> bool:
    """Whether :func:`linear` can run (Triton importable)."""
    return HAS_TRITON


#: which batch-invariant GEMM :func:`linear` runs on CUDA: "triton_m" (the mode's: the Triton
#: kernel, tile by :func:`tile`), "triton" (the Triton kernel, one tile per (N, K): :func:`config`,
#: session 13's), or "cublaslt" (cuBLASLt with split-K and reduced-precision reduction forbidden,
#: vLLM's Hopper setting: NOT M-invariant on the H100, see the module docstring). A/B runs:
#: ``benchmarks/batch_invariant.py cost --modes on:gemm=...``
GEMMS = ("triton_m", "triton", "cublaslt")
GEMM = ["triton_m"]

#: the 16-bit tile shapes of ``"triton_m"``, largest first: ``(BLOCK_M, BLOCK_N, num_warps,
#: num_stages)``, all with ``BLOCK_K`` = 64 and 4 warps per 64 rows (one Hopper warpgroup per
#: ``wgmma m64nNk16``; see the module docstring). The first two are session 13's fixed tiles.
TILES = ((128, 128, 8, 3), (64, 128, 4, 4), (64, 64, 4, 4), (64, 32, 4, 5), (64, 16, 4, 6))
BLOCK_K = 64
#: tiles of :data:`TILES` whose first launch failed in this process (a Triton / GPU that cannot
#: compile them): :func:`tile` skips them (logged once; the bits are the same for every tile)
BROKEN: set = set()


class no_split_k:
    """``with no_split_k(): ...``: torch prefers cuBLASLt and cuBLAS(Lt) may neither reduce in
    reduced precision nor split K (bf16 and fp16 GEMMs; torch >= 2.10: plain cuBLAS refuses
    ``allow_splitk=False`` with a ``RuntimeError``), restored after."""

    def __enter__(self):
        m = torch.backends.cuda.matmul
        self.prev = (m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction)
        self.prev_lib = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        m.allow_bf16_reduced_precision_reduction = (False, False)
        m.allow_fp16_reduced_precision_reduction = (False, False)
        return self

    def __exit__(self, *exc):
        m = torch.backends.cuda.matmul
        m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction = self.prev
        torch.backends.cuda.preferred_blas_library(self.prev_lib)
        return False


def config(N: int, K: int, dtype: torch.dtype) -> dict:
    """``"triton"``'s tile shape for a GEMM of ``N`` outputs and depth ``K`` in ``dtype``: a pure
    function of (N, K, dtype), never of M. 16-bit inputs: 64 x 128 x 64 tiles (128 x 128 for
    N >= 8192, the LM head and wide MLPs); float32 (tests, the interpreter): 32 x 32 x 32."""
    if dtype == torch.float32:
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2)
    bm, bn, warps, stages = TILES[0] if N >= 8192 else TILES[1]
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, GROUP_M=8, num_warps=warps, num_stages=stages)


def tile(M: int, N: int, K: int, dtype: torch.dtype, sms: int) -> dict:
    """``"triton_m"``'s tile shape for ``[M, K] @ [K, N]`` in ``dtype`` on a GPU of ``sms``
    multiprocessors: the first of :data:`TILES` whose tile count ``ceil(M / BLOCK_M) x
    ceil(N / BLOCK_N)`` reaches 3/4 of ``sms`` (one wave that leaves few SMs idle), else the last
    (the most tiles); tiles in :data:`BROKEN` are skipped. The choice follows M; the reduction order does not (``BLOCK_K`` = 64 for
    every tile: see the module docstring). float32 (tests, the interpreter): :func:`config`'s
    fixed 32 x 32 x 32 (IEEE products, summed per element in K order whatever the tile)."""
    if dtype == torch.float32:
        return config(N, K, dtype)
    want = max(1, sms * 3 // 4)
    for bm, bn, warps, stages in [t for t in TILES if t not in BROKEN] or TILES[:1]:
        if -(-M // bm) * -(-N // bn) >= want:
            break
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, GROUP_M=8, num_warps=warps, num_stages=stages)


_SMS: dict[int, int] = {}
_NAMES: dict[int, str] = {}


def _device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` of ``device`` (cached): the key of ``gemm_table.TABLES``."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NAMES:
        _NAMES[idx] = torch.cuda.get_device_name(idx)
    return _NAMES[idx]


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, each walking several tiles
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


if HAS_TRITON:

    @triton.jit
    def _dot_k(p_ptrs, q_ptrs, p_step, q_step, K, acc, p_rows, EVEN_K: tl.constexpr, MASK_P: tl.constexpr,
               IEEE: tl.constexpr, BLOCK_K: tl.constexpr):
        """``acc += p @ q`` over K from 0 upwards in BLOCK_K steps (the fixed order): ``p_ptrs``
        a [*, BLOCK_K] block of pointers, ``q_ptrs`` a [BLOCK_K, *] one, advanced by ``p_step`` /
        ``q_step`` per step; K masked only when not ``EVEN_K``; ``MASK_P``: rows of ``p`` where
        ``p_rows`` ([*, 1] bool) is False read as 0 instead of being loaded."""
        offs_k = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                if MASK_P:
                    p = tl.load(p_ptrs, mask=p_rows, other=0.0)
                else:
                    p = tl.load(p_ptrs)
                q = tl.load(q_ptrs)
            else:
                if MASK_P:
                    p = tl.load(p_ptrs, mask=p_rows & (offs_k[None, :] < K - k0), other=0.0)
                else:
                    p = tl.load(p_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
                q = tl.load(q_ptrs, mask=offs_k[:, None] < K - k0, other=0.0)
            if IEEE:
                acc = tl.dot(p, q, acc, input_precision="ieee")
            else:
                acc = tl.dot(p, q, acc)
            p_ptrs += p_step
            q_ptrs += q_step
        return acc

    # M and the program count vary from call to call: not specialized (== 1, % 16), one compile
    @triton.jit(do_not_specialize=["M", "num_programs"])
    def _bi_matmul_kernel(a_ptr, w_ptr, c_ptr, bias_ptr, M, N, K,
                          stride_am, stride_ak, stride_wn, stride_wk, stride_cm, stride_cn,
                          num_programs, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
                          SWAP_AB: tl.constexpr, MASK_M: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """``c[M, N] = a[M, K] @ w[N, K].T (+ bias[N])``: persistent programs over output tiles;
        each tile reduces K from 0 upwards in BLOCK_K steps (the fixed order). Rows / columns past
        M / N load row / column 0 instead (unmasked loads; never stored), K is masked only when
        ``EVEN_K`` is False (K not a multiple of BLOCK_K). ``SWAP_AB``: each tile computed as
        ``(w_tile @ a_tile.T).T`` (the weight rows are the MMA's M, the tokens its N: a decode
        batch of BLOCK_M = 16 tokens fills an MMA of N = 16 instead of 64 rows of padding).
        ``MASK_M`` (not swapped): rows past M are masked (read as 0, no load issued) instead of
        re-reading row 0: session 14's loads, faster for its 64-row tiles at a few rows (the tile
        by M's path; the table's configurations were measured without it)."""
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        for tile in range(pid, num_m * num_n, num_programs):
            pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            # int64 row offsets: M x K, N x K and M x N may pass 2**31 (14,135 logits rows of a 151,936 vocabulary)
            offs_am = tl.max_contiguous(tl.multiple_of(tl.where(offs_m < M, offs_m, 0), BLOCK_M), BLOCK_M).to(tl.int64)
            offs_wn = tl.max_contiguous(tl.multiple_of(tl.where(offs_n < N, offs_n, 0), BLOCK_N), BLOCK_N).to(tl.int64)
            offs_k = tl.arange(0, BLOCK_K)
            if SWAP_AB:
                acc_t = _dot_k(w_ptr + offs_wn[:, None] * stride_wn + offs_k[None, :] * stride_wk,  # [BLOCK_N, BLOCK_K]
                               a_ptr + offs_am[None, :] * stride_am + offs_k[:, None] * stride_ak,  # [BLOCK_K, BLOCK_M]
                               BLOCK_K * stride_wk, BLOCK_K * stride_ak, K,
                               tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), offs_wn[:, None] >= 0,
                               EVEN_K, False, IEEE, BLOCK_K)
                acc = tl.trans(acc_t)
            else:
                acc = _dot_k(a_ptr + offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak,  # [BLOCK_M, BLOCK_K]
                             w_ptr + offs_wn[None, :] * stride_wn + offs_k[:, None] * stride_wk,  # [BLOCK_K, BLOCK_N]
                             BLOCK_K * stride_ak, BLOCK_K * stride_wk, K,
                             tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), offs_m[:, None] < M,
                             EVEN_K, MASK_M, IEEE, BLOCK_K)
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
            tl.store(c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn,
                     acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           tile_shape: tuple[int, int, int, int] | None = None, cfg: gemm_table.Cfg | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose rows do not depend on M: the Triton kernel, K reduced in
    a fixed order, its launch by :data:`GEMM` (``"triton_m"``: this GPU's table in
    :mod:`rlserve.batch_invariant.gemm_table` where it has one, else :func:`tile`; ``"triton"``:
    :func:`config`; ``"cublaslt"`` with 16-bit inputs: cuBLASLt without split-K, not M-invariant,
    A/B runs only): ``x [..., K]`` and ``weight [N, K]`` of one dtype (bf16 / fp16 / float32) on
    one CUDA device (or CPU under ``TRITON_INTERPRET=1``), ``bias [N]`` or None -> ``[..., N]`` in
    ``x.dtype``. float32 uses IEEE products (no TF32). ``tile_shape`` (one of :data:`TILES`) or
    ``cfg`` (one of ``gemm_table.CANDIDATES``) instead: tests and benchmarks.

    Raises:
        ValueError: dtypes differ, ``weight`` is not 2-D with ``K`` columns, ``tile_shape`` is
            not one of :data:`TILES` or ``cfg`` not one of ``gemm_table.CANDIDATES``.
    """
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} does not take inputs of {x.shape[-1]} features")
    if weight.dtype != x.dtype:
        raise ValueError(f"x is {x.dtype} but weight is {weight.dtype}")
    if GEMM[0] == "cublaslt" and x.dtype != torch.float32:
        with no_split_k():
            return torch.nn.functional.linear(x, weight, bias)
    lead = x.shape[:-1]
    a = x.reshape(-1, x.shape[-1])
    M, K = a.shape
    N = weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out.reshape(*lead, N)
    if cfg is not None:
        if len(cfg) not in (6, 7, 8) or gemm_table.Cfg(*cfg) not in gemm_table.CANDIDATES:
            raise ValueError(f"cfg {tuple(cfg)} is not one of gemm_table.CANDIDATES")
        _launch(a, weight, out, bias, _as_dict(gemm_table.Cfg(*cfg)))
        return out.reshape(*lead, N)
    if tile_shape is not None:
        if tuple(tile_shape) not in TILES:
            raise ValueError(f"tile_shape {tile_shape} is not one of {TILES}")
        bm, bn, warps, stages = tile_shape
        cfg_d = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, GROUP_M=8, num_warps=warps, num_stages=stages)
    elif GEMM[0] == "triton":
        cfg_d = dict(config(N, K, x.dtype))
    else:
        tuned = None
        if x.dtype != torch.float32 and x.device.type == "cuda":
            tuned = gemm_table.pick(M, N, K, _device_name(x.device))
        if tuned is not None and tuned not in gemm_table.BROKEN:
            try:
                _launch(a, weight, out, bias, _as_dict(tuned))
                return out.reshape(*lead, N)
            except Exception:  # noqa: BLE001 - a configuration this Triton / GPU cannot compile: tile()'s
                gemm_table.BROKEN.add(tuned)
                logger.warning("batch-invariant GEMM: table configuration %s failed to launch, tile() from now "
                               "on (the same bits)", tuple(tuned), exc_info=True)
        while True:
            cfg_d = tile(M, N, K, x.dtype, _num_sms(x.device))
            t = (cfg_d["BLOCK_M"], cfg_d["BLOCK_N"], cfg_d["num_warps"], cfg_d["num_stages"])
            try:
                _launch(a, weight, out, bias, cfg_d)
                return out.reshape(*lead, N)
            except Exception:  # noqa: BLE001 - a tile this Triton / GPU cannot compile: the next one
                if x.dtype == torch.float32 or t in BROKEN or len(BROKEN) + 1 >= len(TILES):
                    raise
                BROKEN.add(t)
                logger.warning("batch-invariant GEMM: tile %s failed to launch, skipped from now on", t,
                               exc_info=True)
    _launch(a, weight, out, bias, cfg_d)
    return out.reshape(*lead, N)


def _as_dict(c: gemm_table.Cfg) -> dict:
    return dict(BLOCK_M=c.BLOCK_M, BLOCK_N=c.BLOCK_N, BLOCK_K=c.BLOCK_K, GROUP_M=8, num_warps=c.num_warps,
                num_stages=c.num_stages, waves=c.waves, SWAP_AB=bool(c.swap), TMA=bool(c.tma), MASK_M=False)


def _launch(a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, cfg: dict) -> None:
    """One launch of the kernel: ``out [M, N] = a [M, K] @ weight[N, K].T (+ bias)`` with tile
    ``cfg`` (:func:`tile` / :func:`config`'s dict; ``waves``: programs = ``min(tiles, waves x
    SMs)``, 0 = one per tile; default 1; ``TMA``: through :mod:`rlserve.batch_invariant.gemm_tma`
    where its ``usable`` says so, else this kernel with the same tile)."""
    cfg = dict(cfg)
    warps, stages, waves = cfg.pop("num_warps"), cfg.pop("num_stages"), cfg.pop("waves", 1)
    cfg.setdefault("SWAP_AB", False)
    cfg.setdefault("MASK_M", True)  # tile() / config() / tile_shape: session 14's masked rows
    (M, K), N = a.shape, weight.shape[0]
    tiles = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
    programs = tiles if waves == 0 else min(tiles, waves * _num_sms(a.device))
    if cfg.pop("TMA", False) and gemm_tma.usable(a, weight):
        gemm_tma.launch(a, weight, out, bias, dict(cfg, num_warps=warps, num_stages=stages), programs)
        return
    _bi_matmul_kernel[(programs,)](
        a, weight, out, bias if bias is not None else out, M, N, K,
        a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1), programs,
        HAS_BIAS=bias is not None, IEEE=a.dtype == torch.float32, EVEN_K=K % cfg["BLOCK_K"] == 0,
        num_warps=warps, num_stages=stages, **cfg)


def launches(shapes, device_name: str, sms: int, max_m: int) -> list[tuple]:
    """The distinct launches the mode's GEMM (``"triton_m"``) makes for linear layers of
    ``shapes`` (``(N, K)`` pairs) at every row count M = 1 .. ``max_m`` on a GPU named
    ``device_name`` with ``sms`` multiprocessors (16-bit inputs): ``(N, K, "cfg", Cfg)`` where
    the GPU's table names one (``gemm_table.pick``), ``(N, K, "tile", (BLOCK_M, BLOCK_N,
    num_warps, num_stages))`` where :func:`tile` picks. A pure function (what :func:`warm_up`
    launches)."""
    out: list[tuple] = []
    for N, K in dict.fromkeys(shapes):
        seen = set()
        for M in range(1, max_m + 1):
            c = gemm_table.pick(M, N, K, device_name)
            if c is not None and c not in gemm_table.BROKEN:
                key = (N, K, "cfg", c)
            else:
                t = tile(M, N, K, torch.bfloat16, sms)
                key = (N, K, "tile", (t["BLOCK_M"], t["BLOCK_N"], t["num_warps"], t["num_stages"]))
            if key not in seen:
                seen.add(key)
                out.append(key)
    return out


def warm_up(layers, max_m: int) -> list[tuple]:
    """Launch, once each with one row, every GEMM configuration the mode can pick for the linear
    layers ``layers`` (``(weight [N, K], bias [N] or None)`` pairs; the 16-bit CUDA ones count) at
    row counts 1 .. ``max_m`` (:func:`launches`), so that none compiles (or loads from Triton's
    disk cache) in the middle of serving: the kernel is not specialized on M, so one launch per
    configuration covers every M. The model runner calls it in its warm-up when the mode is on
    (its recording pass compiles them in parallel). Returns the launches."""
    shapes = {}
    for w, b in layers:
        if w.dim() == 2 and w.is_cuda and w.dtype in (torch.bfloat16, torch.float16):
            shapes.setdefault((w.shape[0], w.shape[1], b is not None), (w, b))
    done = []
    for (N, K, _), (w, b) in shapes.items():
        x = torch.zeros(1, K, dtype=w.dtype, device=w.device)
        for _, _, kind, c in launches([(N, K)], _device_name(w.device), _num_sms(w.device), max_m):
            try:
                linear(x, w, b, **({"cfg": c} if kind == "cfg" else {"tile_shape": c}))
            except Exception:  # noqa: BLE001 - linear() falls back from it at its first real call
                logger.warning("batch-invariant GEMM warm-up: %s %s for %dx%d failed", kind, tuple(c), N, K,
                               exc_info=True)
            done.append((N, K, kind, c))
    return done
