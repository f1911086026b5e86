"""The server's tokenizer threads: tokenizer work that grows with the text (encoding a prompt)
runs off the event loop, which serves every other request and stream of the process.

Two threads, each with its own tokenizer: a Hugging Face fast tokenizer used from two threads
at once can fail with "Already borrowed" (an encode that changes its truncation / padding
settings borrows the Rust tokenizer mutably; the reason vLLM has one tokenizer executor), so
each thread encodes with a copy of its own, and the server's tokenizer stays with the threads
that decode (the event loop, the engine replicas' output processing). Text of :data:`LONG_TEXT_CHARS` characters or more goes to
the second thread: encoding the longest allowed prompt (``max_model_len`` x the longest
vocabulary string, e.g. 32,768 x 256 characters) takes seconds, and on one thread every short
request that came after it waited that long for its first token. The Rust tokenizer releases
the GIL while it encodes (measured: an encode of 2.4 M characters on a thread delayed the event
loop 47 ms at most), so neither thread stops the loop.

Prompts of the completion routes (:meth:`TokenizerThreads.encode_many`) are encoded in micro-batches,
as vLLM's ``AsyncMicrobatchTokenizer`` does: the texts of the requests that wait for the
short-text thread go to the tokenizer in batched calls (of up to twice the process's cores texts),
which a Hugging Face fast tokenizer encodes in parallel on the machine's cores (Rust,
``encode_batch``: the same ids as one ``encode`` per text). A burst of requests (``vllm bench serve``'s first 64 or 256, or those that
follow a wave of finishes) then waits for the slowest text, not for all of them one after the
other: the tests' tiny tokenizer took ~0.37 ms of CPU per 512-token random prompt here, 24 ms for
64 of them on one thread (issue 37: p99 time to the first token).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)

#: texts this long (characters) or longer are encoded on the long-text thread
LONG_TEXT_CHARS = 1 << 16


class TokenizerThreads:
    """The short-text and long-text tokenizer threads of one server.

    Args:
        tokenizer: the server's tokenizer (each thread makes a ``copy.deepcopy`` of it on its
            first use; other threads use it as it is).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # the server checks every prompt against max_model_len itself (a 400 naming input_tokens):
        # transformers' one-time "Token indices sequence length is longer than the specified maximum
        # sequence length for this model (9001 > 8192) ... will result in indexing errors" (its
        # tokenizer_config's model_max_length, not the server's context) read as a bug in the server's log
        # when a too-long prompt was refused (session 22's new-user run); marked as given (the threads'
        # copies inherit it)
        warned = getattr(tokenizer, "deprecation_warnings", None)
        if isinstance(warned, dict):
            warned["sequence-length-is-longer-than-the-specified-maximum"] = True
        self._copies: dict[bool, object] = {}  # long-text thread? -> its copy
        self._local = threading.local()
        self._short: ThreadPoolExecutor | None = None
        self._long: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._batch: list = []  # (texts, add_special_tokens, future, loop) waiting for the short-text thread
        #: texts per batched call at most (whole requests; a request's own texts are never split): twice
        #: the cores this process may use. A burst's mean wait is lowest with batches about as large as
        #: the parallelism (each batch then costs about one text's time), its last request's the same
        #: either way; on a loaded 2-core machine one batch of a 64-request burst made every request
        #: wait for all 64.
        self.batch_texts = 2 * _cores()
        self._batch_queued = False  # a _encode_batches call is queued or running on it
        self._closed = False

    def close(self) -> None:
        """Stop both threads (the server's stop): work not started is cancelled, an encode in
        progress is finished (the Rust tokenizer cannot be interrupted: at most the longest
        prompt's encode, seconds) and the threads are joined. A later call raises RuntimeError.
        Before this, the threads outlived every server stop of their process (a test or an
        embedding program that starts and stops servers collected two threads per server)."""
        with self._lock:
            self._closed = True
            pools, self._short, self._long = [p for p in (self._short, self._long) if p is not None], None, None
        for pool in pools:
            pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:  # texts whose batch call was cancelled: their requests fail, none waits
            batch, self._batch, self._batch_queued = self._batch, [], False
        stopped = RuntimeError("the server is stopping: its tokenizer threads are stopped")
        _deliver([(f, lp, None, stopped) for _texts, _flag, f, lp in batch])

    def _executor(self, long: bool) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise RuntimeError("the server is stopping: its tokenizer threads are stopped")
            if long:
                if self._long is None:
                    self._long = ThreadPoolExecutor(1, thread_name_prefix="rlserve-tokenizer-long",
                                                    initializer=self._mark_long)
                return self._long
            if self._short is None:
                self._short = ThreadPoolExecutor(1, thread_name_prefix="rlserve-tokenizer",
                                                 initializer=self._mark_short)
            return self._short

    def _mark_long(self) -> None:
        self._local.long = True

    def _mark_short(self) -> None:
        self._local.long = False

    def current(self):
        """The tokenizer of the calling thread: on a tokenizer thread its own copy (made on the
        thread's first call), elsewhere the server's."""
        long = getattr(self._local, "long", None)
        if long is None:
            return self.tokenizer
        tok = self._copies.get(long)
        if tok is None:
            tok = self._copies[long] = copy.deepcopy(self.tokenizer)
        return tok

    async def run(self, fn, *args, chars: int = 0):
        """``fn(*args)`` on the short-text thread, or on the long-text one when ``chars`` (the
        text's length) is at least :data:`LONG_TEXT_CHARS`; awaited. What ``fn`` raises is
        raised here. ``fn`` encodes with :meth:`current`."""
        executor = self._executor(chars >= LONG_TEXT_CHARS)
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

    async def encode_many(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """The token ids of each of ``texts`` (``tokenizer.encode(text, add_special_tokens=...)``),
        encoded on the short-text thread in one micro-batch with every other request's texts
        waiting there (see the module docstring); ``texts`` of :data:`LONG_TEXT_CHARS` characters
        or more in all go to the long-text thread instead, alone. Validation (Unicode, length) is
        the caller's. What the tokenizer raises for one of ``texts`` is raised here (only for
        the request that sent it)."""
        if sum(len(t) for t in texts) >= LONG_TEXT_CHARS:
            return await self.run(self._encode_each, texts, add_special_tokens, chars=LONG_TEXT_CHARS)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            self._batch.append((texts, bool(add_special_tokens), fut, loop))
            start, self._batch_queued = not self._batch_queued, True
        if start:
            try:
                self._executor(False).submit(self._encode_batches)
            except BaseException as e:  # noqa: BLE001 - no thread to run it: every waiting request fails
                with self._lock:
                    batch, self._batch, self._batch_queued = self._batch, [], False
                _deliver([(f, lp, None, e) for _texts, _flag, f, lp in batch])
        return await fut

    def _encode_each(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        tok = self.current()
        return [list(tok.encode(t, add_special_tokens=add_special_tokens)) for t in texts]

    def _encode_batches(self) -> None:
        """Short-text thread: encode whatever waits, until nothing does (:meth:`_encode_batch`);
        results go back to each request's loop, one callback per loop and batch. Where the thread
        has no tokenizer (its copy could not be made: ``copy.deepcopy`` raised), every waiting
        request gets that error (before, the exception ended this call with ``_batch_queued``
        still set: that request and every later one waited for ever)."""
        failure = None
        try:
            tok = self.current()
            batched = bool(getattr(tok, "is_fast", False)) and callable(tok)
        except BaseException as e:  # noqa: BLE001 - delivered to each waiting request below
            failure, tok, batched = e, None, False
        while True:
            with self._lock:
                n, k = 0, 0  # whole requests, up to batch_texts texts (one request's may be more)
                while k < len(self._batch) and (k == 0 or n + len(self._batch[k][0]) <= self.batch_texts):
                    n += len(self._batch[k][0])
                    k += 1
                batch, self._batch = self._batch[:k], self._batch[k:]
                if not batch:
                    self._batch_queued = False
                    return
            try:
                if failure is not None:
                    raise failure
                results = self._encode_batch(tok, batched, batch)
            except BaseException as e:  # noqa: BLE001 - no request may wait for ever
                results = [(fut, loop, None, e) for _texts, _flag, fut, loop in batch]
            _deliver(results)

    def _encode_batch(self, tok, batched: bool, batch: list) -> list:
        """``[(future, loop, ids per text or None, exception or None)]`` of ``batch``: one
        tokenizer call per ``add_special_tokens`` value (``batched``: a fast tokenizer), else
        (or when that call raises) text by text, so that only the request with a bad text
        fails."""
        out = []
        for flag in {e[1] for e in batch}:
            entries = [e for e in batch if e[1] == flag]
            if batched:
                try:
                    ids = tok([t for e in entries for t in e[0]], add_special_tokens=flag)["input_ids"]
                except Exception:  # noqa: BLE001 - one text's fault: found below, text by text
                    logger.debug("batched encode failed; encoding text by text", exc_info=True)
                else:
                    i = 0
                    for texts, _flag, fut, loop in entries:
                        out.append((fut, loop, [list(x) for x in ids[i:i + len(texts)]], None))
                        i += len(texts)
                    continue
            for texts, _flag, fut, loop in entries:
                try:
                    out.append((fut, loop, self._encode_each(texts, flag), None))
                except Exception as e:  # noqa: BLE001 - delivered to its request
                    out.append((fut, loop, None, e))
        return out


def _cores() -> int:
    """CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _deliver(results) -> None:
    """Hand ``[(future, loop, ids or None, exception or None)]`` to each future's event loop, one
    callback per loop (:func:`_resolve`); a closed loop has nobody waiting."""
    done: dict = {}  # loop -> [(future, ids or None, exception or None)]
    for fut, loop, ids, exc in results:
        done.setdefault(loop, []).append((fut, ids, exc))
    for loop, items in done.items():
        try:
            loop.call_soon_threadsafe(_resolve, items)
        except RuntimeError:  # the loop is closed: nobody waits
            pass


def _resolve(items) -> None:
    """Event-loop side: set each future's ids or exception (unless cancelled: its client left)."""
    for fut, ids, exc in items:
        if fut.done():
            continue
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(ids)
