"""Charges that follow the response: what an endpoint does not count given back, a cost trued up or down.

An endpoint's rule may say which of its responses are charged (``counts``: every one, successes,
client errors, or all but the server's errors) and how far a view may true a request's cost up
(``max_cost``; the view sets ``request.ratelimit_cost``). Such a request is decided as any other,
at the endpoint's ``cost``, in its one round trip: the decision also records what each rate
check spent (:attr:`~ratelimits.decisions.Decision.spent`). Once its response is closed
(:mod:`.holding`), what it cost in the end is settled in one more store call, off the response's
path:

- a response the endpoint does not count costs nothing: every check's spend is given back;
- a view that set ``request.ratelimit_cost`` (0 to ``max_cost``) is charged that: the difference
  from the cost it was admitted at is given back, or charged.

A give-back never creates a token the request did not spend, nor one time has refilled since
(``lua/refund.lua``). A charge is made whether or not the limit has room, since the view has
run: a debt the caller's next requests wait for. So over time a caller is held to its limit
exactly; at one moment, what requests admitted before their true-ups landed can exceed it by at
most ``(max_cost - cost)`` per request in flight (docs/charging.md).

Best effort, as a slot's release is: the store unreachable, or its breaker open, the request
keeps the charge it was admitted at (logged). A request decided without the store (a fail mode)
spent nothing there, and has nothing to settle.
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..choices import Counts
from ..counters import Usage
from ..decisions import Decision

if TYPE_CHECKING:
    from ..policies.values import Check, EndpointRule
    from .limiter import Limiter

__all__ = ["COST_ATTRIBUTE", "Settlement", "cost_in_the_end", "settle", "tell_once"]

logger = logging.getLogger("ratelimits")

#: The request attribute a view sets to the cost its request really had (an ``int``, 0 to the
#: endpoint's ``max_cost``), on the request it was given: Django's, or DRF's.
COST_ATTRIBUTE = "ratelimit_cost"


@dataclass(slots=True)
class Settlement:
    """What settling an admitted request needs once its response is closed."""

    endpoint: str
    rule: EndpointRule
    #: The request's usage row, counted at the cost it was admitted at (``None``: not counted).
    usage: Usage | None
    #: The request its view was given (DRF's or Django's), where the view may set its cost.
    request: weakref.ref[Any]
    #: The check whose store call counted the request's usage (the first: on a cluster, its group's).
    counted_by: Check | None = None
    #: The response's status, once a middleware or decorator of this app saw it.
    status: int | None = None


def settle(limiter: Limiter, decision: Decision, settlement: Settlement) -> None:
    """Settle an admitted request's charge after its response: give back or charge the difference
    between what it was admitted at and what it cost in the end."""
    rule = settlement.rule
    final = cost_in_the_end(settlement)
    if final == rule.cost:
        return
    changes = [(spent, _scaled(spent.tokens, rule.cost, final) - spent.tokens) for spent in decision.spent]
    usage = settlement.usage
    tokens = 0 if usage is None else _scaled(usage.tokens, rule.cost, final) - usage.tokens
    changed = [(spent, change) for spent, change in changes if change]
    limiter.settle(changed, usage, tokens, counted_by=settlement.counted_by)


def cost_in_the_end(settlement: Settlement) -> int:
    """What the request cost, all told: 0 for a response its endpoint does not count, else what
    its view said (within 0 and ``max_cost``), else the endpoint's cost."""
    rule = settlement.rule
    if rule.counts is not Counts.ALL:
        status = settlement.status if settlement.status is not None else _drf_status(settlement.request())
        if status is None:
            tell_once(
                settlement.endpoint,
                "no response status was seen (add ratelimits.middleware.RateLimitMiddleware to MIDDLEWARE): "
                "every response is charged",
            )
        elif not rule.counts.counts(status):
            return 0
    asked = _asked_cost(settlement.request())
    if asked is None:
        return rule.cost
    if rule.max_cost is None:
        tell_once(
            settlement.endpoint,
            f"a view set request.{COST_ATTRIBUTE}, but the endpoint has no max_cost: it costs {rule.cost}",
        )
        return rule.cost
    if isinstance(asked, bool) or not isinstance(asked, int) or asked < 0:
        tell_once(
            settlement.endpoint,
            f"request.{COST_ATTRIBUTE} = {asked!r} is not a number of tokens from 0 to max_cost: it costs {rule.cost}",
        )
        return rule.cost
    if asked > rule.max_cost:
        tell_once(
            settlement.endpoint,
            f"request.{COST_ATTRIBUTE} = {asked} is more than its max_cost: it costs {rule.max_cost}",
        )
        return rule.max_cost
    return asked


def _scaled(tokens: int, cost: int, final: int) -> int:
    """What ``tokens`` spent at an endpoint's ``cost`` come to at ``final``: ``final`` for the
    request's own checks and its usage row (each spends the cost), in proportion for others (a
    view's own limits, each with a cost of its own)."""
    return final if tokens == cost else math.ceil(tokens * final / cost)


def _asked_cost(request: Any) -> Any:
    """The cost the view set on its request (DRF's, or the Django request inside), or ``None``."""
    if request is None:
        return None
    asked = vars(request).get(COST_ATTRIBUTE)
    inner = vars(request).get("_request")  # a DRF Request's own, or none
    if asked is None and inner is not None:
        asked = vars(inner).get(COST_ATTRIBUTE)
    return asked


def _drf_status(request: Any) -> int | None:
    """A DRF view's response status, where no middleware of this app saw it: the view keeps its
    response (``APIView.dispatch`` sets ``view.response``); a view that has none raised what its
    exception handler did not answer, and Django answers 500."""
    context = getattr(request, "parser_context", None) if request is not None else None
    view = context.get("view") if isinstance(context, dict) else None
    if view is None:
        return None
    status = getattr(getattr(view, "response", None), "status_code", None)
    return status if isinstance(status, int) else 500


#: Endpoints whose settlement has been logged about, and why: once per process.
_told: set[tuple[str, str]] = set()


def tell_once(endpoint: str, why: str) -> None:
    """Log why a request to ``endpoint`` is not settled as asked: once per process and reason."""
    if (endpoint, why) in _told or len(_told) > 1_000:
        return
    _told.add((endpoint, why))
    logger.warning("ratelimits: settling a request to %s: %s (logged once)", endpoint, why)
