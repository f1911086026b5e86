"""Summarise the ``decode_step_<label>.log`` files a device script wrote (the JSON row lines
``benchmarks/decode_step.py`` prints as it goes; its ``--json`` file comes only at its end): one
line per label (step time, floor, time / floor, KV and weight bytes), then each label's step
time against the first label's.

    python3 benchmarks/device/decode_step_summary.py OUT_DIR TAG LABEL [LABEL ...]
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    out, tag, labels = argv[0], argv[1], argv[2:]
    rows = {}
    for label in labels:
        p = os.path.join(out, f"decode_step_{label}.log")
        for line in open(p) if os.path.exists(p) else []:
            if line.startswith('{"shape"'):
                rows[label] = json.loads(line)
    for label, r in rows.items():
        t = r.get("graph_ms", r["eager_ms"])
        print(f"{tag} {label}: kv={r['kv_cache_dtype']} operands={r.get('fp8_operand')} B={r['batch']} "
              f"ctx={r['context']} step {t:.3f} ms, floor {r['floor_ms']:.3f} ms ({r['x_floor']:.2f}x), "
              f"KV {r['kv_bytes'] / 1e9:.2f} GB, weights {r['weight_bytes'] / 1e9:.2f} GB")
    first = next((lb for lb in labels if lb in rows), None)
    for label in labels:
        if label != first and label in rows:
            a, b = rows[first], rows[label]
            ta, tb = a.get("graph_ms", a["eager_ms"]), b.get("graph_ms", b["eager_ms"])
            print(f"{tag} {label} / {first} step: {tb / ta:.3f}x time ({ta / tb:.2f}x faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
