"""The chat-template / constraint worker process of :mod:`rlserve.server.template_pool`
(``python -m rlserve.server.template_worker ARGS`` runs :func:`main`).

Two ways to start (argv):

* ``MAX_CHARS TIMEOUT_S WARM_NICED``: read the pickled tokenizer, then serve (a worker the pool
  starts itself: on first use, or a replacement for a killed one);
* ``prestart GRAMMAR NICED``: ``rlserve serve`` starts these before its engine starts
  (:func:`rlserve.server.template_pool.prestart_workers`): the process imports what unpickling a
  tokenizer and rendering a template need (transformers' tokenizer modules, Jinja) and, with
  ``GRAMMAR`` ``1``, what the constraint compiler needs (xgrammar, which imports torch), while the
  server process only waits for its engine; then it reads a JSON frame ``{"max_chars",
  "timeout_s"}`` (known once the engine is up: the context length) and goes on as a worker started
  with them and ``WARM_NICED`` ``NICED`` (``1``: niced from its start, before the imports). Measured on the 2-core CPU machine: these imports were what
  the first chat request after ``ready`` waited for (BENCHMARKS.md, start-up).

Requests and answers are length-prefixed JSON (:func:`rlserve.server.template_pool._write_frame`).
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import signal
import sys

from rlserve.server.template_pool import WORKER_NICE, _read_frame, _write_frame, apply_chat_template, memory_headroom

#: imported by a prestarted worker before its tokenizer comes (the first that exists of the
#: tokenizer modules: transformers 5's ``TokenizersBackend``, 4's ``PreTrainedTokenizerFast``)
TOKENIZER_MODULES = ("transformers.tokenization_utils_base", "transformers.tokenization_utils_tokenizers",
                     "transformers.tokenization_utils_fast", "jinja2", "jinja2.sandbox")
#: ... and with GRAMMAR 1, the constraint compiler's
GRAMMAR_MODULES = ("xgrammar", "rlserve.engine.core.structured")


def preimport(grammar: bool) -> list[str]:
    """Import :data:`TOKENIZER_MODULES` (and :data:`GRAMMAR_MODULES` with ``grammar``); a module
    that is not installed is skipped. Returns the names imported."""
    done = []
    for name in TOKENIZER_MODULES + (GRAMMAR_MODULES if grammar else ()):
        try:
            importlib.import_module(name)
            done.append(name)
        except ImportError:
            pass
    return done


def _set_memory_bound(max_chars: int) -> None:
    import resource

    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = size + memory_headroom(max_chars)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _lower_priority() -> None:
    try:
        os.nice(WORKER_NICE)
    except OSError:
        pass


def main(argv: list[str]) -> int:
    """The worker's entry point (argv: see the module docstring)."""
    # a Ctrl-C at the terminal reaches the server's whole process group, these workers too: the
    # server ends them itself (stdin closed, or killed), so a worker ignores SIGINT instead of
    # printing a KeyboardInterrupt traceback from wherever it was (its tokenizer's imports at start-up)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rfd, wfd = sys.stdin.fileno(), os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a print() must not corrupt the channel
    if argv[:1] != ["prestart"]:
        return _worker_main(rfd, wfd, int(argv[0]), float(argv[1]), argv[2:3] != ["0"])
    niced = argv[2:3] == ["1"]
    if niced:
        _lower_priority()  # before the imports
    preimport(argv[1:2] == ["1"])
    try:
        settings = json.loads(_read_frame(rfd))
    except EOFError:  # the server did not use it (its start failed, or it exited)
        return 0
    return _worker_main(rfd, wfd, int(settings["max_chars"]), float(settings["timeout_s"]), niced)


def _worker_main(rfd: int, wfd: int, max_chars: int, timeout_s: float, warm_niced: bool = True) -> int:
    """Read the pickled tokenizer (trusted: the server sent it) from ``rfd``, then answer render
    requests until it closes, on ``wfd``. Requests and answers are length-prefixed JSON.
    ``warm_niced``: lower the priority at once, else once warm (:mod:`rlserve.server.template_pool`'s
    docstring)."""
    niced = warm_niced
    if niced:
        _lower_priority()  # before the imports and the tokenizer
    try:
        tokenizer = pickle.loads(_read_frame(rfd))
    except EOFError:
        return 0
    except Exception as e:  # noqa: BLE001 - reported to the server
        _write_frame(wfd, json.dumps({"ready": False, "message": f"{type(e).__name__}: {e}"}).encode())
        return 1
    _write_frame(wfd, b'{"ready": true}')
    bound_memory = sys.platform.startswith("linux")
    alarm_s = int(timeout_s) + 2  # the server kills it first; this is for a server that is gone
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    grammar = None
    while True:
        try:
            request = json.loads(_read_frame(rfd))
        except EOFError:
            return 0
        if not niced and request.get("op") != "grammar_init":
            _lower_priority()  # a request's own work: never at the server's priority
            niced = True
        if request.get("op") in ("grammar_init", "compile"):
            grammar, reply = _grammar_op(tokenizer, grammar, request)
            _write_frame(wfd, json.dumps(reply).encode())
            if not niced:  # warm: the compiler is made
                _lower_priority()
                niced = True
            continue
        signal.alarm(alarm_s)
        try:
            if bound_memory:
                _set_memory_bound(max_chars)
            text = apply_chat_template(tokenizer, request["messages"], request["kwargs"])
            if not isinstance(text, str):
                raise TypeError(f"the template gave {type(text).__name__}, not text")
            if len(text) > max_chars:
                reply = {"kind": "too_long", "message": f"the rendered prompt has {len(text)} characters, more than "
                                                        f"the {max_chars} that fit in the model's context"}
            else:
                reply = {"text": text}
        except BaseException as e:  # noqa: BLE001 - MemoryError, RecursionError, the template's own errors
            reply = {"kind": "error", "message": f"{type(e).__name__}: {e}"[:2000]}
        text = None
        payload = json.dumps(reply).encode()
        signal.alarm(0)
        _write_frame(wfd, payload)


def _grammar_op(tokenizer, grammar, request: dict):
    """A worker's constraint request: ``grammar_init`` makes the xgrammar compiler, ``compile``
    compiles ``spec`` with it. Returns (the compiler, the reply: ``{"ok": true}`` or
    ``{"kind": "error", "message"}``). No alarm and no memory bound: the server's time bound
    kills the worker (the alarm of a render is for a server that is gone; a compile only reads)."""
    import resource

    try:
        if sys.platform.startswith("linux"):  # a render's address-space bound does not apply
            _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
        from rlserve.engine.core.structured import GrammarCompiler
        from rlserve.engine.sampling_params import StructuredOutputsParams

        if request["op"] == "grammar_init":
            grammar = GrammarCompiler(tokenizer, request["vocab_size"], request["eos"])
            grammar._get_compiler()
        else:
            grammar.compile(StructuredOutputsParams(**request["spec"]))
        return grammar, {"ok": True}
    except BaseException as e:  # noqa: BLE001 - InvalidRequestError (bad constraint, no xgrammar), ...
        from rlserve.errors import InvalidRequestError

        return grammar, {"kind": "error", "message": str(e) if isinstance(e, InvalidRequestError)
                         else f"{type(e).__name__}: {e}"[:2000]}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
