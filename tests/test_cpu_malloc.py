"""rlserve.engine.cpu.cpu_malloc: glibc malloc thresholds for CPU engine processes."""

import ctypes
import ctypes.util
import platform

import pytest

from rlserve.engine.cpu import cpu_malloc

glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(cpu_malloc, "_done", [])
    calls = []

    def spy(param, value):
        calls.append((param, value))
        return 1  # glibc's "accepted"; the process's real thresholds are left alone

    class FakeLibc:
        mallopt = spy

    monkeypatch.setattr(cpu_malloc.ctypes, "CDLL", lambda name: FakeLibc)
    return calls


@pytest.mark.skipif(not glibc, reason="glibc only")
def test_sets_both_thresholds_once(fresh):
    calls = fresh
    assert cpu_malloc.tune_malloc() is True
    assert calls == [(-3, 64 << 20), (-1, 256 << 20)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    assert cpu_malloc.tune_malloc() is True and len(calls) == 2  # once per process


def test_env_switches_it_off(fresh, monkeypatch):
    calls = fresh
    monkeypatch.setenv("RLSERVE_CPU_MALLOC_TUNE", "0")
    assert cpu_malloc.tune_malloc() is False
    assert calls == []


def test_rejected_or_missing_mallopt_is_not_an_error(monkeypatch):
    monkeypatch.setattr(cpu_malloc, "_done", [])

    class NoMallopt:
        pass

    monkeypatch.setattr(cpu_malloc.ctypes, "CDLL", lambda name: NoMallopt)
    assert cpu_malloc.tune_malloc() is False
    monkeypatch.setattr(cpu_malloc, "_done", [])

    class Rejects:
        @staticmethod
        def mallopt(param, value):
            return 0

    monkeypatch.setattr(cpu_malloc.ctypes, "CDLL", lambda name: Rejects)
    assert cpu_malloc.tune_malloc() is False


@pytest.mark.skipif(not glibc, reason="glibc only")
def test_glibc_accepts_the_values():
    """The real mallopt takes these parameters (1 = accepted); setting them in the test
    process is what an engine process does anyway."""
    mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    assert mallopt(cpu_malloc.M_MMAP_THRESHOLD, cpu_malloc.MMAP_THRESHOLD_BYTES) == 1
    assert mallopt(cpu_malloc.M_TRIM_THRESHOLD, cpu_malloc.TRIM_THRESHOLD_BYTES) == 1
