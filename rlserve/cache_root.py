"""Where rlserve keeps what it builds or fetches: :func:`default_cache_root`.

Its own module, importing nothing of rlserve but :mod:`rlserve.envs`, so that the CPU kernels' cache
(:mod:`rlserve.layers.cpu_build`, ``<root>/kernels/``) does not import the model download's modules
(:mod:`rlserve.download`, which re-exports this function, :mod:`rlserve.default_model`,
:mod:`rlserve.gguf_source`) into the engine-core process.
"""

from __future__ import annotations

import os
from pathlib import Path

from rlserve import envs


def default_cache_root() -> Path:
    """``$RLSERVE_CACHE``, else ``$XDG_CACHE_HOME/rlserve``, else ``~/.cache/rlserve``."""
    env = envs.RLSERVE_CACHE
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "rlserve"
