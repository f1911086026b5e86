"""Engine-core kill chaos (session 21's adversarial pass): a real ``rlserve serve`` (tiny llama, gloo sync,
sleep mode, LoRA, restarts on) whose engine-core process is SIGKILLed at random moments while a trainer
syncs two weight sets A and B in a loop (labels ``vN-A`` / ``vN-B``), clients generate greedily on the
base model and on a LoRA adapter, and a chaos thread sleeps / wakes, pauses / resumes and loads / unloads
the adapter. Every answer carrying one weight version is checked against Hugging Face float32 greedy
tokens of the weights that version names (the adapter's: PEFT's merged model of that base); a 5xx other
than the documented 503s (``engine_dead``, ``weights_lost``, ``model_unavailable``, ``model_sleeping``,
``paused_timeout``), a request longer than 60 s, a thread not done 180 s after the stop, and any answer
under a label the server never committed are problems. At the end: wake, resume, one clean sync, the
greedy tokens of the base and the adapter, /health and the idle gauges. Exit status 1 on any problem.

    python benchmarks/core_kill_chaos.py none 60        # --weight-staging, seconds
    python benchmarks/core_kill_chaos.py host 60 8      # ... mean seconds between kills (default 8)
"""
from __future__ import annotations

import collections
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import httpx  # noqa: E402

from benchmarks.idle_gauges import busy_gauges  # noqa: E402
from rlserve.server.testing import ServerProcess  # noqa: E402
from rlserve.transfer import GlooTrainerInitInfo, HTTPWeightSyncClient, ModuleSource, WeightTransferTrainerFactory  # noqa: E402
from tests.lora_adapters import make_adapter, merged_model  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402
from tests.transfer_harness import greedy_continuation, load_hf  # noqa: E402

staging = sys.argv[1] if len(sys.argv) > 1 else "none"
DUR = float(sys.argv[2]) if len(sys.argv) > 2 else 60
KILL_EVERY = float(sys.argv[3]) if len(sys.argv) > 3 else 8.0
tmp = tempfile.mkdtemp(prefix="rlserve-core-kill-")
path = make_tiny_model("llama", os.path.join(tmp, "llama"), vocab_size=384, max_position_embeddings=4096)
ADAPTER = make_adapter(path, os.path.join(tmp, "a1"), seed=3)
W = {"A": load_hf(path, seed=1), "B": load_hf(path, scale=0.5, seed=2)}
PROMPT = [5, 17, 42, 9, 77, 3]
N = 6
EXP = {("base", k): greedy_continuation(m, PROMPT, N) for k, m in W.items()}
for k, m in W.items():
    m.save_pretrained(os.path.join(tmp, k))
    EXP[("a1", k)] = greedy_continuation(merged_model(os.path.join(tmp, k), ADAPTER), PROMPT, N)
EXP[("base", "ckpt")] = greedy_continuation(merged_model(path, None), PROMPT, N)
EXP[("a1", "ckpt")] = greedy_continuation(merged_model(path, ADAPTER), PROMPT, N)
assert len({tuple(v) for v in EXP.values()}) == len(EXP), EXP
ver2w = {"0": "ckpt"}
log = collections.Counter()
problems = []
stop = threading.Event()
DOCUMENTED_5XX = ("engine_dead", "weights_lost", "model_unavailable", "model_sleeping", "paused_timeout")


def check(who: str, r, dt: float) -> None:
    """One answer of ``who`` ("base" / "a1"): status, documented errors, tokens of its single version."""
    log[f"{who} {r.status_code}"] += 1
    if dt > 60:
        problems.append(f"{who} took {dt:.1f}s")
    if r.status_code != 200:
        try:
            code = r.json()["error"]["code"]
        except Exception:  # noqa: BLE001
            problems.append(f"{who} non-json {r.status_code} {r.text[:200]}")
            return
        log[f"{who} {r.status_code} {code}"] += 1
        if (r.status_code >= 500 and code not in DOCUMENTED_5XX) or (r.status_code == 400):
            problems.append(f"{who} {r.status_code} {r.text[:300]}")
        if who == "base" and r.status_code == 404:
            problems.append(f"base 404 {r.text[:200]}")
        return
    j = r.json()
    vs = j["weight_versions"]
    if any(v not in ver2w for v in vs):
        problems.append(f"{who}: answer under a label never synced: {vs}")
    if len(vs) != 1 or vs[0] not in ver2w:
        return
    got, want = j["choices"][0]["token_ids"], EXP[(who, ver2w[vs[0]])]
    if got != want[:len(got)]:
        problems.append(f"WRONG TOKENS {who} under {vs[0]} ({ver2w[vs[0]]}): {got} vs {want}")
    else:
        log[f"{who} checked"] += 1


def gen_loop(url: str, who: str, model: str) -> None:
    c = httpx.Client(timeout=120)
    while not stop.is_set():
        t = time.monotonic()
        try:
            r = c.post(url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": N,
                                                      "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        except Exception as e:  # noqa: BLE001
            problems.append(f"{who} exception {e!r} after {time.monotonic() - t:.1f}s")
            continue
        check(who, r, time.monotonic() - t)


def trainer_loop(url: str) -> None:
    eng, i = None, 0
    while not stop.is_set():
        w = "AB"[i % 2]
        i += 1
        try:
            if eng is None:
                eng = WeightTransferTrainerFactory.trainer_init(
                    init_info=GlooTrainerInitInfo(world_size=2, timeout_s=30,
                                                  packed_buffer_size_bytes=64 << 10),
                    client=HTTPWeightSyncClient(url, timeout_s=60), source=ModuleSource(W[w]))
            eng.source = ModuleSource(W[w])
            v = f"v{i}-{w}"
            ver2w[v] = w  # before: an answer can come before the finish returns
            eng.send_weights(weight_version=v)
            log["sync ok"] += 1
        except Exception as e:  # noqa: BLE001 - a kill mid-sync: re-initialise
            log[f"sync err {type(e).__name__} {getattr(e, 'status_code', '')} {getattr(e, 'code', '')}"] += 1
            try:
                eng.shutdown()
            except Exception:  # noqa: BLE001
                pass
            eng = None
            time.sleep(0.05)


def chaos_loop(url: str, srv, seed: int) -> None:
    rnd = random.Random(seed)
    c = httpx.Client(timeout=120)
    next_kill = time.monotonic() + rnd.expovariate(1 / KILL_EVERY)
    while not stop.is_set():
        t = time.monotonic()
        rs = []
        try:
            if t >= next_kill:  # a core that runs (not one being restarted: its pid is the dead one's)
                next_kill = t + rnd.expovariate(1 / KILL_EVERY)
                if c.get(url + "/health").json().get("status") not in ("dead", "restarting"):
                    try:
                        os.kill(c.get(url + "/server_info").json()["engine_core_pids"][0], signal.SIGKILL)
                        log["kill"] += 1
                    except ProcessLookupError:
                        log["kill: no such process"] += 1
                continue
            op = rnd.choice(["sleep", "pause", "load", "unload", "reload"])
            if op == "sleep":
                rs.append(c.post(url + f"/sleep?level={rnd.choice([1, 2])}"))
                time.sleep(rnd.random() * 0.3)
                rs.append(c.post(url + "/wake_up"))
            elif op == "pause":
                rs.append(c.post(url + f"/pause?mode={rnd.choice(['abort', 'wait', 'keep'])}&timeout=30"))
                time.sleep(rnd.random() * 0.3)
                rs.append(c.post(url + "/resume"))
            elif op == "unload":
                rs.append(c.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a1"}))
            else:
                rs.append(c.post(url + "/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": ADAPTER,
                                                                       "load_inplace": op == "reload"}))
            log[f"{op} " + " ".join(str(r.status_code) for r in rs)] += 1
            for r in rs:
                if r.status_code >= 500 and (r.status_code != 503 or r.json()["error"]["code"] not in DOCUMENTED_5XX):
                    problems.append(f"{op}: {r.status_code} {r.text[:300]}")
        except Exception as e:  # noqa: BLE001
            problems.append(f"chaos exception {e!r} after {time.monotonic() - t:.1f}s")
        if time.monotonic() - t > 60:
            problems.append(f"chaos op took {time.monotonic() - t:.1f}s")


args = ("--device", "cpu", "--dtype", "float32", "--max-model-len", "4096", "--max-num-seqs", "8",
        "--kv-cache-bytes", str(8 << 20), "--disable-access-log", "--weight-transfer-config", '{"backend": "gloo"}',
        "--weight-staging", staging, "--enable-sleep-mode", "--enable-lora", "--max-loras", "2",
        "--max-lora-rank", "16", "--max-engine-restarts", "1000", "--engine-restart-window", "1")
with ServerProcess(path, *args, startup_timeout_s=600) as srv:
    url = srv.url
    ths = [threading.Thread(target=gen_loop, args=(url, "base", path)), threading.Thread(target=gen_loop, args=(url, "a1", "a1")),
           threading.Thread(target=trainer_loop, args=(url,)), threading.Thread(target=chaos_loop, args=(url, srv, 1))]
    for t in ths:
        t.start()
    time.sleep(DUR)
    stop.set()
    for t in ths:
        t.join(180)
        if t.is_alive():
            problems.append(f"thread {t.name} still running 180 s after stop")
    c = httpx.Client(timeout=120)
    deadline = time.monotonic() + 120
    while httpx.get(url + "/health").json().get("status") in ("dead", "restarting") and time.monotonic() < deadline:
        time.sleep(0.1)
    c.post(url + "/wake_up")
    c.post(url + "/resume")
    c.post(url + "/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": ADAPTER})
    eng = WeightTransferTrainerFactory.trainer_init(
        init_info=GlooTrainerInitInfo(world_size=2, timeout_s=30, packed_buffer_size_bytes=64 << 10),
        client=HTTPWeightSyncClient(url, timeout_s=60), source=ModuleSource(W["A"]))
    ver2w["final-A"] = "A"
    eng.send_weights(weight_version="final-A")
    eng.shutdown()
    for who, model in (("base", path), ("a1", "a1")):
        r = c.post(url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0,
                                                   "ignore_eos": True, "return_token_ids": True})
        ok = r.status_code == 200 and r.json()["weight_version"] == "final-A" and \
            r.json()["choices"][0]["token_ids"] == EXP[(who, "A")]
        print("final", who, r.status_code, ok)
        if not ok:
            problems.append(f"final {who} wrong: {r.text[:300]}")
    print("health", c.get(url + "/health").text, "restarts", c.get(url + "/server_info").json()["engine_restarts"])
    problems += [f"not idle at the end: {line}" for line in busy_gauges(c.get(url + "/metrics").text)]
print(json.dumps(dict(sorted(log.items())), indent=0))
print("PROBLEMS", len(problems))
for p in problems[:30]:
    print(" ", p)
sys.exit(1 if problems else 0)
