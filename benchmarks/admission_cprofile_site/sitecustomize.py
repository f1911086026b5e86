"""cProfile of a server's event-loop thread during ``benchmarks/api_admission.py --cprofile``'s batches:
put this directory first on the server's ``PYTHONPATH`` with ``ADMISSION_CPROFILE_OUT=PREFIX``; in a
process started as ``... serve ...`` (the API process, not its engine core or workers) SIGUSR1
starts profiling the main thread (uvicorn's event loop; its CPU time, ``time.thread_time``, whose
system call per profiled call makes every figure several times the unprofiled one: compare shares)
and SIGUSR2 stops it and writes that batch's stats to ``PREFIX.<n>.pstats`` (``n`` = 0, 1, ... in
the order of the batches)."""

import os
import signal
import sys

_OUT = os.environ.get("ADMISSION_CPROFILE_OUT")
if _OUT and "serve" in sys.argv:
    import cProfile
    import itertools
    import time

    _batches = itertools.count()
    _prof = [None]

    def _start(signum, frame):
        _prof[0] = cProfile.Profile(time.thread_time)  # CPU time of the thread (wall time counts GIL waits)
        _prof[0].enable()

    def _stop(signum, frame):
        _prof[0].disable()
        _prof[0].dump_stats(f"{_OUT}.{next(_batches)}.pstats")

    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
