"""Control-route chaos against weight syncs (session 19's adversarial pass): a trainer syncs two
weight sets A and B in a loop (each sync labelled ``vN-A`` / ``vN-B``), two clients generate
greedily, and a third calls control routes at random (pause abort / wait / keep + resume, prefix
cache resets incl. TRL's alias, abort_requests, sleep level 1 / 2 + wake_up with random tags,
weight_checker, weight_info). Every answer carrying one weight version is checked against the
Hugging Face float32 greedy tokens of the weights that version names (an aborted answer: its
prefix); a 5xx that is not a documented 503, a request longer than 60 s, and a thread not done
180 s after the stop are problems. At the end: one clean sync, the greedy tokens, /health and the
idle gauges. Exit status 1 when any problem was seen.

    python benchmarks/control_chaos.py none 60            # staging, seconds
    python benchmarks/control_chaos.py host 40 pause_abort,pause_wait,pause_keep   # only these ops
    python benchmarks/control_chaos.py host 40 all 2   # all ops, two engine replicas
    python benchmarks/control_chaos.py none 60 all 1 3 # three chaos threads at once: sleep / wake /
                                                       # pause / resume of one overlap another's
"""
from __future__ import annotations

import collections
import json
import os
import random
import sys
import threading
import time

import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import httpx  # noqa: E402

from benchmarks.idle_gauges import busy_gauges  # noqa: E402
from rlserve.transfer import GlooTrainerInitInfo, HTTPWeightSyncClient, ModuleSource, WeightTransferTrainerFactory  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402
from tests.transfer_harness import InProcessServer, greedy_continuation, load_hf  # noqa: E402

staging = sys.argv[1] if len(sys.argv) > 1 else "none"
DUR = float(sys.argv[2]) if len(sys.argv) > 2 else 60
ops_allowed = sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] != "all" else None
DP = int(sys.argv[4]) if len(sys.argv) > 4 else 1  # engine replicas (--data-parallel-size)
CHAOS = int(sys.argv[5]) if len(sys.argv) > 5 else 1  # chaos threads calling control routes at once
path = make_tiny_model("llama", os.path.join(tempfile.gettempdir(), "rlserve-chaos-llama384"), vocab_size=384)
W = {"A": load_hf(path, seed=1), "B": load_hf(path, scale=0.5, seed=2)}
PROMPTS = [[5, 17, 42, 9, 77, 3], [100, 101, 7]]
N = 6
EXP = {k: [greedy_continuation(m, p, N) for p in PROMPTS] for k, m in W.items()}
assert EXP["A"] != EXP["B"]
print("EXP", EXP)
ver2w = {}
log = collections.Counter()
problems = []
stop = threading.Event()

def gen_loop(srv, idx):
    c = httpx.Client(timeout=120)
    while not stop.is_set():
        t = time.monotonic()
        try:
            r = c.post(srv.url + "/generate/", json={"prompt_ids": PROMPTS, "max_tokens": N, "temperature": 0,
                                                     "generation_kwargs": {"ignore_eos": True}})
        except Exception as e:
            problems.append(f"gen exception {e!r} after {time.monotonic()-t:.1f}s"); continue
        dt = time.monotonic() - t
        log[f"gen {r.status_code}"] += 1
        if dt > 60: problems.append(f"gen took {dt:.1f}s")
        if r.status_code != 200:
            try:
                code = r.json()["error"]["code"]
            except Exception:
                problems.append(f"gen non-json {r.status_code} {r.text[:200]}"); continue
            log[f"gen {r.status_code} {code}"] += 1
            if r.status_code >= 500 and code not in ("model_unavailable", "weights_lost", "model_sleeping", "paused_timeout"):
                problems.append(f"gen {r.status_code} {r.text[:300]}")
            continue
        j = r.json()
        vs = j["weight_versions"]
        if len(vs) == 1 and vs[0] in ver2w:
            w = ver2w[vs[0]]
            got = j["completion_ids"]
            # aborted completions are shorter: compare the prefix
            for g, e in zip(got, EXP[w]):
                if g != e[:len(g)]:
                    problems.append(f"WRONG TOKENS under version {vs[0]} ({w}): {got} vs {EXP[w]}")
                    break
            else:
                log["gen checked"] += 1

def trainer_loop(srv):
    eng = None
    i = 0
    while not stop.is_set():
        w = "AB"[i % 2]; i += 1
        try:
            if eng is None:
                eng = WeightTransferTrainerFactory.trainer_init(
                    init_info=GlooTrainerInitInfo(world_size=DP + 1, timeout_s=30,
                                                  packed_buffer_size_bytes=64 << 10),
                    client=HTTPWeightSyncClient(srv.url, timeout_s=60), source=ModuleSource(W[w]))
            eng.source = ModuleSource(W[w])
            v = f"v{i}-{w}"
            ver2w[v] = w   # registered before: a response can come before finish returns
            fin = eng.send_weights(weight_version=v)
            log["sync ok"] += 1
        except Exception as e:
            log[f"sync err {type(e).__name__} {getattr(e, 'status_code', '')} {getattr(e, 'code', '')}"] += 1
            try:
                eng.shutdown()
            except Exception:
                pass
            eng = None
            time.sleep(0.05)

def chaos_loop(srv, seed):
    rnd = random.Random(seed)
    c = httpx.Client(timeout=120)
    ops = ["pause_abort", "pause_wait", "pause_keep", "reset", "reset_trl", "abort", "sleep1", "sleep2", "checker", "info"]
    if ops_allowed: ops = [o for o in ops if o in ops_allowed]
    while not stop.is_set():
        op = rnd.choice(ops)
        t = time.monotonic()
        try:
            if op.startswith("pause"):
                r = c.post(srv.url + f"/pause?mode={op.split('_')[1]}&timeout=30")
                time.sleep(rnd.random() * 0.3)
                r2 = c.post(srv.url + "/resume")
                log[f"{op} {r.status_code} resume {r2.status_code}"] += 1
            elif op == "reset":
                r = c.post(srv.url + "/reset_prefix_cache"); log[f"reset {r.status_code}"] += 1
            elif op == "reset_trl":
                r = c.post(srv.url + "/reset_prefix_cache/"); log[f"reset_trl {r.status_code}"] += 1
            elif op == "abort":
                r = c.post(srv.url + "/abort_requests"); log[f"abort {r.status_code}"] += 1
            elif op.startswith("sleep"):
                lvl = op[-1]
                r = c.post(srv.url + f"/sleep?level={lvl}")
                time.sleep(rnd.random() * 0.3)
                tags = rnd.choice([None, ["weights"], ["kv_cache"]])
                q = "" if tags is None else "?" + "&".join(f"tags={x}" for x in tags)
                r2 = c.post(srv.url + "/wake_up" + q)
                r3 = c.post(srv.url + "/wake_up")
                log[f"sleep{lvl} {r.status_code} wake{tags} {r2.status_code} {r3.status_code}"] += 1
            elif op == "checker":
                r = c.post(srv.url + "/weight_checker", json={}); log[f"checker {r.status_code}"] += 1
            elif op == "info":
                r = c.get(srv.url + "/weight_info"); log[f"info {r.status_code}"] += 1
            for rr in [x for x in (locals().get("r"), locals().get("r2")) if x is not None]:
                if rr.status_code >= 500 and rr.status_code != 504:
                    problems.append(f"{op}: {rr.status_code} {rr.text[:300]}")
        except Exception as e:
            problems.append(f"chaos {op} exception {e!r} after {time.monotonic()-t:.1f}s")
        dt = time.monotonic() - t
        if dt > 60: problems.append(f"chaos {op} took {dt:.1f}s")
        r = r2 = None

with InProcessServer(path, staging=staging, enable_sleep_mode=True, data_parallel_size=DP) as srv:
    ths = [threading.Thread(target=gen_loop, args=(srv, i)) for i in range(2)]
    ths.append(threading.Thread(target=trainer_loop, args=(srv,)))
    ths += [threading.Thread(target=chaos_loop, args=(srv, 1 + k)) for k in range(CHAOS)]
    for t in ths: t.start()
    time.sleep(DUR)
    stop.set()
    for t in ths:
        t.join(180)
        if t.is_alive(): problems.append(f"thread {t.name} still running 180 s after stop")
    c = httpx.Client(timeout=60)
    # settle: wake, resume, then one clean sync of A and check
    c.post(srv.url + "/wake_up"); c.post(srv.url + "/resume")
    print("health", c.get(srv.url + "/health").status_code, c.get(srv.url + "/health").text)
    eng = WeightTransferTrainerFactory.trainer_init(
        init_info=GlooTrainerInitInfo(world_size=DP + 1, timeout_s=30, packed_buffer_size_bytes=64 << 10),
        client=HTTPWeightSyncClient(srv.url, timeout_s=60), source=ModuleSource(W["A"]))
    fin = eng.send_weights(weight_version="final-A"); eng.shutdown()
    r = c.post(srv.url + "/generate/", json={"prompt_ids": PROMPTS, "max_tokens": N, "temperature": 0, "generation_kwargs": {"ignore_eos": True}}).json()
    print("final", r["weight_version"], r["completion_ids"] == EXP["A"])
    if r["completion_ids"] != EXP["A"]: problems.append(f"final tokens wrong {r}")
    problems += [f"not idle at the end: {line}" for line in busy_gauges(c.get(srv.url + "/metrics").text)]
print(json.dumps(dict(sorted(log.items())), indent=0))
print("PROBLEMS", len(problems))
for p in problems[:30]: print(" ", p)
sys.exit(1 if problems else 0)
