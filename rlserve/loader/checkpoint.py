"""Find and stream the tensors of a Hugging Face checkpoint directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch


def checkpoint_files(path: str | Path, load_format: str = "auto") -> tuple[str, list[Path]]:
    """The weight files of a checkpoint directory.

    Args:
        path: model directory.
        load_format: "auto" (safetensors, else ``pytorch_model*.bin`` / ``*.pt``), "safetensors"
            or "pt".

    Returns:
        ``("safetensors" | "pt", sorted files)``. A ``*.index.json`` weight map, when present,
        decides which files belong to the checkpoint (so e.g. Mistral's extra
        ``consolidated.safetensors`` is not read twice).

    Raises:
        FileNotFoundError: the directory is missing or holds no weights of that format.
        ValueError: an unknown ``load_format``.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(root)!r} does not exist")
    if load_format not in ("auto", "safetensors", "pt"):
        raise ValueError(f"load_format must be auto, safetensors or pt to read files, got {load_format!r}")
    if load_format in ("auto", "safetensors"):
        files = _indexed(root, "model.safetensors.index.json") or sorted(root.glob("*.safetensors"))
        if len(files) > 1:
            files = [f for f in files if not f.name.startswith("consolidated")] or files
        if files:
            return "safetensors", files
        if load_format == "safetensors":
            raise FileNotFoundError(f"no *.safetensors files in {str(root)!r}")
    files = _indexed(root, "pytorch_model.bin.index.json") or sorted(root.glob("pytorch_model*.bin"))
    if not files:
        files = sorted(root.glob("*.pt"))
    if not files:
        raise FileNotFoundError(f"no weights (*.safetensors, pytorch_model*.bin, *.pt) in {str(root)!r}")
    return "pt", files


def _indexed(root: Path, index_name: str) -> list[Path]:
    index = root / index_name
    if not index.exists():
        return []
    weight_map = json.loads(index.read_text())["weight_map"]
    return [root / f for f in sorted(set(weight_map.values()))]


def iterate_checkpoint(path: str | Path, load_format: str = "auto") -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(name, tensor)`` pairs (full tensors, on CPU, checkpoint dtype) of a checkpoint.

    The files are located eagerly (errors raise at call time); tensors are read lazily, one
    file open at a time (safetensors via ``safe_open``; ``.bin`` via
    ``torch.load(weights_only=True)``).

    Raises:
        FileNotFoundError / ValueError: see :func:`checkpoint_files`.
    """
    kind, files = checkpoint_files(path, load_format)
    return _iter_safetensors(files) if kind == "safetensors" else _iter_pt(files)


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def _iter_pt(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        try:
            state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # legacy (non-zip) format cannot be mmapped
            state = torch.load(f, map_location="cpu", weights_only=True)
        if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
            state = state["state_dict"]
        for name, tensor in state.items():
            if isinstance(tensor, torch.Tensor):
                yield name, tensor
        del state
