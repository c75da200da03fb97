"""Policy sources: what every source offers its callers, the snapshot-backed base, and the process's source."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from django.utils.module_loading import import_string

from .._process import ProcessWide
from ..conf import Policies, conf, require_app
from ..exceptions import ConfigurationError
from .resolver import default_assignment, explain, resolve_checks
from .snapshot import PolicySnapshot
from .values import Check, EndpointRule, Explained

if TYPE_CHECKING:
    from django.http import HttpRequest

    from ..identity import Identity

__all__ = ["ObservedDecision", "PolicySource", "SnapshotPolicySource", "get_policy_source", "in_event_loop"]

logger = logging.getLogger("ratelimits")


class ObservedDecision(Protocol):
    """What a source may read of a decision it observes (:class:`ratelimits.decisions.Decision` is one).

    Named here, by what the source reads, so that policies need nothing of the decisions, which
    are built from policies' checks.
    """

    @property
    def degraded(self) -> bool:
        """True when a fail mode decided, the store unreachable."""

    @property
    def results(self) -> tuple[object, ...]:
        """One result per check decided (none: an exempt endpoint)."""

    @property
    def local(self) -> str | None:
        """How the worker answered without the store; ``None`` when the store decided."""

    @property
    def policy_version(self) -> str | None:
        """The store's policy version stamp, brought back by the decision."""


@runtime_checkable
class PolicySource(Protocol):
    """Where the checks for a request come from (``RATELIMITS['POLICIES']['SOURCE']`` names the class).

    Everything the engine, the status API, the admin and the commands ask of a source is here;
    :class:`SnapshotPolicySource` implements all of it on top of one ``load()``.
    """

    def snapshot(self) -> PolicySnapshot:
        """Every policy, as currently loaded."""

    def explain(
        self, request: HttpRequest, identity: Identity, *, now: datetime | None = None, method: str | None = None
    ) -> list[Explained]:
        """Every check that applies to ``request`` (called with ``method``), with where its values come from."""

    def checks_for(self, request: HttpRequest, identity: Identity) -> Sequence[Check]:
        """Every check that applies to ``request``, each with its cost (what the throttle decides).

        Not changed by its caller: a source may hand the same object to every request that
        resolves alike (a :class:`~.values.KeptChecks`)."""

    def endpoint_rule(self, endpoint: str, method: str) -> EndpointRule:
        """The rule for an endpoint and HTTP method (a default rule if none is configured)."""

    def observe(self, decision: ObservedDecision) -> None:
        """Called with every decision: a source that caches can notice a new policy version."""

    def invalidate(self) -> None:
        """Forget what is loaded: the next request loads the policies afresh."""

    @property
    def ignored_settings(self) -> tuple[str, ...]:
        """``RATELIMITS`` keys that describe policies this source does not read (the checks warn if set)."""


_MEMBERS = ("snapshot", "explain", "checks_for", "endpoint_rule", "observe", "invalidate", "ignored_settings")


#: How often a background reload waiting out its backoff looks whether it is still wanted (seconds).
RETIRED_CHECK_S = 0.05


class SnapshotPolicySource(ABC):
    """A policy source that loads a :class:`PolicySnapshot` and resolves from it with the one resolver.

    Subclasses say how to :meth:`load`; the snapshot is kept until :meth:`invalidate`. Loading
    never holds requests up for long: once a snapshot is in hand, a reload that fails (a locked
    or slow table, a database restart) is logged once and retried off the request path with
    backoff, while requests are decided on the last snapshot that loaded. Requests that arrive
    while another thread reloads use it too, rather than queue behind the reload.
    """

    #: See :attr:`PolicySource.ignored_settings`.
    ignored_settings: tuple[str, ...] = ()
    #: Seconds between background reload attempts after a failure: doubled each time, up to the cap.
    retry_backoff: tuple[float, float] = (0.25, 5.0)

    def __init__(self) -> None:
        self._snapshot: PolicySnapshot | None = None
        #: The newest snapshot that loaded, served while a reload fails or runs.
        self._last_good: PolicySnapshot | None = None
        self._lock = threading.Lock()
        self._retrying = False

    @abstractmethod
    def load(self) -> PolicySnapshot:
        """Read every policy into a new snapshot."""

    def snapshot(self) -> PolicySnapshot:
        snapshot = self._snapshot
        if snapshot is None:
            snapshot = self._reload()
        return snapshot

    @property
    def loaded(self) -> bool:
        """Whether :meth:`snapshot` answers without loading: it has one in hand, or a background
        reload is running and it serves the last one. An async decision loads off its event loop
        first otherwise, since loading blocks."""
        return self._snapshot is not None or (self._retrying and self._last_good is not None)

    def invalidate(self) -> None:
        self._snapshot = None

    def _reload(self) -> PolicySnapshot:
        last = self._last_good
        if last is None:
            self._lock.acquire()  # nothing to serve yet: wait for the first load
        elif self._retrying or not self._lock.acquire(blocking=False):
            return last  # the background retry, or another request, is loading: decide on what is in hand
        elif in_event_loop():
            # An async decision, invalidated after it made sure of a snapshot: loading here would
            # block its event loop. Decide on what is in hand; the background reload starts now
            # (marked under the lock, so no request thread starts a load of its own meanwhile).
            try:
                self._reload_in_background()
            finally:
                self._lock.release()
            return last
        try:
            snapshot = self._snapshot
            if snapshot is not None:
                return snapshot
            if last is None and self._last_good is not None:
                # Waited for the first load, which failed and fell back meanwhile: decide on that too,
                # as the background retry goes on (one fallback and one log line, not one a thread).
                return self._last_good
            try:
                snapshot = self.load()
            except Exception as exc:
                if last is None:
                    last = self.fallback(exc)
                    if last is None:
                        raise  # no policies at all: nothing to fall back on
                    self._last_good = last
                    self._retry_in_background()
                    return last
                logger.exception(
                    "ratelimits: reloading the policies failed; serving those of version %s until a reload "
                    "succeeds (retried in the background)",
                    last.version,
                )
                self._retry_in_background()
                return last
            self._snapshot = self._last_good = snapshot
            return snapshot
        finally:
            self._lock.release()

    def fallback(self, error: Exception) -> PolicySnapshot | None:
        """What to decide on when the very first load fails with ``error`` (``None``: the error stands).

        A subclass whose store may be unreadable for a while (tables not migrated yet, a database
        that refuses) gives a snapshot here; the load is then retried in the background, and
        requests are decided on it meanwhile.
        """
        return None

    def _retry_in_background(self) -> None:
        """Reload in a thread of its own, with backoff, after a failure (called holding the lock)."""
        self._retrying = True
        try:
            threading.Thread(target=self._retry, name="ratelimits-policy-reload", daemon=True).start()
        except RuntimeError:
            self._retrying = False  # no thread to be had: the next request tries again itself

    def _reload_in_background(self) -> None:
        """Reload in a thread of its own (called holding the lock)."""
        self._retrying = True
        try:
            threading.Thread(target=self._retry, args=(0.0,), name="ratelimits-policy-reload", daemon=True).start()
        except RuntimeError:
            self._retrying = False  # no thread to be had: a later request tries again

    def _retry(self, first_delay: float | None = None) -> None:
        """Reload with backoff until it works, or until this source is no longer the process's
        (``first_delay``: before the first attempt, if not the backoff's)."""
        delay, cap = self.retry_backoff
        wait = delay if first_delay is None else first_delay
        attempts = 1
        try:
            while self._waited(wait):  # backoff between attempts, off the request path
                wait = delay
                attempts += 1
                try:
                    snapshot = self.load()
                except Exception as exc:
                    logger.debug("ratelimits: policy reload attempt %s failed: %s", attempts, exc)
                    delay = min(delay * 2, cap)
                    continue
                with self._lock:
                    if self._snapshot is None:
                        self._snapshot = self._last_good = snapshot
                # A reload an async decision asked for is routine; one after failures is news.
                level = logging.INFO if first_delay is not None and attempts == 2 else logging.WARNING
                logger.log(level, "ratelimits: policies reloaded (version %s), attempt %s", snapshot.version, attempts)
                return
        finally:
            self._retrying = False
            self.finish_thread()

    def _waited(self, seconds: float) -> bool:
        """Wait ``seconds`` before another reload attempt; ``False`` as soon as none is wanted: a
        request loaded the policies meanwhile, or this source retired (the settings changed, and
        another source serves). Looked at every RETIRED_CHECK_S, so a retired source's thread ends
        within that of its retirement, or once the load it may be in (retired just as it began)
        ends: it starts no other."""
        until = time.monotonic() + seconds
        while self._snapshot is None and _source.current() is self:
            left = until - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(left, RETIRED_CHECK_S))
        return False

    def finish_thread(self) -> None:  # noqa: B027  (a hook; subclasses may leave it alone)
        """Called when the background retry's thread ends: a source may close what it opened there."""

    def explain(
        self, request: HttpRequest, identity: Identity, *, now: datetime | None = None, method: str | None = None
    ) -> list[Explained]:
        return explain(self.snapshot(), request, identity, now=now, method=method)

    def checks_for(self, request: HttpRequest, identity: Identity) -> Sequence[Check]:
        return resolve_checks(self.snapshot(), request, identity)

    def endpoint_rule(self, endpoint: str, method: str) -> EndpointRule:
        return self.snapshot().endpoint_rule(endpoint, method)

    def tier_for(self, request: HttpRequest, identity: Identity) -> str | None:
        """The tier of a caller nothing assigns (``POLICIES['TIER_FUNC']``'s, else the default); ``None`` if none."""
        assignment = default_assignment(self.snapshot(), request, identity)
        return assignment.tier if assignment is not None else None

    def observe(self, decision: ObservedDecision) -> None:  # noqa: B027  (a hook; subclasses may leave it alone)
        """Nothing to notice by default: the snapshot stands until :meth:`invalidate`."""


def in_event_loop() -> bool:
    """Whether this thread runs an event loop: code called from it must not block (no database)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def get_policy_source() -> PolicySource:
    """The process-wide policy source named by ``RATELIMITS['POLICIES']['SOURCE']``."""
    return _source.get()


def build_policy_source() -> PolicySource:
    """A new instance of the configured source; a :class:`ConfigurationError` if it is not one."""
    require_app()
    path = conf.policies.source
    try:
        source = import_string(path)()
    except ImportError as exc:
        raise ConfigurationError(
            f"{Policies.source.field}: cannot import {path!r}: {exc}", setting=Policies.source.name
        ) from exc
    if not isinstance(source, PolicySource):
        missing = ", ".join(name for name in _MEMBERS if not hasattr(source, name))
        raise ConfigurationError(
            f"{Policies.source.field}: {path!r} is not a policy source (see ratelimits.policies.PolicySource): "
            f"it has no {missing}. Subclassing ratelimits.policies.SnapshotPolicySource and writing load() gives "
            "it all of them.",
            setting=Policies.source.name,
        )
    return source


_source: ProcessWide[PolicySource] = ProcessWide(build_policy_source)
