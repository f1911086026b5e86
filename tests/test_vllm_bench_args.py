"""The argument plumbing of ``benchmarks/vllm_bench.py --one-client`` and its runner
``benchmarks/vllm_bench_serve.py`` (``--concurrencies``, ``--url-file``): pure functions, no vLLM
needed (the runner itself against a server: ``tests/test_vllm_bench_serve.py``)."""

from __future__ import annotations

import threading
import time

from benchmarks.vllm_bench import with_concurrency, without_concurrency
from benchmarks.vllm_bench_serve import runs, wait_url_file


def test_runs_one_per_concurrency_with_its_result_file():
    argv = ["--backend", "vllm", "--result-filename", "rlserve.json", "--num-prompts", "768"]
    assert runs(argv, None) == [argv]
    got = runs(argv, "256,64")
    assert got == [argv + ["--max-concurrency", "256", "--result-filename", "rlserve@c256.json"],
                   argv + ["--max-concurrency", "64", "--result-filename", "rlserve@c64.json"]]
    # the runner's --result-filename=NAME spelling, and no name at all
    assert runs(["--result-filename=x.json"], "8")[0][-2:] == ["--result-filename", "x@c8.json"]
    assert runs([], "8") == [["--max-concurrency", "8", "--result-filename", "result@c8.json"]]


def test_without_and_with_concurrency():
    args = ["--num-prompts", "4", "--max-concurrency", "16", "--max-concurrency=32", "--ignore-eos"]
    assert without_concurrency(args) == ["--num-prompts", "4", "--ignore-eos"]
    assert with_concurrency(args, 64) == ["--num-prompts", "4", "--ignore-eos", "--max-concurrency", "64"]
    assert with_concurrency(args, None) is args


def test_wait_url_file(tmp_path):
    path = tmp_path / "server.url"
    assert wait_url_file(str(path), 0.3) is None  # never written: gives up after the bound
    path.write_text("")
    assert wait_url_file(str(path), 0.3) is None  # empty: not written yet

    def later():
        time.sleep(0.3)
        path.write_text("http://127.0.0.1:1234\n")

    t = threading.Thread(target=later)
    t.start()
    try:
        assert wait_url_file(str(path), 30) == "http://127.0.0.1:1234"
    finally:
        t.join()
