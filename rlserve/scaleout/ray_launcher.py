"""Place rlserve servers on a Ray cluster with placement groups (``pip install rlserve[ray]``).

One bundle per server (``{"CPU": cpus_per_server, "GPU": TP x DP}``) in one placement group;
each bundle runs a small actor that starts ``rlserve serve`` as a subprocess on its node (the
actor's ``CUDA_VISIBLE_DEVICES``, set by Ray, is the server's GPUs), binds it to ``0.0.0.0`` and
reports ``http://<node ip>:<port>``. Ray only places and supervises; the servers are ordinary
rlserve processes, reached over HTTP (the router, the trainer's control plane) and the transfer
group (the trainer's rendezvous). How verl / OpenRLHF / NeMo-RL place their vLLM replicas, with
our server instead of an in-process engine::

    import ray
    from rlserve.scaleout.ray_launcher import launch_servers
    ray.init()                                     # or address="auto" on a cluster
    fleet = launch_servers("Qwen/Qwen3-8B", num_servers=4, tensor_parallel_size=2,
                           serve_args=["--weight-staging", "host"], admin_key="secret")
    trainer = MultiServerTrainer.create(fleet.urls, source, backend="nccl", admin_key="secret")
    ...
    fleet.shutdown()
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Sequence


def ray_available() -> str | None:
    """``None`` when ``ray`` can be imported, else why not (for test skips)."""
    try:
        import ray  # noqa: F401
    except ImportError as e:
        return f"ray is not installed (pip install 'rlserve[ray]'): {e}"
    return None


class _ServerProcess:
    """The body of the per-server actor (a plain class: Ray wraps it with ``ray.remote``)."""

    def __init__(self, cmd: list[str], env: dict, log_path: str | None, startup_timeout_s: float):
        import ray

        from rlserve.demo import DemoServer

        self.ip = ray.util.get_node_ip_address()
        # cmd binds --port 0 (no port picked here and taken by another process before the bind):
        # the URL is the node's address and the port of the server's ready line
        self.server = DemoServer(cmd, None, env=env, log_path=log_path, startup_timeout_s=startup_timeout_s,
                                 url_host=self.ip)
        self.server.start()

    def wait_ready(self) -> str:
        """Block until the server answers ``/health``; returns its URL."""
        self.server.wait_healthy()
        return self.server.url

    def info(self) -> dict:
        return {"url": self.server.url, "pid": self.server.pid, "node_ip": self.ip,
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "log": self.server.log_path}

    def alive(self) -> bool:
        return self.server.proc is not None and self.server.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server's process group (a crash, for tests)."""
        import signal

        from rlserve.server.launch import killpg

        if self.server.proc is not None:
            killpg(self.server.proc.pid, signal.SIGKILL)
            self.server.proc.wait(30)

    def stop(self) -> int | None:
        return self.server.stop()

    def log_tail(self, n_chars: int = 4000) -> str:
        return self.server.log_tail(n_chars)


@dataclass
class RayServers:
    """Servers placed by :func:`launch_servers`.

    Attributes:
        urls: ``http://<node ip>:<port>`` of each server, in bundle order.
        actors: the Ray actor handles (one per server).
        placement_group: the Ray placement group holding their bundles.
        infos: per server ``{"url", "pid", "node_ip", "cuda_visible_devices", "log"}``.
    """

    urls: list[str]
    actors: list
    placement_group: object
    infos: list[dict] = field(default_factory=list)

    def kill(self, i: int) -> None:
        """SIGKILL server ``i`` (its actor stays, for its log)."""
        import ray

        ray.get(self.actors[i].kill.remote())

    def log_tail(self, i: int, n_chars: int = 4000) -> str:
        import ray

        return ray.get(self.actors[i].log_tail.remote(n_chars))

    def shutdown(self) -> None:
        """Stop every server, kill the actors, remove the placement group. Never raises."""
        import ray

        for a in self.actors:
            try:
                ray.get(a.stop.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - a dead actor or server
                pass
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001
                pass
        try:
            ray.util.remove_placement_group(self.placement_group)
        except Exception:  # noqa: BLE001
            pass


def launch_servers(model: str, num_servers: int, tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                   cpus_per_server: float = 1.0, use_gpus: bool | None = None, serve_args: Sequence[str] = (),
                   backend: str | None = None, admin_key: str | None = None, strategy: str = "PACK",
                   env: dict | None = None, log_dir: str | None = None, startup_timeout_s: float = 1800.0,
                   placement_timeout_s: float = 600.0) -> RayServers:
    """Place ``num_servers`` rlserve servers on the Ray cluster this process is connected to.

    Args:
        model: model path or hub id, as for ``rlserve serve`` (on every node).
        num_servers: replicas (one bundle each).
        tensor_parallel_size / data_parallel_size: each server's TP x DP (its GPUs per bundle).
        cpus_per_server: CPUs reserved per bundle.
        use_gpus: reserve ``TP x DP`` GPUs per bundle (default: when the cluster has GPUs). On
            CPU the servers run with ``--device cpu``.
        serve_args: more ``rlserve serve`` flags (``--weight-staging host``, ``--dtype``, ...).
        backend: ``--weight-transfer-config`` backend (default ``nccl`` on GPUs, ``gloo`` on CPU).
        admin_key: ``--admin-key`` (the servers bind ``0.0.0.0``; the control routes need it).
        strategy: the placement group's strategy: ``PACK`` (fill nodes), ``SPREAD`` (one per node
            where possible), ``STRICT_PACK`` / ``STRICT_SPREAD``.
        env: extra environment variables of the servers.
        log_dir: a directory on every node for ``server<i>.log`` (default: temporary files).
        startup_timeout_s: bound on each server's start (model download and load included).
        placement_timeout_s: bound on the wait for the placement group's resources.

    Returns:
        :class:`RayServers` (every server answering ``/health``).
    Raises:
        RuntimeError: Ray is missing or not initialised; the placement group could not be
            reserved in time; a server failed to start (everything launched is shut down).
    """
    why = ray_available()
    if why is not None:
        raise RuntimeError(why)
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        raise RuntimeError("ray is not initialised: call ray.init() (or ray.init(address='auto')) first")
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    gpus = tensor_parallel_size * data_parallel_size
    if use_gpus is None:
        use_gpus = ray.cluster_resources().get("GPU", 0) > 0
    bundle = {"CPU": float(cpus_per_server)}
    if use_gpus:
        bundle["GPU"] = float(gpus)
    pg = placement_group([dict(bundle) for _ in range(num_servers)], strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=placement_timeout_s)
    except Exception as e:
        ray.util.remove_placement_group(pg)
        raise RuntimeError(f"could not reserve {num_servers} x {bundle} ({strategy}) within "
                           f"{placement_timeout_s:.0f} s; the cluster has {ray.cluster_resources()}") from e
    actor_cls = ray.remote(_ServerProcess)
    actors: list = []
    try:
        for i in range(num_servers):
            sched = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)
            cmd = [sys.executable, "-m", "rlserve", "serve", model, "--host", "0.0.0.0", "--port", "0",
                   "--weight-transfer-config", json.dumps({"backend": backend or ("nccl" if use_gpus else "gloo")})]
            if not use_gpus:
                cmd += ["--device", "cpu"]
            if tensor_parallel_size > 1:
                cmd += ["--tensor-parallel-size", str(tensor_parallel_size)]
            if data_parallel_size > 1:
                cmd += ["--data-parallel-size", str(data_parallel_size)]
            if admin_key:
                cmd += ["--admin-key", admin_key]
            cmd += list(serve_args)
            log = None if log_dir is None else os.path.join(log_dir, f"server{i}.log")
            actors.append(actor_cls.options(
                num_cpus=cpus_per_server, num_gpus=gpus if use_gpus else 0, scheduling_strategy=sched,
                max_concurrency=4,  # kill / stop while wait_ready blocks
            ).remote(cmd, dict(env or {}), log, startup_timeout_s))
        urls = ray.get([a.wait_ready.remote() for a in actors], timeout=startup_timeout_s + 60)
        infos = ray.get([a.info.remote() for a in actors])
    except BaseException:
        RayServers([], actors, pg).shutdown()
        raise
    return RayServers(list(urls), actors, pg, infos)

