"""A kit for a project's own test suite: an isolated limiter whose clock the test moves, the switch, the 429 contract.

- :func:`limiter`: a fresh limiter for one test, on the in-process ``memory`` backend, with a
  clock that moves only when the test says (``advance``); the project's policies apply.
- :func:`disabled`: ``RATELIMITS['ENABLED']`` off: every request admitted, unasked.
- :func:`assert_rate_limited`, :func:`assert_not_rate_limited`: the 429 contract, checked
  against the project's own OpenAPI schema when drf-spectacular generates it.
- :mod:`ratelimits.testing.pytest`: the same as pytest fixtures, for a project that enables them.

Importing it needs neither pytest, Redis nor a network (docs/testing.md).
"""

from .assertions import assert_not_rate_limited, assert_rate_limited
from .isolation import FakeClock, IsolatedLimiter, disabled, limiter

__all__ = [
    "FakeClock",
    "IsolatedLimiter",
    "assert_not_rate_limited",
    "assert_rate_limited",
    "disabled",
    "limiter",
]
