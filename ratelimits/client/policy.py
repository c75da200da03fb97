"""Deprecated: ``ratelimits_client.policy`` (see ``ratelimits.client``), re-exported for one release."""

from __future__ import annotations

import warnings
from typing import Any

from ratelimits_client import policy as _client_policy

#: ``ratelimits_client.policy``'s names, each its own object.
__all__ = list(_client_policy.__all__)

# stacklevel 2: the warning names the importing module (see ratelimits/client/__init__.py).
warnings.warn(
    "ratelimits.client.policy is deprecated: import ratelimits_client.policy instead, the same module "
    "(django-ratelimits installs it; without the app, the ratelimits-client distribution). "
    "ratelimits.client goes in the next release.",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    """``ratelimits_client.policy``'s ``name``, the same object."""
    if name in __all__:
        return getattr(_client_policy, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
