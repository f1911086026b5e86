"""One trainer, N rlserve servers, one transfer group: :class:`MultiServerTrainer`.

::

    trainer = MultiServerTrainer.create(urls, ModuleSource(model), backend="nccl",
                                        admin_key=key, router=router)
    trainer.send_weights()         # every server commits the same new weight version, or none does
    trainer.pause("keep"); ...; trainer.resume()   # every server at once
    trainer.shutdown()

How: a gloo / NCCL trainer engine (:class:`~rlserve.transfer.WeightTransferTrainerFactory`'s,
unchanged) whose client is a :class:`~rlserve.transfer.sdk.fanout.FanOutClient`: one
rendezvous (each server joins with its ``rank_offset``), one broadcast per bucket reaching
every server's workers, the start / update / finish calls sent to all servers concurrently.

Every server commits the same version: ``weight_version`` if given, else the servers' common
version + 1 (:func:`common_next_version`), sent explicitly to each. Finish is called only once
every server has received and checked the whole update.

A server that fails its part fails the whole update (:class:`MultiServerUpdateError`):

- Nobody is asked to finish. Staged servers (``--weight-staging host|device``) keep their old
  weights and serve on; in place, a server whose parameters were written answers 503 until the
  next full update (use staging for fleets).
- The surviving servers' transfer engines are shut down (an open update is failed now, not at
  its timeout), and the next :meth:`~MultiServerTrainer.send_weights` re-initialises the group.
- Servers that no longer answer are dropped from the group and removed from the router; the
  next update runs with the survivors.
- If some servers committed and others failed to (a commit is a local copy after the data
  arrived: rare), the ones that failed are taken out of the router until an update lands on
  them, so the router never mixes versions.

Before each update the servers' ``/health`` is probed (concurrently); a dead one is dropped
then, and the group re-formed without it.
"""

from __future__ import annotations

import logging
import re
import time
import urllib.parse
from typing import Sequence

from rlserve.transfer.errors import WeightTransferFailedError
from rlserve.transfer.sdk.fanout import FanOutClient, FanOutError, is_dead
from rlserve.transfer.sdk.init_info import GlooTrainerInitInfo, NCCLTrainerInitInfo
from rlserve.transfer.sdk.trainer import WeightTransferTrainerFactory
from rlserve.transfer.server.session import next_version

logger = logging.getLogger(__name__)


class MultiServerUpdateError(WeightTransferFailedError):
    """An update failed on some servers, so on all of them.

    Attributes:
        failures: ``{url: exception}`` of the servers whose part failed.
        dropped: servers found dead and removed from the group (and from the router).
        committed: servers that committed the new version anyway (a failure during finish);
            ``[]`` when the failure came before finish (every server keeps its old version).
    """

    def __init__(self, msg: str, failures: dict, dropped: list[str], committed: list[str]):
        super().__init__(msg)
        self.failures, self.dropped, self.committed = failures, dropped, committed


def common_next_version(versions: Sequence[str], nexts: Sequence[str | None] | None = None) -> str:
    """The version after the servers' current ones (the server's own rule: ``"7"`` → ``"8"``,
    ``"step-41"`` → ``"step-42"``, ``"abc"`` → ``"abc.1"``). Servers that disagree (one joined
    later) are all moved past the highest numbered one. ``nexts``: each server's own next label
    (``/weight_info``'s ``next_weight_version``: past every label it used, as labels are unique
    per server); when every server gave one, the highest numbered of them (or their common one)."""
    if nexts and all(nexts):
        vs = sorted({str(v) for v in nexts})
        return vs[0] if len(vs) == 1 else _highest(vs)
    vs = sorted({str(v) for v in versions})
    return next_version(vs[0] if len(vs) == 1 else _highest(vs))


def _highest(vs: list[str]) -> str:
    """The label with the highest trailing number (the first of ``vs`` when none has one)."""
    numbered = [v for v in vs if re.search(r"\d+$", v)]
    if not numbered:
        return vs[0]
    return max(numbered, key=lambda v: int(re.search(r"(\d+)$", v).group(1)))


def trainer_address(urls: Sequence[str]) -> str:
    """The address the servers reach this trainer by: this machine's interface toward the first
    server's host (``127.0.0.1`` when the servers are local). Never assumes loopback."""
    from rlserve.distributed.group import local_address_toward

    host = urllib.parse.urlsplit(urls[0]).hostname or "127.0.0.1"
    return local_address_toward(host)


class MultiServerTrainer:
    """Weight sync from one trainer into several servers (see the module docstring).

    Build it with :meth:`create`. Attributes: ``client`` (the :class:`FanOutClient`),
    ``engine`` (the trainer engine), ``router`` (optional
    :class:`~rlserve.scaleout.router.SGLangRouter`), ``dropped`` (servers left out so far),
    ``last_stats`` (the engine's, plus ``"servers"`` and ``"weight_version"``).
    """

    def __init__(self, client: FanOutClient, engine, router=None):
        self.client = client
        self.engine = engine
        self.router = router
        self.dropped: list[str] = []
        self.out_of_router: set[str] = set()  # alive, but not on the version the others serve
        self._reinit = False
        self.last_stats: dict = {}

    @classmethod
    def create(cls, urls: Sequence[str], source, backend: str = "gloo", master_address: str | None = None,
               admin_key: str | None = None, router=None, **init_kw) -> "MultiServerTrainer":
        """Join every server into one transfer group with this trainer (rank 0).

        Args:
            urls: the servers' base URLs (e.g. :class:`~rlserve.scaleout.ray_launcher.RayServers`'
                ``urls``).
            source: the weight source (:class:`~rlserve.transfer.ModuleSource`).
            backend: ``"gloo"`` or ``"nccl"`` (CUDA IPC is one GPU: one server).
            master_address: where the servers reach this trainer's TCPStore (default:
                :func:`trainer_address`).
            admin_key: the servers' ``--admin-key``.
            router: an :class:`~rlserve.scaleout.router.SGLangRouter` fronting the servers: dead
                ones are removed from it.
            **init_kw: fields of :class:`~rlserve.transfer.GlooTrainerInitInfo` /
                :class:`~rlserve.transfer.NCCLTrainerInitInfo` (``packed_buffer_size_bytes``,
                ``timeout_s``, ``checksums``, ``device``, ...).
        Raises:
            ValueError: unknown backend. FanOutError / TransferTimeoutError: a server refused the
            init or the rendezvous failed (nothing is left joined).
        """
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"a multi-server group is gloo or nccl, got {backend!r}")
        timeout_s = float(init_kw.get("timeout_s", 300.0))
        client = FanOutClient(urls, admin_key=admin_key, timeout_s=timeout_s)
        cls_info = GlooTrainerInitInfo if backend == "gloo" else NCCLTrainerInitInfo
        info = cls_info(master_address=master_address or trainer_address(client.urls), master_port=0,
                        world_size=client.get_world_size() + 1, **init_kw)
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
        logger.info("transfer group of %d ranks: trainer at %s, servers %s", info.world_size, info.master_address,
                    client.rank_offsets())
        return cls(client, engine, router)

    @property
    def urls(self) -> list[str]:
        """The servers in the group now."""
        return self.client.urls

    # ------------------------------------------------------------------ membership
    def _drop(self, urls: Sequence[str], why: str) -> None:
        urls = [u for u in urls if u in self.client.clients]
        if not urls:
            return
        logger.warning("dropping %s from the transfer group (%s)", urls, why)
        self.client.drop(urls)
        self.dropped += urls
        self._reinit = True
        for u in urls:
            self._router_remove(u)

    def _router_remove(self, url: str) -> None:
        if self.router is None:
            return
        try:
            self.router.remove_worker(url)
        except Exception as e:  # noqa: BLE001 - the update's outcome matters more
            logger.warning("could not remove %s from the router: %s", url, e)

    def _dead(self) -> list[str]:
        """The servers in the group that no longer answer (probed concurrently)."""
        return [u for u, d in self.client.map(is_dead).items() if d]

    def _check_members(self) -> None:
        dead = self._dead()
        if len(dead) == len(self.client.urls):
            raise MultiServerUpdateError(f"no server answers any more ({dead})", {}, [], [])
        self._drop(dead, "it does not answer /health")

    # ------------------------------------------------------------------ updates
    def send_weights(self, weight_version: str | None = None, partial: bool = False) -> dict:
        """Push the source's weights into every server; all commit ``weight_version`` (default:
        their common version + 1).

        Returns:
            ``{"weight_version": v, "servers": {url: finish answer}}``.
        Raises:
            MultiServerUpdateError: some server failed its part (see the module docstring for
                what each server holds then).
        """
        t0 = time.perf_counter()
        self._check_members()
        if self._reinit:
            self._regroup()
        if weight_version is None:
            infos = self.client.weight_info()
            weight_version = common_next_version([i.get("weight_version", "0") for i in infos.values()],
                                                  [i.get("next_weight_version") for i in infos.values()])
        weight_version = str(weight_version)
        try:
            fin = self.engine.send_weights(weight_version, partial=partial)
        except BaseException as e:
            raise self._failed(e, weight_version) from e
        versions = {u: a.get("weight_version") for u, a in fin.items()}
        if set(versions.values()) != {weight_version}:  # a server that ignores the version asked for
            raise self._failed(WeightTransferFailedError(f"servers committed {versions}, not {weight_version!r}"),
                               weight_version)
        self._rejoin_router()
        self.last_stats = dict(self.engine.last_stats, servers=len(fin), weight_version=weight_version,
                               total_seconds=time.perf_counter() - t0)
        return {"weight_version": weight_version, "servers": fin}

    def _regroup(self) -> None:
        """A new group for the servers in it now (after a failure, or a server dropped)."""
        ii = self.engine.init_info
        ii.world_size = self.client.get_world_size() + 1
        self.engine.reinit()
        self._reinit = False

    def _failed(self, err: BaseException, version: str) -> MultiServerUpdateError:
        failures = dict(getattr(err, "failures", {}) or {})
        results = dict(self.client.last_results)
        committed = [u for u, r in results.items() if isinstance(r, dict) and r.get("weight_version") == version] \
            if getattr(err, "route", None) == "finish_weight_update" else []
        dead = self._dead()
        for u in dead:
            failures.setdefault(u, err)
        self._drop(dead, "it died during the update")
        if committed:
            for u in self.client.urls:
                if u not in committed:
                    self.out_of_router.add(u)
                    self._router_remove(u)
        # end every open update now (staged: dropped; in place: 503 if written) and re-form the
        # group next time
        try:
            self.client.shutdown_weight_transfer_engine()
        except FanOutError as e:
            logger.warning("shutting the transfer engines down after a failed update: %s", e)
        self._reinit = True
        where = f"committed on {committed}, not on the others" if committed else "nothing was committed"
        return MultiServerUpdateError(
            f"weight update {version!r} failed ({type(err).__name__}: {err}); {where}; dropped {dead or 'none'}",
            failures, dead, committed)

    def _rejoin_router(self) -> None:
        if not self.out_of_router:
            return
        for u in sorted(self.out_of_router):
            if self.router is not None:
                try:
                    self.router.add_worker(u)
                except Exception as e:  # noqa: BLE001
                    logger.warning("could not add %s back to the router: %s", u, e)
                    continue
            self.out_of_router.discard(u)

    # ------------------------------------------------------------------ generation control
    def pause(self, mode: str = "keep", clear_cache: bool = False) -> dict:
        """``POST /pause`` on every server (default ``keep``: requests freeze and continue after
        :meth:`resume`; new ones are held, none is lost)."""
        return self.client.pause(mode, clear_cache)

    def resume(self) -> dict:
        return self.client.resume()

    def weight_versions(self) -> dict[str, str]:
        """``{url: weight version}`` of every server in the group."""
        return {u: i.get("weight_version") for u, i in self.client.weight_info().items()}

    def shutdown(self) -> None:
        """Leave the group on every server and here. Never raises for a dead server."""
        self.engine.shutdown()
        self.client.close()
