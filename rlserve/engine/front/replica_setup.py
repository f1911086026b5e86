"""How the async front builds its data-parallel replicas: a per-replica copy of the config
(:func:`replica_config`: which GPU each replica takes), the replicas themselves for the engine
mode (:func:`build_replicas`), and the API process's tokenizer, loaded once for every replica's
view (:class:`TokenizerOnce`)."""

from __future__ import annotations

import copy
import logging
import threading
import time

from rlserve.gc_heap import no_collections_while_importing
from rlserve.hf_import import from_transformers
from rlserve.startup_log import log_phase

logger = logging.getLogger(__name__)


def replica_config(config, dp_index: int):
    """A per-replica copy of ``config`` (the engine writes resolved values into its config).

    Replica ``i`` uses GPUs ``device_ids[i*TP:(i+1)*TP]`` (default ids ``0..TP*DP-1``): with
    TP > 1 the TP executor picks them from the full list by ``dp_index``; with TP = 1 the
    single in-process worker follows ``config.device``, so it is set to ``cuda:<id>`` here.

    Raises:
        ValueError: fewer device ids than TP x DP.
    """
    cfg = copy.deepcopy(config)
    dp, tp = config.data_parallel_size, config.tensor_parallel_size
    if tp == 1 and (dp > 1 or config.device_ids):
        from rlserve.config import resolve_device

        dev = resolve_device(config.device)
        if dev.type == "cuda" and dev.index is None:
            ids = list(config.device_ids) if config.device_ids else list(range(dp * tp))
            if len(ids) < dp * tp:
                raise ValueError(f"device_ids {ids} has fewer than TP x DP = {dp * tp} entries")
            cfg.device = f"cuda:{ids[dp_index]}"
    return cfg


class TokenizerOnce:
    """Loads the tokenizer in this (the API) process once, for every replica's view. Calling it
    returns the tokenizer (None with ``skip_tokenizer_init``) and raises what loading raises;
    :meth:`prefetch` starts loading it on a thread, so that it loads while the engine-core
    processes start instead of after (importing transformers and loading SmolLM2's tokenizer
    took ~4 s on the loaded 2-core machine). ``tokenizer``: one already loaded in this process
    from ``config.tokenizer or config.model`` (``rlserve serve``'s parser check loads it), used
    instead of loading it again."""

    def __init__(self, config, tokenizer=None):
        self.config = config
        self._tok = None
        self._loaded = False
        if tokenizer is not None and not getattr(config, "skip_tokenizer_init", False):
            self._tok, self._loaded = tokenizer, True
        self._lock = threading.Lock()
        self._prefetching = False

    def prefetch(self) -> None:
        """Start loading on a daemon thread (once); a failure there is raised by the next call."""
        with self._lock:
            if self._prefetching or self._loaded:
                return
            self._prefetching = True
        threading.Thread(target=self._load_quietly, name="rlserve-tokenizer-load", daemon=True).start()

    def _load_quietly(self) -> None:
        try:
            self()
        except Exception as e:  # noqa: BLE001 - the caller's own call loads again and raises it
            logger.info("tokenizer prefetch failed (%s: %s): it loads again when the engine is ready",
                        type(e).__name__, e)

    def __call__(self):
        with self._lock:
            if not self._loaded:
                if not getattr(self.config, "skip_tokenizer_init", False):
                    t = time.perf_counter()
                    with no_collections_while_importing():  # transformers' tokenizer modules and torch
                        auto_tokenizer = from_transformers("AutoTokenizer")  # beside generation_defaults' import
                        self._tok = auto_tokenizer.from_pretrained(self.config.tokenizer or self.config.model)
                    log_phase(logger, "API process: tokenizer load (transformers' import included)",
                              time.perf_counter() - t, f"thread CPU {time.thread_time():.2f} s")
                self._loaded = True
            return self._tok


def build_replicas(front, config, engine_mode: str, engine_factory, weight_version: str, tokenizer=None,
                   api_server_count: int = 1, attach: dict | None = None) -> list:
    """The replicas of ``front`` (an AsyncEngine), not started: one per ``data_parallel_size``.

    Args:
        config: the :class:`~rlserve.config.EngineConfig` (each replica gets
            :func:`replica_config`'s copy; a config without ``data_parallel_size`` -- a test
            fake's -- is shared by one replica).
        engine_mode: ``"thread"`` (:class:`~rlserve.engine.front.thread_replica.ThreadReplica`, the
            engine built by ``engine_factory(cfg, dp_index)``, default ``LLMEngine``) or
            ``"process"`` (:class:`~rlserve.engine.front.core_client.CoreProcReplica`).
        weight_version: the version stamped on outputs at first.
        tokenizer: process mode: the API process's tokenizer, already loaded (:class:`TokenizerOnce`);
            None loads it. (Thread mode: the engine loads its own.)
        api_server_count / attach: see :class:`~rlserve.engine.front.async_engine.AsyncEngine`.

    Raises:
        ValueError: see :func:`replica_config`.
    """
    dp = max(1, int(getattr(config, "data_parallel_size", 1) or 1))
    cfgs = [replica_config(config, i) if hasattr(config, "data_parallel_size") else config for i in range(dp)]
    if engine_mode == "thread":
        from rlserve.engine.front.thread_replica import ThreadReplica

        if engine_factory is None:
            from rlserve.engine.core.llm_engine import LLMEngine

            def engine_factory(cfg, dp_index):
                return LLMEngine(cfg, dp_index=dp_index)

        return [ThreadReplica(front, i, lambda cfg=cfg, i=i: engine_factory(cfg, i), weight_version)
                for i, cfg in enumerate(cfgs)]
    loader = TokenizerOnce(config, tokenizer)
    if attach is not None:
        from rlserve.engine.front.core_attach import AttachedCoreReplica

        return [AttachedCoreReplica(front, i, cfg, weight_version, loader, core_dir=d,
                                    client_index=attach["client_index"])
                for i, (cfg, d) in enumerate(zip(cfgs, attach["core_dirs"]))]
    from rlserve.engine.front.core_client import CoreProcReplica

    return [CoreProcReplica(front, i, cfg, weight_version, loader, api_server_count) for i, cfg in enumerate(cfgs)]
