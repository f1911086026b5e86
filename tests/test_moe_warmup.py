"""The fused-MoE warm-up covers every kernel specialization serving can launch
(:func:`rlserve.layers.moe_kernels.warm_up`, issue 35): counted on the CPU without compiling.

Each Triton launch of the MoE path is recorded with the key Triton compiles by (read from the
real ``JITFunction``'s parameters): constexpr values, ``num_warps`` / ``num_stages``, tensor
dtypes and 16-byte alignment, and for an integer argument not in ``do_not_specialize`` its class
``(== 1, % 16 == 0)``. Tensors live on the ``meta`` device (no memory, no arithmetic: only the
launch arguments matter) and the sm90 tuned table is forced on, as on an H100 / H200. Nothing is
launched, so Triton's interpreter mode (``tests.triton_interp``, shared with the interpreter tests
of the same process) changes nothing but where ``do_not_specialize`` is read from.
"""

from __future__ import annotations

import types

import pytest
import torch

import tests.triton_interp  # noqa: F401  (skips on CUDA or without Triton; Triton's interpreter mode)
from rlserve.layers import moe_kernels as mk  # noqa: E402

E, K, H, I = 128, 8, 2048, 768  # Qwen3-30B-A3B's experts: the tuned table's shape


def _params(fn):
    """``[(name, constexpr?, in do_not_specialize?)]`` of a Triton kernel, compiled
    (``JITFunction``) or interpreted (``InterpretedFunction`` keeps ``triton.jit``'s arguments)."""
    import inspect

    if hasattr(fn, "params"):
        return [(p.name, p.is_constexpr, bool(p.do_not_specialize)) for p in fn.params]
    dns = set(fn.kwargs.get("do_not_specialize") or ())
    return [(q.name, "constexpr" in str(q.annotation), q.name in dns)
            for q in inspect.signature(fn.fn).parameters.values()]


def _key(fn, args, kwargs, honour_dns=True):
    """Triton's compilation key of one launch of kernel ``fn`` (see the module docstring);
    ``honour_dns=False``: as if ``do_not_specialize`` were empty (the kernels before it)."""
    parts = [fn.fn.__name__]
    for (name, constexpr, dns), v in zip(_params(fn), list(args) + [kwargs.get(q[0]) for q in _params(fn)[len(args):]]):
        if constexpr or isinstance(v, bool):
            parts.append((name, v))
        elif isinstance(v, torch.Tensor):
            parts.append((name, v.dtype, v.data_ptr() % 16 == 0))
        elif isinstance(v, int):
            parts.append((name, "int") if (dns and honour_dns) else (name, v == 1, v % 16 == 0))
        else:
            parts.append((name, type(v).__name__))
    parts.append(("num_warps", kwargs.get("num_warps")))
    parts.append(("num_stages", kwargs.get("num_stages")))
    return tuple(parts)


class _Recorder:
    """Stands for the kernels module: ``kernel[grid](...)`` records keys instead of launching."""

    def __init__(self, honour_dns=True):
        from rlserve.layers import moe_triton_kernels as real

        self.keys: set = set()
        for name in ("fused_moe_kernel", "moe_align_counts_kernel", "moe_align_scatter_kernel", "topk_softmax_kernel"):
            fn = getattr(real, name)

            def launcher(grid, fn=fn):
                return lambda *a, **kw: self.keys.add(_key(fn, a, kw, honour_dns))

            setattr(self, name, _Indexable(launcher))


class _Indexable:
    def __init__(self, launcher):
        self._launcher = launcher

    def __getitem__(self, grid):
        return self._launcher(grid)


def _layer(dtype=torch.bfloat16):
    return types.SimpleNamespace(
        w13_weight=torch.empty(E, 2 * I, H, dtype=dtype, device="meta"),
        w2_weight=torch.empty(E, H, I, dtype=dtype, device="meta"), w13_weight_scale=None,
        w2_weight_scale=None, top_k=K, renormalize=True, fp8=False)


def _serve(layer, token_counts):
    """The serving path's launches (routing + experts) for batches of ``token_counts`` tokens."""
    for T in token_counts:
        logits = torch.empty(T, E, dtype=torch.bfloat16, device="meta")
        weights, ids = mk.topk_softmax(logits, K, True)
        mk.experts_triton(torch.empty(T, H, dtype=torch.bfloat16, device="meta"), layer.w13_weight,
                          layer.w2_weight, weights, ids)


# mixed lengths: decode batches (1..256, odd and even), prefill chunks and mixed steps up to 8,192 tokens
WORKLOAD = sorted(set(range(1, 300)) | {383, 384, 385, 511, 767, 768, 769, 1000, 1023, 1024, 2047, 4095, 8191, 8192})


@pytest.fixture
def recording(monkeypatch):
    def start(honour_dns=True, tuned=True):
        rec = _Recorder(honour_dns)
        monkeypatch.setattr(mk, "_kernels", lambda: rec)
        monkeypatch.setattr(mk, "triton_runs_on", lambda device_type: True)
        monkeypatch.setattr(mk, "tuned_device", lambda device, wdtype: tuned)
        return rec
    return start


@pytest.mark.parametrize("tuned", [True, False])
def test_no_new_specialization_after_warm_up(recording, tuned):
    """After the warm-up, a workload of mixed lengths launches no specialization it did not: 5 tile
    classes (tuned) or 2 (vLLM's default rule) x 2 GEMMs, one routing kernel, one counts kernel per
    distinct BLOCK_M, one scatter kernel."""
    rec = recording(tuned=tuned)
    layer = _layer()
    launches = mk.warm_up([layer, _layer()], torch.bfloat16)  # two layers of one shape: warmed once
    warmed = set(rec.keys)
    classes = 5 if tuned else 2
    assert len(launches) == classes
    block_ms = {c[5][0] for c in launches}
    n_fused = sum(1 for k in warmed if k[0] == "fused_moe_kernel")
    assert n_fused == 2 * classes
    assert len(warmed) == 2 * classes + 1 + len(block_ms) + 1
    _serve(layer, WORKLOAD)
    assert rec.keys - warmed == set()
    # every class was reached by the workload too (the warm-up compiles nothing serving never uses)
    assert {k for k in rec.keys if k[0] == "fused_moe_kernel"} == {k for k in warmed if k[0] == "fused_moe_kernel"}


def test_old_specialization_compiled_odd_batches_after_warm_up(recording):
    """The same workload with the batch-sized integers specialized (the kernels before
    ``do_not_specialize``): odd token counts launch specializations the warm-up did not compile, the
    compiles that landed in session 14's and 15's timed runs on a fresh Triton cache."""
    rec = recording(honour_dns=False)
    layer = _layer()
    mk.warm_up([layer], torch.bfloat16)
    warmed = set(rec.keys)
    _serve(layer, WORKLOAD)
    assert len(rec.keys - warmed) > 0


def test_tuned_table_picks():
    """The coarsened vLLM H200 table (bounds in tokens, times top_k in pairs) and the default rule."""
    t = mk.config_table(E, I, K, tuned=True)
    assert [mk.pick(t, T * K)[:3] for T in (1, 32, 33, 192, 193, 384, 385, 768, 769, 8192)] == [
        (16, 64, 128), (16, 64, 128), (16, 128, 128), (16, 128, 128), (32, 256, 128), (32, 256, 128),
        (64, 128, 64), (64, 128, 64), (128, 256, 64), (128, 256, 64)]
    d = mk.config_table(E, I, K, tuned=False)
    assert mk.pick(d, 4 * E) == mk.CONFIGS["small"] and mk.pick(d, 4 * E + 1) == mk.CONFIGS["large"]
    # another shape (e.g. I split over 2 TP ranks): the default rule even where tuned tables apply
    assert mk.config_table(E, I // 2, K, tuned=True) == d


def test_tuned_table_that_fails_falls_back_to_the_default_rule(recording, monkeypatch):
    """A tuned tile that does not compile on this card (e.g. out of shared memory) costs a warning,
    not the engine: the shape goes back to vLLM's default rule, warmed instead, and serving picks it."""
    rec = recording(tuned=True)
    monkeypatch.setattr(mk, "_TUNED_OFF", set())
    real = mk.experts_triton

    def fails_on_big_tiles(*a, config=None, **kw):
        if config is not None and config[0] == 128:
            raise RuntimeError("out of resources: shared memory")
        return real(*a, config=config, **kw)

    monkeypatch.setattr(mk, "experts_triton", fails_on_big_tiles)
    layer = _layer()
    launches = mk.warm_up([layer], torch.bfloat16)
    default = mk.config_table(E, I, K, tuned=False)
    assert [c[5] for c in launches[-2:]] == [cfg for _, cfg in default]
    assert mk.layer_table(layer.w13_weight, K) == default
    warmed = set(rec.keys)
    monkeypatch.setattr(mk, "experts_triton", real)
    _serve(layer, WORKLOAD)
    assert rec.keys - warmed == set()


def test_tuned_configs_switch(monkeypatch):
    """The tuned table is on by default on sm90 (measured faster on an H100, session 16) and off with
    ``RLSERVE_MOE_TUNED_CONFIGS=0``, decided before any device query (so this runs without a GPU:
    the capability cache stands in for the device); other capabilities, fp8 experts and non-CUDA
    devices never take it, switched on or not."""
    monkeypatch.delenv("RLSERVE_MOE_TUNED_CONFIGS", raising=False)
    monkeypatch.setitem(mk._SM90, 0, True)
    assert mk.tuned_device(torch.device("cuda", 0), torch.bfloat16) is True
    monkeypatch.setitem(mk._SM90, 0, False)  # e.g. an A100 (sm80): the default rule
    assert mk.tuned_device(torch.device("cuda", 0), torch.bfloat16) is False
    monkeypatch.setitem(mk._SM90, 0, True)
    monkeypatch.setenv("RLSERVE_MOE_TUNED_CONFIGS", "0")
    assert mk.tuned_device(torch.device("cuda", 0), torch.bfloat16) is False
    monkeypatch.setenv("RLSERVE_MOE_TUNED_CONFIGS", "1")
    assert mk.tuned_device(torch.device("cpu"), torch.bfloat16) is False
    assert mk.tuned_device(torch.device("cuda", 0), torch.float8_e4m3fn) is False
