"""Helpers of the batch-invariant tests (tests/test_batch_invariant.py on CPU,
tests/gpu/test_batch_invariant_gpu.py): random token-id prompts, a sample's tokens and logprobs,
and the bitwise comparison."""

from __future__ import annotations

import random

import torch

VOCAB_LO, VOCAB_HI = 3, 300  # ids of the tiny tokenizers (~330 tokens), special ids 0-2 left out


def random_prompt(rng: random.Random, lo: int = 4, hi: int = 90) -> list[int]:
    """Between ``lo`` and ``hi - 1`` random token ids."""
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(rng.randrange(lo, hi))]


def tokens_and_logprobs(out) -> tuple[list[int], torch.Tensor]:
    """A ``RequestOutput``'s first sample: its token ids and its sampled tokens' logprobs as
    float32 (exact: the engine's float32 values went through Python floats)."""
    o = out.outputs[0]
    return o.token_ids, torch.tensor([d[t] for d, t in zip(o.logprobs, o.token_ids)], dtype=torch.float32)


def assert_same(a, b) -> None:
    """Two :func:`tokens_and_logprobs` results are the same tokens and the same float32 bits."""
    assert a[0] == b[0]
    assert torch.equal(a[1], b[1]), (a[1] - b[1]).abs().max()


def check_among_neighbours(llm, target: list[int], target_params, neighbour_params, sizes, rng: random.Random,
                           hi: int = 90) -> None:
    """``target`` with ``target_params`` generates the same tokens and logprobs alone as among
    ``n`` random neighbours for every ``n`` of ``sizes``, at a random place among them;
    ``neighbour_params(rng, i)`` gives neighbour ``i``'s ``SamplingParams``."""
    alone = tokens_and_logprobs(llm.generate([target], target_params)[0])
    for n in sizes:
        prompts = [random_prompt(rng, 4, hi) for _ in range(n)]
        at = rng.randrange(n + 1)
        prompts.insert(at, target)
        params = [neighbour_params(rng, i) for i in range(n + 1)]
        params[at] = target_params
        assert_same(tokens_and_logprobs(llm.generate(prompts, params)[at]), alone)
