"""cProfile of a server's event-loop thread during ``benchmarks/api_admission.py --cprofile``'s batches:
put this directory first on the server's ``PYTHONPATH`` with ``ADMISSION_CPROFILE_OUT=FILE``; in a
process started as ``... serve ...`` (the API process, not its engine core or workers) SIGUSR1
starts profiling the main thread (uvicorn's event loop; its CPU time, ``time.thread_time``) and SIGUSR2 stops it and writes the stats
gathered so far (all batches together) to ``FILE`` (``pstats`` format)."""

import os
import signal
import sys

_OUT = os.environ.get("ADMISSION_CPROFILE_OUT")
if _OUT and "serve" in sys.argv:
    import cProfile

    import time

    _prof = cProfile.Profile(time.thread_time)  # CPU time of the thread (wall time would count GIL waits)

    def _start(signum, frame):
        _prof.enable()

    def _stop(signum, frame):
        _prof.disable()
        _prof.dump_stats(_OUT)

    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
