"""``--help`` formatting shared by the subcommands."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, minus the noise: ``(default: X)`` is appended only when a
    flag has a default worth stating (not None or empty, not an on/off switch's False) and its help does
    not state one itself (and so never prints a secret taken from the environment)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default is None or default is argparse.SUPPRESS or default == "" or isinstance(default, bool) and action.nargs == 0
                or "default" in text or "%(default)" in text):
            return text
        return super()._get_help_string(action)
