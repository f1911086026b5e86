"""Several ``rlserve serve`` processes on this machine: the CPU stand-in for a fleet of replicas
(tests, ``examples/rlhf_multi_server.py``, ``benchmarks/multi_server_sync.py``). On a cluster the
servers come from :mod:`rlserve.scaleout.ray_launcher` (or any launcher that yields URLs)."""

from __future__ import annotations

import concurrent.futures as cf
import signal
from typing import Sequence

from rlserve.demo import DemoServer, Layout, serve_command
from rlserve.server.launch import killpg

#: Small CPU defaults for a fleet of tiny servers on a shared machine.
CPU_SERVER_ARGS = ("--max-model-len", "256", "--max-num-seqs", "16", "--kv-cache-bytes", str(16 << 20),
                   "--disable-access-log")


class LocalServers:
    """``n`` rlserve servers started together, each in its own process group.

    Args:
        model: model directory (served with dummy weights; the trainer syncs the real ones).
        n: how many servers.
        backend: the weight-transfer backend (``--weight-transfer-config``), ``gloo`` on CPU.
        staging: ``--weight-staging`` (``host`` keeps the old weights serving until a whole
            update arrived: what a multi-server update needs to fail without mixing versions).
        dtype / device: the servers' ``--dtype`` / ``--device``.
        host: the interface they bind (``0.0.0.0`` for other hosts; needs ``admin_key``).
        admin_key: ``--admin-key`` (the control routes need it off loopback).
        extra_args: more ``rlserve serve`` flags (default :data:`CPU_SERVER_ARGS`).
        log_dir: where their logs go (``None``: temporary files, paths in ``log_paths``).
        startup_timeout_s: bound on each server's start.

    ``urls[i]`` is server ``i``'s base URL. :meth:`kill` SIGKILLs one (a crash); :meth:`stop`
    stops them all (also on ``with`` exit).
    """

    def __init__(self, model: str, n: int, backend: str = "gloo", staging: str = "host", dtype: str = "float32",
                 device: str = "cpu", host: str = "127.0.0.1", admin_key: str | None = None,
                 extra_args: Sequence[str] = CPU_SERVER_ARGS, log_dir: str | None = None,
                 startup_timeout_s: float = 300.0):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        layout = Layout(backend, device, None, device, dtype)
        client_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        self.servers: list[DemoServer] = []
        for i in range(n):
            extra = ["--weight-staging", staging, *extra_args]
            if admin_key:
                extra += ["--admin-key", admin_key]
            # --port 0: each binds a port the kernel picks (none can be taken first), read from its ready line
            cmd = serve_command(model, layout, 0, host=host, extra_args=extra)
            log = None if log_dir is None else f"{log_dir}/server{i}.log"
            self.servers.append(DemoServer(cmd, None, log_path=log, startup_timeout_s=startup_timeout_s,
                                           url_host=client_host))

    @property
    def urls(self) -> list[str]:
        """The servers' base URLs (``http://HOST:PORT``), known once :meth:`start` returned."""
        return [s.url for s in self.servers]

    @property
    def log_paths(self) -> list[str]:
        return [s.log_path for s in self.servers]

    def start(self) -> "LocalServers":
        """Start every server and wait until all answer ``/health`` (they load concurrently).

        Raises:
            rlserve.demo.ServerStartError: one did not come up (all are stopped)."""
        try:
            for s in self.servers:
                s.start()
            with cf.ThreadPoolExecutor(len(self.servers)) as pool:
                for f in [pool.submit(s.wait_healthy) for s in self.servers]:
                    f.result()
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, i: int) -> None:
        """SIGKILL server ``i`` and its whole process group (its engine cores): a crash."""
        s = self.servers[i]
        if s.proc is not None:
            killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait(30)

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def __enter__(self) -> "LocalServers":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
