"""transformers' first import from two threads at once (:mod:`rlserve.hf_import`): ``rlserve serve`` reads the
generation defaults and loads the tokenizer on two threads beside the engine's start (GPU, overlap on)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.tiny_models import make_tiny_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_generation_defaults_and_tokenizer_load_side_by_side(tmp_path):
    """Both threads start one after the other, as ``rlserve serve`` starts them, in a fresh process
    (transformers not imported yet), and both succeed: the
    tokenizer loads (its vocabulary read back) and the generation defaults come back as a dict. Fails on the
    code before (each did its own ``from transformers import ...``: the second thread's raised ``ImportError:
    cannot import name ... from 'transformers'`` while the first ran the package's ``__init__``; the
    tokenizer's prefetch swallowed it and the API process loaded the tokenizer after the engine was ready)."""
    model = make_tiny_model("llama", str(tmp_path / "m"))
    code = textwrap.dedent("""
        import sys, threading
        from types import SimpleNamespace
        from rlserve.cli.vllm_compat import generation_defaults
        from rlserve.engine.front.replica_setup import TokenizerOnce
        assert "transformers" not in sys.modules
        out = {}
        def gen():
            try:
                out["gen"] = type(generation_defaults("auto", sys.argv[1])).__name__
            except Exception as e:
                out["gen"] = f"{type(e).__name__}: {e}"
        def tok():
            try:
                t = TokenizerOnce(SimpleNamespace(model=sys.argv[1], tokenizer=None, skip_tokenizer_init=False))()
                out["tok"] = str(len(t.get_vocab()) > 0)
            except Exception as e:
                out["tok"] = f"{type(e).__name__}: {e}"
        threads = [threading.Thread(target=f) for f in (gen, tok)]
        for th in threads: th.start()
        for th in threads: th.join()
        print(out["gen"], out["tok"], sep="\\n")
    """)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # three processes at once: the race does not hit every run (2 of 4 single runs failed on the code before)
    procs = [subprocess.Popen([sys.executable, "-c", code, model], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO) for _ in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
        assert out.splitlines() == ["dict", "True"], out
