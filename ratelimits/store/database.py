"""Admin-managed policies as a policy source: the policy tables in an in-process snapshot.

Workers answer from a snapshot of the tables: no database query per request in steady state.
Every committed policy change bumps the policy version (:mod:`.versioning`); every decision brings
the store's copy of it back in the same round trip, and a worker that sees a newer one reloads
before its next request. While the store is unreachable, workers reload on a short timer instead.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import sqlite3
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from datetime import datetime

from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections, transaction
from django.db.models import F
from django.utils import timezone

from ..choices import FailMode
from ..conf import Policies, conf
from ..exceptions import ConfigurationError
from ..identity import SubjectKind
from ..models import EndpointPolicy, FleetSettings, Override, SubjectAssignment, Tier
from ..policies.settings import SettingsPolicySource, dimensions_from_settings, exempt_rules_from_settings
from ..policies.snapshot import (
    Assignment,
    OverrideRule,
    PolicySnapshot,
    Window,
    endpoint_key,
    endpoint_rule,
    quota_policy,
    tier_policies,
)
from ..policies.source import ObservedDecision, SnapshotPolicySource, in_event_loop
from ..policies.throttle_rates import add_scope_rates, drf_default_tiers, replaced_tiers, throttle_rates
from ..policies.values import EndpointRule, Origin, OriginKind, Policy, Scope, fleet_checks, fleet_share_policy
from ..rates import MAX_LIMIT, check_burst, parse_rate
from .versioning import committed_version, publish_version, stamp_version

__all__ = [
    "DatabasePolicySource",
    "load_snapshot",
    "migrate_hint",
]

logger = logging.getLogger("ratelimits")

FLEET = Origin(OriginKind.FLEET, "fleet settings")


class DatabasePolicySource(SnapshotPolicySource):
    """Policies from the admin-managed tables (``POLICIES['SOURCE']`` short name ``"database"``)."""

    #: Tiers, endpoint policies and the fleet's capacity are rows here, not settings.
    ignored_settings = ("TIERS", "ENDPOINTS", "SHEDDING.FLEET_CAPACITY")
    #: When this process last published a lagging stamp again (monotonic seconds; never, at first).
    _republished_at = -math.inf

    def fallback(self, error: Exception) -> PolicySnapshot | None:
        """The settings' policies, while the tables cannot be read: never a 500 for a deploy mistake.

        Tables not migrated yet (a deploy that runs the new code before ``migrate``) or a database
        that refuses: the settings' tiers, DRF's rates, ``DIMENSIONS`` and ``ENDPOINTS`` decide
        until a background reload reads the tables. Said once, with the cause.
        """
        snapshot = SettingsPolicySource().snapshot()  # a bad setting raises: the checks said so at start
        logger.error(
            "ratelimits: the policy tables cannot be read (%s: %s)%s; deciding on the settings' policies "
            "(RATELIMITS['TIERS'], DIMENSIONS, ENDPOINTS) until they can, retried in the background",
            type(error).__name__,
            error,
            migrate_hint(error),
        )
        return snapshot

    def load(self) -> PolicySnapshot:
        with bounded_waits(conf.policies.load_timeout):
            return load_snapshot()

    def finish_thread(self) -> None:
        connections.close_all()  # the background retry's own connections, not a request's

    def observe(self, decision: ObservedDecision) -> None:
        """Reload when the store's version stamp is ahead of the snapshot; repair it when behind.

        While the store is unreachable, reload every ``POLICIES['POLL_INTERVAL']``. And every
        ``POLICIES['RECHECK_INTERVAL']`` compare with the database itself (one query), for changes
        whose publication nobody saw fail (a command run while only its host lost the store).
        """
        snapshot = self._snapshot
        if snapshot is None:
            return
        now = time.monotonic()
        if decision.degraded:
            if now - snapshot.loaded_at > conf.policies.poll_interval:
                self.invalidate()
            return
        if not decision.results or decision.local is not None:
            # A decision without checks (an exempt endpoint), or one answered from memory, never
            # reached the store: no stamp.
            return
        stamp = stamp_version(decision.policy_version)
        if stamp > snapshot.version:
            self.invalidate()
        elif stamp < snapshot.version:
            # The store lags behind the database: a publication was lost while it was
            # unreachable, or the stamp expired, was flushed or evicted. Publish again, so workers
            # that were idle meanwhile reload too; but at most once per POLICIES['POLL_INTERVAL']: a
            # store that keeps evicting the stamp (or refusing the write) would otherwise cost
            # every decision a second script call, and a warning each time it fails.
            if now - self._republished_at >= conf.policies.poll_interval:
                self._republished_at = now
                _blocking(lambda: publish_version(snapshot.version))
        elif now - snapshot.checked_at > conf.policies.recheck_interval:
            snapshot.checked_at = now
            _blocking(lambda: self._recheck(snapshot))

    def _recheck(self, snapshot: PolicySnapshot) -> None:
        """Invalidate ``snapshot`` if the database has a newer version (one query)."""
        try:
            with bounded_waits(conf.policies.load_timeout):
                newer = committed_version() > snapshot.version
        except DatabaseError as exc:
            logger.warning("ratelimits: policy version recheck failed (%s); checked again later", exc)
            return
        if newer and self._snapshot is snapshot:
            self.invalidate()


def _blocking(work: Callable[[], object]) -> None:
    """Do ``work`` (a database query, a store write) now; called from an event loop (an async
    decision), in a thread of its own instead, which closes its database connections after."""
    if not in_event_loop():
        work()
        return

    def run() -> None:
        try:
            work()
        except Exception:
            logger.exception("ratelimits: policy version upkeep failed off the event loop")
        finally:
            connections.close_all()

    threading.Thread(target=run, name="ratelimits-policy-upkeep", daemon=True).start()


@contextlib.contextmanager
def bounded_waits(seconds: float, using: str = DEFAULT_DB_ALIAS) -> Iterator[None]:
    """Let no statement inside wait on a lock, or run, longer than ``seconds``; a ``DatabaseError`` if one does.

    Policies are reloaded on the request path: a table locked by a migration or a long
    transaction must not hold every worker. PostgreSQL gets ``lock_timeout`` and
    ``statement_timeout`` for this transaction only (restored if an outer one goes on); SQLite its
    busy timeout. Other databases keep their own lock timeouts.
    """
    connection = connections[using]
    milliseconds = max(int(seconds * 1000), 1)
    if connection.vendor == "sqlite":
        # A connection's busy timeout, not a transaction's: set before the transaction and put back
        # after it ends, so that a statement failing inside leaves nothing behind, and its own
        # error (never a TransactionManagementError of a statement after it) is what is raised.
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA busy_timeout")
            (busy_timeout,) = cursor.fetchone()
            cursor.execute(f"PRAGMA busy_timeout = {milliseconds}")
        try:
            with transaction.atomic(using=using):
                yield
        finally:
            # On the driver's connection: Django refuses every statement in an outer transaction a
            # failure above broke, and this one is the connection's, no part of any transaction.
            raw = connection.connection
            if raw is not None:
                with contextlib.suppress(sqlite3.Error):
                    raw.execute(f"PRAGMA busy_timeout = {int(busy_timeout)}")
        return
    outer = connection.in_atomic_block
    with transaction.atomic(using=using):
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT current_setting('lock_timeout'), current_setting('statement_timeout'), "
                    "set_config('lock_timeout', %s, true), set_config('statement_timeout', %s, true)",
                    [f"{milliseconds}ms", f"{milliseconds}ms"],
                )
                lock_timeout, statement_timeout, *_ = cursor.fetchone()
            yield
            if outer:  # an outer transaction goes on: give it its own timeouts back
                with connection.cursor() as cursor:
                    cursor.execute(
                        "SELECT set_config('lock_timeout', %s, true), set_config('statement_timeout', %s, true)",
                        [lock_timeout, statement_timeout],
                    )
        else:
            yield


def migrate_hint(error: BaseException) -> str:
    """``": run manage.py migrate"`` when ``error`` says a table of the app is missing, else ``""``."""
    text = str(error).lower()
    missing = "no such table" in text or ("relation" in text and "does not exist" in text) or "doesn't exist" in text
    return ": run manage.py migrate" if missing and "ratelimits_" in text else ""


def load_snapshot() -> PolicySnapshot:
    """Read every policy table once and index it for lookups without queries.

    A row that cannot be turned into a policy (saved around the admin's validation) is left
    out with an error in the log, rather than taking every request down with it.
    """
    # Read first: a change committed while the tables are read then shows as a newer version.
    version = committed_version()
    now = timezone.now()
    fleet = FleetSettings.objects.filter(pk=1).select_related("anonymous_tier", "authenticated_tier").first()
    mode = _fail_mode(fleet)
    shadow = bool(fleet and fleet.shadow)
    # A policy made from an override alone (a concurrency limit where the tier has none) takes the
    # settings' fail mode, not the fleet settings': what 0.1 did, kept by the redesign.
    snapshot = PolicySnapshot(
        default_fail_mode=conf.failure.default_mode, version=version, fleet_origin=FLEET, tiers_kind=OriginKind.TIER
    )
    for tier in Tier.objects.filter(enabled=True):
        try:
            snapshot.tiers[tier.name] = _tier(tier, mode, shadow)
            snapshot.tier_origins[tier.name] = Origin(OriginKind.TIER, f"tier #{tier.pk}")
        except ConfigurationError as exc:
            logger.error("ratelimits: tier %s left out: %s", tier.name, exc)
    _default_tiers(snapshot, fleet)
    if fleet is not None:
        snapshot.fleet = fleet_checks(fleet.capacity or None, fleet.shed_thresholds(), conf.shedding.fleet_shards)
        snapshot.fleet_share = fleet_share_policy(fleet.capacity or None, conf.shedding.tenant_share)
    _assignments(snapshot, now)
    for row in EndpointPolicy.objects.filter(enabled=True):
        try:
            snapshot.endpoints[endpoint_key(str(row))] = _endpoint(row, mode, shadow)
        except ConfigurationError as exc:
            logger.error("ratelimits: endpoint policy %s left out: %s", row, exc)
    drf = throttle_rates(strict=False)
    replaced_tiers(snapshot, drf)  # the tables' tiers, not DRF's anon and user rates...
    drf_default_tiers(snapshot, drf, mode, conf.policies.default_tiers)  # ...where the tables place no caller
    add_scope_rates(snapshot, drf, mode)
    snapshot.endpoints.update(exempt_rules_from_settings())
    _overrides(snapshot, now, shadow)
    # The fleet's shadow switch means every policy, the settings' static backstops included.
    snapshot.dimensions = dimensions_from_settings(mode, shadow=shadow)
    return snapshot


def _fail_mode(fleet: FleetSettings | None) -> FailMode:
    if fleet is None:
        return conf.failure.default_mode
    try:
        return FailMode(fleet.default_fail_mode)
    except ValueError:
        logger.error(
            "ratelimits: fleet settings' fail mode %r is unknown; using the settings'", fleet.default_fail_mode
        )
        return conf.failure.default_mode


def _tier(tier: Tier, mode: FailMode, shadow: bool) -> tuple[Policy, ...]:
    config = {
        "rate": tier.rate,
        "burst": tier.burst or parse_rate(tier.rate, field=f"tier {tier.name} rate").limit,
        "algorithm": tier.algorithm,
        "fail_mode": tier.fail_mode or mode,
        "scope": tier.scope or "region",
        "quota": tier.quota or None,
        "quota_zone": tier.quota_zone or None,
        "quota_mode": tier.quota_mode or None,
        "concurrency": tier.concurrency or None,  # the admin stores "none" as empty, never as 0
    }
    return tier_policies(tier.name, config, field=f"tier {tier.name}", fail_mode=mode, shadow=tier.shadow or shadow)


def _aware(moment: datetime | None) -> datetime | None:
    """A datetime as an instant: with ``USE_TZ`` False, Django gives naive ones, in ``TIME_ZONE``."""
    if moment is None or moment.tzinfo is not None:
        return moment
    return timezone.make_aware(moment, timezone.get_default_timezone())


def _default_tiers(snapshot: PolicySnapshot, fleet: FleetSettings | None) -> None:
    """The fleet settings' default tiers, else ``POLICIES['DEFAULT_TIERS']`` if it names a tier here."""
    chosen = {
        "anonymous": fleet.anonymous_tier if fleet else None,
        "authenticated": fleet.authenticated_tier if fleet else None,
    }
    for kind, row in chosen.items():
        detail = f"default tier for {kind} callers"
        if row is not None:  # a disabled tier applies no limits, as assigning one does
            snapshot.default_tiers[kind] = Assignment(row.name, Origin(OriginKind.TIER, f"{detail} (fleet settings)"))
            continue
        name = conf.policies.default_tiers.get(kind)
        if name in snapshot.tiers:
            where = f"{detail} ({Policies.default_tiers.field})"
            snapshot.default_tiers[kind] = Assignment(str(name), Origin(OriginKind.SETTINGS, where))


def _assignments(snapshot: PolicySnapshot, now: datetime) -> None:
    assignments: dict[tuple[SubjectKind, str], list[Assignment]] = defaultdict(list)
    # The newest start first; one without a start began before any other (NULLs sort first
    # in descending order on PostgreSQL, last on SQLite: say which).
    live = (
        SubjectAssignment.objects.select_related("tier")
        .exclude(expires_at__lte=now)
        .order_by(F("starts_at").desc(nulls_last=True), "-id")
    )
    for row in live:
        origin = Origin(OriginKind.ASSIGNMENT, f"assignment #{row.pk} ({row.tier.name})")
        entry = Assignment(row.tier.name, origin, Window(row.starts_at, row.expires_at), _aware(row.quota_anchor))
        kind = _kind(row, "assignment")
        if kind is SubjectKind.IP:
            try:
                snapshot.networks.append((ipaddress.ip_network(row.subject_id, strict=False), entry))
            except ValueError:
                logger.error("ratelimits: assignment #%s left out: bad network %r", row.pk, row.subject_id)
        elif kind is not None:
            assignments[(kind, row.subject_id)].append(entry)
    snapshot.assignments = dict(assignments)


def _kind(row: SubjectAssignment | Override, what: str) -> SubjectKind | None:
    """The row's subject kind, or ``None`` (logged) for one saved around the admin's validation."""
    try:
        return SubjectKind(row.subject_kind)
    except ValueError:
        logger.error("ratelimits: %s #%s left out: unknown subject kind %r", what, row.pk, row.subject_kind)
        return None


def _endpoint(row: EndpointPolicy, mode: FailMode, shadow: bool) -> EndpointRule:
    def limit(rate: str, burst: int | None, shards: int = 1) -> dict[str, object] | None:
        return {"rate": rate, "shards": shards, **({"burst": burst} if burst else {})} if rate else None

    return endpoint_rule(
        str(row),
        field=f"endpoint policy {row}",
        origin=Origin(OriginKind.ENDPOINT, "endpoint policy"),
        fail_mode=mode,
        cost=row.cost,
        priority=row.priority,
        per_caller=limit(row.per_caller_rate, row.per_caller_burst),
        endpoint_wide=limit(row.endpoint_rate, row.endpoint_burst, row.endpoint_shards or 1),
        exempt=row.exempt,
        shadow=row.shadow or shadow,
        counts=row.counts,
        max_cost=row.max_cost,
    )


def _overrides(snapshot: PolicySnapshot, now: datetime, shadow: bool) -> None:
    overrides: dict[tuple[SubjectKind, str], list[OverrideRule]] = defaultdict(list)
    for row in Override.objects.filter(enabled=True, expires_at__gt=now).order_by("-created_at", "-id"):
        kind = _kind(row, "override")
        try:
            rule = override_rule(row, shadow)
        except ConfigurationError as exc:
            logger.error("ratelimits: %s", exc)
            continue
        if kind is None:
            continue
        overrides[(kind, row.subject_id)].append(rule)
    snapshot.overrides = dict(overrides)


def override_rule(row: Override, shadow: bool = False) -> OverrideRule:
    """What an override row replaces, as the resolver applies it (checked: a row saved around the
    admin's validation raises :class:`ConfigurationError`)."""
    rate = parse_rate(row.rate, field=f"override #{row.pk} rate") if row.rate else None
    if rate is not None:
        check_burst(rate, row.burst or rate.limit, field=f"override #{row.pk} burst")
    if row.concurrency is not None and row.concurrency > MAX_LIMIT:
        raise ConfigurationError(f"override #{row.pk} concurrency: {row.concurrency} is too large")
    scope = Scope.parse(row.scope, field=f"override #{row.pk} scope") if row.scope else None
    if row.quota:  # checked now, not while a request resolves
        mode = row.quota_mode or "hard"
        quota_policy("override", row.quota, zone="UTC", mode=mode, field=f"override #{row.pk}", fail_mode=FailMode.OPEN)
    return OverrideRule(
        id=row.pk or 0,
        endpoint=row.endpoint,
        window=Window(None, row.expires_at),
        rate=rate,
        burst=row.burst,
        multiplier=float(row.multiplier) if row.multiplier is not None else None,
        concurrency=row.concurrency,
        scope=scope,
        quota=row.quota or None,
        quota_mode=row.quota_mode,
        shadow=row.shadow or shadow,
        origin=Origin(OriginKind.OVERRIDE, f"override #{row.pk}: {row.reason[:80]}"),
    )


def tier_of(row: Tier) -> tuple[Policy, ...]:
    """A tier row's policies, as a request meets them (a row not saved yet too: a preview's)."""
    return _tier(row, FailMode.OPEN, False)


def endpoint_rule_of(row: EndpointPolicy) -> EndpointRule:
    """An endpoint policy row's rule, as a request meets it (a row not saved yet too: a preview's)."""
    return _endpoint(row, FailMode.OPEN, False)
