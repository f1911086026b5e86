"""transformers' names for code that may run on several threads at once while the package is first
imported. ``rlserve serve`` (on a GPU with ``RLSERVE_GPU_START_OVERLAP=1``) reads the generation defaults
(``GenerationConfig``) and loads the tokenizer (``AutoTokenizer``) on two threads beside the engine's
start; while one thread still runs transformers' ``__init__``, the other's ``from transformers import
NAME`` fails with ``ImportError: cannot import name 'NAME' from 'transformers'`` (transformers 5.25, 6 of 6
tries on the 2-core CPU machine, 2026-12-07). The tokenizer's prefetch swallowed that error, and the API
process then loaded the tokenizer -- transformers' tokenizer modules and torch -- only after the engine
core said it was ready: the 5.4-6.1 s between the core's ready and the API's on the H100 (session 21's
first window, benchmarks/results/s21_w1/start)."""

from __future__ import annotations

import threading

_LOCK = threading.RLock()  # re-entrant: a caller that already holds it cannot deadlock itself


def from_transformers(name: str):
    """``from transformers import name``, one thread at a time (a lock around the import and the
    attribute: transformers resolves its names lazily, importing their modules).

    Raises:
        ImportError: transformers is not installed or has no such name.
    """
    with _LOCK:
        import transformers

        try:
            return getattr(transformers, name)
        except AttributeError:
            raise ImportError(f"cannot import name {name!r} from 'transformers'") from None
