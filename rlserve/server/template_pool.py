"""Chat templates rendered in worker processes, with a time and a size bound.

A chat template is a program the client may send (``chat_template``) or steer
(``chat_template_kwargs``, ``messages``, ``tools``). Jinja's sandbox stops it from reaching the
server's objects, not from running long or allocating much: ``{{ 'x' * 10**9 }}`` builds a
1 GB string in one C call that holds the GIL (measured: ``'x' * 10**8`` stopped another thread's
event loop for 0.6 s; the issue-33 run saw ``/health`` take 6.4 s idle, 15-23 s under load), and
two nested ``range(100000)`` loops run 10^10 iterations. A thread cannot be stopped, so the
render runs in a child process of its own (its own GIL), which is killed when it overruns:

* time: :data:`RENDER_TIMEOUT_S` seconds per render, enforced by the server (SIGKILL) and by the
  worker itself (``alarm``: it also dies when the server is gone);
* memory: during a render the worker's address space may grow :func:`memory_headroom` bytes
  past what it holds with the request parsed (``RLIMIT_AS``): ``'x' * 10**9`` is a
  ``MemoryError``;
* output: a rendered prompt longer than ``max_chars`` (the longest text prompt
  ``max_model_len`` can hold, :func:`rlserve.server.limits.max_prompt_chars`) is refused in the
  worker, before it is sent.

The same workers compile structured-output constraints for the API's check (:meth:`TemplateWorkers.
compile`, xgrammar over the worker's tokenizer; the engine core compiles accepted ones again in
its own process): a constraint whose compile overruns :data:`~rlserve.server.limits.COMPILE_TIMEOUT_S`
is a 400 and its worker is killed, where a thread of the API process would have gone on
compiling it (xgrammar cannot be stopped; a regex bomb burned one of two cores for 33 s after
its 400 in the issue-33 fuzz run, slowing every other request).

Each overrun is a 400 naming the template's field; the worker is replaced. The pool holds
:data:`POOL_SIZE` workers, so a request keeps a free worker while another one's template
runs to its bound. ``rlserve serve`` starts their processes as its engine starts
(:func:`prestart_workers`: they import their modules while the server waits for the engine), the
server's start-up hands them the tokenizer (:meth:`TemplateWorkers.start`) and waits until one
is warm (:meth:`TemplateWorkers.wait_warm`) before it says it is ready; the worker process itself
is :mod:`rlserve.server.template_worker`. The server starts them when it starts and
each one is warmed off every request's path before it joins the pool: its tokenizer (sent
pickled by the server) loaded and, where constraints compile here, its xgrammar compiler made
(importing xgrammar imports torch: 4-10 s of CPU on a loaded 2-core machine, which the first
constrained request used to wait for); a replacement for a killed worker warms the same way
while the others serve. Workers run at :data:`WORKER_NICE` (``os.nice``): a bomb compiling to
its bound takes CPU the server process and the engine core do not need (the issue-33 canary
beside a regex bomb took 7.9 s once on 2 cores). The workers made at the server's start warm at
the server's own priority and lower theirs once warm (before their first render or compile: no
request's work runs un-niced): that warm-up is the server's start-up work, and a nice-10
process gets ~1/9 of the CPU a nice-0 one does, so on a busy machine a niced warm-up took
37 s+ (a 2-core machine at load ~30, 2026-12-06) and the first constrained request waited for
it. A replacement for a killed worker (one a request's bomb killed) warms niced, as before, so
that bombs cannot buy un-niced CPU. The wire between them is length-prefixed JSON; the server
never unpickles what a worker sends.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pickle
import queue
import select
import struct
import subprocess
import sys
import threading
import time

logger = logging.getLogger(__name__)

RENDER_TIMEOUT_S = 5.0  # a real template renders in milliseconds; a 100,000-message chat in < 1 s
POOL_SIZE = 2
#: added to a worker's niceness (Linux: a nice-10 process gets ~1/9 of a core a nice-0 one wants)
WORKER_NICE = 10
START_TIMEOUT_S = 120.0  # a worker's start (import + tokenizer) on a loaded 2-core machine
_HEADER = struct.Struct(">I")


class TemplateError(Exception):
    """A render failed for the request's reason: ``kind`` is ``"error"`` (the template raised;
    the message has the exception), ``"timeout"``, ``"too_long"`` (the output is over
    ``max_chars``) or ``"died"`` (the worker process ended while rendering)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


_FUNCTION_KEYS = ("name", "description", "parameters", "strict", "defer_loading")


def template_tool(tool):
    """A request's tool as vLLM 0.32 hands it to the template (its pydantic dump): ``{"type",
    "function": {"name", "description", "parameters"[, "strict"][, "defer_loading"]}}``, the
    missing ``description`` / ``parameters`` null, other keys dropped, a tool-level
    ``defer_loading`` moved into the function. A tool that is not such an object is passed as
    it is."""
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        return tool
    fn = dict(tool["function"])
    if tool.get("defer_loading") is not None and fn.get("defer_loading") is None:
        fn["defer_loading"] = tool["defer_loading"]
    out = {k: fn.get(k) for k in _FUNCTION_KEYS if k in ("name", "description", "parameters") or fn.get(k) is not None}
    return {"type": tool.get("type", "function"), "function": out}


def template_call_kwargs(add_generation_prompt: bool = True, continue_final_message: bool = False,
                         chat_template: str | None = None, chat_template_kwargs: dict | None = None,
                         tools: list | None = None) -> dict:
    """The keyword arguments of ``tokenizer.apply_chat_template`` (besides the messages and
    ``tokenize=False``) for vLLM's request fields: ``add_generation_prompt`` is ignored, as in
    vLLM, when ``continue_final_message`` is set; ``tools`` as :func:`template_tool` makes them."""
    kwargs = dict(chat_template_kwargs or {})
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if tools:
        kwargs["tools"] = [template_tool(t) for t in tools]
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    kwargs["add_generation_prompt"] = add_generation_prompt and not continue_final_message
    return kwargs


def apply_chat_template(tokenizer, messages: list[dict], kwargs: dict) -> str:
    """``tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)`` (what a worker runs)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def memory_headroom(max_chars: int) -> int:
    """Bytes a worker's address space may grow by during one render, past what it holds with the
    request's own data parsed: 256 MiB (Jinja's compile of a template and its working objects)
    plus 8 bytes per character of the longest allowed output (a CPython ``str`` takes up to 4
    bytes a character; Jinja's join of the output takes as much again)."""
    return (256 << 20) + 8 * max(int(max_chars), 0)


def _write_frame(fd: int, payload: bytes) -> None:
    data = _HEADER.pack(len(payload)) + payload
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    """``n`` bytes from ``fd``; raises TimeoutError at ``deadline`` (``time.monotonic()``),
    EOFError when the other end closed."""
    chunks, left = [], n
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int, deadline: float | None = None) -> bytes:
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    return _read_exact(fd, size, deadline)


def worker_command(max_chars: int, timeout_s: float, warm_niced: bool) -> list[str]:
    """The argv of one worker process (:mod:`rlserve.server.template_worker`)."""
    return [sys.executable, "-m", "rlserve.server.template_worker", str(int(max_chars)), repr(float(timeout_s)),
            "1" if warm_niced else "0"]


_PRESTARTED: list[subprocess.Popen] = []  # prestart_workers()'s processes no pool has taken yet


def prestart_workers(count: int = POOL_SIZE, grammar: bool = False) -> None:
    """Start ``count`` worker processes now, before the server knows their settings (``rlserve
    serve`` calls this as its engine starts: they import transformers' tokenizer modules, Jinja and,
    with ``grammar``, xgrammar while the server process only waits; see
    :mod:`rlserve.server.template_worker`). The first warms at the server's priority, the others
    niced (:data:`WORKER_NICE`) from their start: the server's start waits for one warm worker
    (:meth:`TemplateWorkers.wait_warm`), which then gets most of the CPU the workers' imports take
    (two workers importing torch side by side on 2 cores delayed ``ready`` by both). :meth:`TemplateWorkers.
    start` takes them; those never taken exit at the server's exit (their stdin ends) or
    :func:`discard_prestarted`."""
    for _ in range(count - len(_PRESTARTED)):
        try:
            _PRESTARTED.append(subprocess.Popen(
                [sys.executable, "-m", "rlserve.server.template_worker", "prestart", "1" if grammar else "0",
                 "1" if _PRESTARTED else "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True))
        except OSError:
            logger.debug("could not prestart a template worker", exc_info=True)
            return


def discard_prestarted() -> None:
    """Kill the prestarted workers no pool took (a start that failed after :func:`prestart_workers`)."""
    while _PRESTARTED:
        p = _PRESTARTED.pop()
        p.kill()
        p.wait()
        for f in (p.stdin, p.stdout):
            f.close()


class _Worker:
    """One worker process and its pipes (used by one thread at a time)."""

    def __init__(self, tokenizer_pickle: bytes, max_chars: int, timeout_s: float, warm_niced: bool = True,
                 prestarted: subprocess.Popen | None = None):
        """``warm_niced``: the process lowers its priority (:data:`WORKER_NICE`) at once; else only
        once warm (after its constraint compiler is made, or before its first render or compile).
        ``prestarted``: a process of :func:`prestart_workers` to use (it warms un-niced)."""
        self.proc = prestarted or subprocess.Popen(worker_command(max_chars, timeout_s, warm_niced),
                                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        self.ready = False
        self.grammar_ready = False  # its constraint compiler was made
        try:
            if prestarted is not None:
                _write_frame(self.proc.stdin.fileno(), json.dumps({"max_chars": int(max_chars),
                                                                    "timeout_s": float(timeout_s)}).encode())
            _write_frame(self.proc.stdin.fileno(), tokenizer_pickle)
        except OSError:
            pass  # it died at once: found by the ready wait

    def wait_ready(self) -> None:
        """Raises RuntimeError when the worker did not start within :data:`START_TIMEOUT_S`."""
        if self.ready:
            return
        try:
            reply = json.loads(_read_frame(self.proc.stdout.fileno(), time.monotonic() + START_TIMEOUT_S))
        except (TimeoutError, EOFError, ValueError) as e:
            self.kill()
            raise RuntimeError(f"the chat-template worker did not start ({type(e).__name__}; exit status "
                               f"{self.proc.poll()})") from None
        if not reply.get("ready"):
            self.kill()
            raise RuntimeError(f"the chat-template worker did not start: {reply.get('message')}")
        self.ready = True

    def alive(self) -> bool:
        return self.proc.poll() is None

    def render(self, messages: list[dict], kwargs: dict, timeout_s: float) -> str:
        """The rendered text. Raises TemplateError (the worker is then dead for ``timeout`` and
        ``died``), TypeError/ValueError for arguments that are not JSON."""
        request = json.dumps({"messages": messages, "kwargs": kwargs}).encode()
        try:
            _write_frame(self.proc.stdin.fileno(), request)
            reply = json.loads(_read_frame(self.proc.stdout.fileno(), time.monotonic() + timeout_s))
        except TimeoutError:
            self.kill()
            raise TemplateError("timeout", f"the chat template did not finish within {timeout_s:g} s") from None
        except (EOFError, OSError):
            self.kill()
            raise TemplateError("died", "the chat template's worker process ended while rendering it (over its "
                                        "memory bound?)") from None
        if "text" in reply:
            return reply["text"]
        raise TemplateError(reply.get("kind", "error"), reply.get("message", "unknown error"))

    def compile(self, spec: dict, vocab_size: int, eos_token_ids: list[int], timeout_s: float) -> None:
        """Compile the constraint ``spec`` (:class:`~rlserve.engine.sampling_params.
        StructuredOutputsParams`' fields) with xgrammar; the worker's compiler (its tokenizer
        read by xgrammar) is made first, under :data:`START_TIMEOUT_S`. Returns when it
        compiled. Raises TemplateError: ``"error"`` (invalid, or xgrammar missing: the message
        says why), ``"timeout"`` (the worker is then killed), ``"died"``."""
        self.init_grammar(vocab_size, eos_token_ids)
        self._call({"op": "compile", "spec": spec}, timeout_s, "compiling the constraint")

    def init_grammar(self, vocab_size: int, eos_token_ids: list[int]) -> None:
        """Make the worker's constraint compiler (once; under :data:`START_TIMEOUT_S`). Raises
        TemplateError (xgrammar missing: ``"error"``)."""
        if not self.grammar_ready:
            self._call({"op": "grammar_init", "vocab_size": int(vocab_size), "eos": [int(t) for t in eos_token_ids]},
                       START_TIMEOUT_S, "making the constraint compiler")
            self.grammar_ready = True

    def _call(self, request: dict, timeout_s: float, what: str) -> dict:
        try:
            _write_frame(self.proc.stdin.fileno(), json.dumps(request).encode())
            reply = json.loads(_read_frame(self.proc.stdout.fileno(), time.monotonic() + timeout_s))
        except TimeoutError:
            self.kill()
            raise TemplateError("timeout", f"{what} did not finish within {timeout_s:g} s") from None
        except (EOFError, OSError):
            self.kill()
            raise TemplateError("died", f"the worker process ended while {what}") from None
        if "message" in reply:
            raise TemplateError(reply.get("kind", "error"), reply["message"])
        return reply

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class TemplateWorkers:
    """A pool of chat-template worker processes for one tokenizer (thread-safe; the server calls
    :meth:`render` from worker threads, never from its event loop).

    Args:
        tokenizer: a picklable Hugging Face tokenizer (sent to each worker once).
        max_chars: the longest rendered prompt accepted (characters).
        timeout_s: the bound on one render (seconds).
        size: the number of worker processes.
        grammar: ``(vocab_size, eos_token_ids)`` where constraints compile in the workers: each
            worker's compiler is made while it warms (when xgrammar is installed); None: not.

    Raises:
        TypeError / pickle.PicklingError: the tokenizer cannot be sent to a process (the caller
            then renders in-process).
    """

    def __init__(self, tokenizer, max_chars: int, timeout_s: float = RENDER_TIMEOUT_S, size: int = POOL_SIZE,
                 grammar: tuple[int, list[int]] | None = None):
        self._pickle = pickle.dumps(tokenizer)
        self.max_chars = int(max_chars)
        self.timeout_s = float(timeout_s)
        self.size = int(size)
        self.grammar = grammar
        self._idle: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._started = 0
        self._closed = False
        self._warming: set = set()  # workers starting in the background (not in the pool yet)
        self.pids: list[int] = []  # every worker process started, in order

    @property
    def warming(self) -> int:
        """Workers warming in the background (not in the pool yet)."""
        return len(self._warming)

    def start(self) -> None:
        """Start the workers not started yet, now; each joins the pool once warm (see the module
        docstring). Returns at once."""
        with self._lock:
            n, self._started = self.size - self._started, self.size
        for _ in range(n):
            self._spawn_warm(warm_niced=False)

    def wait_warm(self, timeout_s: float = START_TIMEOUT_S, stop=None, one: bool = False) -> bool:
        """Block until every started worker is warm (none warming), or with ``one`` until one is
        warm and idle (what the server's start waits for before it says it is ready: a chat
        request then waits for no worker's start). Returns False when ``timeout_s`` passed first,
        or ``stop()`` (polled every 50 ms; e.g. the server stops) became true, or the pool closed."""
        deadline = time.monotonic() + timeout_s
        while self._warming and not (one and self._idle.qsize()):
            if self._closed or (stop is not None and stop()) or time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _new_worker(self, warm_niced: bool = False) -> _Worker:
        """A worker: one of :func:`prestart_workers` when one is left and ``warm_niced`` is false
        (the server's start), else a new process."""
        prestarted = None if warm_niced or not _PRESTARTED else _PRESTARTED.pop(0)
        w = _Worker(self._pickle, self.max_chars, self.timeout_s, warm_niced, prestarted)
        self.pids.append(w.proc.pid)
        return w

    def _spawn_warm(self, warm_niced: bool = True) -> None:
        """A new worker, warmed on a thread of its own, then put in the pool (also one that failed
        to start: the request that takes it gets the RuntimeError, as before). ``warm_niced``: see
        :class:`_Worker` (false only for the workers of the server's start)."""
        try:
            w = self._new_worker(warm_niced)
        except BaseException:
            with self._lock:
                self._started -= 1
            raise
        with self._lock:
            self._warming.add(w)
        threading.Thread(target=self._warm, args=(w,), name="rlserve-template-warm", daemon=True).start()

    def _warm(self, w: _Worker) -> None:
        try:
            w.wait_ready()
            if self.grammar is not None and importlib.util.find_spec("xgrammar") is not None:
                w.init_grammar(*self.grammar)
        except (RuntimeError, TemplateError) as e:  # a compile makes it again and reports why
            if not self._closed:  # (close() kills warming workers: the server's stop, not a failure)
                logger.warning("a template worker did not warm: %s", e)
        finally:
            with self._lock:
                self._warming.discard(w)
            self._release(w)

    def _acquire(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise RuntimeError("the chat-template workers are shut down")
            try:
                return self._idle.get_nowait()
            except queue.Empty:
                pass
            if self._started < self.size:  # (not started by start(): on first use)
                self._started += 1
                try:
                    return self._new_worker()
                except BaseException:
                    self._started -= 1
                    raise
        return self._idle.get()

    def _release(self, worker: _Worker) -> None:
        """Back to the pool, or (dead) replaced by a new worker that warms in the background."""
        with self._lock:
            if self._closed:
                worker.kill()
                return
            alive = worker.alive() or not worker.ready  # (one that never started: its taker reports it)
        if alive:
            self._idle.put(worker)
            return
        worker.kill()
        self._spawn_warm()

    def render(self, messages: list[dict], kwargs: dict) -> str:
        """``apply_chat_template(messages, tokenize=False, **kwargs)`` in a worker (blocks this
        thread up to :attr:`timeout_s` plus a free worker's wait).

        Raises:
            TemplateError: the template raised, overran its time, memory or output bound.
            RuntimeError: no worker could start.
        """
        return self._on_worker(lambda w: w.render(messages, kwargs, self.timeout_s))

    def _on_worker(self, fn):
        """``fn(worker)`` on a free, started worker (one that could not start is killed:
        RuntimeError); the worker goes back to the pool (or is replaced) after."""
        worker = self._acquire()
        try:
            worker.wait_ready()
            return fn(worker)
        except RuntimeError:
            worker.kill()
            raise
        finally:
            self._release(worker)

    def compile(self, spec, vocab_size: int, eos_token_ids: list[int], timeout_s: float) -> None:
        """Compile a structured-output constraint (a :class:`~rlserve.engine.sampling_params.
        StructuredOutputsParams`) in a worker (:meth:`_Worker.compile`; blocks this thread up to
        ``timeout_s`` plus a free worker's wait). Raises TemplateError, RuntimeError (no worker
        could start)."""
        fields = {"json": spec.json, "regex": spec.regex, "grammar": spec.grammar, "json_object": spec.json_object,
                  "choice": None if spec.choice is None else list(spec.choice)}
        self._on_worker(lambda w: w.compile(fields, vocab_size, eos_token_ids, timeout_s))

    def close(self) -> None:
        """Stop every idle or warming worker (busy ones are stopped when they come back): none
        outlives a server that exits right after (``rlserve serve`` ends by ``os._exit``)."""
        with self._lock:
            self._closed = True
            warming = list(self._warming)
        for w in warming:
            if w.proc.poll() is None:
                w.proc.kill()  # its warm thread sees it end and reaps it
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return
