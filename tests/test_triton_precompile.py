"""rlserve.engine.worker.triton_precompile: record a warm-up's Triton compilations, compile them in child
processes into Triton's on-disk cache, and the parent then loads them from there.

No GPU is needed: each test runs a script in a fresh interpreter (Triton compiled, not interpreted) whose
Triton driver is a stand-in naming an sm_90 CUDA target; Triton compiles for a target without a device
(its bundled ptxas), and ``kernel.warmup(...)`` compiles without launching. The kernels are rlserve's own
(``rlserve.layers.fused_kernels``) on CPU tensors (only their dtypes and alignment matter to Triton).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = r'''
import json, sys, threading
import torch
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

class FakeDriver:  # what JITFunction.run asks of the driver before it compiles
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0

driver.set_active(FakeDriver())
from rlserve.layers import fused_kernels as fk
from rlserve.engine.worker import triton_precompile as tp

TARGET = GPUTarget("cuda", 90, 32)
T, N = 4, 1024
x = torch.zeros(T, N, dtype=torch.bfloat16)
w = torch.ones(N, dtype=torch.bfloat16)
out = torch.empty_like(x)

def rms(has_res, warmup=False):
    args = (x, x, w, out, out, N, N, N, N, N, 1e-6)
    kw = dict(BLOCK=1024, HAS_RES=has_res, num_warps=4)
    if warmup:
        return fk._rms_norm_kernel.warmup(*args, grid=(T,), **kw)
    return fk._rms_norm_kernel[(T,)](*args, **kw)

def silu(warmup=False):
    args = (x, out, N, N, N // 2)
    if warmup:
        return fk._silu_mul_kernel.warmup(*args, BLOCK=512, grid=(T, 1))
    return fk._silu_mul_kernel[(T, 1)](*args, BLOCK=512)

hits = []
knobs.compilation.listener = lambda **kw: hits.append(bool(kw["cache_hit"]))
'''


def _run(body: str, tmp_path) -> dict:
    """Run PRELUDE + ``body`` (which prints one JSON line last) with an empty Triton cache."""
    env = dict(os.environ, PYTHONPATH=ROOT, TRITON_CACHE_DIR=str(tmp_path / "triton-cache"),
               TRITON_DEFAULT_FP_FUSION="1")
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "-c", PRELUDE + body], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_recorded_kernels_compile_in_children_and_the_parent_loads_them_from_the_cache(tmp_path):
    r = _run(r'''
launched = []
def dry():
    launched.append(rms(False)); launched.append(rms(False))  # the same specialization twice: one spec
    launched.append(rms(True)); launched.append(silu())
specs = tp.record(dry)
first = tp.compile_specs(specs, TARGET).wait()
again = tp.compile_specs(specs, TARGET).wait()
kernels = [rms(False, warmup=True), rms(True, warmup=True), silu(warmup=True)]
print(json.dumps({"launched": [k is None for k in launched], "names": [s["name"] for s in specs],
                  "first": first, "again": again, "hits": hits, "compiled": [k is not None for k in kernels],
                  "recorders": len(tp._RECORDERS)}))
''', tmp_path)
    assert r["launched"] == [True] * 4  # recorded launches neither compile nor run
    assert r["names"] == ["_rms_norm_kernel", "_rms_norm_kernel", "_silu_mul_kernel"]
    first = r["first"]
    assert (first["recorded"], first["cached"], first["compiled"], first["failed"]) == (3, 0, 3, 0)
    assert first["workers"] == min(3, os.cpu_count())  # never more children than CPUs
    again = r["again"]  # now in the on-disk cache: no child started
    assert (again["cached"], again["compiled"], again["workers"]) == (3, 0, 0)
    assert r["hits"] == [True, True, True]  # the parent's compilations were cache hits
    assert r["compiled"] == [True, True, True]
    assert r["recorders"] == 0


def test_other_threads_compile_while_one_thread_records(tmp_path):
    r = _run(r'''
other = {}
def dry():
    rms(False)
    t = threading.Thread(target=lambda: other.update(k=silu(warmup=True) is not None))
    t.start(); t.join()
specs = tp.record(dry)
after = rms(False, warmup=True) is not None  # recording over: this thread compiles again
print(json.dumps({"names": [s["name"] for s in specs], "other": other["k"], "after": after, "hits": hits}))
''', tmp_path)
    assert r["names"] == ["_rms_norm_kernel"]  # the other thread's kernel is not recorded...
    assert r["other"] is True  # ...it compiled there
    assert r["after"] is True
    assert r["hits"] == [False, False]  # both compiled in this process (nothing precompiled)


def test_a_failing_child_is_counted_and_a_failing_warm_up_returns_none(tmp_path):
    r = _run(r'''
specs = tp.record(lambda: (rms(False), silu()))
bad = dict(specs[0], data=specs[0]["data"].replace('"BLOCK"', '"NO_SUCH_ARG"'))
st = tp.compile_specs([bad, specs[1]], TARGET, max_workers=1).wait()
def boom():
    rms(True)
    raise ValueError("warm-up failed")
res = tp.precompile(boom, "cuda")
print(json.dumps({"stats": st, "precompile": res, "recorders": len(tp._RECORDERS),
                  "compiles": rms(True, warmup=True) is not None}))
''', tmp_path)
    st = r["stats"]  # one child with both: it exits 1, both count as failed (the good one is cached anyway)
    assert (st["recorded"], st["compiled"], st["failed"], st["workers"]) == (2, 0, 2, 1)
    assert r["precompile"] is None  # logged, not raised: the real warm-up compiles as before
    assert r["recorders"] == 0
    assert r["compiles"] is True


def test_the_recording_pass_runs_one_graph_size_per_specialization_class():
    from rlserve.engine.worker.cuda_graph import capture_sizes, specialization_representatives

    # classes: == 1, and the power-of-two factor capped at 16 (Triton's "equal to 1" / "divisible by 16")
    assert specialization_representatives(capture_sizes(256)) == [256, 8, 4, 2, 1]
    assert specialization_representatives([1, 64, 256]) == [256, 1]
    assert specialization_representatives([3, 5, 24, 40, 48]) == [48, 40, 5]
    assert specialization_representatives([1]) == [1]


def test_the_weight_sync_kernel_is_recorded_and_compiled_in_children(tmp_path):
    """The start-up warm-up's weight-sync launches (rlserve.transfer.multi_tensor.warmup, four variants) are
    recorded under a name a child can import (the kernel was defined inside a function: skipped, so the
    receiver compiled it at its connect) and compile there."""
    r = _run(r'''
from rlserve.transfer import multi_tensor
specs = tp.record(lambda: multi_tensor.warmup(torch.device("cpu"), _allow_cpu=True))
st = tp.compile_specs(specs, TARGET).wait()
print(json.dumps({"names": [(s["module"], s["name"]) for s in specs], "stats": st}))
''', tmp_path)
    assert r["names"] == [["rlserve.transfer.multi_tensor_kernel", "copy_sum"]] * 4
    st = r["stats"]
    assert (st["recorded"], st["cached"], st["compiled"], st["failed"]) == (4, 0, 4, 0)
