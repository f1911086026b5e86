"""``benchmarks/api_stream_step.py`` (issue 37's A/B of the direct writes) runs both paths to their end:
every stream gets its counted events, the last chunk and ``[DONE]`` on each path."""

from __future__ import annotations

import asyncio

import pytest


@pytest.mark.parametrize("direct", [True, False])
def test_both_paths_run_to_the_end(direct):
    uvloop = pytest.importorskip("uvloop")
    pytest.importorskip("httptools")
    from benchmarks import api_stream_step

    out = uvloop.run(asyncio.wait_for(api_stream_step.run(direct, streams=3, steps=2), 120))
    assert out["direct"] is direct and out["events"] == 6 and out["cpu_s"] > 0
