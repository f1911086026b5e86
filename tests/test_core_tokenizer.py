"""The engine-core process's tokenizer is loaded after ready (issue 37, start-up to ready): its start-up imports
leave transformers' tokenizer classes out (:mod:`rlserve.engine.core.core_tokenizer`), an engine built with
``defer_tokenizer`` serves token ids without them and loads the tokenizer on a thread or when first needed, with
the same results as an engine that loaded it at construction."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from rlserve.engine.core.core_tokenizer import DeferredTokenizer
from rlserve.engine.core.engine_setup import eos_token_ids

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = 180  # bound on the subprocess (seconds): only catches a hang

#: what the core's start-up (prestarted imports, then the engine and its EngineCore) no longer imports: transformers'
#: tokenizer classes, rlserve's detokenizer (the API process detokenizes), LoRA's adapter code (no --enable-lora)
#: and, on the CPU, the batch-invariant Triton kernels (and so Triton)
LAZY = ("transformers.models.auto.tokenization_auto", "transformers.tokenization_utils_tokenizers",
        "transformers.convert_slow_tokenizer", "sentencepiece", "rlserve.engine.detokenizer", "rlserve.lora.model",
        "rlserve.lora.adapter", "rlserve.batch_invariant.gpu", "triton")


def test_core_start_up_leaves_the_tokenizer_stack_out(tiny_model):
    """A fresh process does the core's start-up imports (``warm_up_imports``), builds the engine as the core does
    (``defer_tokenizer=True``, EngineCore in delta mode, on the CPU) and generates from token ids: none of
    :data:`LAZY` is imported. Then the load the core starts after its ready message brings the tokenizer. Fails on
    the code before (``llm_engine`` imported ``AutoTokenizer`` at module level and the engine loaded the tokenizer;
    the worker imported ``rlserve.lora.model``; the linear layers ``batch_invariant.gpu``)."""
    code = textwrap.dedent("""
        import sys
        from rlserve.engine.core.core_proc import warm_up_imports
        warm_up_imports("cpu")
        lazy = sys.argv[2].split(",")
        print("after imports:", [m for m in lazy if m in sys.modules])
        from rlserve.config import EngineConfig
        from rlserve.engine.core.engine_core import EngineCore
        from rlserve.engine.core.llm_engine import LLMEngine
        from rlserve.engine.sampling_params import SamplingParams
        engine = LLMEngine(EngineConfig(model=sys.argv[1], max_model_len=64, max_num_seqs=2), defer_tokenizer=True)
        core = EngineCore(engine, 0, "0", deltas=True)
        core.add("r", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), stream=False)
        tokens = []
        while engine.has_unfinished_requests():
            for d in core.step():
                tokens += [t for s in d.samples for t in s.token_ids]
        print("after a request:", [m for m in lazy if m in sys.modules], len(tokens))
        engine.start_tokenizer_load()
        ids = engine.tokenizer.encode("Hello")  # waits for the thread's load
        print("after the load:", [m for m in lazy[:2] if m in sys.modules], ids != [])
    """)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code, tiny_model("llama"), ",".join(LAZY)], env=env,
                         capture_output=True, text=True, timeout=T, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == [
        "after imports: []",
        "after a request: [] 4",
        f"after the load: {list(LAZY[:2])} True",
    ], out.stdout + out.stderr[-3000:]


def test_deferred_engine_matches_an_engine_that_loaded_its_tokenizer(tiny_model):
    """Same EOS ids, same prompt ids for a text prompt (the first read loads the tokenizer), same greedy tokens
    as the engine that loaded its tokenizer at construction; before any read nothing was loaded."""
    from transformers import AutoTokenizer

    from rlserve.config import EngineConfig
    from rlserve.engine.core.llm_engine import LLMEngine
    from rlserve.engine.sampling_params import SamplingParams

    path = tiny_model("llama")

    def engine(defer):
        return LLMEngine(EngineConfig(model=path, max_model_len=64, max_num_seqs=2, seed=0), defer_tokenizer=defer)

    eager, lazy = engine(False), engine(True)
    assert isinstance(lazy._tokenizer, DeferredTokenizer) and not lazy._tokenizer.loaded
    assert lazy.has_tokenizer and lazy.eos_token_ids == eager.eos_token_ids
    params = SamplingParams(max_tokens=6, temperature=0.0)
    outs = []
    for e in (eager, lazy):
        (out,) = e.generate_blocking(["The capital of France is"], [params])
        outs.append((out.prompt_token_ids, out.outputs[0].token_ids, out.outputs[0].text))
    assert outs[0] == outs[1]
    assert outs[1][0] == AutoTokenizer.from_pretrained(path).encode("The capital of France is")
    assert lazy._tokenizer is not None and not isinstance(lazy._tokenizer, DeferredTokenizer)


def test_a_failed_deferred_load_is_logged_and_raised_where_the_tokenizer_is_needed(tmp_path, caplog):
    """A directory without tokenizer files: the background load logs the error, and every ``get`` raises it."""
    tok = DeferredTokenizer(str(tmp_path))
    with caplog.at_level(logging.ERROR, logger="rlserve.engine.core.core_tokenizer"):
        tok.start().join(T)
    assert tok.loaded
    assert [r.getMessage() for r in caplog.records] == [f"the engine's tokenizer ({tmp_path}) did not load"]
    for _ in range(2):
        with pytest.raises((OSError, ValueError)):
            tok.get()


def test_eos_ids_read_the_tokenizer_only_when_no_config_names_one(tmp_path):
    """``eos_token_ids`` calls its tokenizer function only when neither generation_config.json (none here) nor
    config.json names an EOS id (so the engine-core process does not load its tokenizer for them)."""
    calls = []

    def get_tokenizer():
        calls.append(1)
        return SimpleNamespace(eos_token_id=9)

    assert eos_token_ids(str(tmp_path), get_tokenizer, SimpleNamespace(eos_token_id=[3, 4])) == {3, 4}
    assert calls == []
    assert eos_token_ids(str(tmp_path), get_tokenizer, SimpleNamespace(eos_token_id=None)) == {9}
    assert calls == [1]
    assert eos_token_ids(str(tmp_path), lambda: None, SimpleNamespace(eos_token_id=None)) == set()
