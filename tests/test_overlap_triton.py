"""The overlapped loop's decode step after a prefill step (launched before the prefill is read, its
new rows' input ids gathered on the device: ``DecodeCUDAGraphs.run`` with ``(tokens, rows, where)``)
through the Triton attention kernels in Triton's interpreter (``TRITON_INTERPRET=1``; skipped where
CUDA is present: ``tests/gpu/test_overlap_gpu.py`` runs the compiled kernels and real graphs there)
and the emulated CUDA-graph decode path: greedy tokens equal the torch backend's plain loop, logprobs
within 1e-4 (float32: the bound ``tests/test_triton_interpret.py`` holds between the two backends)."""

from __future__ import annotations

import pytest

import tests.triton_interp  # (skips this module, or sets TRITON_INTERPRET=1 first)

tests.triton_interp.rebuild("rlserve.layers.triton_attention_kernels", "rlserve.layers.triton_attention")
from rlserve.layers.attention import get_attention_backend, set_attention_backend  # noqa: E402


@pytest.fixture
def restore_backend():
    name = get_attention_backend()
    yield
    set_attention_backend(name)


def test_decode_after_prefill_through_emulated_graphs_matches_the_plain_loop(tiny_model, restore_backend,
                                                                             monkeypatch):
    from rlserve import LLM, SamplingParams
    from rlserve.engine.worker.cuda_graph import DecodeCUDAGraphs
    from tests.test_mixed_steps import _staggered

    path = tiny_model("smollm")
    prompts = ["The capital of France is", "Hello world! Hello there, how are you", "Once upon a time there",
               "One two three four five six seven"]
    params = SamplingParams(temperature=0, max_tokens=5, min_tokens=5, logprobs=2)
    kw = dict(dtype="float32", device="cpu", block_size=4, max_num_seqs=4, max_consecutive_prefill_steps=1)
    set_attention_backend("torch")
    ref, _ = _staggered(LLM(path, **kw), prompts, params)
    monkeypatch.setenv("RLSERVE_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("RLSERVE_CPU_MICROBATCHES", "1")  # the interpreter's grid is global state
    monkeypatch.setenv("RLSERVE_OVERLAP_AFTER_PREFILL", "1")
    forms = []
    real_run = DecodeCUDAGraphs.run

    def run(self, *a, ids_from=None, **k):
        forms.append(None if ids_from is None else len(ids_from))
        return real_run(self, *a, ids_from=ids_from, **k)

    monkeypatch.setattr(DecodeCUDAGraphs, "run", run)
    llm = LLM(path, extra={"async_scheduling": True}, **kw)
    assert get_attention_backend() == "triton" and llm.engine._overlap is not None
    runner = llm.engine.executor.runner
    runner.use_cuda_graphs = True  # DecodeCUDAGraphs emulates replay on CPU
    outs, _ = _staggered(llm, prompts, params)
    assert runner.cuda_graphs is not None and runner.cuda_graphs.emulate
    assert 3 in forms and 2 in forms  # replays with some rows' ids from the device, and with all of them
    assert llm.engine._overlap.counts["early_host_rows"] > 0 and llm.engine._overlap.counts["after_read"] == 0
    for a, b in zip(outs, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in db:
                assert abs(da[t] - db[t]) < 1e-4
