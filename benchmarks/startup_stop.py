"""Start-up and Ctrl-C stop time of ``rlserve serve`` (issues 21.11 and 17).

For each checkout given (``--checkout DIR``, repeatable; default: this one), interleaved, ``--reps``
times: start ``python -m rlserve serve MODEL --device cpu --port 0 --log-level debug ...`` (default
MODEL: the tests' tiny Llama with ``--load-format dummy``) in a session of its own and time

(a) process start -> the ready line, (b) the server's own "loading" log line -> "engine ready"
(the engine-core process's line in process mode), (c) the signal -> process exit, with
``--in-flight N`` streamed requests generating when it is sent (``--group``: to the whole process
group, as a Ctrl-C in a terminal does; ``--prefill-len N``: and one N-token prompt's prefill under
way, sent ``--prefill-wait`` s before). The stop is split by the server's debug log lines
(``rlserve/cli/serve.py``): signal -> "received" (the handler ran), -> "HTTP server closed"
(uvicorn done), -> "engines stopped" (engine-core processes or threads joined), -> "exit handlers
done"; the rest to the process's end is ``os._exit`` and the kernel freeing the memory. Also
checks that no engine-core process outlived the server. ``--nice N`` runs the server at that
niceness: on a shared machine, a stand-in for a heavier load without adding any.

    python benchmarks/startup_stop.py --reps 3 --checkout /path/to/baseline --checkout .
    python benchmarks/startup_stop.py --reps 5 --in-flight 4 --group --model ~/.cache/rlserve/SmolLM2-135M-Instruct

On a GPU (``--device cuda``), ``--shape qwen3-8b`` serves that shape of ``benchmarks/model_shapes.py`` with
dummy weights and the tests' tiny tokenizer; ``--show-start-log`` prints the server's INFO lines up to
ready with the second of each (where the start-up goes), ``--greedy-tokens N`` reports N greedy tokens of a
fixed prompt (equal across start-ups of the same weights), ``--json`` writes every run:

    TRITON_CACHE_DIR=$(mktemp -d) python3 benchmarks/startup_stop.py --reps 1 --device cuda --shape qwen3-8b \
        --show-start-log --greedy-tokens 16 --json cold.json -- --max-model-len 2056
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

from rlserve.proc_state import pid_alive  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402

# (API processes' lines start "(APIServer pid=P) " since session 25: rlserve/server/log_prefix.py)
_PREFIX = r"(?:\(\S+ pid=\d+\) )?"
_STAMP = _PREFIX + r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ (?:\[engine-core \d+\] )?\S+: "
_MARKS = {"loading": r"loading ", "engine ready": r"engine ready: ", "received": r"stopping: \w+ received",
          "http closed": r"stopping: HTTP server closed", "engines stopped": r"stopping: engines stopped",
          "exit handlers done": r"stopping: exit handlers done"}
_READY = re.compile(r"rlserve: serving .* on (http://\S+) ")


def _stamps(text: str) -> dict[str, float]:
    """Epoch seconds of the first line matching each of :data:`_MARKS`."""
    out = {}
    for key, pat in _MARKS.items():
        m = re.search(_STAMP + pat, text, re.M)
        if m:
            out[key] = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return out


_SERVERS: list[subprocess.Popen] = []  # servers started, for the SIGTERM handler


def _kill_group(p: subprocess.Popen) -> None:
    """SIGKILL the server's whole session (API, engine-core, template workers)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _on_sigterm(signum, frame):
    """A time limit's SIGTERM (e.g. ``timeout``): take the servers still running down with us, so
    none keeps holding the device after this script is gone."""
    for p in _SERVERS:
        if p.poll() is None:
            _kill_group(p)
    sys.exit(128 + signum)


def server_env(checkout: str, environ) -> dict:
    """The server's environment: ``environ`` with ``checkout`` first on ``PYTHONPATH`` and the caller's
    entries kept after it (a machine whose dependencies live on ``PYTHONPATH``, as the GPU machine's
    ``/tmp/site``, needs them: without them ``rlserve serve`` died at its first import, window 2 of
    2026-12-06)."""
    path = [os.path.abspath(checkout)] + [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(path))


def one(checkout: str, model: str, args) -> dict:
    fd, log = tempfile.mkstemp(suffix=".log")
    os.close(fd)
    env = server_env(checkout, os.environ)
    cmd = [sys.executable, "-m", "rlserve", "serve", model, "--port", "0", "--device", args.device, "--log-level",
           "debug", "--disable-access-log", "--engine-mode", args.engine_mode, "--data-parallel-size", str(args.dp),
           *(["--load-format", "dummy"] if args.model is None else []), *args.server_args]
    if args.nice:
        cmd = ["nice", "-n", str(args.nice), *cmd]
    t0 = time.monotonic()
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=os.path.abspath(checkout),
                             start_new_session=True)
        _SERVERS.append(p)
        while True:
            text = open(log).read()
            m = _READY.search(text)
            if m:
                break
            if p.poll() is not None or time.monotonic() - t0 > 900:
                _kill_group(p)
                raise RuntimeError(f"server did not start:\n{text[-3000:]}")
            time.sleep(0.02)
        ready = time.monotonic() - t0
        t_ready = time.time()
        url = m.group(1)
        pids = httpx.get(url + "/server_info", timeout=30).json().get("engine_core_pids") or []
        tokens, first_s = None, None
        chats = [_chat_seconds(url) for _ in range(args.chats)]  # right after ready, one after another
        if args.greedy_tokens:  # a fixed prompt's greedy ids: equal across start-ups of the same weights
            t_first = time.monotonic()  # the first request's seconds: a kernel compiled in it would show
            r = httpx.post(url + "/v1/completions", timeout=300, json={
                "prompt": [5 + 7 * i % 300 for i in range(32)], "max_tokens": args.greedy_tokens,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}).json()
            tokens = r["choices"][0].get("token_ids")
            first_s = time.monotonic() - t_first
        started = threading.Semaphore(0)

        def stream():
            first = True
            try:
                with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
                        "prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: ") and first:
                            started.release()
                            first = False
            except Exception:  # noqa: BLE001 - the stop cuts it
                pass

        threads = [threading.Thread(target=stream, daemon=True) for _ in range(args.in_flight)]
        for t in threads:
            t.start()
        for _ in threads:
            started.acquire(timeout=300)  # every stream has its first token: generating now
        if args.prefill_len:  # one long prompt more, its prefill under way at the signal
            threading.Thread(target=lambda: httpx.post(url + "/v1/completions", timeout=300, json={
                "prompt": [5 + i % 300 for i in range(args.prefill_len)], "max_tokens": 2}), daemon=True).start()
            time.sleep(args.prefill_wait)
        sig = signal.SIGTERM if args.signal == "TERM" else signal.SIGINT
        t_sig = time.time()
        t1 = time.monotonic()
        if args.group:
            os.killpg(p.pid, sig)
        else:
            p.send_signal(sig)
        p.wait(120)
        stop = time.monotonic() - t1
        t_end = t_sig + stop
    text = open(log).read()
    os.remove(log)
    st = _stamps(text)
    start_log = _start_timeline(text, t_ready - ready) if args.show_start_log else []
    if args.show_stop_log:  # the server's log from the signal on
        i = text.find("stopping: ")
        print(text[text.rfind("\n", 0, i) + 1:] if i >= 0 else text[-3000:])
    load = st["engine ready"] - st["loading"] if "engine ready" in st and "loading" in st else float("nan")
    phases, prev = {}, t_sig
    for key in ("received", "http closed", "engines stopped", "exit handlers done"):
        if key in st:
            phases[key] = st[key] - prev
            prev = st[key]
    phases["exit"] = t_end - prev
    phases["core killed"] = "did not exit" in text  # (debug line of core_client.CoreProcReplica.join)
    return {"ready_s": ready, "load_s": load, "stop_s": stop, "rc": p.returncode, "phases": phases,
            "orphans": [q for q in pids if pid_alive(q)], "load_avg": os.getloadavg()[0], "tokens": tokens, "first_request_s": first_s,
            "start_log": start_log, "chats_s": chats, "did_not_warm": text.count("did not warm")}


def _chat_seconds(url: str) -> float:
    """Seconds one 1-token chat completion took (its template rendered in a worker process)."""
    t = time.monotonic()
    r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 1})
    r.raise_for_status()
    return time.monotonic() - t


def _start_timeline(text: str, t_start: float) -> list[tuple[float, str]]:
    """``(seconds since the process started, line)`` of the server's INFO lines up to "serving" (the
    start-up's phases: API set-up, engine-core process, weights, KV cache, warm-up, graphs, ready)."""
    out = []
    for line in text.splitlines():
        m = re.match(_PREFIX + r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO (.*)", line)
        if m:
            t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - t_start
            out.append((round(t, 3), m.group(2)[:200]))
        if _READY.search(line):
            out.append((None, line[:200]))
            break
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkout", action="append", default=None, help="repository root to run (repeatable)")
    ap.add_argument("--reps", type=int, default=3, help="runs per checkout (interleaved)")
    ap.add_argument("--model", default=None, help="model directory (default: the tiny Llama, dummy weights)")
    ap.add_argument("--shape", default=None,
                    help="instead of --model: a shape of benchmarks/model_shapes.py (dummy weights) with the tests' "
                         "tiny tokenizer")
    ap.add_argument("--device", default="cpu", help="the server's --device")
    ap.add_argument("--greedy-tokens", type=int, default=0,
                    help="after ready, generate this many greedy tokens of a fixed prompt (reported)")
    ap.add_argument("--chats", type=int, default=0,
                    help="after ready, time this many 1-token chat completions, one after another (the first one "
                         "waited for the chat-template workers' warm-up before session 20)")
    ap.add_argument("--show-start-log", action="store_true",
                    help="print the server's INFO lines up to ready, with the second of each")
    ap.add_argument("--json", help="write every run's results here")
    ap.add_argument("--engine-mode", default="process", choices=["process", "thread"])
    ap.add_argument("--dp", type=int, default=1, help="--data-parallel-size")
    ap.add_argument("--in-flight", type=int, default=0, help="streamed requests generating at the signal")
    ap.add_argument("--signal", default="INT", choices=["INT", "TERM"])
    ap.add_argument("--group", action="store_true", help="signal the process group (a terminal's Ctrl-C)")
    ap.add_argument("--nice", type=int, default=0, help="run the server at this niceness")
    ap.add_argument("--prefill-len", type=int, default=0,
                    help="also send one prompt of this many tokens --prefill-wait s before the signal")
    ap.add_argument("--prefill-wait", type=float, default=0.5, help="seconds (see --prefill-len)")
    ap.add_argument("--show-stop-log", action="store_true", help="print the server's log from the signal on")
    ap.add_argument("server_args", nargs="*", help="more `rlserve serve` flags (after --)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _on_sigterm)
    checkouts = args.checkout or ["."]
    if args.shape:
        from benchmarks.model_shapes import save_shape
        from tests.tiny_models import build_tokenizer

        model = save_shape(args.shape, tempfile.mkdtemp())
        build_tokenizer().save_pretrained(model)
    else:
        model = args.model or make_tiny_model("llama", os.path.join(tempfile.gettempdir(),
                                                                    "rlserve-bench-tiny-llama"))
    dummy = args.model is None
    res: dict[str, list] = {c: [] for c in checkouts}
    for _ in range(args.reps):
        for c in checkouts:
            r = one(c, model, args)
            res[c].append(r)
            ph = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in r["phases"].items())
            for t, line in r["start_log"]:
                print(f"  {'' if t is None else f'+{t:6.2f}s'} {line}")
            print(f"{c}: ready {r['ready_s']:.2f}s (load {r['load_s']:.2f}s), stop {r['stop_s']:.3f}s [{ph}], "
                  f"rc {r['rc']}, orphans {r['orphans']}, load avg {r['load_avg']:.1f}"
                  + (f", first request {r['first_request_s']:.3f}s, tokens {r['tokens']}" if r["tokens"] is not None
                     else "")
                  + (f", chats {' '.join(f'{s:.2f}' for s in r['chats_s'])} s" if r["chats_s"] else "")
                  + f", 'did not warm' lines {r['did_not_warm']}", flush=True)
    for c, rs in res.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("ready_s", "load_s", "stop_s")}
        print(f"median {c}: ready {med['ready_s']:.1f}s, loading->engine ready {med['load_s']:.1f}s, "
              f"SIG{args.signal}->exit {med['stop_s']:.3f}s (max {max(r['stop_s'] for r in rs):.3f}s, "
              f"{len(rs)} runs)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "shape": args.shape, "model": None if dummy else model,
                       "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"),
                       "triton_precompile": os.environ.get("RLSERVE_TRITON_PRECOMPILE"), "runs": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
