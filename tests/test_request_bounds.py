"""Issue 33, finding 6: one request must not stall the others. A chat template renders in a
worker process bounded in time, memory and output (:mod:`rlserve.server.template_pool`); a
structured-output constraint has a size bound and compiles off the event loop and off the
engine's step loop. Each bomb is a 400, and a canary ``/health`` keeps answering meanwhile."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from rlserve.server import template_pool
from tests.transfer_harness import InProcessServer, wait_pool_warm

# 3 ** 40,000,000 is one C call that holds the GIL: ~3 s for 3 ** 10**7 on this 2-core machine,
# Karatsuba's n^1.585 gives ~25-35 s for 4x the exponent; rendered on a thread of the server
# process (the old code) it stopped the event loop that long.
POW_BOMB = "{{ 3 ** 40000000 }}"
#: a bound that only catches a hang (seconds): the canary waits on states, not on a time
HANG_S = 60.0
LOOP_BOMB = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"  # 10^10 steps
MEMORY_BOMB = "{{ 'x' * 10**9 }}"  # 1 GB in one C call


@pytest.fixture(scope="module")
def srv(tiny_model):
    with InProcessServer(tiny_model("llama"), warm_templates=True) as s:  # as rlserve serve starts them
        yield s


def _chat(srv, timeout=120, **extra):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, **extra}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=timeout)


def _with_canary(srv, fn):
    """``fn()`` on a thread while this thread sends ``GET /health`` back to back (each bounded by
    :data:`HANG_S` only); returns (fn's result, how many /health answered 200)."""
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", fn()), daemon=True)
    count = 0
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as client:
        t.start()
        while t.is_alive():
            assert client.get("/health").status_code == 200
            count += 1
            time.sleep(0.02)
    t.join(HANG_S)
    return box["r"], count


def test_server_is_healthy_only_once_its_template_workers_are_warm(srv):
    """(First in this module.) The server's start-up waits for one of its chat-template /
    constraint workers to warm before /health answers 200 (and before ``rlserve serve`` logs
    ``ready``): a chat request right after needs no worker's start. Fails on the old code: the
    workers warmed in the background after the start-up (the first chat request after ``ready``
    waited 9-24 s for them on the 2-core machine)."""
    idle, warming = srv.templates_at_health
    assert idle >= 1 and idle + warming == template_pool.POOL_SIZE, srv.templates_at_health


def test_workers_start_with_the_server_niced_and_warm_and_a_constraint_compiles_once(srv):
    """(First in this module: the shared server's pool is as its start left it.) The template /
    constraint workers start with the server, niced, and warm before any request: tokenizer
    loaded and xgrammar's compiler made (the fuzz run's first constrained request waited for
    that: several seconds, importing torch). A constrained request then starts no worker; the
    same constraint again is not compiled in a worker again (the engine core compiles it once
    and keeps it). Fails on the old code: no worker existed before the first request."""
    pytest.importorskip("xgrammar")
    import os

    state = srv.app.state.rlserve
    workers = state._templates
    assert workers, "no template workers were made at start-up"
    srv.wait_templates_warm()
    warm = list(workers._idle.queue)
    assert len(warm) == template_pool.POOL_SIZE and workers.warming == 0, (len(warm), workers.warming)
    assert all(w.ready and w.grammar_ready for w in warm)
    want_nice = min(19, os.getpriority(os.PRIO_PROCESS, 0) + template_pool.WORKER_NICE)
    assert [os.getpriority(os.PRIO_PROCESS, w.proc.pid) for w in warm] == [want_nice] * len(warm)
    started = list(workers.pids)
    compiles = []
    real = template_pool._Worker.compile

    def counted(self, spec, *a):
        compiles.append(spec["regex"])
        return real(self, spec, *a)

    template_pool._Worker.compile = counted
    try:
        for _ in range(2):
            r = httpx.post(srv.url + "/v1/completions", timeout=120,
                           json={"prompt": "hi", "max_tokens": 5, "structured_outputs": {"regex": "(yes|no)"}})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text
    finally:
        template_pool._Worker.compile = real
    assert compiles == ["(yes|no)"]  # once, for the first request
    assert workers.pids == started  # no worker started for a request


def test_start_workers_warm_unniced_then_lower_their_priority_and_replacements_warm_niced():
    """The workers made at start warm at the server's priority (a niced warm-up took 37 s+ on a
    busy machine, and the first constrained request waited for it) and are niced before their
    first render; a replacement for a killed worker (what a bomb causes) is niced from its
    start. Fails on the old code: a warm worker was already niced before any request."""
    import os

    from tests.tiny_models import build_tokenizer

    base = os.getpriority(os.PRIO_PROCESS, 0)
    niced = min(19, base + template_pool.WORKER_NICE)
    pool = template_pool.TemplateWorkers(build_tokenizer(), max_chars=10_000, size=1)
    try:
        pool.start()
        wait_pool_warm(pool)
        (w,) = list(pool._idle.queue)
        assert os.getpriority(os.PRIO_PROCESS, w.proc.pid) == base
        kwargs = template_pool.template_call_kwargs()
        text = pool.render([{"role": "user", "content": "hi"}], kwargs)
        assert "hi" in text
        assert os.getpriority(os.PRIO_PROCESS, w.proc.pid) == niced
        w.proc.kill()
        with pytest.raises(template_pool.TemplateError) as ei:
            pool.render([{"role": "user", "content": "hi"}], kwargs)
        assert ei.value.kind == "died"
        wait_pool_warm(pool)
        (r,) = list(pool._idle.queue)
        assert r is not w and os.getpriority(os.PRIO_PROCESS, r.proc.pid) == niced
        assert pool.render([{"role": "user", "content": "hi"}], kwargs) == text
    finally:
        pool.close()


def _blocked_reading_stdin(pid: int) -> bool:
    """Whether process ``pid`` is blocked in ``read(0, ...)`` (``/proc/PID/syscall``: the
    syscall number, then its first argument, the fd)."""
    import platform

    nr = {"x86_64": 0, "aarch64": 63}[platform.machine()]
    with open(f"/proc/{pid}/syscall") as f:
        return f.read().split()[:2] == [str(nr), "0x0"]


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="/proc/PID/syscall")
def test_worker_ignores_sigint_from_its_start_up_on(tmp_path):
    """Ctrl-C at the terminal reaches every process of the server's group: a worker still reading
    its tokenizer (start-up), or idle between requests, printed a KeyboardInterrupt traceback and
    died. Now it ignores SIGINT (the server ends it). Fails on the old code (a traceback, exit 1
    before ready)."""
    import os
    import pickle
    import signal
    import subprocess

    from tests.tiny_models import build_tokenizer

    err = open(tmp_path / "stderr", "w+")
    p = subprocess.Popen(template_pool.worker_command(10_000, 5.0, True), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=err)
    try:
        deadline = time.monotonic() + HANG_S
        while not _blocked_reading_stdin(p.pid):  # its start-up reached the tokenizer's read
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(p.pid, signal.SIGINT)
        template_pool._write_frame(p.stdin.fileno(), pickle.dumps(build_tokenizer()))
        assert json.loads(template_pool._read_frame(p.stdout.fileno(), time.monotonic() + HANG_S)) == {"ready": True}
        while not _blocked_reading_stdin(p.pid):  # idle: waiting for a request
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(p.pid, signal.SIGINT)
        request = {"messages": [{"role": "user", "content": "hi"}], "kwargs": template_pool.template_call_kwargs()}
        template_pool._write_frame(p.stdin.fileno(), json.dumps(request).encode())
        reply = json.loads(template_pool._read_frame(p.stdout.fileno(), time.monotonic() + HANG_S))
        assert "hi" in reply["text"]
        p.stdin.close()  # how the server ends an idle worker
        assert p.wait(HANG_S) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    err.seek(0)
    text = err.read()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text


def test_cpu_bound_template_is_a_400_and_does_not_stop_the_loop(srv, monkeypatch):
    """A /health sent after the bomb went to its worker is answered while the bomb's request still
    waits for the worker (states, no time bound: the request's thread is held at its read until the
    canary answered; the wait bound HANG_S only catches a hang). Then the render's own timeout
    answers 400 chat_template_timeout. On the code before the template workers the render held the
    GIL ~30 s in the API process and answered 200: no worker read, the wait below hangs (fails)."""
    rendering, answered, armed = threading.Event(), threading.Event(), [True]
    real = template_pool._read_frame

    def held(fd, deadline=None):
        if armed and threading.current_thread() is not threading.main_thread():
            armed.clear()  # the bomb's read (the pool is warm: no other worker read is in flight)
            rendering.set()
            answered.wait(HANG_S)
        return real(fd, deadline)

    wait_pool_warm(srv.app.state.rlserve.template_workers())
    monkeypatch.setattr(template_pool, "_read_frame", held)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", _chat(srv, chat_template=POW_BOMB)), daemon=True)
    t.start()
    assert rendering.wait(HANG_S), "the bomb never reached a template worker"
    assert httpx.get(srv.url + "/health", timeout=HANG_S).status_code == 200
    assert t.is_alive()  # answered while the bomb's request still waited for its worker
    answered.set()
    t.join(HANG_S)
    r = box["r"]
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "chat_template_timeout" and err["param"] == "chat_template", err
    assert f"within {template_pool.RENDER_TIMEOUT_S:g} s" in err["message"], err


def test_endless_template_is_a_400_within_its_time_bound(srv):
    """10^10 loop steps: on the old code the request never got an answer (and a thread spun
    forever); now a 400 after RENDER_TIMEOUT_S, and the next chat request renders as before."""
    expect = _chat(srv)
    assert expect.status_code == 200, expect.text
    t0 = time.monotonic()
    r = _chat(srv, timeout=60, chat_template=LOOP_BOMB)
    took = time.monotonic() - t0
    assert r.status_code == 400 and r.json()["error"]["code"] == "chat_template_timeout", r.text
    assert template_pool.RENDER_TIMEOUT_S <= took < template_pool.RENDER_TIMEOUT_S + 30, took
    again = _chat(srv)
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["message"] == expect.json()["choices"][0]["message"]


def test_memory_bomb_template_is_a_400(srv):
    r = _chat(srv, chat_template=MEMORY_BOMB)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "chat_template" and "MemoryError" in err["message"], err
    assert _chat(srv).status_code == 200


def test_template_output_over_the_context_is_a_400(srv):
    """A render longer than max_prompt_chars is refused in the worker (never sent back)."""
    n = srv.app.state.rlserve.limits.max_prompt_chars + 1
    r = _chat(srv, chat_template="{{ 'y' * %d }}" % n)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "input_text", err  # (vLLM 0.32's name)
    assert f"has {n} characters" in err["message"], err


def test_template_errors_and_tokenize_use_the_workers(srv):
    """The same renders as before through /tokenize and the template's own errors: a 400
    naming chat_template with the template's exception."""
    body = {"messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(srv.url + "/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    state = srv.app.state.rlserve
    text = state.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                               add_generation_prompt=True)
    assert r.json()["tokens"] == state.tokenizer.encode(text, add_special_tokens=False)
    bad = httpx.post(srv.url + "/v1/chat/completions",
                     content=json.dumps({**body, "chat_template": "{{ raise_exception('no') }}"}),
                     headers={"content-type": "application/json"}, timeout=60)
    err = bad.json()["error"]
    assert bad.status_code == 400 and err["param"] == "chat_template", bad.text
    assert "could not apply the chat template" in err["message"] and "no" in err["message"], err


# ---- structured outputs ----------------------------------------------------------------------
def _slow_compiles(monkeypatch, seconds: float) -> None:
    """Every constraint compile of the engine takes ``seconds`` longer (a sleep: no CPU), as a
    large constraint's does (20,000 choices: 9-30 s of CPU on the 2-core machine)."""
    from rlserve.engine.core import structured

    real = structured.GrammarCompiler.compile

    def slow(self, spec):
        time.sleep(seconds)
        return real(self, spec)

    monkeypatch.setattr(structured.GrammarCompiler, "compile", slow)


def test_oversized_constraints_are_a_400_before_compiling(srv, monkeypatch):
    """100,000 choices (issue 33: ~45 s of stall for every other request) and a regex over
    MAX_CONSTRAINT_CHARS are refused by size before any compile starts (none is called), with a
    canary /health answering (bounded by HANG_S only)."""
    from rlserve.server.limits import MAX_CHOICES, MAX_CONSTRAINT_CHARS

    def send():
        out = []
        for so in ({"choice": [f"c{i}" for i in range(100_000)]}, {"regex": "a" * (MAX_CONSTRAINT_CHARS + 1)},
                   {"json": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}}):
            t0 = time.monotonic()
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "structured_outputs": so},
                           timeout=120)
            out.append((r, time.monotonic() - t0))
        return out

    compiles = []  # no constraint of these reaches a compile (in a template worker or in-process)
    from rlserve.engine.core import structured

    real_pool, real_inproc = template_pool.TemplateWorkers.compile, structured.GrammarCompiler.compile
    monkeypatch.setattr(template_pool.TemplateWorkers, "compile",
                        lambda self, spec, *a, **k: compiles.append(spec) or real_pool(self, spec, *a, **k))
    monkeypatch.setattr(structured.GrammarCompiler, "compile",
                        lambda self, spec: compiles.append(spec) or real_inproc(self, spec))
    answers, _count = _with_canary(srv, send)
    (choice, _), (regex, _), (schema, _) = answers
    err = choice.json()["error"]
    assert choice.status_code == 400 and err["code"] == "constraint_too_large", choice.text
    assert err["param"] == "structured_outputs.choice" and f"at most {MAX_CHOICES} choices, got 100000" in err["message"]
    err = regex.json()["error"]
    assert regex.status_code == 400 and err["param"] == "structured_outputs.regex", regex.text
    assert f"at most {MAX_CONSTRAINT_CHARS} characters, got {MAX_CONSTRAINT_CHARS + 1}" in err["message"], err
    assert schema.status_code == 400 and schema.json()["error"]["param"] == "structured_outputs.json", schema.text
    assert compiles == [], compiles  # (count: how many /health answered meanwhile, each under HANG_S)
    ok = httpx.post(srv.url + "/v1/completions", timeout=60,
                    json={"prompt": "hi", "max_tokens": 5, "structured_outputs": {"choice": ["yes", "no"]}})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in ("yes", "no"), ok.text


def test_constraint_over_its_compile_time_is_a_400_and_stops_compiling(srv, monkeypatch):
    """A constraint within the size bound whose compile overruns COMPILE_TIMEOUT_S (lowered to
    0.5 s here; the fuzz's regex bomb ``(a|b)*`` x 2000 compiles for 30 s and more) is a 400
    ``constraint_timeout`` after the bound, and its compile stops: it ran in a template worker,
    which is killed (P33: it ran on a thread of the API process, which cannot be stopped, and
    burned one of the two cores for ~33 s after the answer in the fuzz run). Fails before: the
    compile ran in the API process. Then a good constraint is served (a fresh worker)."""
    from rlserve.engine.core import structured
    from rlserve.server import structured_check

    monkeypatch.setattr(structured_check, "COMPILE_TIMEOUT_S", 0.5)
    in_api = []
    real = structured.GrammarCompiler.compile
    monkeypatch.setattr(structured.GrammarCompiler, "compile", lambda self, spec: in_api.append(spec) or real(self, spec))
    state = srv.app.state.rlserve
    # the pool's workers, started by an earlier chat request or this one
    assert _chat(srv).status_code == 200
    before = {w.proc.pid: w for w in list(state.template_workers()._idle.queue)}
    t0 = time.monotonic()
    r = httpx.post(srv.url + "/v1/completions", timeout=120,
                   json={"prompt": "hi", "max_tokens": 2, "structured_outputs": {"regex": "(a|b)*" * 2000}})
    took = time.monotonic() - t0
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "constraint_timeout", r.text
    assert err["param"] == "structured_outputs" and "within 0.5 s" in err["message"], err
    assert took < 30.0, took  # the bound plus a worker's start on a loaded machine
    assert in_api == []  # nothing compiled in the API process
    killed = [w for w in before.values() if w.proc.poll() is not None]
    after = {w.proc.pid for w in list(state.template_workers()._idle.queue)}
    assert len(killed) == 1 or len(before) < template_pool.POOL_SIZE, (before, after)
    assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
    monkeypatch.setattr(structured_check, "COMPILE_TIMEOUT_S", 60.0)
    ok = httpx.post(srv.url + "/v1/completions", timeout=120,
                    json={"prompt": "hi", "max_tokens": 5, "structured_outputs": {"regex": "(yes|no)"}})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in ("yes", "no"), ok.text
    bad = httpx.post(srv.url + "/v1/completions", timeout=120,
                     json={"prompt": "hi", "max_tokens": 2, "structured_outputs": {"regex": "(unclosed"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "structured_outputs", bad.text
    assert "structured_outputs.regex is not valid" in bad.json()["error"]["message"], bad.text


def test_engine_compiles_constraints_beside_its_steps(tiny_model, monkeypatch):
    """A constraint that takes seconds to compile no longer holds the engine's step loop:
    add_request returns within INLINE_COMPILE_S plus overhead (the old code compiled inside it,
    the whole 3 s), another request runs to its end meanwhile, and the constrained one then
    answers one of its choices. The engine bounds no size (the API process does), so this
    reaches it directly."""
    from rlserve.engine.core import llm_engine
    from rlserve.engine.llm import LLM
    from rlserve.engine.sampling_params import SamplingParams, StructuredOutputsParams

    inline_s = getattr(llm_engine, "INLINE_COMPILE_S", 0.05)  # (so that the old code fails on time, not import)
    eng = LLM(tiny_model("llama"), dtype="float32", device="cpu").engine
    _slow_compiles(monkeypatch, 3.0)
    eng.add_request("plain", "hello", SamplingParams(temperature=0, max_tokens=8, min_tokens=8))
    eng.step()
    choices = ("yes", "no", "maybe")
    t0 = time.monotonic()
    eng.add_request("slow", "hi", SamplingParams(max_tokens=12, structured_outputs=StructuredOutputsParams(
        choice=choices)))
    added = time.monotonic() - t0
    assert added < inline_s + 1.0, added  # the old code: the whole compile (3 s)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = (o, time.monotonic() - t0)
    plain, slow = done["plain"], done["slow"]
    assert len(plain[0].outputs[0].token_ids) == 8 and plain[1] < 3.0 <= slow[1], (plain[1], slow[1])
    assert slow[0].outputs[0].finish_reason == "stop" and slow[0].outputs[0].text in choices, slow[0].outputs[0]
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_request_aborted_while_its_constraint_compiles(tiny_model, monkeypatch):
    from rlserve.engine.llm import LLM
    from rlserve.engine.sampling_params import SamplingParams, StructuredOutputsParams

    eng = LLM(tiny_model("llama"), dtype="float32", device="cpu").engine
    _slow_compiles(monkeypatch, 1.0)
    eng.add_request("slow", "hi", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        choice=("a", "b"))))
    outs = eng.abort_request("slow")
    assert [o.outputs[0].finish_reason for o in outs] == ["abort"] and not eng.has_unfinished_requests()
    eng.add_request("next", "hello", SamplingParams(temperature=0, max_tokens=3, min_tokens=3))
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


# ---- tokenizing ----------------------------------------------------------------------------
def test_long_text_is_encoded_on_its_own_thread(srv, monkeypatch):
    """A text of LONG_TEXT_CHARS or more (lowered to 1,000 here) is encoded on the long-text thread, a short one
    on the short-text thread, each with a tokenizer copy of its own: a short request never waits behind
    the seconds a maximal prompt takes (the old code had one thread for both). Same ids."""
    from rlserve.server import tokenizer_threads

    monkeypatch.setattr(tokenizer_threads, "LONG_TEXT_CHARS", 1000)  # the tiny model's context holds 3,328
    state = srv.app.state.rlserve
    seen = []
    real = type(state.tokenizer).encode

    def spy(tok, text, *a, **k):
        seen.append((threading.current_thread().name.rsplit("_", 1)[0], tok is state.tokenizer, len(text)))
        return real(tok, text, *a, **k)

    monkeypatch.setattr(type(state.tokenizer), "encode", spy)
    long_text = "ab " * 400
    short = httpx.post(srv.url + "/tokenize", json={"prompt": "ab ab"}, timeout=60)
    long = httpx.post(srv.url + "/tokenize", json={"prompt": long_text}, timeout=60)
    assert short.status_code == 200 and long.status_code == 200, (short.text, long.text)
    # (P33) the short-text thread encodes with a copy too: the server's tokenizer is the one the
    # replicas' output processing and the event loop decode with (the old code shared it: "Already
    # borrowed" when an encode changed its truncation settings meanwhile)
    assert ("rlserve-tokenizer", False, 5) in seen, seen
    assert not any(mine for _thread, mine, _n in seen), seen
    assert ("rlserve-tokenizer-long", False, len(long_text)) in seen, seen
    assert long.json()["tokens"] == real(state.tokenizer, long_text, add_special_tokens=True)


def test_prestarted_workers_are_taken_and_a_stop_while_warming_logs_no_warning(caplog, monkeypatch):
    """``rlserve serve`` prestarts its template workers as its engine starts
    (:func:`template_pool.prestart_workers`: the first at the server's priority, the others niced
    from their start): the pool's start takes them (no new process) and they render. A pool closed while its workers warm (Ctrl-C during the start-up) logs no "did
    not warm" warning: the old code logged one per worker on every early stop."""
    import logging
    import sys

    from tests.tiny_models import build_tokenizer

    import os

    template_pool.prestart_workers(2)
    pre, niced = template_pool._PRESTARTED  # the second warms niced from its start
    deadline = time.monotonic() + HANG_S
    while os.getpriority(os.PRIO_PROCESS, niced.pid) == os.getpriority(os.PRIO_PROCESS, 0):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert os.getpriority(os.PRIO_PROCESS, pre.pid) == os.getpriority(os.PRIO_PROCESS, 0)
    template_pool._PRESTARTED.remove(niced)  # (the pool below takes the first one only)
    niced.kill()
    niced.wait()
    niced.stdin.close()
    niced.stdout.close()
    pool = template_pool.TemplateWorkers(build_tokenizer(), max_chars=10_000, size=1)
    try:
        pool.start()
        assert pool.pids == [pre.pid] and template_pool._PRESTARTED == []
        assert pool.wait_warm(HANG_S)
        assert "hi" in pool.render([{"role": "user", "content": "hi"}], template_pool.template_call_kwargs())
    finally:
        pool.close()
    # workers that never get ready (a process that only sleeps): closed while warming, for sure
    monkeypatch.setattr(template_pool, "worker_command", lambda *a: [sys.executable, "-c", "import time; time.sleep(600)"])
    pool = template_pool.TemplateWorkers(build_tokenizer(), max_chars=10_000, size=2)
    with caplog.at_level(logging.WARNING, logger=template_pool.__name__):
        pool.start()
        assert pool.warming == 2
        pool.close()
        deadline = time.monotonic() + HANG_S
        while pool.warming:  # the warm threads see their workers end
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert not [r for r in caplog.records if "did not warm" in r.getMessage()], caplog.text


@pytest.mark.parametrize("field,body", [
    ("response_format", {"response_format": {"type": "json_object"}}),
    ("structured_outputs", {"structured_outputs": {"regex": "(yes|no)"}}),
])
def test_constraint_without_xgrammar_names_the_field_sent(srv, monkeypatch, field, body):
    """Without xgrammar (here: not importable in the server's process, ``sys.modules`` entry None), a
    constrained request is a 400 whose message names the field the request used and the extra to
    install. The old message said "structured_outputs needs ..." for a ``response_format`` too (the
    compiler's word for it; session 19), and here the old code compiled it in a worker process."""
    import sys

    monkeypatch.setitem(sys.modules, "xgrammar", None)
    r = httpx.post(srv.url + "/v1/completions", timeout=HANG_S, json={"prompt": "hi", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field
    assert err["message"] == f"{field} needs the xgrammar package on the server: pip install 'rlserve[structured]'"
