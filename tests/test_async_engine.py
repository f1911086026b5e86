"""AsyncEngine: threads, pause modes, held requests, errors, DP balancing, versions.

Most tests drive a small fake engine (deterministic, one token per step, errors on
demand); the last ones run the real LLMEngine on a tiny random model."""

from __future__ import annotations

import asyncio
import threading
import time
import types

import pytest

from rlserve.engine.front.async_engine import AsyncEngine, HeldTooLongError
from rlserve.errors import EngineStepError
from rlserve.engine.outputs import CompletionOutput, RequestOutput
from rlserve.engine.sampling_params import SamplingParams
from rlserve.errors import InvalidRequestError, ModelUnavailableError

T = 20.0  # bound on every await in this module (seconds)


class FakeEngine:
    """Emits token ``prompt[0] + k`` at step k; finishes after ``max_tokens``."""

    def __init__(self, cfg, dp_index, step_s=0.002):
        self.dp_index = dp_index
        self.reqs: dict = {}
        self.step_s = step_s
        self.fail_steps = 0
        self.resets = 0
        self.steps = 0
        self.thread_ids = set()
        self.stats = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}

    def add_request(self, rid, prompt, params):
        self.thread_ids.add(threading.get_ident())
        if rid in self.reqs:
            raise InvalidRequestError(f"duplicate {rid}")
        if prompt == [666]:
            raise InvalidRequestError("bad prompt 666")
        self.reqs[rid] = (list(prompt), params, [[] for _ in range(params.n)])

    def _out(self, rid, reason=None):
        prompt, params, gens = self.reqs[rid]
        outs = [CompletionOutput(index=i, text="".join(f"<{t}>" for t in g), token_ids=list(g),
                                 finish_reason=reason if reason else ("length" if len(g) >= params.max_tokens else None))
                for i, g in enumerate(gens)]
        return RequestOutput(rid, None, prompt, None, outs, all(o.finish_reason for o in outs))

    def step(self):
        self.thread_ids.add(threading.get_ident())
        time.sleep(self.step_s)
        self.steps += 1
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("injected step failure")
        outs = []
        for rid in list(self.reqs):
            prompt, params, gens = self.reqs[rid]
            for g in gens:
                g.append(prompt[0] + len(g))
            out = self._out(rid)
            outs.append(out)
            if out.finished:
                del self.reqs[rid]
        return outs

    def abort_request(self, ids):
        ids = [ids] if isinstance(ids, str) else list(ids)
        outs = [self._out(r, "abort") for r in ids if r in self.reqs]
        for r in ids:
            self.reqs.pop(r, None)
        return outs

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def reset_prefix_cache(self):
        self.resets += 1


def _cfg(dp=1):
    return types.SimpleNamespace(data_parallel_size=dp, tensor_parallel_size=1, device="cpu", device_ids=None,
                                 max_logprobs=20)


@pytest.fixture
def fake():
    engines = []

    def factory(cfg, i):
        e = FakeEngine(cfg, i)
        engines.append(e)
        return e

    def make(dp=1, **kw):
        a = AsyncEngine(_cfg(dp), engine_factory=factory, **kw)
        made.append(a)
        return a, sorted(engines, key=lambda e: e.dp_index)

    made = []
    yield make
    for a in made:
        a.shutdown()


async def _run(aeng, prompt, max_tokens=5, n=1, rid=None):
    last = None
    async for out in aeng.generate(prompt, SamplingParams(max_tokens=max_tokens, n=n), rid):
        last = out
    return last


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, T))


def test_generate_on_engine_thread(fake):
    aeng, (eng,) = fake()

    async def main():
        outs = [o async for o in aeng.generate([10], SamplingParams(max_tokens=4, n=2), "a")]
        return outs

    outs = run(main())
    assert [o.outputs[0].token_ids for o in outs][-1] == [10, 11, 12, 13]
    assert outs[-1].finished and outs[-1].outputs[1].finish_reason == "length"
    assert all(o.weight_version == "0" for o in outs)
    assert eng.thread_ids and threading.get_ident() not in eng.thread_ids


def test_non_streaming_and_slow_consumers(fake):
    aeng, engines = fake()

    async def main():
        finals = [o async for o in aeng.generate([1], SamplingParams(max_tokens=30), stream=False)]
        assert len(finals) == 1 and finals[0].finished and finals[0].outputs[0].token_ids == list(range(1, 31))
        assert finals[0].first_token_time >= finals[0].arrival_time
        seen = []
        async for o in aeng.generate([1], SamplingParams(max_tokens=30), "slow"):
            seen.append(len(o.outputs[0].token_ids))
            while any("slow" in e.reqs for e in engines):  # a consumer slower than the engine (state)
                await asyncio.sleep(0.005)
        # the outputs made while it was away coalesced into the final one
        assert seen[-1] == 30 and seen == sorted(seen) and len(seen) <= 2

    run(main())


def test_invalid_request_fails_only_itself(fake):
    aeng, _ = fake()

    async def main():
        with pytest.raises(InvalidRequestError, match="666"):
            await _run(aeng, [666])
        return await _run(aeng, [1])

    assert run(main()).outputs[0].token_ids == [1, 2, 3, 4, 5]
    assert aeng.num_unfinished == 0


def test_step_error_fails_requests_and_keeps_serving(fake):
    aeng, (eng,) = fake()

    async def main():
        eng.fail_steps = 1
        with pytest.raises(EngineStepError, match="injected step failure"):
            await _run(aeng, [1])
        return await _run(aeng, [2])

    assert run(main()).outputs[0].token_ids == [2, 3, 4, 5, 6]
    assert aeng.is_alive()


def test_unavailable_and_weight_versions(fake):
    aeng, _ = fake()

    async def main():
        aeng.set_unavailable("half-updated weights")
        with pytest.raises(ModelUnavailableError, match="half-updated"):
            await _run(aeng, [1])
        aeng.set_unavailable(None)
        seen = []
        async for out in aeng.generate([1], SamplingParams(max_tokens=40)):
            seen.append(out)
            if len(seen) == 3:
                aeng.set_weight_version("7")
        return seen

    seen = run(main())
    assert seen[0].weight_version == "0" and seen[-1].weight_version == "7"
    assert seen[-1].weight_versions == ["0", "7"]


def test_every_replica_stamps_the_fronts_label_after_an_incomplete_in_engine_commit_and_a_restore(fake):
    """A sync committed inside an engine command stamps its new label in that engine
    (``rlserve.transfer.server.engine_calls.worker_rpc``: the one-call ipc path). When the
    front's weight state says the weights are still lost (an incomplete refill), that label
    never went live; once valid again through ``set_unavailable(None)`` (``WeightState.restore``)
    every replica (DP 2 here) must stamp the front's label, not the engine's stale one. Fails
    without the re-stamp: replica 0 kept answering "6"."""
    aeng, _engines = fake(dp=2)
    cores = [r.core for r in aeng._replicas]
    aeng.lose_weights("a level-2 sleep discarded the weights")
    cores[0].weight_version = "6"  # what worker_rpc's commit does in the engine command
    assert not aeng.commit_weights("6", {"embed"}, {"embed", "head"})  # incomplete: still lost
    aeng.set_unavailable(None)
    assert aeng.weight_version == "0"
    assert [c.weight_version for c in cores] == ["0", "0"]

    async def main():
        return await asyncio.gather(*(_run(aeng, [i * 10], max_tokens=3) for i in range(4)))

    assert {o.weight_version for o in run(main())} == {"0"}


def test_pause_abort_holds_new_requests(fake):
    aeng, _ = fake()

    async def main():
        tasks = [asyncio.create_task(_run(aeng, [i * 100], max_tokens=10_000)) for i in range(16)]
        await asyncio.sleep(0.05)
        await aeng.pause("abort")
        done = await asyncio.gather(*tasks)
        assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in done)
        held = asyncio.create_task(_run(aeng, [5], max_tokens=3))
        await asyncio.sleep(0.2)
        assert not held.done() and aeng.num_held == 1
        await aeng.resume()
        return await held

    assert run(main()).outputs[0].token_ids == [5, 6, 7]


def test_pause_wait_drains(fake):
    aeng, _ = fake()

    async def main():
        tasks = [asyncio.create_task(_run(aeng, [i], max_tokens=30)) for i in range(16)]
        await asyncio.sleep(0.02)
        await aeng.pause("wait", clear_cache=True)
        assert all(t.done() for t in tasks)
        outs = [t.result() for t in tasks]
        assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 30 for o in outs)
        late = asyncio.create_task(_run(aeng, [9], max_tokens=2))
        await asyncio.sleep(0.1)
        assert not late.done()
        await aeng.resume()
        return await late

    assert run(main()).outputs[0].token_ids == [9, 10]


def test_pause_keep_freezes_and_continues(fake):
    aeng, (eng,) = fake()

    async def main():
        tasks = [asyncio.create_task(_run(aeng, [i * 1000], max_tokens=200)) for i in range(16)]
        await asyncio.sleep(0.05)
        await aeng.pause("keep")
        steps = eng.steps
        # run_in_engines works while frozen (weight updates run this way)
        assert await aeng.run_in_engines(lambda e: e.dp_index) == [0]
        await asyncio.sleep(0.2)
        assert eng.steps == steps and not any(t.done() for t in tasks)
        await aeng.resume()
        return await asyncio.gather(*tasks)

    outs = run(main())
    for i, o in enumerate(outs):
        assert o.outputs[0].token_ids == list(range(i * 1000, i * 1000 + 200))
        assert o.outputs[0].finish_reason == "length"


def test_failed_pause_is_undone(fake):
    """A pause that does not take effect (here: its timeout passes first) leaves nothing paused
    that nobody owns: generation resumes when it was running, or the earlier pause stays."""
    aeng, (eng,) = fake()

    async def main():
        long = asyncio.create_task(_run(aeng, [1], max_tokens=10_000_000, rid="long"))
        while not eng.reqs:  # state, not time: the request is in the engine
            await asyncio.sleep(0.001)
        with pytest.raises(asyncio.TimeoutError):  # "wait" cannot drain a request this long
            await aeng.pause("wait", timeout_s=1e-300)
        assert not aeng.is_paused() and aeng.pause_mode is None
        assert (await _run(aeng, [5], max_tokens=3)).outputs[0].token_ids == [5, 6, 7]  # not held
        # under an earlier keep-pause, a failed wait-pause leaves that keep-pause in force
        await aeng.pause("keep")
        with pytest.raises(asyncio.TimeoutError):
            await aeng.pause("wait", timeout_s=1e-300)
        assert aeng.is_paused() and aeng.pause_mode == "keep"
        steps = await aeng.run_in_engines(lambda e: e.steps)  # the freeze was posted again first
        assert await aeng.run_in_engines(lambda e: e.steps) == steps  # frozen: no step in between
        await aeng.resume()
        await aeng.abort("long")
        assert (await long).outputs[0].finish_reason == "abort"

    run(main())


def test_held_requests_end_within_the_bound(fake):
    aeng, _ = fake(hold_timeout_s=0.2)

    async def main():
        await aeng.pause("abort")
        t0 = time.monotonic()
        with pytest.raises(HeldTooLongError, match="paused"):
            await _run(aeng, [5], max_tokens=3)
        assert time.monotonic() - t0 >= 0.2 and aeng.num_held == 0 and aeng.num_unfinished == 0
        await aeng.resume()
        return await _run(aeng, [5], max_tokens=3)

    assert run(main()).outputs[0].token_ids == [5, 6, 7]
    assert issubclass(HeldTooLongError, ModelUnavailableError)  # HTTP 503


def test_abort_single_and_cancel(fake):
    aeng, (eng,) = fake()

    async def main():
        t = asyncio.create_task(_run(aeng, [1], max_tokens=10_000, rid="x"))
        await asyncio.sleep(0.05)
        await aeng.abort("x")
        out = await t
        assert out.outputs[0].finish_reason == "abort"
        # cancelling the consumer aborts in the engine too
        t2 = asyncio.create_task(_run(aeng, [1], max_tokens=10_000, rid="y"))
        await asyncio.sleep(0.05)
        t2.cancel()
        await asyncio.gather(t2, return_exceptions=True)
        while eng.reqs:  # the abort reaches the engine thread (bounded by run()'s T)
            await asyncio.sleep(0.01)
        assert aeng.num_unfinished == 0

    run(main())


def test_data_parallel_balances_by_load(fake):
    aeng, engines = fake(dp=2)

    async def main():
        tasks = [asyncio.create_task(_run(aeng, [i], max_tokens=10_000)) for i in range(8)]
        while sum(len(e.reqs) for e in engines) < 8:  # all added on their engine threads (state, not time)
            await asyncio.sleep(0.005)
        counts = [len(e.reqs) for e in engines]
        await aeng.abort_all()
        await asyncio.gather(*tasks)
        assert await aeng.run_in_engines(lambda e: e.dp_index) == [0, 1]
        await aeng.reset_prefix_cache()
        return counts

    counts = run(main())
    assert counts == [4, 4]
    assert [e.resets for e in engines] == [1, 1]


# ---- the real engine ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tiny_model):
    return tiny_model("llama")


def test_real_engine_matches_offline(tiny_llama):
    from rlserve import LLM
    from rlserve.config import EngineConfig

    prompts = ["Hello world", "The capital of France is", "def main():"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(tiny_llama, device="cpu").generate(prompts, params)]
    aeng = AsyncEngine(EngineConfig(model=tiny_llama, device="cpu", data_parallel_size=2))
    try:
        async def main():
            async def one(p):
                last = None
                async for o in aeng.generate(p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)):
                    last = o
                return last.outputs[0].token_ids

            return await asyncio.gather(*(one(p) for p in prompts))

        assert run(main()) == ref
    finally:
        aeng.shutdown()
