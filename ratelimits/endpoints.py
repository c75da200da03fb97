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
from typing import Any, NamedTuple

from django.urls import URLPattern, URLResolver, get_resolver, get_urlconf

from .policies.source import get_policy_source

__all__ = ["DrfRoute", "drf_routes", "is_known_endpoint", "known_endpoints", "route_endpoints"]


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


def route_endpoints() -> frozenset[str]:
    """The endpoint names of the current URLconf's routes (an error importing it propagates)."""
    return _route_endpoints(get_resolver(get_urlconf()))


class DrfRoute(NamedTuple):
    """A DRF route of the URLconf, as its throttles see it."""

    #: The view name Django's ResolverMatch gives it.
    name: str
    #: The view's class (its ``__qualname__`` names it in messages).
    view: Any
    #: Its throttle classes (a viewset action's own, where it names them).
    throttle_classes: tuple[Any, ...]
    #: Its ``throttle_scope`` (a viewset action's own, where it names one), or ``None``.
    scope: str | None


def drf_routes() -> Iterator[DrfRoute]:
    """Every DRF route of the current URLconf."""
    for name, view, callback in _routes(get_resolver(get_urlconf()).url_patterns, ()):
        if getattr(callback, "cls", None) is None:
            continue
        initkwargs = getattr(callback, "initkwargs", None) or {}
        classes = initkwargs.get("throttle_classes", getattr(view, "throttle_classes", ()))
        scope = initkwargs.get("throttle_scope", getattr(view, "throttle_scope", None))
        yield DrfRoute(name, view, tuple(classes or ()), str(scope) if scope else None)


@functools.lru_cache(maxsize=8)
def _route_endpoints(resolver: URLResolver) -> frozenset[str]:
    """The names of every route of ``resolver``: read once per URLconf (they never change in a process)."""
    names = set()
    for name, view, callback in _routes(resolver.url_patterns, ()):
        initkwargs = getattr(callback, "initkwargs", None) or {}
        scope = (
            initkwargs.get("throttle_scope")
            or getattr(view, "throttle_scope", None)
            or getattr(callback, "ratelimit_scope", None)
        )
        if scope:
            names.add(str(scope))
        names.add(name)
    return frozenset(names)


def _routes(patterns: Iterable[Any], namespaces: tuple[str, ...]) -> Iterator[tuple[str, Any, Any]]:
    """(view name, view, callback) of every route: the name as Django's ResolverMatch makes it."""
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            inner = (*namespaces, pattern.namespace) if pattern.namespace else namespaces
            yield from _routes(pattern.url_patterns, inner)
        elif isinstance(pattern, URLPattern):
            callback = pattern.callback
            view = getattr(callback, "view_class", None) or getattr(callback, "cls", None) or callback
            path = pattern.name or f"{view.__module__}.{getattr(view, '__name__', type(view).__name__)}"
            yield ":".join((*namespaces, path)), view, callback
