"""The endpoint names this project knows: what its routes are limited as, and what its policies name.

A request is limited as an endpoint named by its view (``throttle_scope``, or ``@ratelimit``'s
scope), else by its route's name, else by the view's dotted path (``ratelimits.drf.endpoint_name``
and the middleware name it so). Policies may also name endpoints no route serves yet. Anything else
names nothing: ``GET /rate_limit`` refuses it rather than report the default limits of a name no
request ever has.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import Any

from django.urls import URLPattern, URLResolver, get_resolver, get_urlconf

from .policies.source import get_policy_source

__all__ = ["is_known_endpoint", "known_endpoints"]


def known_endpoints() -> frozenset[str]:
    """Every endpoint name of the current URLconf and of the policy source's endpoint rules."""
    rules = get_policy_source().snapshot().endpoints
    # Rules are keyed "METHOD endpoint" or "endpoint" (any method).
    named = {key.partition(" ")[2] or key for key in rules}
    return _route_endpoints(get_resolver(get_urlconf())) | named


def is_known_endpoint(name: str) -> bool:
    if name in _route_endpoints(get_resolver(get_urlconf())):
        return True  # the common case, without building the policies' set
    return name in known_endpoints()


@functools.lru_cache(maxsize=8)
def _route_endpoints(resolver: URLResolver) -> frozenset[str]:
    """The names of every route of ``resolver``: read once per URLconf (they never change in a process)."""
    return frozenset(_walk(resolver.url_patterns, ()))


def _walk(patterns: Iterable[Any], namespaces: tuple[str, ...]) -> Iterator[str]:
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            inner = (*namespaces, pattern.namespace) if pattern.namespace else namespaces
            yield from _walk(pattern.url_patterns, inner)
        elif isinstance(pattern, URLPattern):
            callback = pattern.callback
            view = getattr(callback, "view_class", None) or getattr(callback, "cls", None) or callback
            scope = getattr(view, "throttle_scope", None) or getattr(callback, "ratelimit_scope", None)
            if scope:
                yield str(scope)
            # The route's view name, as Django's ResolverMatch makes it.
            path = pattern.name or f"{view.__module__}.{getattr(view, '__name__', type(view).__name__)}"
            yield ":".join((*namespaces, path))
