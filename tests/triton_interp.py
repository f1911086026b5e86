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


def _patch_interpreter_dot() -> None:
    """Triton's interpreter runs ``tl.dot`` as ``np.matmul``, whose summation order over K depends on the
    operands' shapes through the BLAS kernel NumPy picks (OpenBLAS's Haswell kernels on an AMD EPYC: a tile of
    33 rows and one of 1 row summed the same K terms in different orders, so the batch-invariance tests'
    bit-equality failed there and passed on an AVX-512 Xeon). A GPU's dot sums each output's K terms in one
    order fixed by the kernel's tiles, not by the other rows. Here every output element is the sequential
    float sum over k = 0..K-1 of its products (a reduction over a non-contiguous axis: NumPy adds the K
    slices in order), so a row's bits depend on its own inputs and K only, on every machine."""
    import numpy as np
    import triton.runtime.interpreter as ti

    builder = getattr(ti, "InterpreterBuilder", None)
    orig = getattr(builder, "create_dot", None)
    if orig is None or getattr(orig, "_rlserve_patched", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, b_data = a.data, b.data
        if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or \
           (b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()):
            return orig(self, a, b, d, input_precision, max_num_imprecise_acc)
        dt = d.data.dtype
        prod = a_data.astype(dt)[..., :, :, None] * b_data.astype(dt)[..., None, :, :]  # [..., M, K, N]
        return ti.TensorHandle(np.add.reduce(prod, axis=-2, dtype=dt) + d.data, d.dtype.scalar)

    create_dot._rlserve_patched = True
    builder.create_dot = create_dot


_patch_interpreter_dot()


def rebuild(*names: str) -> None:
    """Reload the modules ``names`` (in order: kernels first) that were imported before
    ``TRITON_INTERPRET=1`` was set, so their ``@triton.jit`` functions are the interpreter's."""
    import importlib

    for name in names:
        if name in sys.modules:
            importlib.reload(sys.modules[name])
