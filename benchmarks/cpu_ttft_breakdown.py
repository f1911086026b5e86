"""Where a single stream's first token goes: client TTFT against the server's own phase times.

Sends ``--requests`` streamed ``/v1/completions`` one after the other to a running server
(rlserve or vLLM: both export vLLM's metric names), each a prompt of ``--prompt-len`` random
token ids and ``--max-tokens`` tokens, greedy, and reads ``/metrics`` before and after. Per
request, means in ms:

- ``client_ttft``: send -> first streamed chunk with a choice, at the client;
- ``server_ttft``: ``vllm:time_to_first_token_seconds`` (arrival at the API -> first token);
- ``queue``: ``vllm:request_queue_time_seconds`` (arrival -> scheduled in the engine: API work,
  the hop to the engine core, waiting);
- ``prefill``: ``vllm:request_prefill_time_seconds`` (scheduled -> first token: the prefill
  step's forward, sampling and the step's host work);
- ``http``: client_ttft - server_ttft (request parsing before arrival is stamped, the SSE
  chunk's way back, the client).

The load average is printed with every figure (the machine is shared). Usage:

    python benchmarks/cpu_ttft_breakdown.py --url http://127.0.0.1:8000 --requests 10 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time

import httpx

VOCAB = 49152  # SmolLM2's vocabulary (the default model)
PHASES = {"server_ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
          "prefill": "vllm:request_prefill_time_seconds"}


def histogram_sums(text: str) -> dict[str, tuple[float, float]]:
    """``{metric: (sum, count)}`` of the :data:`PHASES` histograms in Prometheus text, summed
    over label sets (0, 0 for a metric that is absent)."""
    out = {}
    for name in PHASES.values():
        vals = []
        for suffix in ("_sum", "_count"):
            pat = re.compile(rf"^{re.escape(name + suffix)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", re.M)
            vals.append(sum(float(m.group(1)) for m in pat.finditer(text)))
        out[name] = (vals[0], vals[1])
    return out


def run(url: str, n: int, prompt_len: int, max_tokens: int, seed: int) -> dict:
    """Send the requests; returns the means (ms) described in the module docstring."""
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=600) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        before = histogram_sums(client.get("/metrics").text)
        ttfts = []
        for _ in range(n):
            body = {"model": model, "prompt": [rng.randrange(3, VOCAB) for _ in range(prompt_len)],
                    "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
            t0 = time.perf_counter()
            first = None
            with client.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if first is None and line.startswith("data: ") and line != "data: [DONE]" \
                            and json.loads(line[6:]).get("choices"):
                        first = time.perf_counter() - t0
            ttfts.append(first)
        time.sleep(0.5)  # the last request's histograms are recorded as it finishes
        after = histogram_sums(client.get("/metrics").text)
    res = {"requests": n, "client_ttft": 1e3 * sum(ttfts) / n, "client_ttft_median": 1e3 * sorted(ttfts)[n // 2]}
    for key, name in PHASES.items():
        ds, dc = after[name][0] - before[name][0], after[name][1] - before[name][1]
        res[key] = 1e3 * ds / dc if dc else None
    if res["server_ttft"] is not None:
        res["http"] = res["client_ttft"] - res["server_ttft"]
    return {k: (round(v, 1) if isinstance(v, float) else v) for k, v in res.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, action="append", help="server base URL (repeat: measured in turn)")
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="rounds over the URLs (order alternating)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    runs = []
    for rnd in range(args.rounds):
        for url in args.url if rnd % 2 == 0 else args.url[::-1]:
            load = os.getloadavg()
            res = run(url, args.requests, args.prompt_len, args.max_tokens, args.seed + rnd)
            res.update(url=url, round=rnd, load_before=[round(x, 2) for x in load],
                       load_after=[round(x, 2) for x in os.getloadavg()])
            runs.append(res)
            print(json.dumps(res), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
