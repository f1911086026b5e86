"""CPU time of a streamed route's own per-chunk work (issue 37), in-process, without a server or an
engine: ``stream_completions`` / ``stream_chat`` (``rlserve/server/openai_stream.py``) over the
prebuilt cumulative outputs of one request of ``--tokens`` ordinary tokens (one token an output, as at
one token an event; the tests' tiny tokenizer, ``tests/test_sse_templates.py``'s helpers), plain
requests (no logprobs, n = 1). The figure is ``time.process_time()`` per chunk over ``--streams``
streams, min and median of ``--rounds`` rounds; the configurations interleave in every round, in one
process: ``on`` (this tree, templates), ``off`` (this tree, ``RLSERVE_SSE_TEMPLATES=0``) and, with
``--baseline FILE``, ``base``: another checkout's ``openai_stream.py`` loaded as a module beside this
tree's (a baseline's ``git show main:rlserve/server/openai_stream.py``; it imports this tree's
other modules).

    python benchmarks/sse_chunk_encode.py --baseline /tmp/main_openai_stream.py --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure(tokens: int, streams: int, rounds: int, baseline: str | None) -> dict:
    """``{config: {"completions": [us per chunk per round], "chat": [...]}}``."""
    import importlib.util

    import tests.test_sse_templates as T
    from rlserve.server import openai_stream
    from rlserve.server.protocol import ChatCompletionRequest, CompletionRequest

    mods = {"on": (openai_stream, "1"), "off": (openai_stream, "0")}
    if baseline:
        spec = importlib.util.spec_from_file_location("baseline_openai_stream", baseline)
        base = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(base)
        mods["base"] = (base, "0")
    for mod, _ in mods.values():
        mod.system_fingerprint = lambda state: "rlserve-0.1-abcdef12"  # no server state here
    tok = T.build_tokenizer()
    ids = (T._ids(tok, "Hello world, this is a longer text that goes on and on. ") * (tokens // 8 + 1))[:tokens]
    outs = T._outputs(tok, ids)
    state = T._State(tok)
    cb = CompletionRequest(model="m", prompt=T.PROMPT, stream=True, max_tokens=tokens)
    hb = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], stream=True, max_tokens=tokens)

    async def agen():
        for o in outs:
            yield o

    async def one(mod, kind: str) -> float:
        t0 = time.process_time()
        for _ in range(streams):
            g = mod.stream_completions(
                state, cb, [(None, T.PROMPT, None)], "cmpl-0123456789abcdef01234567", 1765000000, "Qwen/Qwen3-0.6B",
                1, (False, False), None, [agen()]) if kind == "completions" else mod.stream_chat(
                state, hb, T.PROMPT, "chatcmpl-0123456789abcdef01234567", 1765000000, "Qwen/Qwen3-0.6B",
                (False, False), agen())
            async for _ in g:
                pass
        return (time.process_time() - t0) / (streams * len(outs)) * 1e6

    res: dict = {name: {"completions": [], "chat": []} for name in mods}
    for _ in range(rounds):
        for name, (mod, env) in mods.items():
            os.environ["RLSERVE_SSE_TEMPLATES"] = env
            for kind in ("completions", "chat"):
                res[name][kind].append(round(asyncio.run(one(mod, kind)), 3))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--streams", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--baseline", help="another checkout's rlserve/server/openai_stream.py")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    res = measure(args.tokens, args.streams, args.rounds, args.baseline)
    for name, r in res.items():
        print(name, " ".join(f"{k} us/chunk min {min(v):.2f} median {statistics.median(v):.2f}" for k, v in r.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "load": os.getloadavg(), "us_per_chunk": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
