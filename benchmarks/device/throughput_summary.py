"""Summarise the ``throughput_<engine>.json`` files a device script wrote (benchmarks/throughput.py
``--json``): one line per engine, the rlserve / vLLM ratio, and ``throughput.json`` with both.

    python3 benchmarks/device/throughput_summary.py OUT_DIR CARD [LABEL]
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    out, card = argv[0], argv[1]
    label = argv[2] if len(argv) > 2 else "a)"
    res = {}
    for e in ("rlserve", "vllm"):
        p = os.path.join(out, f"throughput_{e}.json")
        if os.path.exists(p):
            with open(p) as f:
                res[e] = json.load(f)["results"][0]
    for name, x in res.items():
        b1 = f", batch-1 {x['batch1_ms_per_token']:.3f} ms/token" if "batch1_ms_per_token" in x else ""
        print(f"{label} {name}: {x['tokens_per_s']:.1f} tok/s ({x['seconds']:.2f} s, {x['output_tokens']} tokens){b1}, "
              f"startup {x.get('startup_s', 0):.1f} s, KV {x.get('kv_cache_tokens')} tokens")
    r, v = res.get("rlserve"), res.get("vllm")
    if r and v:
        print(f"{label} rlserve / vLLM: {r['tokens_per_s'] / v['tokens_per_s']:.3f}x, KV tokens "
              f"{r.get('kv_cache_tokens')} / {v.get('kv_cache_tokens')}")
        if "batch1_ms_per_token" in r and "batch1_ms_per_token" in v:
            print(f"{label} batch-1 rlserve / vLLM ms/token: {r['batch1_ms_per_token'] / v['batch1_ms_per_token']:.3f}x "
                  "(issue 35: <= 1.0)")
    with open(os.path.join(out, "throughput.json"), "w") as f:
        json.dump({"card": card, **res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
