"""``/metrics`` over the N API processes of ``--api-server-count N`` (N > 1): prometheus_client's
multiprocess mode, as vLLM 0.32 uses it (``vllm/v1/metrics/prometheus.py``: a ``PROMETHEUS_MULTIPROC_DIR``
made by the launching process; ``MultiProcessCollector`` on the ``/metrics`` registry). N = 1 does none of
this: no directory, in-memory values, no extra cost.

Every counter and histogram value of each process lives in a memory-mapped file in that directory
(one per process and metric type); a scrape of any process reads all the files, so every process
answers the same aggregate: counters and histograms summed over the processes, gauges by their
``multiprocess_mode`` (:mod:`rlserve.server.metrics`, :mod:`rlserve.server.vllm_metrics`):

* ``mostrecent`` (vLLM's for its gauges): what the engines report (requests running / waiting,
  KV-cache usage, prefix-cache totals, pause, weight version, sleep state, ``vllm:cache_config_info``).
  Every process gets every engine core's stats; the scraping process writes its fresh view just
  before it reads the files, so the newest value is the one served;
* ``livesum``: what each process holds itself (``rlserve_num_requests_held``,
  ``rlserve_num_requests_unfinished``): each process writes its own count
  (:func:`publish_live`, every :data:`LIVE_PUBLISH_S` seconds and at each of its scrapes); a scrape
  sums them, the other processes' as of their last write.

prometheus_client's documented limits of the mode, checked against every rlserve metric (``grep -n
"Counter(\\|Gauge(\\|Histogram(\\|Info(" rlserve/server/*metrics*.py``):

* custom collectors are not aggregated: those whose values are the engines' own totals
  (``rlserve_engine_steps_total``, ``vllm:num_preemptions``, ``vllm:prefix_cache_*``,
  ``vllm:prompt_tokens_cached``, ``vllm:iteration_tokens_total``) are the same in every process and
  stay collectors of the scraping process; the per-process one, ``vllm:inter_token_latency_seconds``
  (a weighted histogram), writes into a multiprocess ``Histogram``'s values instead;
  ``process_*`` / ``python_*`` (the process and GC collectors) are left out, as vLLM's multiprocess
  registry leaves them out;
* ``Info`` is not supported: ``rlserve_api_server_info`` (which process answered, by design) and
  ``rlserve_weight_version_info`` (the same in every process) are the scraping process's own;
* gauges take a ``multiprocess_mode`` (above); no ``pid`` label is added to any of them.

Counters that one process owns are only counted there: weight syncs (process 0 runs them) and
``rlserve_generation_paused_seconds_total`` (process 0's pause clock; the others' would count it N times).

Lifetime: API process 0 picks the directory (:func:`setup_dir`) before it starts the engine cores and the
others (they get its path in their attach description) and builds its app, and removes it at exit
(:func:`remove_dir`) when it made it. As vLLM 0.32 (``setup_multiprocess_prometheus``): a
``PROMETHEUS_MULTIPROC_DIR`` the user set is used as is, with a warning that it is not cleaned (its
files from an earlier run add to this one's counts), and never removed; else a new directory
``<tmp>/rlserve-metrics-<pid>-XXXX`` (:data:`DIR_PREFIX`, after process 0's pid). A SIGKILLed process 0
cannot remove its own: the next ``--api-server-count`` start removes the directories of processes that are
gone (:func:`rlserve.pid_dirs.pid_dir`; only rlserve's own, by their name, this user's, pid not alive).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil

logger = logging.getLogger(__name__)

#: seconds between two writes of a process's own live counts (held, unfinished) in multiprocess mode
LIVE_PUBLISH_S = 0.5
_ENV = "PROMETHEUS_MULTIPROC_DIR"  # (prometheus_client's variable: it names each process's files)


#: the name of the directories :func:`setup_dir` makes, before process 0's pid
DIR_PREFIX = "rlserve-metrics-"


def setup_dir(root: str | None = None) -> tuple[str, bool]:
    """The directory for the value files (API process 0, N > 1) and whether this process made it (and
    removes it at exit): the user's ``PROMETHEUS_MULTIPROC_DIR`` (made if missing, never removed; a
    warning says its files are not cleaned), else a fresh ``<root>/rlserve-metrics-<pid>-XXXX`` (only this
    user can enter it; ``root``: default the temporary directory), the leftovers of dead processes removed
    first. Raises OSError when the user's directory cannot be made."""
    user = os.environ.get(_ENV)
    if user:
        os.makedirs(user, exist_ok=True)
        logger.warning("Found PROMETHEUS_MULTIPROC_DIR=%s set by the user: --api-server-count's metric files go "
                       "there and are not cleaned. This directory must be wiped between runs or you will find "
                       "inaccurate metrics. Unset the variable and rlserve will make (and remove) its own.", user)
        return user, False
    from rlserve.pid_dirs import pid_dir

    return pid_dir(DIR_PREFIX, root), True


def remove_dir(path: str | None) -> None:
    """Remove the directory and its files (API process 0's exit, after the others stopped)."""
    if path:
        shutil.rmtree(path, ignore_errors=True)


def enable(path: str) -> None:
    """Make this process's prometheus values from now on live in ``path``'s files (before the
    server's metrics are made). prometheus_client picks its value class at import from the
    environment; it was imported before the directory existed, so the class is switched here."""
    from prometheus_client import values

    os.environ[_ENV] = path
    if values.ValueClass is values.MutexValue:  # (already file-backed: the user's variable was set at import)
        values.ValueClass = values.MultiProcessValue()


def collector(registry, path: str) -> None:
    """Register the collector that reads (and aggregates) every process's files on ``registry``."""
    from prometheus_client.multiprocess import MultiProcessCollector

    MultiProcessCollector(registry, path=path)


async def publish_live(metrics, aengine) -> None:
    """Write this process's live counts every :data:`LIVE_PUBLISH_S` seconds, until cancelled
    (the app's lifetime; multiprocess mode only)."""
    while True:
        try:
            metrics.set_live(aengine.num_held, aengine.num_unfinished)
        except Exception:  # noqa: BLE001 - metrics are best effort; the next turn tries again
            logger.debug("publishing the live request counts failed", exc_info=True)
        await asyncio.sleep(LIVE_PUBLISH_S)
