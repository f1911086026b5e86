"""``RLSERVE_CPU_TEAM_BIND`` (:func:`rlserve.layers.cpu_gemm.bind`, off by default; engine-core
processes only): the team's worker pinned to its CPU for good, the engine thread to its own for the
length of each team step only (inline steps and everything between steps keep the thread's whole
mask), on CPUs that no other rlserve engine on the machine holds; ``avoid``
(:func:`rlserve.layers.cpu_gemm.avoid`): the workers kept off the engine thread's CPU before each
team step, the engine thread free."""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from rlserve.config import EngineConfig
from rlserve.engine.cpu import cpu_threads
from rlserve.layers import cpu_gemm

pytestmark = [
    pytest.mark.skipif(not cpu_gemm.available(), reason="no C compiler: the CPU team cannot be built"),
    pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                       reason="needs 2 usable CPUs and sched_setaffinity"),
]


def _allowed(tid: int) -> set[int]:
    for line in open(f"/proc/self/task/{tid}/status"):
        if line.startswith("Cpus_allowed_list:"):
            return set(cpu_threads.parse_cpu_list(line.split(":", 1)[1].strip()))
    raise AssertionError("no Cpus_allowed_list")


def _threads_pinned_to(cpu: int) -> int:
    me = threading.get_native_id()
    return sum(1 for t in os.listdir("/proc/self/task") if int(t) != me and _allowed(int(t)) == {cpu})


def _free_workers():
    n = cpu_gemm._lib().rlserve_team_size() - 1
    cpu_gemm._lib().rlserve_team_pin_workers((ctypes.c_int * n)(*([-1] * n)), n)


@pytest.fixture
def team2():
    prev, mask = cpu_gemm.size(), set(os.sched_getaffinity(0))
    team = cpu_gemm.start(2)
    yield team
    _free_workers()
    os.sched_setaffinity(0, mask)
    cpu_gemm.start(prev)


def test_bind_pins_the_worker_for_good_and_the_engine_thread_in_team_steps(team2):
    mask = sorted(os.sched_getaffinity(0))
    before = _threads_pinned_to(mask[0])
    assert cpu_gemm.bind(cpu_gemm.Team(1), [mask[-1], mask[0]]) == []  # a team of 1: nothing to pin
    assert cpu_gemm.bind(team2, [mask[-1]]) == []  # fewer CPUs than threads
    assert cpu_gemm.bind(team2, [mask[-1], mask[0]]) == [mask[-1], mask[0]]
    assert _threads_pinned_to(mask[0]) == before + 1  # the worker
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 64, generator=g), torch.randn(96, 64, generator=g)
    with cpu_gemm.step_guard("decode"):
        assert os.sched_getaffinity(0) == {mask[-1]}
        out = cpu_gemm.linear(x, cpu_gemm.pack(w), 96)  # the team runs while pinned
    assert os.sched_getaffinity(0) == set(mask)  # restored after the step
    torch.testing.assert_close(out, x @ w.T, atol=1e-5, rtol=1e-5)
    team2.guards["other"].skip = 1  # a step the guard runs inline: the engine thread stays free
    with cpu_gemm.step_guard("other"):
        assert os.sched_getaffinity(0) == set(mask)
    with pytest.raises(RuntimeError, match="boom"):  # an error in the step still restores the mask
        with cpu_gemm.step_guard("decode"):
            raise RuntimeError("boom")
    assert os.sched_getaffinity(0) == set(mask)
    _free_workers()
    assert _threads_pinned_to(mask[0]) == before


def test_configure_engine_threads_binds_where_allowed_on_claimed_cpus(team2, monkeypatch, tmp_path):
    """Off by default; with ``1`` in an engine-core process (``bind``) only, and only on CPUs this
    process could claim (another engine holding one: nothing pinned)."""
    monkeypatch.setenv("RLSERVE_CPU_THREADS", "1")
    monkeypatch.delenv("RLSERVE_CPU_TEAM", raising=False)
    monkeypatch.delenv("RLSERVE_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("RLSERVE_CPU_TEAM_BIND", raising=False)
    monkeypatch.setattr(cpu_threads, "_held_locks", [])
    monkeypatch.setattr(cpu_threads.tempfile, "gettempdir", lambda: str(tmp_path))  # this test's lock files
    mask = tuple(sorted(os.sched_getaffinity(0)))
    old = torch.get_num_threads()
    try:
        cpu_threads.configure_engine_threads(EngineConfig(model="unused"), bind=True)
        assert cpu_gemm.current().size >= 2 and cpu_gemm.current().bind is None  # off by default
        monkeypatch.setenv("RLSERVE_CPU_TEAM_BIND", "1")
        cpu_threads.configure_engine_threads(EngineConfig(model="unused"), bind=False)
        assert cpu_gemm.current().bind is None  # not an engine-core process
        cpu_threads.configure_engine_threads(EngineConfig(model="unused"), bind=True)
        assert cpu_gemm.current().bind == (mask[-1], mask)  # the highest CPU for the engine thread
        assert len(cpu_threads._held_locks) == cpu_gemm.current().size  # one lock file per CPU claimed
        # a second engine on the machine (here: the same lock files, held) pins nothing
        cpu_threads.configure_engine_threads(EngineConfig(model="unused"), bind=True)
        assert cpu_gemm.current().bind is None
        monkeypatch.setenv("RLSERVE_CPU_TEAM_BIND", "avoid")
        cpu_threads.configure_engine_threads(EngineConfig(model="unused"), bind=True)
        assert cpu_gemm.current().avoid and cpu_gemm.current().bind is None
        monkeypatch.setenv("RLSERVE_CPU_TEAM_BIND", "yes")
        with pytest.raises(ValueError, match="RLSERVE_CPU_TEAM_BIND"):
            cpu_threads.configure_engine_threads(EngineConfig(model="unused"), bind=True)
    finally:
        torch.set_num_threads(old)
        for f in cpu_threads._held_locks:
            f.close()


def test_avoid_keeps_the_workers_off_the_engine_threads_cpu(team2):
    mask = set(os.sched_getaffinity(0))
    workers_before = {t for t in os.listdir("/proc/self/task") if _allowed(int(t)) == mask}
    assert cpu_gemm.avoid(team2) and team2.bind is None
    try:
        with cpu_gemm.step_guard("decode"):
            here = cpu_gemm._sched_getcpu()
            # the worker's mask: the engine thread's less the CPU it ran on at the step's start (most likely
            # still `here`; the test accepts any one CPU left out, as the thread may have moved since)
            narrowed = [t for t in workers_before if len(_allowed(int(t))) == len(mask) - 1]
            assert os.sched_getaffinity(0) == mask  # the engine thread itself stays free
        assert len(narrowed) >= 1 and here in mask  # the team's worker(s)
    finally:
        team2.avoid = False
        cpu_gemm._lib().rlserve_team_avoid_cpu(-1)
    assert all(_allowed(int(t)) == mask for t in workers_before)


_AUTO_BIND = """
import json, os, sys, threading
from rlserve.config import EngineConfig
from rlserve.engine.cpu import cpu_threads
from rlserve.layers import cpu_gemm
cpu_threads.tempfile.gettempdir = lambda: sys.argv[1]  # this test's lock files
config = EngineConfig(model="unused")
n = cpu_threads.engine_cpu_threads(config)
size = cpu_threads.engine_team_size(config, threads=n)
before = set(os.listdir("/proc/self/task"))
cpu_threads.configure_engine_threads(config, bind=True)
def allowed(tid):
    for line in open(f"/proc/self/task/{tid}/status"):
        if line.startswith("Cpus_allowed_list:"):
            return cpu_threads.parse_cpu_list(line.split(":", 1)[1].strip())
new = sorted(set(os.listdir("/proc/self/task")) - before)
print(json.dumps({"size": size, "team": cpu_gemm.current().size, "engine": sorted(os.sched_getaffinity(0)),
                  "workers": [allowed(t) for t in new], "locks": len(cpu_threads._held_locks)}))
"""


def test_auto_bind_claims_the_teams_cpus_and_the_team_runs_on_them(tmp_path):
    """``RLSERVE_CPU_OMP_THREADS_BIND=auto`` in an engine-core process (session 21, FIX21 item 5: it claimed
    one CPU for the one torch thread, pinned the engine thread there, and the team, sized after the pin,
    shrank to 1): it claims the team's CPUs, the team keeps the size it has unbound, and its worker threads
    (started after the pin, in a fresh process as in an engine-core process) run on those CPUs only."""
    env = {k: v for k, v in os.environ.items() if k not in (
        "RLSERVE_CPU_THREADS", "RLSERVE_CPU_TEAM", "OMP_NUM_THREADS", "RLSERVE_CPU_TEAM_BIND",
        "RLSERVE_CPU_RESERVED_CPUS")}
    env["RLSERVE_CPU_OMP_THREADS_BIND"] = "auto"

    def run() -> dict:
        out = subprocess.run([sys.executable, "-c", _AUTO_BIND, str(tmp_path)], env=env, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    got = run()
    if got["size"] < 2:
        pytest.skip(f"no CPU team on this machine's mask: {got}")
    assert got["team"] == got["size"] == len(got["engine"]) == got["locks"], got  # not a team of 1
    assert len(got["workers"]) >= got["size"] - 1, got
    assert all(set(w) <= set(got["engine"]) for w in got["workers"]), got
    # another engine holds one of those CPUs: the torch thread's one CPU (never a shared core), a team of 1
    top = max(os.sched_getaffinity(0))
    with open(tmp_path / "rlserve-cpu-bind" / f"{top}.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        got = run()
    if got["size"] == 2 and len(os.sched_getaffinity(0)) == 2:  # (one torch thread: one CPU is left for it)
        assert got["engine"] != [top] and len(got["engine"]) == 1 and got["team"] == 1, got
