#!/usr/bin/env bash
# Session 20: the piecewise prefill CUDA graphs (RLSERVE_PREFILL_CUDA_GRAPHS=1: buckets 256..8192; off by default)
# on the offline Qwen3-0.6B workload against its HBM floor (BENCHMARKS "Offline workload vs its own HBM floor"),
# s18_overlap.sh's runs with the graphs as the switch: off then on, the prefill windows, the prefill-graph GPU
# tests (tests/gpu/test_prefill_graphs_gpu.py: float32 greedy = eager = HF on the engine path), then on / off again
# when time is left. Budget ~150 s.
export NAME=s20_pgoffline AB_VAR=RLSERVE_PREFILL_CUDA_GRAPHS AB_TESTS=tests/gpu/test_prefill_graphs_gpu.py
exec bash "$(dirname "$0")/s18_overlap.sh"
