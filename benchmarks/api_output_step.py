"""CPU time of the API process's per-step output work, in-process and without a server (issue 37):
the engine-output callback's decoding of a core message and
:meth:`~rlserve.engine.front.output_processor.OutputProcessor.process` (detokenization, outputs) for
``--requests`` streamed requests that each gain one token a step, as at ``vllm bench serve``'s
concurrency 256.

Output ids come from ``--ids LO HI``: the default 1000 .. 151000 are ids the tests' tiny tokenizer
(336 tokens) does not know, what a dummy-weight Qwen3 samples in the GPU benchmarks; ``3 300`` are
ordinary tokens. Prompts: ``--prompt-len`` random ordinary tokens. ``--tokenizer PATH`` decodes with
a real tokenizer (a directory ``AutoTokenizer`` loads, e.g. the default model's in rlserve's cache,
``~/.cache/rlserve/SmolLM2-135M-Instruct``) instead of the tiny one. ``--tokens-per-step K``: each
delta carries K tokens (the core's deltas of K steps handled together, as when the event loop
falls behind); the figure stays per request and message. ``--start-len N``: each request already has
N output tokens (an uncounted first message) when the counted steps start: the per-step cost of a
long output (issue 37's O(output length) copies). ``--text PATH``: output ids are the
tokenization of that file (each request from its own random offset, wrapping): text a model would
write, instead of ``--ids`` 's random ones (which, drawn from a byte-level tokenizer's first
ids, are mostly single bytes: invalid UTF-8). The figure is
``time.process_time()`` (this process's CPU seconds, which the machine's load moves least) per
request and step, best of ``--repeats``, after the start-up heap is frozen out of garbage collection
(``rlserve.gc_heap.freeze_startup_heap``, as ``rlserve serve`` does: without it the full collections
over torch's and transformers' objects are most of the figure).

Instruction counts instead of CPU time (``valgrind --tool=callgrind --instr-atstart=no`` with
``API_OUTPUT_STEP_CALLGRIND=1``: only the timed loop is instrumented; use ``--repeats 1``)::

    API_OUTPUT_STEP_CALLGRIND=1 valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=cg.out \
        python benchmarks/api_output_step.py --repeats 1 --steps 16  # then: grep totals cg.out

Compare two checkouts by running each one's copy (``PYTHONPATH=TREE python TREE/benchmarks/api_output_step.py``)::

    python benchmarks/api_output_step.py --requests 256 --steps 64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_tokenizer(path: str | None):
    """The tokenizer at ``path`` (``AutoTokenizer``), else the tests' tiny one."""
    if path is None:
        from tests.tiny_models import build_tokenizer

        return build_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def run(requests: int, steps: int, ids: tuple[int, int], prompt_len: int, seed: int, tok, per_step: int = 1,
        text_ids: list[int] | None = None, start_len: int = 0) -> float:
    """CPU seconds per request-step of decoding ``steps`` core messages of ``requests`` deltas
    (``per_step`` tokens each: drawn from ``ids``, or read from ``text_ids``) and processing them
    (one output per request per message). ``start_len`` > 0: a first, uncounted message gives each
    request that many output tokens (the counted steps are then those of a long output)."""
    from rlserve.engine import core_protocol as proto
    from rlserve.engine.front.output_processor import OutputProcessor
    from rlserve.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=start_len + steps * per_step + 1, ignore_eos=True)
    reqs = {f"r{i}": SimpleNamespace(prompt=None, params=params, stream=True, arrival_time=0.0)
            for i in range(requests)}
    prompts = {rid: [rng.randrange(3, 300) for _ in range(prompt_len)] for rid in reqs}
    if text_ids:
        pos = {rid: rng.randrange(len(text_ids)) for rid in reqs}

        def draw(rid, k=per_step):
            out = [text_ids[(pos[rid] + j) % len(text_ids)] for j in range(k)]
            pos[rid] += k
            return out
    else:
        def draw(rid, k=per_step):
            return [rng.randrange(*ids) for _ in range(k)]
    enc = proto.output_encoder()
    frames = []
    first = -1 if start_len else 0  # (the frame that carries the requests' starts)
    for k in range(first, steps):
        deltas = [proto.RequestDelta(rid, [proto.SampleDelta(0, toks, [-1.0] * len(toks))], finished=False,
                                     weight_versions=["0"], first_token_time=1.0,
                                     start=proto.RequestStart(prompts[rid]) if k == first else None)
                  for rid in reqs for toks in [draw(rid, start_len if k < 0 else per_step)]]
        frames.append(enc.encode(proto.CoreOutputs(deltas=deltas)))
    dec = proto.output_decoder()
    op = OutputProcessor(tok)
    if start_len:  # the uncounted first message: long outputs already
        op.process(dec.decode(frames.pop(0)).deltas, reqs)
    from rlserve.gc_heap import freeze_startup_heap

    freeze_startup_heap("api_output_step")  # as rlserve serve does before serving
    _callgrind("on")
    t0 = time.process_time()
    n = 0
    for raw in frames:
        msg = dec.decode(raw)
        outputs, errors, _stops, _aborts = op.process(msg.deltas, reqs)
        assert not errors and len(outputs) == requests
        n += len(outputs)
    t = time.process_time() - t0
    _callgrind("off")
    return t / n


def _callgrind(state: str) -> None:
    """Under ``valgrind --tool=callgrind --instr-atstart=no`` with ``API_OUTPUT_STEP_CALLGRIND=1``:
    instrument the timed loop only (``callgrind_control -i on|off``): its instruction count, which
    the machine's load does not move (the ``callgrind_control`` call's own Python, a few thousand
    instructions, is inside)."""
    if os.environ.get("API_OUTPUT_STEP_CALLGRIND") == "1":
        import subprocess

        subprocess.run(["callgrind_control", "-i", state, str(os.getpid())], check=True, capture_output=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--ids", type=int, nargs=2, default=(1000, 151000), metavar=("LO", "HI"))
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", help="a tokenizer directory (default: the tests' tiny tokenizer)")
    p.add_argument("--tokens-per-step", type=int, default=1)
    p.add_argument("--text", help="output ids: this file's tokens (default: random --ids)")
    p.add_argument("--start-len", type=int, default=0,
                   help="output tokens each request has before the counted steps (an uncounted first message)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    tok = load_tokenizer(args.tokenizer)
    text_ids = None
    if args.text:
        with open(args.text, encoding="utf-8") as f:
            text_ids = tok.encode(f.read(), add_special_tokens=False)
    runs = [run(args.requests, args.steps, tuple(args.ids), args.prompt_len, args.seed + r, tok, args.tokens_per_step,
                text_ids, args.start_len) for r in range(args.repeats)]
    best = min(runs)
    import rlserve

    res = {"us_per_request_step": round(best * 1e6, 2), "runs_us": [round(x * 1e6, 2) for x in runs],
           "requests": args.requests, "steps": args.steps, "ids": list(args.ids), "tokenizer": args.tokenizer or "tiny", "text": args.text,
           "tokens_per_step": args.tokens_per_step, "start_len": args.start_len, "rlserve": os.path.dirname(rlserve.__file__),
           "load": os.getloadavg()[0]}
    print(json.dumps(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
