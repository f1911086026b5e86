"""Abort storm (session 20's adversarial pass) against a running ``rlserve serve``: TOTAL clients,
CONCURRENCY at a time, each a random request (n=4 with logprobs=20, n=2 best_of=3, prompt_logprobs=20,
stop strings, max_tokens 1e9 / 2**63, min_tokens > max_tokens, a never-ending EBNF grammar or regex,
json_object, chat n=3 top_logprobs=20, echo) that disconnects after 0-20 stream chunks or at a
0.05-0.5 s read timeout. Two canaries run beside it: a greedy completion (same tokens every time)
and a greedy stream cut by a 3-character stop string taken from the middle of its own text
(spanning a token boundary, stream_interval 1). A problem: a 5xx, an in-stream error, a wrong
canary, a request over 100 s, or (3 s after the storm) a running / waiting / held / unfinished
request or KV-cache use left. Structured outputs need xgrammar (else those kinds are 400s).

    python benchmarks/abort_storm.py http://127.0.0.1:8000 MODEL 400 32
"""
import asyncio, collections, json, random, sys, time
import os

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.idle_gauges import busy_gauges  # noqa: E402
URL, MODEL, TOTAL, CONC = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
log = collections.Counter(); problems = []
PROMPT = [5, 17, 42, 9, 77, 3]

def body(rnd):
    kind = rnd.choice(["n4lp20", "bestof", "plp", "stop", "huge", "minmax", "grammar", "regex", "json", "chat_n", "plain", "echo"])
    b = {"model": MODEL, "prompt": [rnd.randrange(300) for _ in range(rnd.randint(1, 40))], "max_tokens": rnd.randint(1, 200),
         "temperature": rnd.choice([0, 1.0]), "stream": rnd.random() < 0.8}
    if kind == "n4lp20": b.update(n=4, logprobs=20)
    elif kind == "bestof": b.update(n=2, best_of=3)
    elif kind == "plp": b.update(prompt_logprobs=20, logprobs=5); b["stream"] = False
    elif kind == "stop": b.update(stop=["a", "the", "\n\n", "xy"], include_stop_str_in_output=rnd.random() < .5, stream_interval=rnd.choice([1, 3]))
    elif kind == "huge": b.update(max_tokens=rnd.choice([10**9, 2**63, 10**30, 250]))
    elif kind == "minmax": b.update(min_tokens=b["max_tokens"] + rnd.randint(1, 1000))
    elif kind == "grammar": b.update(structured_outputs={"grammar": 'root ::= "a" root | "b" root'}, max_tokens=rnd.randint(50, 240))
    elif kind == "regex": b.update(structured_outputs={"regex": "(ab|cd)*"}, max_tokens=rnd.randint(50, 240))
    elif kind == "json": b.update(response_format={"type": "json_object"}, max_tokens=rnd.randint(50, 240))
    elif kind == "echo": b.update(echo=True, logprobs=3)
    if kind == "chat_n":
        b.pop("prompt"); b.update(messages=[{"role": "user", "content": "hi " * rnd.randint(1, 30)}], n=3, logprobs=True, top_logprobs=20)
    return kind, b

async def sse_lines(r):
    # SSE lines end at CR / LF only (httpx's aiter_lines also splits at U+2028, U+0085 inside JSON strings)
    buf = b""
    async for chunk in r.aiter_bytes():
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for ln in lines:
            yield ln.rstrip(b"\r").decode()

async def storm(i, sem):
    rnd = random.Random(i)
    kind, b = body(rnd)
    path = "/v1/chat/completions" if "messages" in b else "/v1/completions"
    cut = rnd.choice([0, 1, 2, 5, 20, None])
    async with sem:
        t = time.monotonic()
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(120, read=rnd.choice([0.05, 0.5, 120]) if not b["stream"] else 120)) as c:
                if b["stream"]:
                    async with c.stream("POST", URL + path, json=b) as r:
                        if r.status_code != 200:
                            await r.aread(); code = r.json()["error"]["code"]; log[f"{kind} {r.status_code} {code}"] += 1
                            if r.status_code >= 500: problems.append(f"{kind} {r.status_code} {r.text[:200]}")
                            return
                        k = 0
                        async for line in sse_lines(r):
                            if line.startswith("data: ") and line != "data: [DONE]":
                                j = json.loads(line[6:])
                                if "error" in j: problems.append(f"{kind} in-stream {j}"[:300]); return
                                k += 1
                                if cut is not None and k >= cut:
                                    log[f"{kind} cut"] += 1; return
                        log[f"{kind} 200 full"] += 1
                else:
                    r = await c.post(URL + path, json=b)
                    log[f"{kind} {r.status_code}"] += 1
                    if r.status_code >= 500: problems.append(f"{kind} {r.status_code} {r.text[:200]}")
        except httpx.ReadTimeout:
            log[f"{kind} client-timeout"] += 1
        except Exception as e:
            problems.append(f"{kind} exc {e!r}")
        if time.monotonic() - t > 100: problems.append(f"{kind} slow {time.monotonic()-t:.0f}s")

async def canary(stop_ev, exp, stop_exp):
    async with httpx.AsyncClient(timeout=120) as c:
        while not stop_ev.is_set():
            r = await c.post(URL + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
            if r.status_code != 200 or r.json()["choices"][0]["token_ids"] != exp:
                problems.append(f"canary {r.status_code} {r.text[:200]}")
            else: log["canary ok"] += 1
            text = ""
            async with c.stream("POST", URL + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True, "stop": [stop_exp[1]], "stream_interval": 1}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        j = json.loads(line[6:]); text += "".join(ch["text"] for ch in j["choices"])
            if text != stop_exp[0]: problems.append(f"stop canary {text!r} vs {stop_exp[0]!r}")
            else: log["stop canary ok"] += 1

async def main():
    async with httpx.AsyncClient(timeout=120) as c:
        r = await c.post(URL + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        exp = r.json()["choices"][0]["token_ids"]
        r = await c.post(URL + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True})
        full = r.json()["choices"][0]["text"]
    # a stop string spanning a token boundary, somewhere in the middle
    s = full[len(full)//2: len(full)//2 + 3]
    stop_exp = (full[:full.index(s)], s)
    print("stop", repr(s), "expect", repr(stop_exp[0]))
    stop_ev = asyncio.Event()
    can = [asyncio.create_task(canary(stop_ev, exp, stop_exp)) for _ in range(2)]
    sem = asyncio.Semaphore(CONC)
    t = time.monotonic()
    await asyncio.gather(*[storm(i, sem) for i in range(TOTAL)])
    stop_ev.set(); await asyncio.wait(can, timeout=120)
    print(f"storm took {time.monotonic()-t:.0f}s")
    await asyncio.sleep(3)
    async with httpx.AsyncClient(timeout=60) as c:
        print("health", (await c.get(URL + "/health")).status_code)
        problems.extend(f"not idle: {line}" for line in busy_gauges((await c.get(URL + "/metrics")).text))
    print(json.dumps(dict(sorted(log.items())), indent=0)); print("PROBLEMS", len(problems))
    for p in problems[:25]: print(" ", p)
asyncio.run(main())
