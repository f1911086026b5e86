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

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def max_model_len(value: str) -> int:
    """``--max-model-len`` as vLLM 0.32 reads it (``human_readable_int_or_auto``,
    ``vllm/utils/argparse_utils.py``): ``-1`` or ``auto`` (-1: fit the KV cache,
    :func:`rlserve.kv_size.fit_max_model_len`), an integer >= 1, or one with a suffix: ``k`` / ``m`` /
    ``g`` / ``t`` decimal (``25.6k`` = 25,600), ``K`` / ``M`` / ``G`` / ``T`` binary (``1K`` = 1,024;
    whole numbers only)."""
    text = value.strip()
    if text == "-1" or text.lower() == "auto":
        return -1
    n = None
    if len(text) > 1 and text[-1] in _DECIMAL and text[:-1].replace(".", "", 1).isdigit():
        n = int(float(text[:-1]) * _DECIMAL[text[-1]])
    elif len(text) > 1 and text[-1] in _BINARY and text[:-1].isdigit():
        n = int(text[:-1]) * _BINARY[text[-1]]
    elif text.isdigit():
        n = int(text)
    if n is None or n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 (or 1k, 1K, 25.6k ...), or -1 / auto (fit the KV "
                                         f"cache), got {value!r}")
    return n


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
