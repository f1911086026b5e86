"""Run in the Python that has vLLM (``tests/vllm_python.py`` starts it, once per test session):
import vLLM's heavy modules ONCE, then run each script the tests send in a fork of this warm
process, so that the suite's ~8 scripts that print facts of the installed vLLM's code pay for one
vLLM import instead of one each (~13-15 s of CPU a fresh import on a 2-core machine; the union
below ~20 s, then a fork ~0.1 s).

Protocol (one JSON object a line): this process prints ``{"ready": true}`` once imported; each
request on stdin is ``{"argv": [script or "-c", ...], "cwd", "env", "sys_path", "stdin"}`` and
its answer ``{"rc", "stdout", "stderr"}`` -- what ``subprocess.run([python, *argv], cwd=cwd,
env=env, input=stdin)`` would give, the script running as ``__main__`` in a forked child with
``sys.argv``, ``sys.path`` (``sys_path`` first, as ``PYTHONPATH`` would put it, then the script's
folder first of all as ``python script.py`` does), the working folder, environment and file
descriptors 0/1/2 of such a process. A request with ``"detach": true`` (a script the test talks
to while it runs: ``subprocess.Popen``'s use) comes with four file descriptors on the socket of
``--fd N`` (its stdin, stdout, stderr and a pipe its exit code is written to) and is answered
``{"pid"}`` at once. It exits at its stdin's end. No test imports this module."""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import socket
import sys
import tempfile
import traceback

#: imported before the first request: every vLLM module the fact scripts import (tests/vllm_*.py);
#: a script importing another one still works (its fork imports it)
PRELOAD = [
    "vllm.config", "vllm.sampling_params", "vllm.logprobs",
    "vllm.entrypoints.openai.chat_completion.serving", "vllm.entrypoints.openai.completion.serving",
    "vllm.entrypoints.openai.responses.protocol", "vllm.entrypoints.serve.tokenize.serving",
    "vllm.v1.metrics.loggers", "vllm.v1.structured_output.request", "vllm.parser.parser_manager",
    "vllm.entrypoints.launchers.cli_args", "vllm.tokenizers.registry", "transformers",
]


def _child(req: dict, fds: list[int], rc_fd: int | None = None) -> None:
    """The forked child: file descriptors 0, 1, 2 from ``fds``, then become ``python *argv`` and
    run it; writes its exit code to ``rc_fd`` (when given) and exits; never returns."""
    code = 1
    try:
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        for fd, f in enumerate(fds):
            os.dup2(f, fd)
            os.close(f)
        if _SOCK is not None:
            _SOCK.close()
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False)
        argv = req["argv"]
        try:
            if argv[0] == "-c":
                sys.argv = ["-c", *argv[2:]]
                sys.path[:0] = ["", *req["sys_path"]]
                exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            else:
                sys.argv = list(argv)
                sys.path[:0] = [os.path.dirname(os.path.abspath(argv[0])), *req["sys_path"]]
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - reported as python would, with its exit code
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if rc_fd is not None:
            os.write(rc_fd, str(code).encode())
        os._exit(code)


def _detach(req: dict) -> dict:
    """Fork a child whose stdin, stdout, stderr and exit-code pipe are the four file descriptors
    the test sent over the socket (:class:`tests.vllm_python.VllmChild`); answer its pid at once."""
    _, fds, _, _ = socket.recv_fds(_SOCK, 16, 4)
    pid = os.fork()
    if pid == 0:
        _child(req, fds[:3], fds[3])
    for f in fds:
        os.close(f)
    return {"pid": pid}


def _run(req: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="rlserve-vllm-run-") as d:
        out_path, err_path, in_path = (os.path.join(d, n) for n in ("out", "err", "in"))
        for p, text in ((out_path, ""), (err_path, ""), (in_path, req.get("stdin") or "")):
            with open(p, "w") as f:
                f.write(text)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(req, [os.open(in_path, os.O_RDONLY), os.open(out_path, os.O_WRONLY), os.open(err_path, os.O_WRONLY)])
        _, status = os.waitpid(pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        with open(out_path) as f, open(err_path) as g:
            return {"rc": rc, "stdout": f.read(), "stderr": g.read()}


#: the socket the test sends a detached child's file descriptors on (``--fd N``), or None
_SOCK: socket.socket | None = None


def main() -> int:
    import importlib

    global _SOCK
    if sys.argv[1:2] == ["--fd"]:
        _SOCK = socket.socket(fileno=int(sys.argv[2]))

    for name in PRELOAD:
        importlib.import_module(name)
    out = sys.stdout
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:  # reap the detached children that ended
                pass
        if line.strip():
            req = json.loads(line)
            print(json.dumps(_detach(req) if req.get("detach") else _run(req)), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
