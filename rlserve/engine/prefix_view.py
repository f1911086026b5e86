"""A read-only view of a growing list's first ``n`` items: what a streamed request's unfinished
``CompletionOutput.token_ids`` / ``logprobs`` carry (issue 37).

:class:`~rlserve.engine.front.output_processor.OutputProcessor` builds one cumulative output per
streamed request and engine step. Copying the sample's token list (and logprobs list) into each
made that O(output length) per step, O(length^2) per stream (at 2048 output tokens most of the
per-event work; ``benchmarks/api_output_step.py --start-len``). Those lists only grow by appends
(tokens and logprobs are cut only on the step that finishes the sample, before any output of that
step is built), so ``PrefixView(lst, len(lst))`` stays equal to the list it saw: O(1) to build.

Who gets a view: only the unfinished outputs that rlserve's own routes read
(``AsyncEngine.generate(..., views=True)``); they slice, ``len`` and iterate them. A finished
output, and every output another caller of ``AsyncEngine.generate`` gets, holds plain lists
(:func:`plain_lists`).
"""

from __future__ import annotations

from itertools import islice
from typing import Any


class PrefixView:
    """The first ``n`` items of ``items`` (a list that only grows by appends), read-only.

    ``len``, indexing (an int, negative ones counted from ``n``; ``IndexError`` past either end),
    slices (a new plain ``list``, O(slice length)), iteration, truth, ``==`` with a list or another
    view (item by item), ``repr`` as the list's. Not hashable, like a list. No JSON encoding: a
    consumer that serialises one takes a slice (a list) or :meth:`tolist` first.
    """

    __slots__ = ("_items", "_n")

    def __init__(self, items: list, n: int):
        self._items = items
        self._n = n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)  # (bounds within the first n)
            if step == 1:
                return self._items[start:stop]
            return [self._items[k] for k in range(start, stop, step)]  # (a stop of -1 means "before 0" here)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("list index out of range")
        return self._items[i]

    def __iter__(self):
        return islice(self._items, self._n)

    def tolist(self) -> list:
        """The items, as a new list (O(n))."""
        return self._items[:self._n]

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, PrefixView):
            other = other.tolist()
        if not isinstance(other, list):
            return NotImplemented
        return len(other) == self._n and self.tolist() == other

    __hash__ = None  # type: ignore[assignment]  (a list's rule)

    def __repr__(self) -> str:
        return repr(self.tolist())


def plain_lists(out):
    """Replace ``out`` 's (a ``RequestOutput``) views by lists, in place, and return it: what a caller
    outside rlserve's routes gets (O(output length), paid only there)."""
    for c in out.outputs:
        if type(c.token_ids) is PrefixView:
            c.token_ids = c.token_ids.tolist()
        if type(c.logprobs) is PrefixView:
            c.logprobs = c.logprobs.tolist()
    return out
