"""Would handing a compiled constraint from the API's worker to the engine core save the core's
compile? xgrammar's ``CompiledGrammar.serialize_json`` / ``deserialize_json`` against a compile,
per constraint kind, over a 32,000-token byte-level BPE vocabulary trained here on random words
(no model hub). Prints one line per kind: compile ms, serialized KiB and ms, deserialize ms.

    python benchmarks/constraint_handoff.py
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


def main() -> None:
    import xgrammar as xgr

    hf = tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                          "tags": {"type": "array", "items": {"type": "string"}}},
                         "required": ["name", "age"]})
    cases = [("json", lambda: comp.compile_json_schema(schema)),
             ("regex", lambda: comp.compile_regex(r"[a-z]{3,8}-\d{2,4}")),
             ("choice", lambda: comp.compile_regex("(yes|no|maybe)")),
             ("json_object", lambda: comp.compile_json_schema('{"type": "object"}'))]
    print(f"vocabulary {len(hf)}")
    for kind, compile_it in cases:
        t = time.perf_counter()
        c = compile_it()
        tc = time.perf_counter() - t
        t = time.perf_counter()
        s = c.serialize_json()
        ts = time.perf_counter() - t
        t = time.perf_counter()
        xgr.CompiledGrammar.deserialize_json(s, info)
        td = time.perf_counter() - t
        print(f"{kind}: compile {tc * 1e3:.1f} ms, serialized {len(s) / 1024:.1f} KiB in {ts * 1e3:.1f} ms, "
              f"deserialized {td * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
