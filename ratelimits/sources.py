"""Where ``ratelimits.sources.DatabasePolicySource`` was documented: it lives in :mod:`ratelimits.policies.database`.

Kept so that settings naming the old path (``POLICIES['SOURCE']``) keep working.
"""

from .policies.database import DatabasePolicySource

__all__ = ["DatabasePolicySource"]
