"""The first (cold) weight sync of a server against its later (warm) ones, phase by phase, on the CPU.

A real ``rlserve serve MODEL --load-format dummy`` (gloo) and a trainer (this process) holding
random float32 tensors with the model's Hugging Face names (``benchmarks/sync.py``'s
``model_tensors``): the server idles ``--idle`` seconds after ready, then ``trainer_init`` and
``--syncs`` x ``send_weights``. Per sync: wall seconds, the engine-core process's CPU seconds
during it (utime + stime of every thread, from ``/proc/PID/stat``: steadier than wall time on a
shared machine), this process's CPU seconds, and the phases the SDK and the server report
(``last_stats["phases_s"]``, the server's ``worker_phases_s``, as ``rlserve demo`` prints them).
Run it from each checkout in turn (interleaved) to compare two trees.

    python benchmarks/sync_cold.py                                   # SmolLM2-135M's cached dir
    python benchmarks/sync_cold.py --model DIR --shape smollm2-135m --syncs 3 --idle 20

One JSON line (``COLD_SYNC {...}``) on stdout, the phase lines before it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.sync import model_tensors  # noqa: E402
from rlserve.demo.trainer import phase_lines  # noqa: E402
from rlserve.server.testing import ServerProcess  # noqa: E402
from rlserve.transfer import (  # noqa: E402
    GlooTrainerInitInfo,
    HTTPWeightSyncClient,
    TensorListSource,
    WeightTransferTrainerFactory,
)


def core_pid(server_pid: int) -> int | None:
    """The engine-core child of the server process (its command line names ``core_proc``)."""
    for d in glob.glob("/proc/[0-9]*"):
        try:
            cmd = open(d + "/cmdline", "rb").read()
            ppid = int(open(d + "/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"core_proc" in cmd and ppid == server_pid:
            return int(d[len("/proc/"):])
    return None


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), seconds."""
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/rlserve/SmolLM2-135M-Instruct"))
    ap.add_argument("--shape", default="smollm2-135m", help="benchmarks/model_shapes.py shape of --model")
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--idle", type=float, default=20.0, help="seconds the server idles after ready")
    args = ap.parse_args()
    named = model_tensors(args.shape, torch.float32, "cpu")
    out: dict = {"load_avg_start": os.getloadavg()[0]}
    with ServerProcess(args.model, "--load-format", "dummy", "--device", "cpu", "--dtype", "float32",
                       "--weight-transfer-config", json.dumps({"backend": "gloo"}), startup_timeout_s=900) as srv:
        time.sleep(args.idle)
        pid = core_pid(srv.proc.pid)
        t0 = time.perf_counter()
        eng = WeightTransferTrainerFactory.trainer_init(
            init_info=GlooTrainerInitInfo(master_address="127.0.0.1", world_size=2),
            client=HTTPWeightSyncClient(srv.url), source=TensorListSource(named))
        out.update(trainer_init_s=time.perf_counter() - t0, init_stats=eng.init_stats, syncs=[])
        for i in range(args.syncs):
            c0, p0, t1 = cpu_seconds(pid) if pid else 0.0, time.process_time(), time.perf_counter()
            eng.send_weights()
            st = eng.last_stats
            out["syncs"].append({"wall_s": time.perf_counter() - t1,
                                 "core_cpu_s": (cpu_seconds(pid) - c0) if pid else None,
                                 "trainer_cpu_s": time.process_time() - p0,
                                 "phases_s": st.get("phases_s"), "server": st.get("server")})
            print(f"[sync {i + 1}] wall {out['syncs'][-1]['wall_s']:.2f} s, core CPU "
                  f"{out['syncs'][-1]['core_cpu_s'] or 0:.2f} s", flush=True)
            print("\n".join(phase_lines(st, eng.init_stats if i == 0 else None)), flush=True)
        eng.shutdown()
    out["load_avg_end"] = os.getloadavg()[0]
    print("COLD_SYNC " + json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
