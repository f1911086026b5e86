"""The engine's Hugging Face tokenizer, loaded now or later (:class:`DeferredTokenizer`).

An :class:`~rlserve.engine.core.llm_engine.LLMEngine` in an engine-core process does not detokenize (the API
process does, :mod:`rlserve.engine.front.output_processor`) and gets token ids; it needs its tokenizer only
for a text prompt, a ``structured_outputs`` constraint (xgrammar's vocabulary) and, where neither
``generation_config.json`` nor ``config.json`` names an EOS token, the tokenizer's EOS id. Loading it
(``from transformers import AutoTokenizer``: transformers' tokenizer classes and, in transformers 5.17,
``auto_factory`` -> ``GenerationMixin`` -> FSDP, masking and candidate-generator code, 5.6 s of the 9.5 s of
start-up imports on the H100 machine, issue 37) is therefore not on the core's path to ready: the core starts
the load on a background thread right after its ready message (:meth:`DeferredTokenizer.start`), and whatever
needs the tokenizer before that thread is done waits for it (:meth:`DeferredTokenizer.get`).

Nothing here imports transformers at module level.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)


def load_tokenizer(path: str):
    """``AutoTokenizer.from_pretrained(path)`` (transformers imported here, not at start-up).

    Raises:
        what ``from_pretrained`` raises (OSError: no tokenizer files there, ...)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class DeferredTokenizer:
    """A tokenizer that is loaded once, on a background thread (:meth:`start`) or by the first :meth:`get`.

    Args:
        path: the tokenizer's directory or name (``EngineConfig.tokenizer or EngineConfig.model``).

    Thread-safe: :meth:`get` from any thread returns the one tokenizer, waiting while another thread loads it.
    A failed load is raised again by every :meth:`get` (the API process loads the same tokenizer and fails the
    start itself; here it fails only what needs the tokenizer)."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._done = False
        self._tokenizer = None
        self._error: BaseException | None = None

    def start(self) -> threading.Thread:
        """Load on a daemon thread now (returns it; a failure is logged there and raised by :meth:`get`)."""
        def run():
            try:
                self.get()
            except BaseException:  # noqa: BLE001 - raised again by get() where the tokenizer is needed
                logger.exception("the engine's tokenizer (%s) did not load", self.path)

        t = threading.Thread(target=run, name="rlserve-engine-tokenizer", daemon=True)
        t.start()
        return t

    @property
    def loaded(self) -> bool:
        """Whether the load has ended (tokenizer or error), so :meth:`get` returns at once."""
        return self._done

    def get(self):
        """The tokenizer: loaded here if no thread loaded it yet; waits while one does.

        Raises:
            what :func:`load_tokenizer` raised (each call)."""
        with self._lock:
            if not self._done:
                t0 = time.perf_counter()
                try:
                    self._tokenizer = load_tokenizer(self.path)
                except BaseException as e:  # noqa: BLE001 - kept and raised on every call
                    self._error = e
                self._done = True
                logger.debug("engine tokenizer %s loaded in %.2f s (%s)", self.path, time.perf_counter() - t0,
                             threading.current_thread().name)
        if self._error is not None:
            raise self._error
        return self._tokenizer
