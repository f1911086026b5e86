"""Shared set-up of the CPU tests that compile Triton kernels ahead of time for an H100 (sm_90) with
Triton's CUDA backend (no GPU needed): importing this module from a test module skips that module when
Triton's interpreter is on (its @jit functions cannot be compiled), when Triton is not installed or has
no ``ASTSource`` / ``GPUTarget``. Not a test module."""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    pytest.skip("the interpreter's @jit functions cannot be compiled", allow_module_level=True)
triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - an old Triton
    pytest.skip("this Triton has no ASTSource / GPUTarget", allow_module_level=True)


def compile_sm90(fn, sig: dict, const: dict, aligned: set[int], num_warps: int, num_stages: int):
    """``fn`` (a ``@triton.jit`` kernel) compiled for sm_90: ``sig`` maps every argument name to its
    Triton type (``"*bf16"``, ``"i32"``, ``"constexpr"``...), ``const`` gives the constexpr values,
    ``aligned`` the argument positions the runtime specializes as 16-byte aligned / multiples of 16.
    Returns the compiled kernel (``.asm["ptx"]``, ``.metadata.shared``); skips the test when this
    Triton wheel has no ``ptxas``."""
    attrs = {(i,): [["tt.divisibility", 16]] for i in sorted(aligned)}
    try:
        return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    except (RuntimeError, FileNotFoundError) as e:  # no ptxas in this Triton wheel
        if "ptxas" in str(e):
            pytest.skip(f"Triton's CUDA backend cannot run here: {e}")
        raise
