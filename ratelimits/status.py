"""The caller's current limits without consuming anything (GitHub's ``GET /rate_limit``)."""

from __future__ import annotations

import math
from typing import Any

from rest_framework.request import Request

from .engine import evaluate

__all__ = ["current_limits"]


def current_limits(request: Request, *, endpoint: str) -> dict[str, Any]:
    """Every policy that applies to ``request`` on ``endpoint``, with what is left right now."""
    identity, decision = evaluate(request, endpoint=endpoint, auth=request.auth, user=request.user, consume=False)
    resources = []
    for result in decision.results:
        # A peek reports what would remain after one more request; add that request back.
        remaining = result.remaining + result.check.cost if result.allowed else result.remaining
        policy = result.check.policy
        resources.append(
            {
                "policy": policy.name,
                "subject": result.check.subject.kind,
                "description": policy.describe(),
                "algorithm": policy.algorithm.value,
                "limit": result.limit,
                "remaining": min(remaining, result.limit),
                "used": max(result.limit - remaining, 0),
                "reset": math.ceil((decision.now_us + result.reset_us) / 1_000_000),
                "window_seconds": policy.window_seconds,
                "cost": result.check.cost,
            }
        )
    from .views import today_usage

    return {
        "endpoint": endpoint,
        "degraded": decision.degraded,
        "resources": resources,
        "today": today_usage(identity),
    }
