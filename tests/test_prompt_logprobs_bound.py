"""Prompt logprobs of a long prompt in bounded memory (session 21's adversarial pass). A step's prompt rows are
all its prompt's tokens (on CUDA with chunked prefill off, a step takes ``max(8192, max_model_len)`` tokens), and
their scores were one float32 ``[rows, vocab]`` tensor, plus its ``log_softmax`` and a boolean of the same size:
for a 40,960-token prompt of a 151,936-token vocabulary ~62 GB beside the model-dtype logits, the kind of request
(``prompt_logprobs``, ``echo`` with ``logprobs``: a reference model's scoring) that ran a GPU out of memory and
failed every request of its step. :func:`ranked_logprob_dicts` now scores :data:`ROWS_BYTES`-sized row blocks one
at a time; its answer is the one-block answer, exactly (every op is per row)."""

from __future__ import annotations

import pytest
import torch

from rlserve.engine.core import prompt_logprobs as pl


def _spy(monkeypatch) -> list:
    """Record the row count of each block :func:`prompt_logprobs._scores` scores."""
    rows, real = [], pl._scores

    def scores(logits, mode):
        rows.append(logits.shape[0])
        return real(logits, mode)

    monkeypatch.setattr(pl, "_scores", scores)
    return rows


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits"])
@pytest.mark.parametrize("num_top", [0, 3])
def test_scores_in_bounded_blocks_equal_one_block(monkeypatch, mode, num_top):
    g = torch.Generator().manual_seed(0)
    V, N = 1000, 37
    logits = torch.randn(N, V, generator=g) * 4
    logits[5, :] = logits[5, 17]  # a row of ties: every token ranks V
    target = torch.randint(V, (N,), generator=g).tolist()
    whole = pl.ranked_logprob_dicts(logits, target, num_top, mode)
    rows = _spy(monkeypatch)
    monkeypatch.setattr(pl, "ROWS_BYTES", 8 * V * 4, raising=False)  # 8 float32 rows a block
    got = pl.ranked_logprob_dicts(logits, target, num_top, mode)
    assert rows == [8, 8, 8, 8, 5]  # main: [37], the whole [rows, vocab] at once
    assert got == whole  # bit for bit: each row's ops see that row only
    assert got[1][5] == V and got[0][5][target[5]] == whole[0][5][target[5]]


def test_the_default_block_is_bounded(monkeypatch):
    """The default bound: a 151,936-token vocabulary scores 441 rows a block (~256 MiB of float32), a small
    one all its rows at once."""
    assert pl.ROWS_BYTES == 256 << 20
    assert pl.block_rows(151936) == 441 and pl.block_rows(32) == (256 << 20) // 128
    rows = _spy(monkeypatch)
    logits = torch.randn(3, 32)
    pl.ranked_logprob_dicts(logits, [1, 2, 3], 2)
    assert rows == [3]
