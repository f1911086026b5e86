"""``rlserve serve`` flags that replace an environment variable (issue 34): the flag reaches the
engine config, the variable stays its default."""

from __future__ import annotations

import argparse

import pytest

from rlserve.cli import serve as serve_cli


def _config(*argv: str):
    p = argparse.ArgumentParser()
    serve_cli.register(p.add_subparsers())
    args = p.parse_args(["serve", "some-model", *argv])
    return serve_cli.engine_config_from_args(args, "some-model")


def test_cudagraph_capture_sizes_reach_the_engine_config():
    assert _config("--cudagraph-capture-sizes", "1", "8", "64").extra == {"cuda_graph_sizes": [1, 8, 64]}
    assert _config().extra == {}  # unset: RLSERVE_CUDA_GRAPH_SIZES, else the default ladder


@pytest.mark.parametrize("bad", ["0", "two"])
def test_cudagraph_capture_sizes_refuses_non_positive_integers(bad, capsys):
    with pytest.raises(SystemExit) as e:
        _config("--cudagraph-capture-sizes", "4", bad)
    assert e.value.code == 2
    assert f"must be an integer >= 1, got '{bad}'" in capsys.readouterr().err
