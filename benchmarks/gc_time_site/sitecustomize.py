"""GC time per generation in every process of a server (issue 37's API-process profile,
``benchmarks/api_profile_layers.py``): put this directory first on the server's ``PYTHONPATH``
(``api_stream_load.py --env PYTHONPATH=benchmarks/gc_time_site:. GC_TIME_DIR=DIR``) and each
process appends, to ``DIR/<pid>.txt`` after a first line with its ``sys.argv``, lines of
``<unix time s> <n0> <n1> <n2> <s0> <s1> <s2>``: collections of generation 0, 1, 2 since the
process started and their CPU seconds (``time.thread_time`` of the collecting thread, from
``gc.callbacks``' start to stop: a collection holds the GIL, so a thread preempted meanwhile on a
loaded machine adds no time here), at most every 0.5 s, written at a collection's end."""

import gc
import os
import sys
import time

_DIR = os.environ.get("GC_TIME_DIR")
if _DIR:
    _n, _s, _t0, _last = [0, 0, 0], [0.0, 0.0, 0.0], [0.0], [0.0]
    _f = open(os.path.join(_DIR, f"{os.getpid()}.txt"), "a", buffering=1)
    _f.write(" ".join(sys.argv) + "\n")

    def _on_gc(phase, info, _clock=time.thread_time):
        if phase == "start":
            _t0[0] = _clock()
            return
        g = info["generation"]
        _n[g] += 1
        _s[g] += _clock() - _t0[0]
        now = time.time()
        if now - _last[0] > 0.5:
            _last[0] = now
            _f.write(f"{now:.3f} {_n[0]} {_n[1]} {_n[2]} {_s[0]:.6f} {_s[1]:.6f} {_s[2]:.6f}\n")

    gc.callbacks.append(_on_gc)
