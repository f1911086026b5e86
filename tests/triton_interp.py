"""Shared set-up of the CPU tests that run Triton kernels through Triton's interpreter.

Importing this module from a test module (at its top, before anything imports Triton)
skips that module when CUDA is present (``tests/gpu`` runs the compiled kernels there, and
the interpreter flag must not leak into them), when Triton is not installed, or when
Triton was already imported without the interpreter; otherwise it sets
``TRITON_INTERPRET=1``, imports Triton and patches its interpreter for NumPy >= 2.3.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: the compiled kernels are tested in tests/gpu", allow_module_level=True)
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    # triton.language's own @jit helpers were built for the compiler already
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set", allow_module_level=True)
# must precede the first `import triton` of the process
os.environ["TRITON_INTERPRET"] = "1"
import triton  # noqa: E402,F401


def _patch_interpreter_for_numpy2() -> None:
    """Triton 3.x's interpreter turns a scalar tensor into an index with
    ``int(ndarray of shape (1,))``, which NumPy >= 2.3 refuses; take the element instead
    (needed for loops with runtime bounds)."""
    import triton.runtime.interpreter as ti

    orig = getattr(ti, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_rlserve_patched", False):
        return  # another Triton version: nothing to patch (or already patched)

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._rlserve_patched = True
    ti._patch_lang_tensor = patched


_patch_interpreter_for_numpy2()


def rebuild(*names: str) -> None:
    """Reload the modules ``names`` (in order: kernels first) that were imported before
    ``TRITON_INTERPRET=1`` was set, so their ``@triton.jit`` functions are the interpreter's."""
    import importlib

    for name in names:
        if name in sys.modules:
            importlib.reload(sys.modules[name])
