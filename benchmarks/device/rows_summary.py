"""One summary line per linear and row count of ``decode_step.py --gemms``' JSON lines (stdin) for the
device scripts of the small-batch GEMM (``s18_decode.sh``): ``forms`` (b: the plain chains, warm weight,
and the model's form with cold weights, ``benchmarks/rows_forms.py``) or ``sweep`` (e: the tile sweep)."""

import json
import sys


def main(kind: str) -> None:
    for line in sys.stdin:
        if not line.startswith('{"shape'):
            continue
        r = json.loads(line)
        if "chain_rows_us" not in r:
            continue
        if kind == "sweep":
            tiles = " ".join(f"{t['tile']}:{t['us']}us" for t in r.get("rows_sweep", []))
            print(f"e) {r['linear']:8s} M={r['M']} cublas {r['chain_cublas_us']:.2f} {tiles}")
            continue
        cold = " ".join(f"{k[5:-3]} {r[k]:7.2f}" for k in ("cold_cublas_us", "cold_rows_us", "cold_rows_fold_us") if k in r)
        print(f"b) {r['linear']:8s} M={r['M']:3d} tile {r['rows_tile']} warm plain: cublas {r['chain_cublas_us']:7.2f} "
              f"rows {r['chain_rows_us']:7.2f} | cold {r.get('form', '?')} x{r.get('cold_copies', '?')}: {cold} us")


if __name__ == "__main__":
    main(sys.argv[1])
