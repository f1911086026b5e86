"""Checking the server's completions against the trainer's greedy ids (near ties measured in
logits) and printing the before/after table."""

from __future__ import annotations

import shutil
import textwrap
from dataclasses import dataclass
from typing import Callable, Sequence

from rlserve.demo.client import Completion
from rlserve.demo.common import EXIT_MISMATCH, EXIT_OK


@dataclass
class Mismatch:
    """A server completion that differs from the trainer's greedy ids. ``gap`` (set by
    :func:`measure_gaps`): at the first difference, the trainer's logit of its own token minus its
    logit of the server's token, in nats; a small gap is a near tie that 16-bit rounding can flip."""

    index: int
    prompt: str
    server_ids: list[int]
    reference_ids: list[int]
    gap: float | None = None

    def near_tie(self, tolerance: float) -> bool:
        """``|gap| <= tolerance`` with ``tolerance > 0`` (0 = exact: never a tie)."""
        return tolerance > 0 and self.gap is not None and abs(self.gap) <= tolerance

    @property
    def first_difference(self) -> int:
        for i, (a, b) in enumerate(zip(self.server_ids, self.reference_ids)):
            if a != b:
                return i
        return min(len(self.server_ids), len(self.reference_ids))


def compare_completions(completions: Sequence[Completion], reference: Sequence[Sequence[int]]) -> list[Mismatch]:
    """The completions whose token ids differ from the trainer's greedy ids (empty: all equal)."""
    if len(completions) != len(reference):
        raise ValueError(f"{len(completions)} completions but {len(reference)} reference outputs")
    return [Mismatch(i, c.prompt, list(c.token_ids), list(r))
            for i, (c, r) in enumerate(zip(completions, reference)) if list(c.token_ids) != list(r)]


def measure_gaps(model, completions: Sequence[Completion], mismatches: Sequence[Mismatch]) -> None:
    """Set each mismatch's ``gap``: one trainer forward over the prompt + the common prefix."""
    import torch

    device = next(model.parameters()).device
    with torch.inference_mode():
        for m in mismatches:
            k = m.first_difference
            if k >= len(m.server_ids) or k >= len(m.reference_ids):
                m.gap = float("inf")  # one side ended early (cannot be a near tie)
                continue
            ids = list(completions[m.index].prompt_token_ids) + list(m.server_ids[:k])
            logits = model(torch.tensor([ids], dtype=torch.long, device=device)).logits[0, -1].float()
            m.gap = float(logits[m.reference_ids[k]] - logits[m.server_ids[k]])


def default_tie_tolerance(dtype: str) -> float:
    """0 (exact) in float32; 0.5 nats in 16-bit dtypes, where server and Hugging Face kernels
    round differently and a near tie between two tokens can go either way."""
    return 0.0 if dtype == "float32" else 0.5


def describe_mismatches(mismatches: Sequence[Mismatch], decode: Callable[[list[int]], str] | None = None) -> str:
    lines = []
    for m in mismatches:
        k = m.first_difference
        gap = f"; trainer logit gap there {m.gap:.3f}" if m.gap is not None else ""
        lines.append(f"  [{m.index}] {m.prompt!r}: first difference at generated token {k} "
                     f"(server {m.server_ids[k:k + 1]}, trainer {m.reference_ids[k:k + 1]}{gap})")
        if decode is not None:
            lines.append(f"      server : {decode(m.server_ids)!r}")
            lines.append(f"      trainer: {decode(m.reference_ids)!r}")
    return "\n".join(lines)


def verdict(mismatches: Sequence[Mismatch], n_prompts: int, tie_tolerance: float, dtype: str,
            allow_mismatch: bool = False, decode: Callable[[list[int]], str] | None = None
            ) -> tuple[int, list[bool | str], list[str]]:
    """The demo's conclusion from its mismatches (gaps measured: :func:`measure_gaps`).

    Args:
        mismatches: :func:`compare_completions`' list.
        n_prompts: how many completions were compared.
        tie_tolerance: the logit gap (nats) up to which a first difference is a near tie (rounding
            of ``dtype``, not a failed sync); 0: every difference counts.
        dtype: the server's dtype (named in the messages).
        allow_mismatch: exit 0 even when completions differ beyond rounding.
        decode: token ids -> text, for the mismatches' description (``None``: ids only).

    Returns:
        ``(exit code, marks, lines)``: :data:`EXIT_OK`, or :data:`EXIT_MISMATCH` when a completion
        differs beyond rounding; per prompt ``True`` (equal), ``False`` (differs) or ``"near tie"``
        (:func:`format_table`'s ``matches``); the log lines that say so.
    """
    ties = [m for m in mismatches if m.near_tie(tie_tolerance)]
    real = [m for m in mismatches if not m.near_tie(tie_tolerance)]
    marks: list[bool | str] = [True] * n_prompts
    for m in mismatches:
        marks[m.index] = "near tie" if m.near_tie(tie_tolerance) else False
    if not mismatches:
        return EXIT_OK, marks, [f"[demo] OK: all {n_prompts} server completions equal the trainer's greedy "
                                "generate, token for token"]
    lines = [f"[demo] {len(mismatches)} of {n_prompts} server completions differ from the trainer's greedy "
             f"generate:\n{describe_mismatches(mismatches, decode)}"]
    if ties:
        lines.append(f"[demo] {len(ties)} of them first differ at a near tie (trainer logit gap <= {tie_tolerance} "
                     f"nats, within {dtype} rounding); --tie-tolerance 0 makes them count")
    if real:
        lines.append(f"[demo] MISMATCH: {len(real)} completion(s) differ beyond rounding"
                     + (" (--allow-mismatch: exit 0)" if allow_mismatch else ""))
    else:
        lines.append(f"[demo] OK within {dtype} rounding: {n_prompts - len(ties)} of {n_prompts} equal token for "
                     f"token, {len(ties)} first differ at a near tie")
    return (EXIT_OK if allow_mismatch or not real else EXIT_MISMATCH), marks, lines


def _clip(s: str, width: int) -> str:
    s = repr(s)[1:-1]
    return s if len(s) <= width else s[: max(0, width - 1)] + "…"


def versions_line(before: Sequence[Completion] | None, after: Sequence[Completion]) -> str:
    """The ``weight_version`` each answer came back with (what the server says produced it), in
    prompt order: ``"weight version of each answer: before sync 0 0 0 0, after sync 2 2 2 2"``
    (``?`` where an answer carried none)."""
    def vs(cs: Sequence[Completion]) -> str:
        return " ".join(c.weight_version if c.weight_version is not None else "?" for c in cs)
    parts = ([f"before sync {vs(before)}"] if before is not None else []) + [f"after sync {vs(after)}"]
    return "weight version of each answer: " + ", ".join(parts)


def format_table(prompts: Sequence[str], before: Sequence[Completion] | None, after: Sequence[Completion],
                 matches: Sequence[bool | str] | None = None, width: int | None = None) -> str:
    """A before/after table (texts clipped to the terminal width), the weight version of each answer
    (:func:`versions_line`), then the full texts after the sync."""
    width = width or shutil.get_terminal_size((120, 24)).columns
    width = max(80, min(width, 200))
    pw = max(len("prompt"), min(max(len(repr(p)) - 2 for p in prompts), 38))
    mark_w = len(" | = trainer") if matches is not None else 0
    cols = 2 if before is not None else 1
    tw = max(12, (width - pw - mark_w - 3 * cols) // cols)
    head = [f"{'prompt':<{pw}}"]
    if before is not None:
        head.append(f"{'before sync (dummy weights)':<{tw}}")
    head.append(f"{'after sync (trainer weights)':<{tw}}")
    if matches is not None:
        head.append("= trainer")
    sep = " | "
    rows = [sep.join(head), "-" * min(width, len(sep.join(head)) + 2)]
    for i, p in enumerate(prompts):
        cells = [f"{_clip(p, pw):<{pw}}"]
        if before is not None:
            cells.append(f"{_clip(before[i].text, tw):<{tw}}")
        cells.append(f"{_clip(after[i].text, tw):<{tw}}")
        if matches is not None:
            m = matches[i]
            cells.append(m if isinstance(m, str) else ("yes" if m else "NO"))
        rows.append(sep.join(cells))
    rows.append("")
    rows.append(versions_line(before, after))
    rows.append("after the sync, in full:")
    for i, p in enumerate(prompts):
        rows.append(textwrap.fill(f"{p!r} -> {after[i].text!r}", width=width, subsequent_indent="    "))
    return "\n".join(rows)


