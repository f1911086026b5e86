"""The adversarial HTTP hunt of issue 23 (not a benchmark): schemathesis over ``/openapi.json``
plus hand-made extremes on every route, against a tiny-model ``rlserve serve`` (gloo weight
routes on, ``--pause-hold-timeout 5``), once without keys and once with ``--api-key`` /
``--admin-key`` (schemathesis both with the keys and without any). It reports the requests sent,
their statuses (from the server's access log), the 5xx answers (goal 0) and the hangs (goal 0: a
request unanswered within ``--request-timeout``, or a server that stops answering /health, or
requests still unfinished after the hunt).

    pip install -e ".[fuzz]"            # schemathesis 4.x
    python benchmarks/fuzz_http.py --max-examples 25 --out /tmp/fuzz

Issue 33's classes (``benchmarks/fuzz_cases.py``: wrong-typed values in every nested kwargs
dict, lone surrogates in every string field, template and grammar bombs, out-of-range TRL
routes) run first, with a canary client sending a small completion beside them; they report
the 5xx answers, the engine deaths (the engine-core process's PID changed, or an answer said
``engine_dead``) and the canary's p50/p99 latency (targets: 0, 0, p99 < 250 ms on the 2-core
machine). ``--classes typed,bombs --skip-schemathesis --skip-extremes`` runs only those.

Exit status 0 when there were no hangs and no 5xx except by design (a 504 for a timeout the request
set itself, a 503 for a request held longer than --pause-hold-timeout behind a pause the hunt
left in force). On the 2-core machine shared with other work (load 20+) a full run with
``--max-examples 30`` took over 50 minutes; 2026-12-01's results are in the issue 23 note.
"""

from __future__ import annotations

import argparse
import base64
import collections
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.fuzz_canary import issue33_pass  # noqa: E402
from benchmarks.fuzz_cases import CLASSES  # noqa: E402
from rlserve.server.testing import ServerProcess  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402

API_KEY, ADMIN_KEY = "fuzz-api-key", "fuzz-admin-key"
_ACCESS = re.compile(r'"([A-Z]+) (\S+) HTTP/[0-9.]+" (\d{3})')
# generation and read-only routes; the control/weight routes run in their own pass (a fuzzed
# /pause or /start_weight_update holds generation, which would make the serving pass wait)
SERVING = r"^/(v1/|generate/|health|get_world_size|server_info|version|is_paused|metrics|weight_info)"


def _extremes(model: str) -> list[tuple[str, str, object]]:
    """(method, path, body) cases: ``bytes`` are sent raw, anything else as JSON (None: no body)."""
    deep = b"[" * 100_000 + b"]" * 100_000
    big_str = "a" * (3 << 20)
    surrogate = b'{"prompt": "\\ud800\\udfff\\ud800", "max_tokens": 2}'
    nul = {"prompt": "a\u0000b", "max_tokens": 2}
    common = [None, b"", b"null", b"[]", b"{}", b"{", b"\xff\xfe", deep, b'{"a": NaN}', b'{"a": 1e999}',
              b'{"a": ' + b"9" * 5000 + b"}", "x" * 100]
    gen = [
        {"prompt": "hi", "n": 10 ** 6}, {"prompt": "hi", "n": -1}, {"prompt": "hi", "n": 2 ** 70},
        {"prompt": "hi", "best_of": 10 ** 6}, {"prompt": "hi", "max_tokens": -5}, {"prompt": "hi", "max_tokens": 0},
        {"prompt": "hi", "max_tokens": 10 ** 30}, {"prompt": "hi", "logprobs": 10 ** 9},
        {"prompt": "hi", "prompt_logprobs": 10 ** 9}, {"prompt": [[]]}, {"prompt": [10 ** 20]},
        {"prompt": [True, False]}, {"prompt": [1.5]}, {"prompt": ["a"] * 100_000}, {"prompt": [[1]] * 100_000},
        {"prompt": "hi", "stop": ["x"] * 100_000}, {"prompt": "hi", "stop": "y" * 100_000},
        {"prompt": "hi", "stop_token_ids": list(range(100_000))}, {"prompt": "hi", "stop_token_ids": [-1]},
        {"prompt": "hi", "temperature": 1e308}, {"prompt": "hi", "temperature": -0.0}, {"prompt": "hi", "top_p": 0},
        {"prompt": "hi", "top_k": -(2 ** 63)}, {"prompt": "hi", "top_k": 2 ** 63}, {"prompt": "hi", "seed": 2 ** 70},
        {"prompt": "hi", "seed": -1}, {"prompt": "hi", "min_tokens": 10 ** 9}, {"prompt": "hi", "min_p": 2},
        {"prompt": "hi", "repetition_penalty": 0}, {"prompt": "hi", "frequency_penalty": 1e308},
        {"prompt": "hi", "logit_bias": {"1": 100}}, {"prompt": "hi", "echo": True, "logprobs": 20, "max_tokens": 1},
        {"prompt": "hi", "stream": True, "n": 3, "logprobs": 5, "max_tokens": 4},
        {"prompt": "hi", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 3},
        {"prompt": big_str}, {"prompt": "hi", "model": "x" * 100_000}, {"prompt": "hi", "user": "u" * 100_000},
        {"prompt": "hi", "suffix": "s"}, {"prompt": "hi", "max_tokens": 2, "skip_special_tokens": False},
        nul, surrogate,
    ]
    chat = [
        {"messages": []}, {"messages": [{"role": "user"}]}, {"messages": [{"role": "x" * 10_000, "content": "hi"}]},
        {"messages": [{"role": "user", "content": "hi"}] * 100_000},
        {"messages": [{"role": "user", "content": big_str}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        {"messages": [{"role": "user", "content": "hi"}], "n": 10 ** 6},
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 10 ** 6, "logprobs": True},
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10 ** 30},
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": "{{ 7*7 }}"}},
        {"messages": [{"role": "user", "content": "{% for i in range(10**9) %}x{% endfor %}"}], "max_tokens": 2},
        {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True,
         "add_generation_prompt": True, "max_tokens": 2},
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
        {"messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2, "logprobs": True,
         "top_logprobs": 3, "max_tokens": 4},
        b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
    ]
    trl = [
        {"prompts": ["hi"], "n": 10 ** 6}, {"prompts": ["hi"], "generation_kwargs": {"n": 10 ** 6}},
        {"prompts": ["hi"], "generation_kwargs": {"nope": 1}}, {"prompts": ["hi"], "generation_kwargs": {"stop": 5}},
        {"prompts": ["hi"], "generation_kwargs": {"logprobs": 10 ** 9}}, {"prompts": ["hi"], "max_tokens": 10 ** 30},
        {"prompts": [[]]}, {"prompts": [[10 ** 20]]}, {"prompt_ids": [[1, 2]], "prompts": ["x"]},
        {"prompts": ["hi"], "truncate_prompt_tokens": -1}, {"prompts": ["hi"], "truncate_prompt_tokens": 10 ** 20},
        {"prompts": [big_str]}, {"prompts": ["hi"], "images": ["x"]}, {"prompts": ["hi"] * 100_000},
        {"prompts": ["hi"], "guided_decoding_regex": "a+"},
    ]
    weights = [
        {"init_info": {"backend": "gloo", "master_address": "256.0.0.1", "master_port": 1, "world_size": 2,
                       "timeout_s": 1e-300}},
        {"init_info": {"backend": "gloo", "master_address": "127.0.0.1", "master_port": 70000, "world_size": 2}},
        {"init_info": {"backend": "gloo", "master_address": "127.0.0.1", "master_port": 29999, "world_size": 10 ** 9}},
        {"init_info": {"backend": "gloo", "master_address": "127.0.0.1", "master_port": 29999, "world_size": 2,
                       "timeout_s": float("inf")}},
        {"init_info": {"backend": "nccl"}}, {"init_info": None}, {"init_info": []},
        {"update_info": {"names": ["x"] * 100_000, "dtype_names": ["float32"] * 100_000,
                         "shapes": [[1]] * 100_000}},
        {"update_info": {"names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[10 ** 12, 10 ** 12]]}},
        {"weight_version": "v" * 10_000}, {"weight_version": "1" * 300},
        {"compare": {"x": "y" * 100}}, {"compare": []},
    ]
    cases: list[tuple[str, str, object]] = []
    for path in ("/v1/completions", "/v1/chat/completions", "/generate/", "/abort_requests",
                 "/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/sync_weights",
                 "/finish_weight_update", "/weight_checker", "/init_communicator/", "/update_named_param/",
                 "/close_communicator/", "/reset_prefix_cache/", "/nope"):
        cases += [("POST", path, b) for b in common]
    cases += [("POST", "/v1/completions", b) for b in gen]
    cases += [("POST", "/v1/chat/completions", b) for b in chat]
    cases += [("POST", "/generate/", b) for b in trl]
    for path in ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/sync_weights",
                 "/finish_weight_update", "/weight_checker", "/init_communicator/", "/update_named_param/"):
        cases += [("POST", path, b) for b in weights]
    cases += [("POST", "/update_named_param/", {"name": "lm_head.weight", "dtype": "torch.float32", "shape": [1]}),
              ("POST", "/init_communicator/", {"host": "256.0.0.1", "port": 1, "world_size": 2}),
              ("POST", "/abort_requests", {"request_ids": [1, None, {"a": 1}]}),
              ("POST", "/abort_requests", {"request_ids": ["x"] * 100_000})]
    for q in ("mode=wait&timeout=1e-300", "mode=wait&timeout=1e308", "mode=keep&timeout=-1", "mode=abort&timeout=nan",
              "mode=abort&timeout=inf", "mode=sideways", "mode=keep&clear_cache=maybe", "mode=" + "k" * 10_000,
              "mode=abort", "mode=keep", "mode=wait"):
        cases += [("POST", "/pause?" + q, None), ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                  ("POST", "/resume", None)]
    for path in ("/health", "/health/", "/get_world_size", "/get_world_size/", "/server_info", "/version",
                 "/is_paused", "/metrics", "/v1/models", "/weight_info", "/openapi.json", "/docs"):
        cases += [("GET", path, None), ("GET", path + "?x=" + "y" * 10_000, None), ("POST", path, b"{}"),
                  ("DELETE", path, None)]
    cases += [("POST", "/shutdown_weight_transfer_engine", None), ("POST", "/reset_prefix_cache", None),
              ("POST", "/v1/completions", b"{" + b'"a": 1, ' * 2_000_000 + b'"prompt": "x"}'),  # ~16 MB of keys
              ("POST", "/v1/completions", b"a" * (65 << 20))]  # over the 64 MiB body limit
    return cases


def _send(client: httpx.Client, method: str, path: str, body, headers: dict, timeout: float):
    h = dict(headers)
    kw = {}
    if body is not None:
        raw = body if isinstance(body, bytes) else body.encode() if isinstance(body, str) else \
            json.dumps(body, allow_nan=True).encode()
        kw["content"] = raw
        h["content-type"] = "application/json"
    return client.request(method, path, headers=h, timeout=timeout, **kw)


def _wait_quiet(url: str, headers: dict, timeout_s: float = 60.0) -> float:
    """Resume, then wait until no request is left unfinished; returns the count left (0 = none)."""
    httpx.post(url + "/resume", headers=headers, timeout=30)
    left = math.inf
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        text = httpx.get(url + "/metrics", timeout=30).text
        left = sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("rlserve_num_requests_unfinished{"))
        if left == 0:
            break
        time.sleep(0.5)
    return left


def hand_made(url: str, model: str, headers: dict, timeout: float) -> dict:
    """Send every extreme; returns {"sent", "statuses", "5xx": [...], "hangs": [...]}."""
    statuses: collections.Counter = collections.Counter()
    fivexx, hangs = [], []
    with httpx.Client(base_url=url) as client:
        for method, path, body in _extremes(model):
            what = f"{method} {path[:80]} {repr(body)[:120]}"
            t0 = time.monotonic()
            try:
                r = _send(client, method, path, body, headers, timeout)
            except httpx.TimeoutException:
                hangs.append(f"{what}: no answer within {timeout:.0f} s")
                continue
            except httpx.HTTPError as e:
                # the server may close the connection after a 413 while the client still writes
                statuses[type(e).__name__] += 1
                continue
            statuses[r.status_code] += 1
            if r.status_code >= 500:
                fivexx.append(f"{what} -> {r.status_code} {r.text[:300]}")
            try:  # a new connection: the server may have closed this one (413)
                health = httpx.get(url + "/health", timeout=30)
                if health.status_code != 200:
                    hangs.append(f"after {what}: /health {health.status_code} {health.text[:200]}")
            except httpx.HTTPError as e:
                hangs.append(f"after {what}: /health unanswered ({type(e).__name__}, {time.monotonic() - t0:.0f} s)")
    return {"sent": sum(statuses.values()), "statuses": dict(statuses), "5xx": fivexx, "hangs": hangs}


def schemathesis(url: str, headers: dict, include: str, exclude: bool, max_examples: int, timeout: float,
                 report_dir: str) -> dict:
    """One ``st run`` pass; returns its exit code and the tail of its output."""
    st = shutil.which("st") or shutil.which("schemathesis")
    if st is None:
        raise SystemExit("schemathesis is not installed: pip install schemathesis")
    # rlserve answers bad input with 400 (not the schema's 422), so only server errors are failures
    cmd = [st, "run", url + "/openapi.json", "--checks", "not_a_server_error", "--continue-on-failure",
           "--request-timeout", str(timeout), "--max-examples", str(max_examples), "--workers", "2",
           "--phases", "examples,coverage,fuzzing", "--seed", "23", "--warnings=off",
           "--report", "ndjson", "--report-dir", report_dir,
           "--exclude-path-regex" if exclude else "--include-path-regex", include]
    for k, v in headers.items():
        cmd += ["-H", f"{k}: {v}"]
    os.makedirs(report_dir, exist_ok=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=report_dir)  # its cache goes there
    out = p.stdout + p.stderr
    fivexx = []
    for path in glob.glob(os.path.join(report_dir, "*.ndjson")):
        with open(path) as f:
            for line in f:
                for inter in (json.loads(line).get("ScenarioFinished", {}).get("recorder", {})
                              .get("interactions", {}).values()):
                    resp = inter.get("response") or {}
                    if resp.get("status_code", 0) >= 500:
                        body = base64.b64decode((resp.get("content") or {}).get("$base64", "")).decode(errors="replace")
                        fivexx.append(f"{inter['request']['method']} {inter['request']['uri'].split('/', 3)[-1]} -> "
                                      f"{resp['status_code']} {body[:300]}")
    return {"cmd": " ".join(cmd), "rc": p.returncode, "tail": out[-6000:], "5xx": fivexx}


def access_statuses(log_path: str) -> collections.Counter:
    c: collections.Counter = collections.Counter()
    with open(log_path, errors="replace") as f:
        for ln in f:
            m = _ACCESS.search(ln)
            if m:
                c[int(m.group(3))] += 1
    return c


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-examples", type=int, default=25, help="schemathesis cases per operation and phase")
    ap.add_argument("--request-timeout", type=float, default=60.0, help="seconds before a request counts as a hang")
    ap.add_argument("--out", default=None, help="directory for the reports (default: a temporary one)")
    ap.add_argument("--skip-schemathesis", action="store_true", help="no schemathesis passes")
    ap.add_argument("--skip-extremes", action="store_true", help="no pass of issue 23's hand-made extremes")
    ap.add_argument("--classes", default=",".join(CLASSES),
                    help=f"issue 33's classes to send, comma-separated (of {','.join(CLASSES)}; '' for none)")
    ap.add_argument("--no-keys-only", action="store_true", help="only the server without --api-key/--admin-key")
    args = ap.parse_args()
    out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="rlserve-fuzz-"))
    os.makedirs(out, exist_ok=True)
    model = make_tiny_model("llama_tied", os.path.join(out, "tiny"))
    summary = {}
    classes = [c for c in args.classes.split(",") if c]
    unknown = set(classes) - set(CLASSES)
    if unknown:
        ap.error(f"--classes: unknown {sorted(unknown)}; known: {sorted(CLASSES)}")
    for keyed in (False,) if args.no_keys_only else (False, True):
        flags = ["--max-model-len", "128", "--device", "cpu", "--kv-cache-bytes", str(32 << 20),
                 "--weight-transfer-config", '{"backend": "gloo"}', "--pause-hold-timeout", "5"]
        auth: dict = {}
        if keyed:
            flags += ["--api-key", API_KEY, "--admin-key", ADMIN_KEY]
        name = "keys" if keyed else "no-keys"
        with ServerProcess(model, *flags, startup_timeout_s=300) as srv:
            runs = {}
            header_sets = {"": {}}
            if keyed:  # the admin key opens everything it guards; the API key the generation routes
                header_sets = {"admin key": {"Authorization": f"Bearer {ADMIN_KEY}"},
                               "api key": {"Authorization": f"Bearer {API_KEY}"}, "no key": {}}
            if classes:  # with the key that opens everything (TRL routes included)
                runs["issue 33"] = issue33_pass(srv, model, classes, next(iter(header_sets.values())),
                                                args.request_timeout, os.path.join(out, f"server-{name}"))
                _wait_quiet(srv.url, {"Authorization": f"Bearer {ADMIN_KEY}"} if keyed else {})
            for label, headers in header_sets.items():
                if not args.skip_schemathesis:
                    for part, include, exclude in (("serving", SERVING, False), ("control", SERVING, True)):
                        rd = os.path.join(out, f"st-{name}-{label.replace(' ', '_') or 'none'}-{part}")
                        runs[f"schemathesis {label} {part}".strip()] = schemathesis(
                            srv.url, headers, include, exclude, args.max_examples, args.request_timeout, rd)
                        _wait_quiet(srv.url, {"Authorization": f"Bearer {ADMIN_KEY}"} if keyed else {})
                if not args.skip_extremes:
                    runs[f"hand-made {label}".strip()] = hand_made(srv.url, model, headers, args.request_timeout)
            left = _wait_quiet(srv.url, {"Authorization": f"Bearer {ADMIN_KEY}"} if keyed else {})
            ok = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                            headers={"Authorization": f"Bearer {API_KEY}"} if keyed else {}, timeout=60)
            statuses = access_statuses(srv.log_path)
            for life in glob.glob(os.path.join(out, f"server-{name}-life-*.log")):  # lives before restarts
                statuses += access_statuses(life)
            alive = srv.proc.poll() is None
            shutil.copy(srv.log_path, os.path.join(out, f"server-{name}.log"))
        summary[name] = {"runs": runs, "server_statuses": dict(sorted(statuses.items())),
                         "requests": sum(statuses.values()),
                         "5xx": sum(v for k, v in statuses.items() if k >= 500),
                         "unfinished_after": left, "serves_after": ok.status_code, "alive": alive}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    bad = 0

    def by_design(line: str) -> bool:
        """A 504 the request asked for (a timeout it set, code "timeout") or a 503 for a request held
        longer than --pause-hold-timeout behind a pause the hunt left in force."""
        return ('"code":"timeout"' in line and "-> 504" in line) or \
            ("-> 503" in line and "--pause-hold-timeout" in line)

    for name, s in summary.items():
        print(f"== {name}: {s['requests']} requests, statuses {s['server_statuses']}, 5xx {s['5xx']}, "
              f"unfinished after {s['unfinished_after']}, serves after: {s['serves_after']}")
        for run_name, r in s["runs"].items():
            unexpected = [x for x in r["5xx"] if not by_design(x)]
            if "canary" in r:
                c = r["canary"]
                print(f"  {run_name}: {r['sent']} sent, {r['statuses']}, 5xx {len(r['5xx'])}, engine deaths "
                      f"{len(r['deaths'])}, hangs {len(r['hangs'])}, server restarts {r['restarts']}, not sent "
                      f"{r['not_sent']}; canary p50 {c['p50_ms']} ms p99 {c['p99_ms']} ms "
                      f"max {c['max_ms']} ms over {c['n']} requests, {len(c['failures'])} failed (alone before: "
                      f"p50 {r['canary_alone']['p50_ms']} ms p99 {r['canary_alone']['p99_ms']} ms)")
                for x in r["deaths"][:20] + r["hangs"][:20] + r["dropped"][:20] + c["failures"][:5]:
                    print("    " + x[:400])
                for t, w in r["slowest"][:5]:
                    print(f"    slowest: {t} s {w[:200]}")
                for t, w in r["canary_slowest"][:5]:
                    print(f"    slowest canary: {t} ms beside {w[:200]}")
                bad += len(r["deaths"]) + len(r["hangs"]) + (c["p99_ms"] is None or c["p99_ms"] >= 250)
            elif "rc" in r:
                cases = re.findall(r"(\d+) generated", r["tail"])
                print(f"  {run_name}: schemathesis exit {r['rc']}, {cases[-1] if cases else '?'} cases, "
                      f"5xx {len(r['5xx'])} ({len(unexpected)} not by design)")
            else:
                print(f"  {run_name}: {r['sent']} sent, {r['statuses']}, 5xx {len(r['5xx'])} ({len(unexpected)} not "
                      f"by design), hangs {len(r['hangs'])}")
                bad += len(r["hangs"])
                for x in r["hangs"][:20]:
                    print("    hang: " + x)
            for x in r["5xx"][:30]:
                print(("    by design: " if by_design(x) else "    5xx: ") + x[:400])
            bad += len(unexpected)
        bad += (s["unfinished_after"] != 0) + (s["serves_after"] != 200) + (not s["alive"])
    print(f"reports in {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
