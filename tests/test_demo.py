"""``rlserve demo`` end to end on a tiny random model (gloo on CPU), its check, and its cleanup.

The tiny Llama (tied embeddings) is built with ``initializer_range=0.5`` so that its greedy text is
varied: the server's dummy weights then visibly produce something else before the sync.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from rlserve import demo
from rlserve.demo import (
    EXIT_MISMATCH,
    EXIT_OK,
    Completion,
    DemoOptions,
    DemoServer,
    ServerStartError,
    choose_layout,
    compare_completions,
    describe_mismatches,
    format_table,
    pid_alive,
    run_demo,
    verdict,
)

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama_tied", initializer_range=0.5)


def _opts(model_dir, tmp_path, **kw) -> DemoOptions:
    return DemoOptions(model=model_dir, backend="gloo", max_tokens=MAX_TOKENS, startup_timeout_s=180,
                       server_log=str(tmp_path / "server.log"), server_args=["--max-model-len", "128"], **kw)


def _wait_gone(pid: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.1)
    return False


# ---------------------------------------------------------------------------- end to end
def test_demo_end_to_end_gloo(model_dir, tmp_path, capsys):
    res = run_demo(_opts(model_dir, tmp_path))
    cap = capsys.readouterr()
    out = cap.out
    assert res.exit_code == EXIT_OK, f"{res.error}\n{out}\n{(tmp_path / 'server.log').read_text()[-3000:]}"
    assert res.layout.backend == "gloo"
    assert f"[demo] model {model_dir} (local directory)" in out.splitlines()
    # every phase that can take a while has a progress line (stderr)
    for phase in ("[trainer] loading the model", "[server] starting", "[generate] before sync",
                  "[sync] cold: trainer_init + send_weights", "[sync] warm: send_weights", "[generate] after sync",
                  "[trainer] generate"):
        assert phase in cap.err, (phase, cap.err[-2000:])
    # after the sync, the server's greedy ids are the trainer's own HF greedy ids
    assert [c.token_ids for c in res.after] == res.reference
    assert res.mismatches == []
    # ... and they come from the synced weights, not the dummy ones
    assert any(b.token_ids != a.token_ids for b, a in zip(res.before, res.after))
    assert {c.weight_version for c in res.before} == {"0"}
    assert {c.weight_version for c in res.after} == {"2"}  # a cold sync, then a warm one
    # ... and the output says so, answer by answer (a new user's trial, session 22: it did not)
    assert "weight version of each answer: before sync 0 0 0 0, after sync 2 2 2 2" in out, out
    # every token-counting progress line ends at 100%, also where a completion ended at EOS before
    # max_tokens (session 22: "[generate] after sync ... 126/128" was its last state)
    for phase in ("[generate] before sync", "[generate] after sync", "[trainer] generate"):
        last = cap.err[cap.err.rindex(phase):].split("\n")[0].split("\r")[0]
        n, total = re.search(r"\| *(\d+)/(\d+) \[", last).groups()
        assert n == total and "100%" in last, last
    assert res.sync.bytes > 0 and res.sync.buckets >= 1 and res.sync.send_s > 0 and res.sync.kind == "cold"
    assert res.warm_sync.kind == "warm" and res.warm_sync.bytes == res.sync.bytes and res.warm_sync.init_s == 0
    assert "cold sync time" in out and "warm sync time" in out and "before sync (dummy weights)" in out
    # every phase of the cold sync is printed, the server's included (session 18: ~4 s of the
    # first sync were outside the data plane and reported nowhere)
    assert "[sync]   trainer_init: group " in out and " | init_call " in out, out
    assert out.count("[sync]   send_weights: metadata ") == 2, out
    cold = out[out.index("cold sync ("): out.index("warm sync (")]
    assert "[sync]   server: receive " in cold and "load " in cold and "update_weights " in cold, cold
    assert "[sync]   server: " in out[out.index("warm sync ("):], out
    assert "OK: all 4" in out
    assert f"its log is kept at {tmp_path / 'server.log'}" in out and (tmp_path / "server.log").stat().st_size > 0
    assert res.server_pid is not None and _wait_gone(res.server_pid), "server still running after the demo"


@pytest.fixture(scope="module")
def off_by_one_run(model_dir, tmp_path_factory):
    """One demo run whose trainer reference differs from the server's completion 2 at generated
    token 1 (``trainer_greedy`` patched): ``(DemoResult, its stdout)``. Exact comparison (float32's
    default tie tolerance, 0); test_demo_near_tie_is_not_a_failed_sync judges the same run again."""
    real = demo.trainer_greedy

    def off_by_one(model, prompt_ids, max_new_tokens, progress=None):
        ref = real(model, prompt_ids, max_new_tokens)
        ref[2] = ref[2][:1] + [(ref[2][1] + 1) % 300] + ref[2][2:]
        return ref

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setattr(demo, "trainer_greedy", off_by_one)
        res = run_demo(_opts(model_dir, tmp_path_factory.mktemp("off_by_one")))
    return res, out.getvalue()


def _one_difference_at_token_1_of_completion_2(res, out):
    assert [m.index for m in res.mismatches] == [2]
    assert res.mismatches[0].first_difference == 1
    assert res.mismatches[0].gap is not None and res.mismatches[0].gap < 0  # the trainer prefers the server's token
    assert "1 of 4 server completions differ" in out and "first difference at generated token 1" in out


def test_demo_exits_nonzero_when_outputs_differ(off_by_one_run):
    res, out = off_by_one_run
    assert res.exit_code == EXIT_MISMATCH and "MISMATCH: 1 completion(s)" in out, f"{res.error}\n{out}"
    _one_difference_at_token_1_of_completion_2(res, out)
    assert _wait_gone(res.server_pid)


def test_demo_near_tie_is_not_a_failed_sync(off_by_one_run):
    """The same run judged with ``--tie-tolerance 1e9`` (every difference a near tie: rounding,
    not a failed sync): exit 0, the difference reported as a near tie."""
    res, _ = off_by_one_run
    code, marks, lines = verdict(res.mismatches, len(demo.PROMPTS), 1e9, "float32")
    out = "\n".join(lines)
    assert code == EXIT_OK and "first differ at a near tie" in out and "near tie" in out, out
    assert marks == [True, True, "near tie", True]
    _one_difference_at_token_1_of_completion_2(res, out)
    assert _wait_gone(res.server_pid)


def test_demo_failed_sync_exits_1_and_stops_the_server(model_dir, tmp_path, capsys):
    def broken_trainer_init(client, model, layout):
        raise RuntimeError("trainer could not join the group")

    res = run_demo(_opts(model_dir, tmp_path, trainer_init=broken_trainer_init))
    out = capsys.readouterr().out
    assert res.exit_code == demo.EXIT_ERROR and "trainer could not join the group" in (res.error or ""), out
    assert res.before is not None and res.after is None
    assert "server log" in out and "shutting down" in out
    assert _wait_gone(res.server_pid)


def test_demo_ctrl_c_stops_the_server(model_dir, tmp_path):
    """SIGINT while the server boots: exit 130, and the server (its own session) is gone."""
    cmd = [sys.executable, "-m", "rlserve", "demo", "--model", model_dir, "--backend", "gloo",
           "--server-log", str(tmp_path / "server.log"), "--startup-timeout", "120"]
    # a shell running this suite in the background starts it with SIGINT ignored, and an ignored
    # signal stays ignored across exec: give the demo the disposition a terminal user's has
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"),
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    server_pid = None
    try:
        deadline = time.monotonic() + 120
        for line in p.stdout:
            m = re.search(r"\[server\] pid (\d+)", line)
            if m:
                server_pid = int(m.group(1))
                break
            assert time.monotonic() < deadline
        assert server_pid is not None, "the demo never started its server"
        assert pid_alive(server_pid)
        p.send_signal(signal.SIGINT)
        rc = p.wait(timeout=60)
        rest = p.stdout.read()
        assert rc == 130, rest
        assert "shutting down" in rest
        assert _wait_gone(server_pid), "server survived the demo's Ctrl-C"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        if server_pid is not None and pid_alive(server_pid):
            os.killpg(server_pid, signal.SIGKILL)


# ---------------------------------------------------------------------------- pieces, no model
def test_compare_completions_and_message():
    comps = [Completion("a", "x", [5, 6, 2], [1]), Completion("b", "y", [7, 8, 9], [1])]
    assert compare_completions(comps, [[5, 6, 2], [7, 8, 9]]) == []
    mm = compare_completions(comps, [[5, 6, 2], [7, 8]])  # the trainer stopped earlier
    assert [m.index for m in mm] == [1] and mm[0].first_difference == 2
    mm = compare_completions(comps, [[5, 0, 2], [7, 8, 9]])
    assert [m.index for m in mm] == [0] and mm[0].first_difference == 1
    msg = describe_mismatches(mm, decode=lambda ids: "-".join(map(str, ids)))
    assert "'a': first difference at generated token 1" in msg and "server : '5-6-2'" in msg
    with pytest.raises(ValueError):
        compare_completions(comps, [[1]])


def test_near_tie_tolerance():
    m = demo.Mismatch(0, "p", [1, 2], [1, 3], gap=0.2)
    assert m.near_tie(0.5) and not m.near_tie(0.1) and not m.near_tie(0.0)
    assert not demo.Mismatch(0, "p", [1], [2]).near_tie(0.5)  # gap not measured
    assert not demo.Mismatch(0, "p", [1], [2], gap=float("inf")).near_tie(0.5)
    assert demo.default_tie_tolerance("float32") == 0.0 and demo.default_tie_tolerance("bfloat16") > 0


def test_format_table_marks_mismatches():
    c = [Completion("p", "a\nb", [1], [1]), Completion("q", "z" * 500, [1], [1])]
    t = format_table(["p", "q"], c, c, [True, False], width=100)
    lines = t.splitlines()
    assert "before sync" in lines[0] and lines[2].endswith("yes") and lines[3].endswith("NO")
    assert all(len(line) <= 100 for line in lines[:4])
    assert "a\\nb" in lines[2]
    assert lines[5] == "weight version of each answer: before sync ? ?, after sync ? ?"


def test_trainer_progress_line_ends_at_100_when_generate_stops_at_eos(model_dir, capsys):
    """The reference generate's token line counts prompts x max_new_tokens, less what EOS left:
    here EOS is made the first greedy token, so each prompt stops after 1 of its 6 tokens."""
    from rlserve.demo.trainer import load_trainer_model, trainer_greedy

    model = load_trainer_model(model_dir)
    prompts = [[1, 2, 3], [4, 5]]
    full = trainer_greedy(model, prompts, 6)
    assert all(len(g) == 6 for g in full), full  # no EOS within 6 tokens (the tiny model's config)
    model.generation_config.eos_token_id = full[0][0]
    capsys.readouterr()
    got = trainer_greedy(model, prompts[:1], 6, progress="[trainer] generate")
    assert got == [full[0][:1]]
    err = capsys.readouterr().err
    last = err[err.rindex("[trainer] generate"):].split("\n")[0].split("\r")[0]
    assert "100%" in last and "| 1/1 [" in last, err


def test_format_table_says_each_answers_weight_version():
    before = [Completion("p", "x", [1], [1], "length", "0"), Completion("q", "y", [1], [1], "length", "0")]
    after = [Completion("p", "a", [2], [1], "stop", "2"), Completion("q", "b", [2], [1], "length", "3")]
    lines = format_table(["p", "q"], before, after, [True, True], width=100).splitlines()
    assert lines[5] == "weight version of each answer: before sync 0 0, after sync 2 3"
    lines = format_table(["p", "q"], None, after, None, width=100).splitlines()
    assert lines[5] == "weight version of each answer: after sync 2 3"


@pytest.mark.parametrize("backend,tp,gpus,want", [
    ("auto", 1, 0, ("gloo", "cpu", None, "cpu", "float32")),
    ("auto", 1, 1, ("ipc", "cuda", [0], "cuda:0", "bfloat16")),
    ("auto", 1, 2, ("nccl", "cuda", [0], "cuda:1", "bfloat16")),
    ("auto", 2, 2, ("ipc", "cuda", [0, 1], "cuda:0", "bfloat16")),
    ("auto", 2, 3, ("nccl", "cuda", [0, 1], "cuda:2", "bfloat16")),
    ("auto", 1, 8, ("nccl", "cuda", [0], "cuda:7", "bfloat16")),
    ("gloo", 1, 4, ("gloo", "cpu", None, "cpu", "float32")),
    ("ipc", 1, 4, ("ipc", "cuda", [0], "cuda:0", "bfloat16")),
])
def test_choose_layout(backend, tp, gpus, want):
    lay = choose_layout(backend, tp, num_gpus=gpus)
    assert (lay.backend, lay.server_device, lay.server_device_ids, lay.trainer_device, lay.dtype) == want


@pytest.mark.parametrize("backend,tp,gpus", [("nccl", 1, 1), ("nccl", 2, 2), ("ipc", 1, 0), ("auto", 3, 2),
                                             ("nvlink", 1, 0), ("auto", 0, 0)])
def test_choose_layout_refuses(backend, tp, gpus):
    with pytest.raises(demo.DemoError):
        choose_layout(backend, tp, num_gpus=gpus)


def test_server_that_exits_fails_fast(tmp_path):
    srv = DemoServer([sys.executable, "-c", "import sys; print('boom', flush=True); sys.exit(7)"],
                     "http://127.0.0.1:9", log_path=str(tmp_path / "log"), startup_timeout_s=60)
    t0 = time.monotonic()
    with srv, pytest.raises(ServerStartError, match=r"(?s)status 7.*boom"):
        srv.wait_healthy()
    assert time.monotonic() - t0 < 30


def test_stop_kills_the_whole_process_group(tmp_path):
    child_pid_file = tmp_path / "child"
    code = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(child_pid_file)!r}, 'w').write(str(c.pid)); "
            "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)")  # ignores SIGTERM
    srv = DemoServer([sys.executable, "-c", code], "http://127.0.0.1:9", log_path=str(tmp_path / "log"))
    srv.start()
    deadline = time.monotonic() + 30
    while not (child_pid_file.exists() and child_pid_file.read_text()):
        assert time.monotonic() < deadline and srv.proc.poll() is None, srv.log_tail()
        time.sleep(0.05)
    child = int(child_pid_file.read_text())
    t0 = time.monotonic()
    srv.stop(grace_s=1.0)
    assert time.monotonic() - t0 < 15
    assert _wait_gone(srv.pid) and _wait_gone(child)
    assert srv.stop() is not None  # idempotent


def test_demo_and_test_servers_share_one_launcher():
    """``DemoServer`` and the tests' ``ServerProcess`` are one :class:`ServerSubprocess` (its
    ``log_tail``, ``stop`` and ``with``, not two copies): a fresh one has a kept log file in the
    temporary directory named after its kind, and stops as "never started"."""
    from rlserve.server.launch import ServerSubprocess
    from rlserve.server.testing import ServerProcess

    for name in ("log_tail", "stop", "__enter__", "__exit__", "pid"):
        assert getattr(DemoServer, name) is getattr(ServerProcess, name) is getattr(ServerSubprocess, name), name
    demo_srv = DemoServer([sys.executable, "-c", "pass"], "http://127.0.0.1:9/")
    test_srv = ServerProcess("/no/model", "--device", "cpu")
    for srv, prefix in ((demo_srv, "rlserve-demo-server-"), (test_srv, "rlserve-server-")):
        try:
            assert os.path.basename(srv.log_path).startswith(prefix) and os.path.exists(srv.log_path)
            assert srv.env["PYTHONUNBUFFERED"] == "1" and srv.pid is None and srv.log_tail() == ""
            assert srv.stop() is None
        finally:
            os.remove(srv.log_path)
    assert demo_srv.url == "http://127.0.0.1:9"
    assert DemoServer(["x"], "http://h", log_path="-").log_tail() == "(server output went to the terminal above)"


def test_sigterm_becomes_system_exit():
    with pytest.raises(SystemExit) as e:
        with demo.exit_on_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    assert e.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None) or callable(signal.getsignal(signal.SIGTERM))


def _demo_cli(monkeypatch, capsys, *flags: str) -> tuple[int, str]:
    """``rlserve demo FLAGS`` in this process with a run_demo that must not be reached: the exit
    status (argparse's too) and the output."""
    from rlserve.cli import main

    def no_run(*a, **k):
        raise AssertionError("the demo was started")

    monkeypatch.setattr(demo, "run_demo", no_run)
    capsys.readouterr()
    try:
        rc = main(["demo", *flags])
    except SystemExit as e:  # argparse
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


@pytest.mark.parametrize("backend,message", [
    ("nccl", "rlserve demo: error: --backend nccl needs 2 CUDA GPUs (the server's TP=1 and one of its own for the "
             "trainer) and this machine has none; use --backend gloo (server and trainer on the CPU)"),
    ("ipc", "rlserve demo: error: --backend ipc needs 1 CUDA GPU (the trainer shares GPU 0 with the server) and "
            "this machine has none; use --backend gloo (server and trainer on the CPU)"),
])
def test_demo_gpu_backend_without_gpus_is_one_line_exit_2(monkeypatch, capsys, backend, message):
    """Session 18: `rlserve demo --backend nccl|ipc` on a CPU-only machine exited 1 from inside the run
    (a traceback in its report); now one line saying what the backend needs, exit 2, nothing started."""
    monkeypatch.setattr("rlserve.demo.layout.cuda_device_count", lambda: 0)
    rc, out = _demo_cli(monkeypatch, capsys, "--backend", backend)
    assert rc == 2 and out.strip() == message, out


@pytest.mark.parametrize("flags,message", [
    (["--port", "abc"], "argument --port: must be a TCP port in [0, 65535] (0: a free one), got 'abc'"),
    (["--port", "70000"], "argument --port: must be a TCP port in [0, 65535] (0: a free one), got '70000'"),
    (["--max-tokens", "0"], "argument --max-tokens: must be an integer >= 1, got '0'"),
    (["-tp", "0"], "argument --tensor-parallel-size/-tp: must be an integer >= 1, got '0'"),
    (["--startup-timeout", "-5"], "argument --startup-timeout: must be a number of seconds > 0, got '-5'"),
    (["--startup-timeout", "nan"], "argument --startup-timeout: must be a number of seconds > 0, got 'nan'"),
    (["--tie-tolerance", "-1"], "argument --tie-tolerance: must be a number >= 0, got '-1'"),
    (["--tie-tolerance", "inf"], "argument --tie-tolerance: must be a number >= 0, got 'inf'"),
    (["--server-args", '"--enforce-eager'], "argument --server-args: not shell words (No closing quotation)"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
])
def test_demo_bad_flag_exits_2_naming_it(monkeypatch, capsys, flags, message):
    """Every demo flag with a bad value: argparse's message naming the flag, exit 2, nothing started
    (the old types let --port 70000, -tp 0, a negative timeout or tolerance and an unclosed quote in
    --server-args through to the run: exit 1, the last one with a traceback)."""
    rc, out = _demo_cli(monkeypatch, capsys, "--backend", "gloo", *flags)
    assert rc == 2 and f"rlserve demo: error: {message}" in out, out
    assert "Traceback" not in out


@pytest.mark.parametrize("model", ["/nonexistent", __file__])
def test_demo_unknown_model_exits_2_naming_it(monkeypatch, capsys, model):
    """`rlserve demo --model /nonexistent` (or a file): one line naming the path, exit 2, nothing
    started, as `rlserve serve`. The old code ran the demo and failed inside it: exit 1."""
    monkeypatch.setattr("rlserve.demo.run_demo", lambda opts: pytest.fail("the demo started"))
    rc, out = _demo_cli(monkeypatch, capsys, "--backend", "gloo", "--model", model)
    assert rc == 2, out
    assert out.startswith(f"rlserve demo: error: ") and repr(model) in out and out.count("\n") == 1, out


def test_demo_server_skips_the_chat_template_workers_unless_asked(monkeypatch):
    """The demo sends text completions only: its server does not prestart (and its ready does not wait for)
    chat-template workers, unless the user set RLSERVE_TEMPLATE_WORKERS_AT_START; CUDA adds NCCL's settings."""
    from rlserve.demo import NCCL_SAFE_ENV, server_env

    monkeypatch.delenv("RLSERVE_TEMPLATE_WORKERS_AT_START", raising=False)
    assert server_env("cpu") == {"RLSERVE_TEMPLATE_WORKERS_AT_START": "0"}
    assert server_env("cuda") == {**NCCL_SAFE_ENV, "RLSERVE_TEMPLATE_WORKERS_AT_START": "0"}
    monkeypatch.setenv("RLSERVE_TEMPLATE_WORKERS_AT_START", "1")
    assert server_env("cpu") == {}


def test_demo_says_whether_the_default_model_was_cached_or_downloaded(model_dir, tmp_path, monkeypatch):
    """The demo's model line names where the model came from: a local directory, the cache, or a download now
    (the package index stood in for: ensure_default_model builds a finished directory)."""
    from rlserve import download
    from rlserve.default_model import MARKER, REQUIRED_FILES
    from rlserve.demo import resolve_demo_model

    assert resolve_demo_model(model_dir) == (model_dir, "local directory")
    target = download.default_model_dir(tmp_path)
    built = []
    real = download.ensure_default_model

    def fetch(cache_dir=None, progress=True, force=False):
        if not download.is_model_ready(download.default_model_dir(cache_dir)):
            built.append(cache_dir)
            target.mkdir(parents=True)
            for f in REQUIRED_FILES:
                (target / f).write_text("{}")
            (target / MARKER).write_text("{}")
        return real(cache_dir=cache_dir, progress=progress, force=force)

    monkeypatch.setattr(download, "ensure_default_model", fetch)
    path, source = resolve_demo_model("default", str(tmp_path))
    assert path == str(target) and re.fullmatch(r"downloaded in \d+\.\d s", source) and built == [str(tmp_path)]
    assert resolve_demo_model("default", str(tmp_path)) == (str(target), "cached") and len(built) == 1
