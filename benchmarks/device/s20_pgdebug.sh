#!/usr/bin/env bash
# Session 20: why the engine never replayed the piecewise prefill CUDA graphs on a GPU in session 19
# (tests/gpu/test_prefill_graphs_gpu.py: graphs captured, PrefillCUDAGraphs.run never called). Runs
# benchmarks/device/s20_pgdebug.py (each step's reasons for running eagerly), then the GPU test itself.
# Budget ~90 s. GPU only (DRY_RUN=1 just checks the probe imports).
NAME=s20_pgdebug BUDGET=${BUDGET:-90}; source "$(dirname "$0")/lib.sh"
say "card: $CARD; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if [ "$DRY_RUN" = 1 ]; then $PY -c "import ast; ast.parse(open('benchmarks/device/s20_pgdebug.py').read())"; say "dry ok"; exit 0; fi
bounded "$(slot 60 10)" $PY benchmarks/device/s20_pgdebug.py > "$OUT_DIR/probe.log" 2>&1
say "probe rc=$?"; grep -vi warn "$OUT_DIR/probe.log" | tail -30 | while read -r l; do say "  $l"; done
bounded "$(slot 60 5)" $PY -m pytest -x -q -p no:cacheprovider tests/gpu/test_prefill_graphs_gpu.py > "$OUT_DIR/pytest.log" 2>&1
say "pytest rc=$? $(tail -n 1 "$OUT_DIR/pytest.log")"
say done
