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


def test_a_moe_models_recording_pass_covers_its_forwards_and_the_weight_sync_kernel(tmp_path, tiny_model):
    """A model with routed experts records its whole warm-up for the children (``ModelRunner._record_pass``):
    before session 24 it recorded only its fused-MoE kernels (``precompile_safe`` refused the rest), so on a cold
    Triton cache its forwards' kernels and the weight sync's four ``copy_sum`` variants compiled one after the
    other in the warm-up. A tiny Qwen3-MoE's runner on the CPU: its forwards launch no Triton kernel here (the CPU
    paths), so what is recorded is the weight-sync warm-up, let onto CPU tensors as in the test above; the
    fused-MoE part needs CUDA (``jit_warmup.moe_layers`` is empty on the CPU). During the pass every sparse layer
    of every warm-up forward returns zeros (``jit_warmup.routed_experts_off``) and routing never runs (its skipped
    kernel would leave uninitialized expert ids); after it, and after an exception inside the switch, each layer
    routes again and gives what it gave before (bitwise: same inputs, same CPU kernels)."""
    r = _run(r'''
from rlserve.config import EngineConfig
from rlserve.engine.core.llm_engine import LLMEngine
from rlserve.engine.worker import jit_warmup
from rlserve.layers import moe
from rlserve.transfer import multi_tensor

runner = LLMEngine(EngineConfig(%r, dtype="float32", device="cpu", max_model_len=128, max_num_seqs=2)).executor.runner
jit_warmup.warm_weight_sync = lambda device: multi_tensor.warmup(device, _allow_cpu=True)
routed, off = [], []
real_route, real_off = moe.route, jit_warmup._no_experts
moe.route = lambda *a: (routed.append(1), real_route(*a))[1]
jit_warmup._no_experts = lambda x, logits: (off.append(x.shape[0]), real_off(x, logits))[1]
layers = [m for m in runner.model.modules() if isinstance(m, moe.FusedMoE)]
g = torch.Generator().manual_seed(0)
x = torch.randn(3, layers[0].hidden_size, generator=g)
logits = torch.randn(3, layers[0].num_experts, generator=g)
before = [m(x, logits) for m in layers]
routed.clear()
specs = tp.record(lambda: runner._record_pass(False))
routed_in_pass, right_after = len(routed), [float(t.abs().sum()) for t in (m(x, logits) for m in layers)]
try:
    with jit_warmup.routed_experts_off(runner.model):
        raise KeyError("inside")
except KeyError:
    pass
after = [m(x, logits) for m in layers]
counts = sorted({min(n, runner._max_batched_tokens()) for n in jit_warmup.prefill_token_counts(runner.model, runner.device)})
print(json.dumps({"names": [(s["module"], s["name"]) for s in specs], "routed_in_pass": routed_in_pass,
                  "off": off, "counts": counts, "layers": len(layers), "routed_after": len(routed),
                  "same": [bool(torch.equal(a, b)) for a, b in zip(before, after)],
                  "nonzero": [float(a.abs().sum()) > 0 for a in after], "right_after": right_after,
                  "instance_forward": [("forward" in m.__dict__) for m in layers]}))
''' % tiny_model("qwen3_moe"), tmp_path)
    assert r["names"] == [["rlserve.transfer.multi_tensor_kernel", "copy_sum"]] * 4
    assert r["routed_in_pass"] == 0
    assert r["layers"] >= 1
    # each warm-up forward's token count, once per sparse layer, in forward order
    assert r["off"] == [n for n in r["counts"] for _ in range(r["layers"])], r
    assert r["routed_after"] == 2 * r["layers"]  # the two calls after the pass, one per layer each
    assert r["same"] == [True] * r["layers"] and r["nonzero"] == [True] * r["layers"]
    assert all(z > 0 for z in r["right_after"])  # right after the pass the experts are back (not zeros)
    assert r["instance_forward"] == [False] * r["layers"]
