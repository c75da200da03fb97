"""The policy store: admin-managed policies in the database, and what keeps them honest.

- :mod:`.database`: the database as a policy source, read into an in-process snapshot.
- :mod:`.versioning`: the policy version every committed change raises and the limiter's store
  carries to the workers.
- :mod:`.audit`: the audit trail, written in the same transaction as the change.
- :mod:`.portability`: policies exported and imported between environments.
- :mod:`.expiry`: expired overrides and assignments tidied away.

The values these modules read and write (policies, the snapshot, the resolver, the settings
source) are :mod:`ratelimits.policies`, a layer below, which needs no database. Nothing is
imported here, so that importing one module does not run the others (and the models load only
when a module that needs them is imported).
"""
