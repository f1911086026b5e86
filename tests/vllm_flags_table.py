"""docs/vllm-flags.md: every ``rlserve serve`` flag against ``vllm serve``'s (vLLM 0.32):
supported, no-op (one warning line), partly (some values refused with a message saying why),
rlserve's own; and the ``vllm serve`` flags rlserve refuses (unrecognized: ``rlserve serve``'s usage
and a "did you mean"). Made from the real parser (:func:`rlserve.cli.build_parser`) and
:data:`rlserve.cli.vllm_compat.NOOP_FLAGS` / ``LIMITED_FLAGS``; ``tests/test_vllm_flags_table.py``
fails when the page is stale and checks :data:`VLLM_032_SERVE_FLAGS` against vLLM's own parser.

Regenerate: ``PYTHONPATH=. python -m tests.vllm_flags_table > docs/vllm-flags.md``.
"""

from __future__ import annotations

import argparse

from rlserve.cli.vllm_flags import VLLM_032_SERVE_FLAGS  # the page's vLLM column


def vllm_serve_flags() -> list[str]:
    """The installed vLLM's ``vllm serve`` flags, sorted (run in a Python that has vLLM)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    return sorted({o for a in parser._actions for o in a.option_strings if o.startswith("--")})


def serve_actions() -> list[argparse.Action]:
    """``rlserve serve``'s flag actions (not ``--help``, not the positional MODEL)."""
    from rlserve.cli import _subparser, build_parser

    sub = _subparser(build_parser(), "serve")
    return [a for a in sub._actions if any(o.startswith("--") for o in a.option_strings) and a.dest != "help"]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The page's markdown."""
    from rlserve.cli.vllm_compat import LIMITED_FLAGS, NOOP_FLAGS

    vllm = set(VLLM_032_SERVE_FLAGS)
    rows, ours = [], set()
    for a in sorted(serve_actions(), key=lambda a: a.option_strings[0].lstrip("-")):
        names = [o for o in a.option_strings if o.startswith("--")]
        ours.update(names)
        flag = names[0]
        if flag in NOOP_FLAGS:
            status = "no-op, one warning line: " + NOOP_FLAGS[flag]
        elif flag in LIMITED_FLAGS:
            status = "partly: " + LIMITED_FLAGS[flag]
        else:
            status = "supported"
        in_vllm = "yes" if vllm & set(names) else "no"
        shown = ", ".join(f"`{o}`" for o in a.option_strings)
        rows.append(f"| {shown} | {in_vllm} | {_cell(status)} |")
    refused = [f for f in VLLM_032_SERVE_FLAGS if f not in ours
               and not (f.startswith("--no-") and "--" + f[5:] in vllm and "--" + f[5:] not in ours)]
    out = [
        "# `rlserve serve` flags against `vllm serve` (vLLM 0.32)",
        "",
        "Generated from rlserve's parser by `PYTHONPATH=. python -m tests.vllm_flags_table > docs/vllm-flags.md`",
        "(`tests/test_vllm_flags_table.py` fails when this page is stale; the vLLM column is vLLM 0.32's",
        "`vllm serve` parser). [flags.md](flags.md) explains each flag; back to the [README](../README.md).",
        "",
        "| `rlserve serve` flag | in `vllm serve` 0.32 | rlserve |",
        "|---|---|---|",
        *rows,
        "",
        f"The other {len(refused)} `vllm serve` flags are refused: `rlserve serve` exits 2 with one line naming",
        "the flag as a `vllm serve` flag it does not implement.",
        "",
        "<details><summary>the refused flags</summary>",
        "",
        ", ".join(f"`{f}`" for f in refused),
        "",
        "</details>",
    ]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
