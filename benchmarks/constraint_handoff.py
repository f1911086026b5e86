"""What a new constraint's second compile (the engine core's, after the API's worker's) costs, and
would handing the compiled form over save it? xgrammar's ``CompiledGrammar.serialize_json`` /
``deserialize_json`` against a compile, per constraint kind, over a byte-level BPE vocabulary of
``--vocab`` tokens trained here on random words (no model hub; 151,000 asked gives ~120,000, about
Qwen3's 151,669). Prints one line per kind and vocabulary: compile ms (the median of 3, xgrammar's
own cache off), serialized KiB and ms, deserialize ms.

``--worker-memory``: also the memory of one chat-template / constraint worker
(:mod:`rlserve.server.template_pool`) when ready (tokenizer loaded) and once its constraint
compiler is made (xgrammar imports torch), from ``/proc/PID/smaps_rollup``: RSS and private
(the memory only that process holds; shared library pages count in RSS only).

    python benchmarks/constraint_handoff.py [--vocab 32000 151000] [--worker-memory]
"""

from __future__ import annotations

import json
import random
import string
import time


def tokenizer(vocab: int = 32000):
    """A byte-level BPE ``PreTrainedTokenizerFast`` of ``vocab`` tokens (random words + JSON)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 10))) for _ in range(60000)]
    text = [" ".join(rng.choice(words) for _ in range(50)) + ' {"a": 1, "b": [true, null]}' for _ in range(6000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def worker_memory(hf) -> None:
    """One template worker's memory: ready, then with its constraint compiler made (MB)."""
    import pickle

    from rlserve.server.template_pool import _Worker

    def mem(pid: int) -> str:
        d = {}
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                k, v = line.split()[:2]
                if k in ("Rss:", "Private_Clean:", "Private_Dirty:"):
                    d[k] = int(v) / 1024
        return f"RSS {d['Rss:']:.0f} MB, private {d['Private_Clean:'] + d['Private_Dirty:']:.0f} MB"

    w = _Worker(pickle.dumps(hf), 100_000, 5.0)
    try:
        t = time.perf_counter()
        w.wait_ready()
        print(f"worker ready (tokenizer) in {time.perf_counter() - t:.1f} s: {mem(w.proc.pid)}")
        t = time.perf_counter()
        w.init_grammar(len(hf), [0])
        print(f"worker's constraint compiler made in {time.perf_counter() - t:.1f} s: {mem(w.proc.pid)}")
    finally:
        w.kill()


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000])
    ap.add_argument("--worker-memory", action="store_true")
    args = ap.parse_args()
    for vocab in args.vocab:
        hf = tokenizer(vocab)
        handoff(hf)
    if args.worker_memory:
        worker_memory(hf)


def handoff(hf) -> None:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                          "tags": {"type": "array", "items": {"type": "string"}}},
                         "required": ["name", "age"]})
    cases = [("json", lambda: comp.compile_json_schema(schema)),
             ("regex", lambda: comp.compile_regex(r"[a-z]{3,8}-\d{2,4}")),
             ("choice", lambda: comp.compile_regex("(yes|no|maybe)")),
             ("json_object", lambda: comp.compile_json_schema('{"type": "object"}'))]
    for kind, compile_it in cases:
        times = []
        for _ in range(3):
            t = time.perf_counter()
            c = compile_it()
            times.append(time.perf_counter() - t)
        tc = sorted(times)[1]
        t = time.perf_counter()
        s = c.serialize_json()
        ts = time.perf_counter() - t
        t = time.perf_counter()
        xgr.CompiledGrammar.deserialize_json(s, info)
        td = time.perf_counter() - t
        print(f"vocabulary {len(hf)}, {kind}: compile {tc * 1e3:.1f} ms, serialized {len(s) / 1024:.1f} KiB in {ts * 1e3:.1f} ms, "
              f"deserialized {td * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
