"""Seconds per phase of one operation (a receive's buckets), reported in the update's answer."""

from __future__ import annotations

import contextlib
import time


class Phases(dict):
    """``{name: seconds}``, summed over every block timed under that name:
    ``with ph("receive_load"): ...`` adds the block's wall time (``perf_counter``) to
    ``ph["receive_load"]``, also when the block raises."""

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self[name] = self.get(name, 0.0) + time.perf_counter() - t0
