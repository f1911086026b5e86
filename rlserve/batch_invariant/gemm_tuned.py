"""The committed batch-invariant GEMM tables (:mod:`rlserve.batch_invariant.gemm_table`): device
name -> ``{"NxK": [[M, [BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, waves]], ...]}``, each
written by ``benchmarks/batch_invariant.py sweep --table-out`` on that card (the fastest
configuration per layer shape and M among those whose bits equal the reference's there).
Empty: every GPU uses :func:`rlserve.batch_invariant.gpu.tile`."""

TUNED: dict[str, dict] = {}
