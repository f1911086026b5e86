"""The batch-invariant GEMM's launch configurations and the per-device table that picks one by M.

A configuration (:class:`Cfg`) is ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, waves,
swap, tma)`` of :func:`rlserve.batch_invariant.gpu.linear`'s Triton kernel; ``waves`` is the launch
(programs = ``min(tiles, waves x SMs)``, 0 = one program per output tile); ``swap`` = 1 computes
each tile as ``(w_tile @ a_tile.T).T`` (the weight rows are the MMA's M: 16 tokens of a decode
batch need no 64-row padding; the same products, whether the MMA sums them in the same order in
that role is what the bit check below decides); ``tma`` = 1 loads the tiles through TMA
descriptors (:mod:`rlserve.batch_invariant.gemm_tma`; the pointer kernel where a GEMM's strides
do not allow it). Every configuration of
:data:`CANDIDATES` reduces K the same way: each output element is one float32 accumulator fed
by Hopper ``wgmma ...k16`` steps over K = 0..15, 16..31, ... in order (BLOCK_K = 64 or 128 is 4
or 8 such steps per loop iteration, the same sequence); BLOCK_M / BLOCK_N / warps / stages /
waves only change which elements are computed side by side and how the loads are pipelined.
That the bits do not change is checked on the device, not derived: ``tests/gpu/
test_batch_invariant_gpu.py`` (every candidate equals :data:`REFERENCE` bit for bit on seven
shapes, 300 rows with M and N edges) and ``benchmarks/batch_invariant.py sweep`` (every
candidate timed AND compared with :data:`REFERENCE` on each layer shape and M it is timed at;
a configuration that differs is never written to a table). A table entry outside
:data:`CANDIDATES` is refused (:func:`check`), so a table can only choose among checked ones.

Tables (:data:`TABLES`, by ``torch.cuda.get_device_name``): ``{"NxK": [[M, cfg], ...]}`` with
entries sorted by M: a GEMM of ``m`` rows takes the entry of the smallest listed ``M >= m``
(the last entry beyond), a shape not listed falls back to :func:`rlserve.batch_invariant.gpu.tile`.
Where the numbers come from: ``benchmarks/batch_invariant.py sweep --table-out`` on that card
(:mod:`rlserve.batch_invariant.gemm_tuned` holds the committed ones).
"""

from __future__ import annotations

import json
from typing import NamedTuple


class Cfg(NamedTuple):
    """One launch of the batch-invariant GEMM kernel (see the module docstring)."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int
    waves: int  # programs = min(tiles, waves x SMs); 0: one program per tile
    swap: int = 0  # 1: each tile as (w_tile @ a_tile.T).T: the tokens are the MMA's N (decode batches)
    tma: int = 0  # 1: tiles loaded through TMA descriptors (rlserve.batch_invariant.gemm_tma)


#: session 13's prefill tile, persistent, one program per SM: what every candidate is compared with
REFERENCE = Cfg(128, 128, 64, 8, 3, 1)

_SHAPES = (  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); smem <= 196 KiB of the H100's 227
    (64, 16, 64, 4, 6), (64, 32, 64, 4, 5), (64, 64, 64, 4, 4), (64, 128, 64, 4, 4),  # gpu.TILES
    (64, 32, 128, 4, 4), (64, 64, 128, 4, 3), (64, 128, 128, 4, 3), (64, 64, 64, 4, 6), (64, 128, 64, 4, 6),
    (64, 256, 64, 8, 3),
    (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 128, 8, 3),
)
#: the swapped form (``swap`` = 1): BLOCK_M tokens as the MMA's N (16 .. 64), BLOCK_N weight rows as its M (a
#: multiple of 64, 4 warps per 64)
_SWAPPED = ((16, 64, 64, 4, 6), (16, 128, 64, 4, 4), (16, 128, 64, 4, 6), (16, 256, 64, 8, 4), (32, 128, 64, 4, 4),
            (64, 128, 64, 4, 4))
#: the TMA form (``tma`` = 1, :mod:`rlserve.batch_invariant.gemm_tma`): BLOCK_K 64 (128-byte rows, the TMA swizzle)
_TMA = ((64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 128, 64, 4, 6), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
        (128, 256, 64, 8, 4))
#: launches the sweep tries for each tile shape of ``_SHAPES`` (no recompilation between them)
WAVES = (1, 2, 0)
#: every configuration a table may name (16-bit inputs)
CANDIDATES = (tuple(Cfg(*s, w) for s in _SHAPES for w in WAVES) + tuple(Cfg(*s, w, 1) for s in _SWAPPED for w in WAVES)
              + tuple(Cfg(*s, w, 0, 1) for s in _TMA for w in WAVES))
_SET = frozenset(CANDIDATES)

#: configurations whose launch failed in this process (a Triton / GPU that cannot compile them):
#: ``gpu.linear`` falls back to ``gpu.tile`` for them (logged once; the same bits)
BROKEN: set = set()

#: device name -> {"NxK": [(M, Cfg), ...] sorted by M}: the tables in use (:func:`use`)
TABLES: dict[str, dict[str, list[tuple[int, Cfg]]]] = {}


def check(table: dict) -> dict[str, list[tuple[int, Cfg]]]:
    """``{"NxK": [[M, [6 to 8 ints]], ...]}`` (JSON's form) -> the same with :class:`Cfg` entries,
    sorted by M.

    Raises:
        ValueError: a key not ``"<int>x<int>"``, an M < 1, or a configuration outside
            :data:`CANDIDATES` (not checked bit for bit against :data:`REFERENCE`)."""
    out = {}
    for key, rows in table.items():
        n, _, k = str(key).partition("x")
        if not (n.isdigit() and k.isdigit()):
            raise ValueError(f"GEMM table key {key!r}: want 'NxK'")
        entries = []
        for m, cfg in rows:
            c = Cfg(*[int(v) for v in cfg]) if len(cfg) in (6, 7, 8) else None
            if int(m) < 1 or c not in _SET:
                raise ValueError(f"GEMM table {key} M={m}: {tuple(cfg)} is not one of gemm_table.CANDIDATES")
            entries.append((int(m), c))
        out[f"{int(n)}x{int(k)}"] = sorted(entries)
    return out


def use(device_name: str, table: dict | str) -> None:
    """Take ``table`` (a dict as :func:`check` takes, or the path of a JSON file holding one, or
    ``{"device": ..., "gemms": {...}}`` as the sweep writes) for GPUs named ``device_name``.

    Raises:
        ValueError: see :func:`check`; OSError: the file cannot be read."""
    if isinstance(table, str):
        with open(table) as f:
            table = json.load(f)
    if "gemms" in table:
        table = table["gemms"]
    TABLES[device_name] = check(table)


def pick(M: int, N: int, K: int, device_name: str) -> Cfg | None:
    """The table's configuration for ``[M, K] @ [K, N]`` on a GPU named ``device_name``: the entry
    of the smallest listed M >= ``M`` (the last one beyond); None when the device or shape has no
    table (the caller falls back to :func:`rlserve.batch_invariant.gpu.tile`)."""
    rows = TABLES.get(device_name, {}).get(f"{N}x{K}")
    if not rows:
        return None
    for m, c in rows:
        if m >= M:
            return c
    return rows[-1][1]


def _load_committed() -> None:
    from rlserve.batch_invariant.gemm_tuned import TUNED

    for name, table in TUNED.items():
        TABLES.setdefault(name, check(table))


_load_committed()
