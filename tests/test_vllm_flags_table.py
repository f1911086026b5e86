"""docs/vllm-flags.md (``rlserve serve``'s flags against ``vllm serve``'s) is what
``tests/vllm_flags_table.py`` makes from the real parser, and its vLLM list is vLLM 0.32's own
(``$RLSERVE_VLLM_PYTHON``, as ``.ci/run`` sets it; else the literal copy stands)."""

from __future__ import annotations

import json
import os

import pytest

from rlserve.cli.vllm_compat import LIMITED_FLAGS, NOOP_FLAGS
from tests import vllm_flags_table as table
from tests.vllm_python import run_vllm, vllm_python

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "vllm-flags.md")


def test_page_is_up_to_date():
    with open(PAGE, encoding="utf-8") as f:
        page = f.read()
    assert page == table.render(), ("docs/vllm-flags.md is stale (a flag was added or changed): regenerate it with "
                                    "`PYTHONPATH=. python -m tests.vllm_flags_table > docs/vllm-flags.md`")


def test_every_classified_flag_is_a_serve_flag():
    names = {o for a in table.serve_actions() for o in a.option_strings}
    assert set(NOOP_FLAGS) <= names and set(LIMITED_FLAGS) <= names
    assert not set(NOOP_FLAGS) & set(LIMITED_FLAGS)
    # a flag vLLM 0.32 refuses is in the page only as rlserve's (accepted for older launch lines)
    assert {"--disable-log-requests", "--swap-space", "--max-seq-len-to-capture"}.isdisjoint(
        table.VLLM_032_SERVE_FLAGS)
    for flag in ("--chat-template", "--generation-config", "--enable-log-requests", "--tokenizer-mode",
                 "--pipeline-parallel-size", "--structured-outputs-config", "--optimization-level",
                 "--compilation-config", "--enable-chunked-prefill", "--disable-log-stats"):
        assert flag in table.VLLM_032_SERVE_FLAGS and flag in names, flag


def test_vllm_flag_list_is_vllm_032s():
    exe = vllm_python()
    if exe is None:
        pytest.skip("no Python with vLLM: set RLSERVE_VLLM_PYTHON (.ci/run does)")
    code = "import json; from tests.vllm_flags_table import vllm_serve_flags; print(json.dumps(vllm_serve_flags()))"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = run_vllm(["-c", code], cwd=root, env=dict(os.environ, PYTHONPATH=root))
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == table.VLLM_032_SERVE_FLAGS
