"""The prestarted engine-core process's first half (``python -m rlserve.engine.core.core_proc
--prestarted DEVICE``, :func:`rlserve.engine.front.core_spawn.prestart_cores`): the imports that do not
depend on the replica's arguments (:func:`warm_up_imports`), then :func:`prestarted_main` reads those
arguments from stdin and runs ``main`` (:func:`rlserve.engine.core.core_proc.main`). Moved out of ``core_proc``
(session 23), which re-exports both names."""

from __future__ import annotations

import importlib
import logging
import sys
import time

from rlserve import envs

logger = logging.getLogger("rlserve.engine.core.core_proc")


def prestarted_main(main) -> int:
    """``core_proc --prestarted``: started before the API process knows this replica's arguments
    (:func:`rlserve.engine.front.core_spawn.prestart_cores`): import the engine now, then read the
    arguments (a JSON list of :func:`main`'s argv) from stdin and run :func:`main`; stdin's end
    before them: exit 0 (the server did not start)."""
    import json

    from rlserve.gc_heap import no_collections_while_importing

    t0 = time.perf_counter()
    with no_collections_while_importing():
        parts = warm_up_imports(sys.argv[2] if len(sys.argv) > 2 else "cpu")
    t1 = time.perf_counter()
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    return main(json.loads(line), prestarted=(t1 - t0, time.perf_counter() - t1, parts))


#: Hugging Face config modules a prestarted core imports: ``AutoConfig`` imports the model's on its first
#: call, and transformers 5's pull in its weight-conversion code and ``torch.distributed.tensor`` (shared by
#: every architecture: 3.0 s of a 3.5 s ``AutoConfig.from_pretrained`` on the 2-core CPU machine,
#: 2026-12-06, after ``import transformers``); the architecture's own module is small
_CONFIG_MODULES = ("transformers.models.qwen3.configuration_qwen3", "transformers.models.llama.configuration_llama")


def warm_up_imports(device: str) -> list[tuple[str, float]]:
    """What a prestarted core does before its arguments come (none of it depends on them): import the
    engine (torch, transformers, the worker, model runner, loader, layers) and, where ``device`` (the
    server's ``--device``) may be a GPU and ``RLSERVE_GPU_START_OVERLAP=1``: load the CUDA driver (no context: the device is not chosen yet;
    ``torch.cuda.init`` makes none) and Triton's one-time hash of its own sources (``triton_key``, the
    first part of every kernel's cache key: 0.35 s on the H100 machine in session 14's profile, 1.5 s on
    the 2-core CPU machine). A failure here is left for the real start to meet and report.

    Returns ``[(part, seconds)]`` in order, for the start-up line (wall-clock seconds of each part:
    ``torch``, ``engine modules`` (rlserve's engine, ZMQ; not transformers' tokenizer code: the core
    loads its tokenizer after ready, :mod:`rlserve.engine.core.core_tokenizer`), ``transformers
    configs`` (:data:`_CONFIG_MODULES`), then ``CUDA init`` and ``Triton import + key`` where they ran), and last
    ``CPU`` (this process's CPU seconds so far: well below the parts' sum means the imports waited on the
    disk)."""
    parts: list[tuple[str, float]] = []
    t = time.perf_counter()

    def mark(what: str) -> None:
        nonlocal t
        now = time.perf_counter()
        parts.append((what, now - t))
        t = now

    import torch

    mark("torch")
    import zmq  # noqa: F401

    from rlserve.engine.core import engine_core, llm_engine  # noqa: F401
    from rlserve.engine.worker import worker  # noqa: F401
    from rlserve.models import registry  # noqa: F401

    mark("engine modules")
    for name in _CONFIG_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - another transformers version: AutoConfig imports what it needs
            pass
    mark("transformers configs")
    if not device.startswith("cpu") and envs.RLSERVE_GPU_START_OVERLAP:
        try:
            if torch.cuda.is_available():
                torch.cuda.init()
                mark("CUDA init")
                try:
                    from triton.runtime.cache import triton_key
                except ImportError:  # Triton before 3.5 kept it in the compiler
                    from triton.compiler.compiler import triton_key
                triton_key()
                mark("Triton import + key")
        except Exception:  # noqa: BLE001 - e.g. no Triton, or an older one without triton_key
            logger.debug("prestarted engine core: CUDA / Triton warm-up skipped", exc_info=True)
    parts.append(("CPU", time.process_time()))
    return parts
