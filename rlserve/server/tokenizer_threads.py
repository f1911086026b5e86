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
"""

from __future__ import annotations

import asyncio
import copy
import threading
from concurrent.futures import ThreadPoolExecutor

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
        self._copies: dict[bool, object] = {}  # long-text thread? -> its copy
        self._local = threading.local()
        self._short: ThreadPoolExecutor | None = None
        self._long: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self, long: bool) -> ThreadPoolExecutor:
        with self._lock:
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
