"""The 0.1 home of ``DatabasePolicySource``: it lives in :mod:`ratelimits.store.database`.

Deprecated: kept for one release so that settings naming the old path (``POLICIES['SOURCE']``) keep
working; importing it warns, and ``manage.py check`` names the setting (``ratelimits.W022``).
Removed in 0.3.
"""

import warnings

from .store.database import DatabasePolicySource

__all__ = ["DatabasePolicySource"]

warnings.warn(
    "ratelimits.sources is deprecated and will be removed in 0.3: "
    "use POLICIES['SOURCE'] = 'database' (or ratelimits.store.database.DatabasePolicySource)",
    DeprecationWarning,
    stacklevel=2,
)
