"""Progress lines (tqdm on stderr) for phases that take more than a few seconds: a user must
be able to tell a slow machine from a hang.

``progress(desc, total=..., unit=...)`` is a tqdm bar whose line is redrawn every
``refresh_s`` seconds by a background thread, so the elapsed time keeps moving even while no
unit is done (a prefill, a blocking call); without ``total`` it shows the elapsed time only::

    with progress("[server] starting") :
        server.wait_healthy()
    with progress("[generate] tokens", total=n_prompts * max_tokens, unit="tok") as bar:
        for chunk in stream: bar.update(len(chunk))
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator

#: Seconds between two redraws of a progress line (a line at least this often).
REFRESH_S = 2.0


@contextlib.contextmanager
def progress(desc: str, total: int | None = None, unit: str = "it", refresh_s: float = REFRESH_S,
             enabled: bool = True, file=None) -> Iterator:
    """A tqdm bar for one phase, redrawn every ``refresh_s`` seconds until the block ends.

    Args:
        desc: what the phase does (the line starts with it).
        total: units to do (None: elapsed time only).
        unit: the unit's name.
        refresh_s: seconds between redraws by the background thread.
        enabled: False yields a disabled bar (``update`` is a no-op).
        file: stream (default: ``sys.stderr``).

    Yields:
        the ``tqdm`` bar (``update(n)``, ``set_postfix_str(s)``).
    """
    from tqdm.auto import tqdm

    fmt = None if total is not None else "{desc}: {elapsed}{postfix}"
    bar = tqdm(total=total, desc=desc, unit=unit, bar_format=fmt, file=file or sys.stderr, disable=not enabled,
               mininterval=0.5, dynamic_ncols=True, leave=True)
    stop = threading.Event()

    def tick():
        while not stop.wait(refresh_s):
            with contextlib.suppress(Exception):  # a closed stream must not kill the phase
                bar.refresh()

    thread = threading.Thread(target=tick, name="rlserve-progress", daemon=True)
    if enabled:
        thread.start()
    try:
        yield bar
    finally:
        stop.set()
        if enabled:
            thread.join()
        bar.close()
