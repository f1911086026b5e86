"""LoRA churn (session 20's adversarial pass) against ``rlserve serve MODEL --enable-lora
--max-loras 2 --max-lora-rank 16``: six clients ask greedy completions (60% streamed, 30% of those cut
after 1-12 chunks) of the base model or one of three adapters while a churner loads, unloads,
reloads in place, loads the same name twice at once, and unloads + loads at once. Each name always
maps to the same adapter file, so every answer must equal that model's greedy tokens (measured
alone first); an adapter not loaded must be a 404 model_not_found (in-stream for a stream). At the
end /health, the gauges, and the adapters left.

    python benchmarks/lora_churn.py URL SECONDS MODEL a1=PATH a2=PATH a3=PATH
"""
import asyncio, collections, json, random, sys, time
import os

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.idle_gauges import busy_gauges  # noqa: E402
URL = sys.argv[1]; DUR = float(sys.argv[2]); BASE = sys.argv[3]
FILES = dict(a.split("=", 1) for a in sys.argv[4:])
PROMPT = [5, 17, 42, 9, 77, 3]
N = 12
log = collections.Counter(); problems = []
EXP = {}

async def load(c, name, inplace=False):
    return await c.post(URL + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": FILES[name], "load_inplace": inplace})

async def unload(c, name):
    return await c.post(URL + "/v1/unload_lora_adapter", json={"lora_name": name})

async def complete(c, model, stream, cut=None):
    body = {"model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    t = time.monotonic()
    if not stream:
        r = await c.post(URL + "/v1/completions", json=body)
        return r.status_code, (r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text), time.monotonic() - t
    body["stream"] = True
    toks = []
    async with c.stream("POST", URL + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread(); return r.status_code, r.json(), time.monotonic() - t
        k = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            j = json.loads(line[6:])
            if "error" in j:
                return 599, j, time.monotonic() - t
            for ch in j["choices"]:
                toks += ch.get("token_ids") or []
            k += 1
            if cut is not None and k >= cut:
                return "cut", toks, time.monotonic() - t
    return 200, {"choices": [{"token_ids": toks}]}, time.monotonic() - t

async def client(idx, stop):
    rnd = random.Random(idx)
    async with httpx.AsyncClient(timeout=120) as c:
        while not stop.is_set():
            model = rnd.choice([BASE, *FILES])
            stream = rnd.random() < 0.6
            cut = rnd.randint(1, N) if stream and rnd.random() < 0.3 else None
            try:
                st, j, dt = await complete(c, model, stream, cut)
            except Exception as e:
                problems.append(f"client exc {model} {e!r}"); continue
            if dt > 60: problems.append(f"slow {dt:.1f}s {model}")
            if st == "cut":
                log["cut"] += 1
                if j != EXP[model][:len(j)]: problems.append(f"WRONG prefix {model} {j} vs {EXP[model]}")
                continue
            if st == 200:
                got = j["choices"][0]["token_ids"]
                if got != EXP[model]: problems.append(f"WRONG {model} stream={stream} {got} vs {EXP[model]}")
                else: log[f"ok {'base' if model == BASE else 'lora'}"] += 1
            else:
                code = j["error"]["code"] if isinstance(j, dict) and "error" in j else j
                log[f"{st} {code}"] += 1
                if not (st in (404, 599) and code == "model_not_found"):
                    problems.append(f"{model} {st} {str(j)[:300]}")

async def churn(stop):
    rnd = random.Random(99)
    async with httpx.AsyncClient(timeout=120) as c:
        while not stop.is_set():
            name = rnd.choice(list(FILES))
            op = rnd.choice(["load", "unload", "inplace", "double", "double_inplace", "unload_load"])
            t = time.monotonic()
            if op == "double" or op == "double_inplace":
                rs = await asyncio.gather(load(c, name, op.endswith("inplace")), load(c, name, op.endswith("inplace")))
            elif op == "unload_load":
                rs = await asyncio.gather(unload(c, name), load(c, name))
            elif op == "load": rs = [await load(c, name)]
            elif op == "inplace": rs = [await load(c, name, True)]
            else: rs = [await unload(c, name)]
            for r in rs:
                log[f"{op} {r.status_code}"] += 1
                if r.status_code >= 500: problems.append(f"{op} {name} {r.status_code} {r.text[:300]}")
            if time.monotonic() - t > 30: problems.append(f"{op} slow")
            await asyncio.sleep(rnd.random() * 0.2)

async def main():
    async with httpx.AsyncClient(timeout=120) as c:
        for m in [BASE, *FILES]:
            if m != BASE:
                for n in FILES: await unload(c, n)
                r = await load(c, m); assert r.status_code == 200, r.text
            st, j, _ = await complete(c, m, False)
            assert st == 200, j
            EXP[m] = j["choices"][0]["token_ids"]
        print("EXP", EXP)
        assert len({tuple(v) for v in EXP.values()}) == len(EXP)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(client(i, stop)) for i in range(6)] + [asyncio.create_task(churn(stop))]
    await asyncio.sleep(DUR); stop.set()
    done, pending = await asyncio.wait(tasks, timeout=180)
    if pending: problems.append(f"{len(pending)} tasks hung")
    async with httpx.AsyncClient(timeout=60) as c:
        h = await c.get(URL + "/health"); print("health", h.status_code)
        info = (await c.get(URL + "/server_info")).json().get("lora_adapters")
        print("adapters", [(a["name"], a.get("lora_int_id")) for a in info])
        problems.extend(f"not idle: {line}" for line in busy_gauges((await c.get(URL + "/metrics")).text))
    print(json.dumps(dict(sorted(log.items())), indent=0))
    print("PROBLEMS", len(problems))
    for p in problems[:30]: print(" ", p)
asyncio.run(main())
