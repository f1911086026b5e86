"""Sleep mode on the CPU (issue 19): the offline ``LLM``'s ``sleep`` / ``wake_up`` state machine,
what each level does to the weights (level 1 restores them exactly, level 2 really loses them:
a full wake reloads the checkpoint, a load between the two wakes gives the trainer's greedy
output), the 409s of out-of-order calls (nothing changed), and ``generate`` refused while asleep.

Each test runs twice: with the CPU's in-place regions, and with the GPU's arena path (parameters
re-pointed into one flat arena, the KV cache cut out of another) over :class:`HostArena`, a
host-memory stand-in for the CUDA VMM arena whose unmap overwrites the pages and whose map hands
back garbage, as new physical pages would. The HTTP routes are in tests/test_sleep_server.py;
the real VMM in tests/gpu/test_sleep_gpu.py."""

from __future__ import annotations

import pytest
import torch

from rlserve.engine.llm import LLM
from rlserve.engine.sampling_params import SamplingParams
from rlserve.errors import InvalidRequestError, ModelSleepingError, SleepStateError
from tests.transfer_harness import greedy_continuation, load_hf

PROMPTS = [[5, 17, 42, 9, 77, 3], [100, 101, 7, 8]]
N_TOK = 6
GREEDY = SamplingParams(temperature=0, max_tokens=N_TOK, ignore_eos=True)


def _greedy(llm) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]


def _params(llm) -> list[torch.Tensor]:
    return [p.detach().clone() for p in llm.engine.model.parameters()]


class HostArena:
    """:class:`~rlserve.engine.worker.cuda_vmm.VMMArena`'s interface over one host buffer: ``unmap``
    overwrites it with 0xFF (NaN in every float dtype), ``map`` with 0xAB (new pages hold
    anything), ``view`` refuses while unmapped. Addresses never move."""

    device = torch.device("cpu")

    def __init__(self, nbytes: int):
        self.size = -(-int(nbytes) // 4096) * 4096
        self.buf = torch.full((self.size,), 0xAB, dtype=torch.uint8)
        self.ptr = self.buf.data_ptr()
        self.mapped = True

    def map(self):
        if not self.mapped:
            self.buf.fill_(0xAB)
            self.mapped = True

    def unmap(self):
        self.buf.fill_(0xFF)
        self.mapped = False

    def view(self, offset=0, nbytes=None):
        assert self.mapped, "a view of an unmapped arena"
        return self.buf[offset: offset + (self.size - offset if nbytes is None else nbytes)]

    def close(self):
        self.mapped = False


@pytest.fixture(scope="module", params=["inplace", "arena"])
def llm(request, tiny_model):
    from rlserve.engine.worker.sleep_memory import WorkerSleep

    mp = pytest.MonkeyPatch()
    if request.param == "arena":
        init = WorkerSleep.__init__
        mp.setattr(WorkerSleep, "__init__", lambda self, worker: init(self, worker, arena_factory=HostArena))
    try:
        llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4,
                  kv_cache_bytes=4 << 20, enable_sleep_mode=True)
    finally:
        mp.undo()
    ws = llm.engine.executor.sleep
    assert ws.vmm == (request.param == "arena")
    if ws.vmm:  # every parameter and KV tensor lives in an arena
        for region, tensors in ((ws.regions["weights"], list(llm.engine.model.parameters())),
                                (ws.regions["kv_cache"], [t for kv in llm.engine.executor.runner.kv_caches for t in kv])):
            lo, hi = region.arena.ptr, region.arena.ptr + region.arena.size
            assert all(lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi for t in tensors)
    return llm


def _addresses(llm) -> list[int]:
    runner = llm.engine.executor.runner
    return [p.data_ptr() for p in llm.engine.model.parameters()] + [t.data_ptr() for kv in runner.kv_caches for t in kv]


def test_level1_restores_exactly_and_refuses_generation(llm):
    before, weights, addrs = _greedy(llm), _params(llm), _addresses(llm)
    kv = llm.engine.executor.runner.kv_caches[0][0]
    llm.sleep(level=1)
    assert llm.is_sleeping()
    info = llm.engine.sleep_mode.info()
    assert info["tags"] == {"weights": "offloaded", "kv_cache": "discarded"} and info["level"] == 1
    asleep = info["bytes"]["weights"] + info["bytes"]["kv_cache"]
    assert info["bytes_discarded"] == asleep > 0
    # the arena (CUDA's path) gives its pages back; the CPU's in-place regions keep their memory
    assert info["bytes_released"] == (asleep if llm.engine.executor.sleep.vmm else 0)
    # really gone from the model while asleep (NaN bytes), not just flagged
    assert all(torch.isnan(p).all() for p in llm.engine.model.parameters())
    assert torch.isnan(kv).all()
    with pytest.raises(ModelSleepingError):
        llm.generate(PROMPTS, GREEDY)
    assert not llm.engine.has_unfinished_requests()  # nothing was queued
    llm.wake_up()
    assert not llm.is_sleeping()
    assert all(torch.equal(a, b) for a, b in zip(weights, _params(llm)))
    assert not kv.any()  # the KV cache comes back zeroed
    assert _addresses(llm) == addrs
    assert _greedy(llm) == before


def test_level1_on_the_cpu_copies_nothing(llm):
    """The sleep reports the bytes it copied to host memory: the arena (CUDA's path) copies its
    used bytes; the CPU's weights already are in host memory, so a level-1 sleep sets them aside
    without copying or writing a byte (the memory behind the parameters keeps its values while
    the parameters read NaN); the wake gives back the same tensors. The code before copied every
    weight (538 MB for SmolLM2, 0.24-9.56 s under load) and overwrote the memory with 0xFF."""
    ws = llm.engine.executor.sleep
    weights = _params(llm)
    held = [p.data for p in llm.engine.model.parameters()]  # the memory itself, not a copy
    llm.sleep(level=1)
    try:
        info = llm.engine.sleep_mode.info()
        if ws.vmm:
            assert info["last_sleep_copied_bytes"] == ws.regions["weights"].used > 0
        else:
            assert info["last_sleep_copied_bytes"] == 0
            assert all(torch.equal(a, b) for a, b in zip(held, weights))  # never written
            assert all(torch.isnan(p).all() for p in llm.engine.model.parameters())
    finally:
        llm.wake_up()
    assert all(torch.equal(a, b) for a, b in zip(weights, _params(llm)))
    if not ws.vmm:
        assert [p.data_ptr() for p in llm.engine.model.parameters()] == [t.data_ptr() for t in held]
    llm.sleep(level=2)  # level 2 still loses them, in the same memory
    try:
        assert llm.engine.sleep_mode.info()["last_sleep_copied_bytes"] == 0
        if not ws.vmm:
            assert all(torch.isnan(t).all() for t in held if t.is_floating_point())
    finally:
        llm.wake_up()  # reloads the checkpoint
    assert all(torch.equal(a, b) for a, b in zip(weights, _params(llm)))


def test_out_of_order_calls_are_refused_and_change_nothing(llm):
    with pytest.raises(SleepStateError) as ei:
        llm.wake_up()
    assert ei.value.code == "not_sleeping"
    with pytest.raises(InvalidRequestError):
        llm.sleep(level=3)
    assert not llm.is_sleeping()
    llm.sleep(level=1)
    try:
        for call in (lambda: llm.sleep(level=1), lambda: llm.sleep(level=2)):
            with pytest.raises(SleepStateError) as ei:
                call()
            assert ei.value.code == "already_sleeping"
        with pytest.raises(InvalidRequestError):
            llm.wake_up(["weights", "bogus"])
        assert llm.engine.sleep_mode.info()["tags"] == {"weights": "offloaded", "kv_cache": "discarded"}
        # a load into weights offloaded by a level-1 sleep would be overwritten by the wake
        with pytest.raises(SleepStateError) as ei:
            llm.engine.load_weights([])
        assert ei.value.code == "weights_offloaded"
        llm.wake_up(["kv_cache"])
        assert llm.is_sleeping()  # weights still asleep: still no generation
        with pytest.raises(ModelSleepingError):
            llm.generate(PROMPTS, GREEDY)
        with pytest.raises(SleepStateError) as ei:
            llm.wake_up(["kv_cache"])
        assert ei.value.code == "not_sleeping"
    finally:
        if llm.is_sleeping():
            llm.wake_up()
    assert not llm.is_sleeping()


def test_level2_full_wake_reloads_the_checkpoint(llm):
    before, weights = _greedy(llm), _params(llm)
    llm.sleep(level=2)
    assert llm.engine.sleep_mode.info()["tags"] == {"weights": "discarded", "kv_cache": "discarded"}
    assert all(torch.isnan(p).all() for p in llm.engine.model.parameters())
    reloads = llm.engine.sleep_mode.stats["reloads"]
    llm.wake_up(["weights"])  # memory back, contents undefined: no generation yet
    assert not any(torch.equal(a, b) for a, b in zip(weights, _params(llm)))
    llm.wake_up(["kv_cache"])  # fully awake, nobody refilled the weights: the checkpoint again
    assert llm.engine.sleep_mode.stats["reloads"] == reloads + 1
    assert all(torch.equal(a, b) for a, b in zip(weights, _params(llm)))
    assert _greedy(llm) == before


def test_level2_load_between_wakes_gives_the_trainers_greedy(llm, tiny_model):
    hf = load_hf(tiny_model("llama"), seed=1)  # a different, non-degenerate greedy
    expected = [greedy_continuation(hf, p, N_TOK) for p in PROMPTS]
    before = _greedy(llm)
    assert expected != before and len({t for e in expected for t in e}) > 3
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    llm.engine.load_weights((k, v.detach().clone()) for k, v in hf.state_dict().items())
    reloads = llm.engine.sleep_mode.stats["reloads"]
    llm.wake_up(tags=["kv_cache"])
    assert llm.engine.sleep_mode.stats["reloads"] == reloads  # refilled: no reload
    assert _greedy(llm) == expected
    # back to the checkpoint for the other tests: level 2 + a plain wake reloads it
    llm.sleep(level=2)
    llm.wake_up()
    assert _greedy(llm) == before


def test_sleep_mode_off(tiny_model):
    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", max_model_len=64, max_num_seqs=2,
              kv_cache_bytes=1 << 20)
    assert not llm.is_sleeping()
    with pytest.raises(SleepStateError) as ei:
        llm.sleep()
    assert ei.value.code == "sleep_mode_disabled"


def test_wake_without_free_memory_stays_asleep(tiny_model, monkeypatch):
    """The driver says out of memory (another process holds it): SleepMemoryError (HTTP 503),
    nothing half-awake (a region that did come back is released again), a later wake works."""
    from rlserve.engine.worker.cuda_vmm import CUDADriverError
    from rlserve.engine.worker.sleep_memory import WorkerSleep
    from rlserve.errors import SleepMemoryError

    class TakenArena(HostArena):
        taken = False

        def map(self):
            if not self.mapped and TakenArena.taken and self.size > 1 << 20:  # the KV arena (4 MiB)
                raise CUDADriverError("cuMemCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY")
            super().map()

    init = WorkerSleep.__init__
    monkeypatch.setattr(WorkerSleep, "__init__", lambda self, worker: init(self, worker, arena_factory=TakenArena))
    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4,
              kv_cache_bytes=4 << 20, enable_sleep_mode=True)
    ws = llm.engine.executor.sleep
    assert ws.regions["weights"].arena.size < 1 << 20 < ws.regions["kv_cache"].arena.size
    before = _greedy(llm)
    llm.sleep(level=1)
    TakenArena.taken = True
    with pytest.raises(SleepMemoryError):
        llm.wake_up()  # weights come back first, then the KV cache fails
    assert llm.engine.sleep_mode.info()["tags"] == {"weights": "offloaded", "kv_cache": "discarded"}
    assert ws.state == {"weights": "offloaded", "kv_cache": "discarded"}  # weights released again
    assert not ws.regions["weights"].arena.mapped
    with pytest.raises(ModelSleepingError):
        llm.generate(PROMPTS, GREEDY)
    TakenArena.taken = False
    llm.wake_up()
    assert _greedy(llm) == before
