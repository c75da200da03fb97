"""pytest fixtures of the test kit; a project enables them in its root ``conftest.py``::

    pytest_plugins = ["ratelimits.testing.pytest"]

They are never loaded on their own (no ``pytest11`` entry point): a project that does not ask
for them gets none. With pytest-django, the settings they change go through its ``settings``
fixture, so that changes a test makes there are undone in the right order.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..conf import conf
from .isolation import IsolatedLimiter, disabled, limiter

__all__ = ["ratelimits_disabled", "ratelimits_limiter"]


@pytest.fixture
def ratelimits_limiter(request: pytest.FixtureRequest) -> Iterator[IsolatedLimiter]:
    """A fresh limiter for the test (:func:`ratelimits.testing.limiter`): the project's policies, on
    an in-process store of the test's own, with a clock that moves by ``ratelimits_limiter.advance(seconds)``."""
    if not conf.enabled:
        _with_pytest_django(request, enabled=True)
    with limiter() as isolated:
        yield isolated


@pytest.fixture
def ratelimits_disabled(request: pytest.FixtureRequest) -> Iterator[None]:
    """``RATELIMITS['ENABLED']`` off for the test: every request admitted without asking the store, no headers."""
    if _with_pytest_django(request, enabled=False):
        yield
        return
    with disabled():
        yield


def _with_pytest_django(request: pytest.FixtureRequest, *, enabled: bool) -> bool:
    """Set ``ENABLED`` through pytest-django's ``settings`` fixture, if pytest-django runs; whether it did.

    Its overrides are undone at the end of the test, last first: one of ours made any other way
    could be undone before one the test made on top of it, which would then restore ours.
    """
    if not request.config.pluginmanager.hasplugin("django"):
        return False
    settings = request.getfixturevalue("settings")
    settings.RATELIMITS = {**conf.user_settings, "ENABLED": enabled}
    return True
