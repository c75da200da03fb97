"""The engine: a request's checks decided by the store behind a circuit breaker, with fail modes and shedders.

- :mod:`.evaluation`: one request, from its identity to its decision, and the slots it holds.
- :mod:`.limiter`: the backend behind the breaker; each policy's fail mode when it cannot answer.
- :mod:`.breaker`: the per-process circuit breaker.
- :mod:`.shedding`: the worker utilisation shedder, which needs no store.
- :mod:`.gauges`: what the engine tells the metrics at each flush.
"""

from __future__ import annotations

from .._process import ProcessWide
from ..policies.source import get_policy_source
from .breaker import BreakerState, CircuitBreaker
from .evaluation import evaluate, usage_of
from .holding import after_response
from .limiter import Limiter, get_limiter
from .shedding import WorkerShedder, get_worker_shedder

# Imported for its effect: the metrics sample the engine's gauges at each flush.
from . import gauges  # noqa: F401  isort: skip

__all__ = [
    "BreakerState",
    "CircuitBreaker",
    "Limiter",
    "WorkerShedder",
    "after_response",
    "evaluate",
    "get_limiter",
    "get_policy_source",
    "get_worker_shedder",
    "reset",
    "usage_of",
]


def reset() -> None:
    """Forget the process's limiter, backend, policy source and shedder: the next request rebuilds them.

    All together, always (as a change of the settings does): the limiter holds the backend, so
    forgetting one alone would leave two backends in the process.
    """
    ProcessWide.reset_all()
