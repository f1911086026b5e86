"""argparse types shared by the subcommands (``rlserve serve``, ``rlserve demo``): each raises
``argparse.ArgumentTypeError`` with a message argparse prints after the flag's name (exit 2)."""

from __future__ import annotations

import argparse
import math
import shlex

from rlserve import envs


def int_at_least(minimum: int):
    """An argparse type: an integer >= ``minimum`` (:func:`rlserve.envs.int_at_least`)."""
    def parse(value: str) -> int:
        try:
            return envs.int_at_least(value, "the value", minimum)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value!r}") from None
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def port(value: str) -> int:
    """A TCP port, 0..65535 (0: a free one)."""
    try:
        n = int(value)
    except ValueError:
        n = -1
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [0, 65535] (0: a free one), got {value!r}")
    return n


def _number(value: str, ok, what: str) -> float:
    """``value`` as a float for which ``ok(x)`` holds (NaN never does), else the error saying ``what``."""
    try:
        x = float(value)
    except ValueError:
        x = math.nan
    if not ok(x):
        raise argparse.ArgumentTypeError(f"must be {what}, got {value!r}")
    return x


def positive_seconds(value: str) -> float:
    """A finite number of seconds > 0."""
    return _number(value, lambda x: 0 < x < math.inf, "a number of seconds > 0")


def non_negative_number(value: str) -> float:
    """A finite number >= 0."""
    return _number(value, lambda x: 0 <= x < math.inf, "a number >= 0")


def shell_words(value: str) -> str:
    """A string that ``shlex.split`` can split (returned as it is: the caller splits it)."""
    try:
        shlex.split(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not shell words ({e}): {value!r}") from None
    return value
