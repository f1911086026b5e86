"""Issue 33, finding 8: a wrong ``rlserve serve`` setting is one ``rlserve serve: error: ...``
line and exit status 2 before any engine starts (the old code loaded the model first and
ended in a traceback, exit 1 or 3), and a client that never completes its request head is
disconnected (slow-loris)."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from rlserve.server.testing import ServerProcess


def _serve(monkeypatch, capsys, model: str, *flags: str) -> tuple[int, str]:
    """``rlserve serve MODEL --port 0 --device cpu FLAGS`` in this process (the code path of
    ``python -m rlserve``) with an engine that cannot start: the exit status (argparse's too)
    and the output. An engine start returns 1 ("could not start the engine"), so a setting
    that was only found after the engine (the old code) fails the test."""
    from rlserve.cli import main
    from rlserve.engine.front import async_engine

    def no_engine(*a, **k):
        raise RuntimeError("the engine was started")

    monkeypatch.setattr(async_engine, "AsyncEngine", no_engine)
    capsys.readouterr()  # (what building the tiny model printed)
    try:
        rc = main(["serve", model, "--port", "0", "--device", "cpu", *flags])
    except SystemExit as e:  # argparse
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


@pytest.fixture
def port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


CASES = {
    "unknown backend": (["--weight-transfer-config", '{"backend": "glo"}'],
                        "weight transfer backend must be one of ('gloo', 'nccl', 'ipc'), got 'glo'"),
    "unknown key": (["--weight-transfer-config", '{"backend": "gloo", "tiemout_s": 5}'],
                    "weight transfer config: unknown key(s) ['tiemout_s']"),
    "bad flag value": (["--weight-transfer-config", '{"backend": "gloo", "direct_receive": "yes"}'],
                       "direct_receive must be true or false, got 'yes'"),
    "port out of range": (["--port", "70000"], "argument --port: must be a TCP port in [0, 65535]"),
    "cuda without cuda": (["--device", "cuda"], "--device cuda: no CUDA device is available here"),
    "host not ours": (["--host", "192.0.2.1"], "cannot listen on 192.0.2.1:0: "),
    # P33: argparse's errors without its ~50-line usage; refused settings that the old code
    # accepted and that failed later (ipc on a CPU server: at the trainer's init; timeout_s -1:
    # every init 400) or with a traceback (--device bogus, after the model loaded). nccl on the
    # CPU is only a warning: `trl vllm-serve` passes it on every machine (test_trl_client)
    "port not a number": (["--port", "abc"], "argument --port: must be a TCP port in [0, 65535] (0: a free one), "
                                             "got 'abc'"),
    "config not JSON": (["--weight-transfer-config", "{backend: gloo}"],
                        "argument --weight-transfer-config: not valid JSON (Expecting property name"),
    "ipc on cpu": (["--weight-transfer-config", '{"backend": "ipc"}'],
                   "weight transfer backend 'ipc' shares CUDA memory; this server runs on --device cpu"),
    "negative timeout": (["--weight-transfer-config", '{"backend": "gloo", "timeout_s": -1}'],
                         "weight transfer config: timeout_s must be a number of seconds from 1 "),
    "zero buffers": (["--weight-transfer-config", '{"backend": "gloo", "packed_num_buffers": 0}'],
                     "weight transfer config: packed_num_buffers must be >= 1, got 0"),
    "unknown device": (["--device", "bogus"], "argument --device: expected auto, cpu, cuda or cuda:N, got 'bogus'"),
    "int flag": (["--max-engine-restarts", "-1"], "argument --max-engine-restarts: must be an integer >= 0, got '-1'"),
    # a new user's `rlserve serve default --reasoning-parser qwen3` loaded the engine, then ended in
    # a 26-line traceback (exit 1): the tiny llama's vocabulary has no <think> tokens either
    # session 18: `--max-model-len 99999999` loaded the model, then ended in a traceback (exit 1);
    # now checked against config.json first, with vLLM's message (rlserve.model_len)
    "max-model-len above the model's": (["--max-model-len", "99999999"],
                                        "User-specified max_model_len (99999999) is greater than the derived "
                                        "max_model_len (max_position_embeddings=256 or model_max_length=None in "
                                        "model's config.json). To allow overriding this maximum, set the env var "
                                        "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."),
    "max-model-len 0": (["--max-model-len", "0"], "argument --max-model-len: must be an integer >= 1 (or 1k, 1K, "
                                                  "25.6k ...), or -1 / auto (fit the KV cache), got '0'"),
    "max-model-len negative": (["--max-model-len", "-5"], "argument --max-model-len: must be an integer >= 1 (or 1k, "
                                                          "1K, 25.6k ...), or -1 / auto (fit the KV cache), got '-5'"),
    "max-model-len not an integer": (["--max-model-len", "1.5"],
                                     "argument --max-model-len: must be an integer >= 1 (or 1k, 1K, 25.6k ...), or -1 "
                                     "/ auto (fit the KV cache), got '1.5'"),
    "max-model-len binary suffix with decimals": (["--max-model-len", "1.5K"],
                                                  "argument --max-model-len: must be an integer >= 1 (or 1k, 1K, "
                                                  "25.6k ...), or -1 / auto (fit the KV cache), got '1.5K'"),
    # session 19's new user: `--dtype fp64` exited 1 from the engine's start with a traceback (vLLM's
    # --dtype has fixed choices: argparse refuses the rest)
    "dtype not one of the names": (["--dtype", "fp64"], "argument --dtype: invalid choice: 'fp64'"),
    # session 19: `--kv-cache-bytes 10` failed at the engine's start (exit 1); the tiny llama's block:
    # 2 (K, V) x 2 layers x 16 tokens x 2 KV heads x 16 (head_dim) x 4 bytes (float32 on the CPU)
    "kv-cache-bytes below one block": (["--kv-cache-bytes", "10"],
                                       "--kv-cache-bytes 10 holds no KV-cache block: one block of 16 tokens takes "
                                       "8192 bytes for this model; one sequence of --max-model-len 256 tokens needs "
                                       "131072 bytes"),
    # session 21: a cache between one block and one --max-model-len sequence started, and a long prompt then
    # raised a RuntimeError in the scheduler; vLLM refuses such a cache at start (_check_enough_kv_cache_memory)
    "kv-cache-bytes below one sequence": (["--kv-cache-bytes", "65536"],
                                          "To serve at least one request with the model's max seq len (256), KV cache "
                                          "for 16 blocks is needed (16 blocks of 16 tokens, 131072 bytes), which is "
                                          "larger than the available KV cache memory (--kv-cache-bytes 65536: 8 blocks "
                                          "of 16 tokens, 65536 bytes; 8192 bytes per block); the longest "
                                          "--max-model-len it holds is 128. "
                                          "Raise --kv-cache-bytes or lower --max-model-len"),
    "num-kv-blocks below one sequence": (["--num-kv-blocks", "4", "--max-model-len", "100"],
                                         "To serve at least one request with the model's max seq len (100), KV cache "
                                         "for 7 blocks is needed (7 blocks of 16 tokens), which is larger than the "
                                         "available KV cache memory (--num-kv-blocks 4: 4 blocks of 16 tokens); the "
                                         "longest --max-model-len it holds is 64. Raise --num-kv-blocks or lower "
                                         "--max-model-len"),
    "reasoning parser without its tokens": (["--reasoning-parser", "qwen3"],
                                            "--reasoning-parser qwen3: Qwen3ReasoningParser: the tokenizer has no "),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_setting_is_one_line_exit_2_before_the_engine(tiny_model, monkeypatch, capsys, case):
    """Each wrong setting fails the same way. ("cuda without cuda" needs a machine without
    CUDA, as the CPU test machine is.)"""
    flags, message = CASES[case]
    if case == "cuda without cuda":
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    rc, out = _serve(monkeypatch, capsys, tiny_model("llama"), *flags)
    assert rc == 2, out
    lines = out.strip().splitlines()  # one line: no usage (the old code printed argparse's ~50)
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("rlserve serve: error: "), out
    assert "Traceback" not in out and "engine was started" not in out, out


@pytest.mark.parametrize("name", ["RLSERVE_CUDA_GRAPH_SIZES", "RLSERVE_PREFILL_CUDA_GRAPHS"])
def test_bad_graph_size_list_is_one_line_exit_2(tiny_model, monkeypatch, capsys, name):
    """A bad item of either comma list (one parser, rlserve.envs.positive_int_list) is refused
    before the engine starts, naming the variable (the decode sizes' old read dropped "0")."""
    monkeypatch.setenv(name, "64,0")
    rc, out = _serve(monkeypatch, capsys, tiny_model("llama"))
    assert rc == 2, out
    assert out.strip() == f"rlserve serve: error: {name}: every item must be an integer >= 1, got '0'", out


def test_enable_lora_without_peft_is_one_line_exit_2(tiny_model, monkeypatch, capsys):
    """Session 19's new user: `--enable-lora` after the plain install (no PEFT) started, and every
    `/v1/load_lora_adapter` then answered 500 (ModuleNotFoundError: peft). Now refused at start."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    rc, out = _serve(monkeypatch, capsys, tiny_model("llama"), "--enable-lora")
    assert rc == 2, out
    assert out.strip() == "rlserve serve: error: --enable-lora needs the peft package: pip install 'rlserve[lora]'", out


def test_long_max_model_len_escape(tiny_model, monkeypatch, capsys, caplog):
    """VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (vLLM's escape): the length past the model's is let through to
    the engine's start (here a stand-in that refuses: exit 1), with vLLM's warning."""
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    # (a cache for one such sequence: 51.2 GB for the tiny llama, never allocated by the stand-in)
    rc, out = _serve(monkeypatch, capsys, tiny_model("llama"), "--max-model-len", "99999999",
                     "--kv-cache-bytes", str(100 << 30))
    assert rc == 1 and "engine was started" in out, out
    assert "must be used with extreme caution" in caplog.text


@pytest.mark.parametrize("value,want", [("auto", -1), ("-1", -1), ("1k", 1000), ("1K", 1024), ("25.6k", 25600),
                                        ("200", 200)])
def test_max_model_len_takes_vllms_forms(value, want):
    """``--max-model-len`` as vLLM 0.32's ``human_readable_int_or_auto``."""
    from rlserve.cli._arg_types import max_model_len

    assert max_model_len(value) == want


def test_max_model_len_auto_is_not_refused_for_a_short_cache(tiny_model, monkeypatch, capsys):
    """``--max-model-len auto`` with a cache shorter than the model's 256 positions: the engine fits the
    length to the cache (vLLM's auto-fit), so the check before the engine lets it through (to the stand-in
    engine: exit 1); a block less than one is still refused."""
    rc, out = _serve(monkeypatch, capsys, tiny_model("llama"), "--max-model-len", "auto", "--kv-cache-bytes", "65536")
    assert rc == 1 and "engine was started" in out, out
    rc, out = _serve(monkeypatch, capsys, tiny_model("llama"), "--max-model-len", "-1", "--kv-cache-bytes", "10")
    assert rc == 2 and "--kv-cache-bytes 10 holds no KV-cache block" in out, out


def test_port_in_use_is_one_line_exit_2(tiny_model, monkeypatch, capsys, port_in_use):
    rc, out = _serve(monkeypatch, capsys, tiny_model("llama"), "--port", str(port_in_use))
    assert rc == 2, out
    assert f"rlserve serve: error: cannot listen on 127.0.0.1:{port_in_use}: Address already in use" in out, out
    assert "Traceback" not in out and "engine was started" not in out, out


def _recv_until_closed(sock: socket.socket, trickle: bytes, bound_s: float, t0: float) -> float | None:
    """Send one byte of ``trickle`` every 0.2 s; the seconds from ``t0`` (a ``time.monotonic()`` read
    before the connection was made or its last bytes sent: the server's bound cannot have started
    earlier, so a lower bound on the result holds however late this process runs) until the server
    closed the connection, or None if it was still open ``bound_s`` after ``t0``."""
    sock.settimeout(0.2)
    i = 0
    while time.monotonic() - t0 < bound_s:
        try:
            if sock.recv(4096) == b"":
                return time.monotonic() - t0
        except socket.timeout:
            pass
        except ConnectionResetError:
            return time.monotonic() - t0
        try:
            sock.sendall(trickle[i % len(trickle):i % len(trickle) + 1])
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - t0
        i += 1
    return None


def _stack_env(impl: str) -> tuple[dict, str]:
    """The server's environment for RLSERVE_HTTP_IMPL=``impl`` and the stack its log names
    (``auto`` is uvloop + httptools: skipped where either is not installed)."""
    if impl == "auto":
        pytest.importorskip("uvloop")
        pytest.importorskip("httptools")
        return {"RLSERVE_HTTP_IMPL": "auto"}, "uvloop+httptools"
    return {"RLSERVE_HTTP_IMPL": impl}, "asyncio+h11"


@pytest.mark.parametrize("impl", ["h11", "auto"])
def test_slow_loris_connections_are_closed(tiny_model, impl):
    """--http-header-timeout 2: a connection that trickles header bytes (the old code kept it
    open for ever), or sends nothing, is closed after ~2 s; a request whose head arrived in
    time is answered, and its keep-alive connection has the same bound for the next head. The
    same on both HTTP stacks (h11; uvloop + httptools, session 18's default), and more than
    16 KiB of a head that does not end is a 400 on both (h11's limit; httptools has none of its
    own: the old parser's bound must hold on the new one)."""
    env, stack = _stack_env(impl)
    with ServerProcess(tiny_model("llama"), "--device", "cpu", "--http-header-timeout", "2", env=env) as srv:
        assert f"HTTP: uvicorn on {stack}" in srv.log_tail(1_000_000)
        port = int(srv.url.rsplit(":", 1)[1])
        t0 = time.monotonic()  # (every t0 here is read before the server's bound can start)
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            took = _recv_until_closed(s, b"X-Slow: aaaaaaaaaaaaaaaaaaaaaaaa\r\n", bound_s=30, t0=t0)
        assert took is not None and 1.5 < took < 20, took
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.settimeout(30)
            assert s.recv(4096) == b""  # sent nothing: closed
            assert 1.5 < time.monotonic() - t0 < 20
        with httpx.Client(base_url=srv.url, timeout=30) as client:  # heads in time: answered, kept alive
            for _ in range(3):
                assert client.get("/health").status_code == 200
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            s.settimeout(30)
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
            t0 = time.monotonic()
            s.sendall(b"GET /health HTTP/1.1\r\n")  # the second head never ends
            took = _recv_until_closed(s, b"X", bound_s=30, t0=t0)
        assert took is not None and took < 20, took
        with socket.create_connection(("127.0.0.1", port)) as s:  # two pipelined heads: both answered
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n"
                      b"Connection: close\r\n\r\n")
            assert _read_all(s).count(b"HTTP/1.1 200") == 2
        for head in (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000,  # never ends
                     b"GET /health?" + b"q" * 20_000):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(head)
                assert _read_all(s).startswith(b"HTTP/1.1 400")  # and closed (_read_all returned)
        with httpx.Client(base_url=srv.url, timeout=30) as client:  # still serving
            assert client.get("/health", headers={"X-Ok": "a" * 8_000}).status_code == 200


@pytest.mark.parametrize("impl", ["h11", "auto"])
def test_slow_body_connections_are_closed(tiny_model, impl):
    """Session 21: --http-header-timeout 2 bounds the wait between two reads of a request body too. A head
    with Content-Length and part of the body (or none), then nothing, on a control route and a generation
    route: closed ~2 s after the last byte, nothing answered (main held each connection for ever: one file
    descriptor per such client); a body trickled faster than the bound is read whole and answered."""
    env, _stack = _stack_env(impl)
    with ServerProcess(tiny_model("llama"), "--device", "cpu", "--http-header-timeout", "2", env=env) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        for path, part in (("/abort_requests", b""), ("/v1/completions", b'{"prompt": "hi", ')):
            t0 = time.monotonic()  # before the last byte is sent: the server's ~2 s cannot start earlier
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n" + part)
                s.settimeout(30)
                assert _read_all(s) == b"", path  # closed, nothing answered
                assert 1.5 < time.monotonic() - t0 < 20, path
        body = b'{"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}'
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
            for i in range(0, len(body), 8):  # 7 pieces, 0.5 s apart: 3.5 s in all, never 2 s without a byte
                time.sleep(0.5)  # (1.5 s of margin for a late wake-up on a loaded machine; 1 s apart left 1 s)
                s.sendall(body[i:i + 8])
            s.settimeout(30)
            assert s.recv(65536).startswith(b"HTTP/1.1 200")


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (30 s bound)."""
    sock.settimeout(30)
    chunks = []
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)


def test_http_impl_setting(monkeypatch, capsys, tiny_model):
    """RLSERVE_HTTP_IMPL picks the stack (h11: the stdlib loop + h11); another value is one
    error line and exit 2 before the engine starts."""
    from rlserve.server.http_protocol import http_stack

    assert http_stack("h11").name == "asyncio+h11"
    assert http_stack("h11").protocol(3.0).header_timeout_s == 3.0
    with pytest.raises(ValueError, match="RLSERVE_HTTP_IMPL must be auto, h11 or uvloop-h11, not 'fast'"):
        http_stack("fast")
    monkeypatch.setenv("RLSERVE_HTTP_IMPL", "fast")
    rc, out = _serve(monkeypatch, capsys, tiny_model("llama"))
    assert rc == 2 and "rlserve serve: error: RLSERVE_HTTP_IMPL must be auto, h11 or uvloop-h11, not 'fast'" in out, out


def test_a_parser_flag_loads_the_tokenizer_once(tmp_path, monkeypatch, capsys):
    """``--reasoning-parser`` checks the parser against the tokenizer before any engine starts
    (tool_flags.check_parsers_fit_tokenizer); the server then uses that tokenizer instead of
    loading it a second time (~0.5 s of start-up). The real engine starts (engine-core process)
    and is stopped; the loads in this (the API) process are counted. Was 2 on the old code."""
    import transformers

    from rlserve.engine.front import async_engine
    from tests.tool_models import make_tool_model

    model = make_tool_model(tmp_path / "m")
    real_load, loads, made = transformers.AutoTokenizer.from_pretrained, [], []

    def counted(*a, **k):
        loads.append(a[0] if a else k.get("pretrained_model_name_or_path"))
        made.append(real_load(*a, **k))
        return made[-1]

    real_engine, seen = async_engine.AsyncEngine, {}

    def start_then_stop(*a, **k):
        eng = real_engine(*a, **k)
        seen["tokenizer"] = eng.engine.tokenizer
        eng.shutdown()
        raise RuntimeError("started and stopped")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counted)
    monkeypatch.setattr(async_engine, "AsyncEngine", start_then_stop)
    from rlserve.cli import main

    rc = main(["serve", model, "--port", "0", "--device", "cpu", "--reasoning-parser", "qwen3",
               "--engine-mode", "process"])
    out = capsys.readouterr()
    assert rc == 1 and "started and stopped" in out.err, out.err
    assert loads == [model], loads
    assert seen["tokenizer"] is made[0]  # the API process's tokenizer is the checked one
