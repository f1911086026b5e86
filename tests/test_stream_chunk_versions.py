"""A middle stream chunk holding tokens of several weight versions names them all (session 22, FIX item 4):
``stream_chunks.chunk_versions`` reads ``CompletionOutput.version_marks`` (where each version's tokens start,
tests/test_output_processor.py) for the chunk's tokens ``token_ids[k0:]``; one version, or no marks, is None (the
chunk's ``weight_version`` says it)."""

from __future__ import annotations

import pytest

from rlserve.engine.outputs import CompletionOutput
from rlserve.server.stream_chunks import chunk_versions as _chunk_versions

MARKS = ((0, "0"), (4, "1"), (6, "2"))


@pytest.mark.parametrize("n_tokens, k0, want", [
    (4, 0, None),               # tokens 0-3: version 0 only
    (5, 2, ["0", "1"]),         # tokens 2-4: the update came after token 3
    (5, 4, None),               # token 4 alone: version 1 (the chunk starts where it starts)
    (6, 3, ["0", "1"]),         # tokens 3-5
    (8, 3, ["0", "1", "2"]),    # tokens 3-7: two updates inside one chunk
    (8, 5, ["1", "2"]),
    (8, 6, None),               # tokens 6-7: version 2
])
def test_a_chunk_names_the_versions_of_its_tokens(n_tokens, k0, want):
    c = CompletionOutput(0, "", list(range(n_tokens)), version_marks=MARKS)
    assert _chunk_versions(c, k0) == want


def test_one_version_or_no_marks_is_none():
    assert _chunk_versions(CompletionOutput(0, "", [1, 2, 3], version_marks=((0, "0"),)), 1) is None
    assert _chunk_versions(CompletionOutput(0, "", [1, 2, 3]), 1) is None
