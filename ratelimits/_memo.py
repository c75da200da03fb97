"""Bounded memos for the hot path: what a decision computes once and reads again and again.

A memo is a plain dict emptied whole when full. Dropping it all is cheaper on the hot path than
keeping an LRU order, and the callers that matter come back at once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["MEMO_SIZE", "memoize", "remember"]

K = TypeVar("K")
T = TypeVar("T")

#: Entries kept by each hot-path memo before it starts over; bounds memory under address churn.
MEMO_SIZE = 65_536


def remember(memo: dict[K, T], key: K, value: T) -> T:
    """Keep ``value`` under ``key`` in a hot-path memo, which is emptied first when full."""
    if len(memo) >= MEMO_SIZE:
        memo.clear()
    memo[key] = value
    return value


def memoize(func: Callable[..., T]) -> Callable[..., T]:
    """Cache a pure function of hashable arguments in a memo of its own (:func:`remember`'s rule).

    Hashing identities and parsing addresses cost more than the rest of a decision's Python;
    the same callers come back again and again.
    """
    cache: dict[tuple[Any, ...], T] = {}

    @functools.wraps(func)
    def wrapper(*args: Any) -> T:
        try:
            return cache[args]
        except KeyError:
            return remember(cache, args, func(*args))

    return wrapper
