"""Deprecated: the client is ``ratelimits_client`` now, the ``ratelimits-client`` distribution's package.

This app's wheel carries ``ratelimits_client`` (clients/python/src), so ``import ratelimits_client``
works wherever ``ratelimits`` does; a process without the app installs ``ratelimits-client``, which
needs neither Django nor redis-py. This module re-exports it (the same objects) for one release, and
warns on import; it goes in the next. docs/client.md has the client.
"""

from __future__ import annotations

import warnings
from typing import Any

import ratelimits_client

#: The client's names, each the client's own object (read from it when first named: the transport
#: adapters each need an optional library).
__all__ = list(ratelimits_client.__all__)

# stacklevel 2: the warning names the module that imported this one (the import system's frames
# are skipped), where the import to change is.
warnings.warn(
    "ratelimits.client is deprecated: import ratelimits_client instead, the same client "
    "(`from ratelimits_client import session`). django-ratelimits installs it; without the app, "
    "install the ratelimits-client distribution, which needs neither Django nor redis-py. "
    "ratelimits.client goes in the next release.",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    """``ratelimits_client``'s ``name``, the same object."""
    if name in __all__:
        return getattr(ratelimits_client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
