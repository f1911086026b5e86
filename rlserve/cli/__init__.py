"""``rlserve`` command line: one module per subcommand under ``rlserve/cli/``.

A subcommand module (e.g. ``rlserve/cli/serve.py``) defines::

    def register(subparsers: argparse._SubParsersAction) -> None:
        p = subparsers.add_parser("NAME", help="...")
        ...                      # its flags
        p.set_defaults(func=run)  # run(args) -> int exit status

and is found automatically (modules whose name starts with ``_`` are skipped). A module
that fails to import is reported on ``--help`` instead of breaking the other commands.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

# Subcommands listed first in --help, in this order; others follow alphabetically.
_ORDER = ("serve", "demo", "download", "bench")


def _subcommand_modules() -> list[str]:
    names = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    return sorted(names, key=lambda n: (_ORDER.index(n) if n in _ORDER else len(_ORDER), n))


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every importable subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="rlserve",
        description="rlserve: LLM inference server for RL post-training (OpenAI API, TRL protocol, weight sync).",
    )
    from rlserve import __version__

    parser.add_argument("--version", action="version", version=f"rlserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", help="run `rlserve COMMAND --help` for its flags")
    broken = []
    for name in _subcommand_modules():
        try:
            mod = importlib.import_module(f"{__name__}.{name}")
        except Exception as e:  # noqa: BLE001 - one broken subcommand must not hide the others
            broken.append(f"{name} ({type(e).__name__}: {e})")
            continue
        register = getattr(mod, "register", None)
        if callable(register):
            register(sub)
    if broken:
        parser.epilog = "unavailable subcommands: " + "; ".join(broken)
    return parser


def _subparser(parser: argparse.ArgumentParser, name: str | None) -> argparse.ArgumentParser:
    """The subcommand ``name``'s parser (``parser`` itself when there is none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    return parser


def _unrecognized(parser: argparse.ArgumentParser, args, unknown: list[str]) -> None:
    """Exit 2 naming the unrecognized arguments. Where each flag among them is a ``vllm serve``
    0.32 flag (:mod:`rlserve.cli.vllm_flags`), one line per flag says so (and why it is refused,
    e.g. ``--api-server-count``); else the subcommand's usage (one line: its full usage lists ~80
    flags), the error and, per flag, the closest flags the subcommand has (difflib, cutoff 0.6) or
    the vLLM line."""
    import difflib

    from rlserve.cli.vllm_flags import refused_hint

    sub = _subparser(parser, getattr(args, "command", None))
    flags = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    named = [arg.split("=", 1)[0] for arg in unknown if arg.startswith("-")]
    vllm = {flag: refused_hint(flag) for flag in named if sub is not parser}
    if named and all(vllm.values()):  # only vLLM flags (and their values): nothing else to say
        sub.exit(2, "".join(f"{sub.prog}: error: {vllm[flag]}\n" for flag in dict.fromkeys(named)))
    hints = []
    for flag in named:
        near = difflib.get_close_matches(flag, flags, n=3, cutoff=0.6)
        if vllm.get(flag):
            hints.append(vllm[flag])
        elif near:
            hints.append(f"{flag}: did you mean {' or '.join(near)}?")
    usage = f"usage: {sub.prog} [MODEL] [FLAGS ...] (`{sub.prog} --help` lists every flag)" if sub is not parser \
        else sub.format_usage().rstrip("\n")
    lines = [usage, f"{sub.prog}: error: unrecognized arguments: {' '.join(unknown)}", *hints]
    sub.exit(2, "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rlserve`` script and ``python -m rlserve``. Returns the exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # (rlserve serve --api-server-count: its other processes)
    if unknown:
        _unrecognized(parser, args, unknown)  # exits 2
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        rc = func(args)
    except KeyboardInterrupt:
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
