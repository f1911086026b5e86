"""rlserve/batch_invariant/gemm_table.py: a table picks the batch-invariant GEMM's launch by M
among the checked candidates only (the bits of each are compared with the reference on the GPU:
tests/gpu/test_batch_invariant_gpu.py)."""

from __future__ import annotations

import json

import pytest
import torch

from rlserve.batch_invariant import gemm_table
from rlserve.batch_invariant.gemm_table import REFERENCE, Cfg


def test_candidates_reduce_k_in_wgmma_k16_steps_and_include_the_reference():
    assert REFERENCE in gemm_table.CANDIDATES
    assert len(set(gemm_table.CANDIDATES)) == len(gemm_table.CANDIDATES) == (15 + 6 + 6) * 3
    for c in gemm_table.CANDIDATES:
        # the MMA's M (BLOCK_M, or BLOCK_N swapped) a multiple of the wgmma m64, one or two warpgroups (8
        # warps on 64 rows split N), BLOCK_K a multiple of its k16; smem of the stages within 196 KiB
        mma_m, mma_n = (c.BLOCK_N, c.BLOCK_M) if c.swap else (c.BLOCK_M, c.BLOCK_N)
        assert mma_m % 64 == 0 and c.num_warps in (4, 8) and mma_n % 16 == 0
        assert c.BLOCK_K in (64, 128) and c.waves in (0, 1, 2) and c.swap in (0, 1) and c.tma in (0, 1)
        assert not (c.tma and (c.swap or c.BLOCK_K != 64))  # TMA: 128-byte rows of the swizzle
        assert c.num_stages * (c.BLOCK_M + c.BLOCK_N) * c.BLOCK_K * 2 <= 196 * 1024, c


def test_pick_takes_the_smallest_listed_m_at_least_m(monkeypatch):
    monkeypatch.setattr(gemm_table, "TABLES", {})
    small, mid, big = Cfg(64, 32, 64, 4, 5, 0), Cfg(64, 128, 64, 4, 4, 1), Cfg(128, 256, 64, 8, 3, 1)
    gemm_table.use("GPU X", {"4096x12288": [[2048, list(big)], [1, list(small)], [64, list(mid)]]})
    assert [gemm_table.pick(m, 4096, 12288, "GPU X") for m in (1, 2, 64, 65, 2048, 8192)] == \
        [small, mid, mid, big, big, big]
    assert gemm_table.pick(1, 4096, 4096, "GPU X") is None  # shape not listed: gpu.tile's
    assert gemm_table.pick(1, 4096, 12288, "GPU Y") is None  # another card


def test_use_reads_the_sweeps_json_and_refuses_unchecked_configs(tmp_path, monkeypatch):
    monkeypatch.setattr(gemm_table, "TABLES", {})
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"device": "GPU X", "gemms": {"6144x4096": [[1, list(REFERENCE)]]}}))
    gemm_table.use("GPU X", str(p))
    assert gemm_table.pick(300, 6144, 4096, "GPU X") == REFERENCE
    with pytest.raises(ValueError, match="not one of gemm_table.CANDIDATES"):
        gemm_table.use("GPU X", {"6144x4096": [[1, [128, 128, 32, 8, 3, 1]]]})  # BLOCK_K 32: unchecked
    with pytest.raises(ValueError, match="want 'NxK'"):
        gemm_table.use("GPU X", {"6144": [[1, list(REFERENCE)]]})
    with pytest.raises(ValueError, match="M=0"):
        gemm_table.use("GPU X", {"6144x4096": [[0, list(REFERENCE)]]})
    assert gemm_table.pick(300, 6144, 4096, "GPU X") == REFERENCE  # a refused table changes nothing


def test_committed_tables_are_checked_at_import():
    from rlserve.batch_invariant.gemm_tuned import TUNED

    for name, table in TUNED.items():
        assert gemm_table.check(table)


def test_warm_up_launches_cover_every_pick_for_m_up_to_the_step_budget(monkeypatch):
    """gpu.launches (what the model runner's warm-up launches once each, so no GEMM kernel
    compiles mid-serving): each distinct configuration the table or gpu.tile picks for M = 1 .. max_m,
    once per (N, K) even when several layers share it."""
    from rlserve.batch_invariant import gpu

    monkeypatch.setattr(gemm_table, "TABLES", {})
    small, big = Cfg(64, 32, 64, 4, 5, 0), Cfg(128, 256, 64, 8, 3, 1)
    gemm_table.use("GPU X", {"4096x12288": [[64, list(small)], [2048, list(big)]]})
    got = gpu.launches([(4096, 12288), (4096, 12288), (1024, 3072)], "GPU X", 132, 8192)
    assert got[:2] == [(4096, 12288, "cfg", small), (4096, 12288, "cfg", big)]
    want_tiles = {(1024, 3072, "tile", tuple(t[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")))
                  for t in (gpu.tile(m, 1024, 3072, torch.bfloat16, 132) for m in range(1, 8193))}
    assert set(got[2:]) == want_tiles and len(got[2:]) == len(want_tiles) >= 3
    monkeypatch.setattr(gemm_table, "BROKEN", {big})  # a config that failed to launch: tile()'s instead
    assert (4096, 12288, "cfg", big) not in gpu.launches([(4096, 12288)], "GPU X", 132, 8192)
