"""Redis backend: every check of a request decided by one EVALSHA of ``lua/decide.lua``."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from importlib import resources
from typing import Any, NamedTuple, cast

import redis
from redis.cluster import RedisCluster

from .._memo import remember
from ..conf import conf
from ..counters import Usage, overflow_of
from ..decisions import Decision, Result, Spent, admitted
from ..exceptions import BackendUnavailable
from ..policies.values import Check, KeptChecks
from ..shares import ShareRecord
from . import layout
from .aio import AsyncClients, async_pool_factory
from .base import (
    BulletinSupport,
    Grant,
    HealthSupport,
    LeaseSupport,
    PolicyFailed,
    RegionSupport,
    SettleSupport,
    StoreHealth,
    UsagePeek,
    UsageSupport,
    new_slot,
    slot_keys,
    store_threads,
)
from .codec import (
    DEADLINE,
    LEASE,
    PERIOD,
    REFUND_CHECK,
    REFUND_NOW,
    REFUNDABLE,
    REQUEST,
    STATE_FORMATS,
    check_record,
    read_state,
)
from .connection import make_client as new_client
from .connection import tight
from .deadline import StoreClock
from .invalidation import RESET, Subscription, channel, held, version_message
from .transport import ThreadConnections, call

__all__ = [
    "ADD_USAGE",
    "DECIDE",
    "PUBLISH_VERSION",
    "RELEASE",
    "RENEW",
    "STATE_FORMATS",
    "RedisBackend",
    "Script",
    "make_client",
    "read_state",
]

logger = logging.getLogger("ratelimits")


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script shipped in ``ratelimits/lua/``: its text and SHA-1, read once at import.

    A script that also runs as a Redis Function has a ``function`` name and its ``library``'s
    text (``FUNCTION LOAD``): its file defines the function and stops, and is ended here both
    ways, so the two forms are one source.
    """

    name: str
    text: str
    sha: str
    #: The Redis Function's name ("": a script only), unique to this text: two releases' libraries
    #: live side by side through a rolling deploy.
    function: str = ""
    library: str = ""

    @classmethod
    def load(cls, name: str, *, entry: str | None = None) -> Script:
        """The script ``name``; with ``entry``, also the Redis Function that calls the file's
        ``entry(KEYS, ARGV)``."""
        source = resources.files("ratelimits").joinpath("lua", name).read_text(encoding="utf-8")
        if entry is None:
            return cls(name, source, _sha(source))
        text = _unwrapped(source, entry)
        sha = _sha(text)
        function = f"ratelimits_{entry}_{sha[:16]}"
        library = f"#!lua name={function}\n{source}\nredis.register_function('{function}', {entry})\n"
        return cls(name, text, sha, function, library)


def _unwrapped(source: str, entry: str) -> str:
    """``source`` as a script: the body of its last function, ``entry``, run at the top of the chunk.

    Called as a function from the chunk instead, the script would make that closure, over every
    local above it, on each call: about a tenth of a decision's instructions more (callgrind).
    """
    opening = f"\nlocal function {entry}(KEYS, ARGV)\n"
    head, found, body = source.rpartition(opening)
    if not found or not body.rstrip().endswith("\nend"):
        raise RuntimeError(f"lua: {entry}(KEYS, ARGV) must be the last thing the file defines")
    return f"{head}\n{body.rstrip()[: -len('end')]}"


def _sha(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


#: Run as a Redis Function where the store has them: its closures are made once, not per call.
DECIDE = Script.load("decide.lua", entry="decide")


class Functions:
    """Whether a store runs scripts as Redis Functions (``FCALL``), until it refuses one.

    A store refuses them before Redis 7 (an unknown command), or by an ACL that allows ``EVALSHA``
    but not ``FCALL`` or ``FUNCTION LOAD``: from then on it is sent scripts, which cost it about
    an eighth more CPU per decision (docs/benchmarks.md). Told once in the log.
    """

    __slots__ = ("enabled",)

    def __init__(self) -> None:
        self.enabled = True

    def refused(self, exc: redis.ResponseError) -> bool:
        """Whether ``exc`` says the store runs no Functions; if so, none are sent it again. (A
        refused key is not that: a script would be refused it too.)"""
        message = str(exc).lower()
        command_refused = isinstance(exc, redis.exceptions.NoPermissionError) and (
            "'fcall'" in message or "'function" in message
        )
        if not (command_refused or message.startswith("unknown command")):
            return False
        if self.enabled:
            self.enabled = False
            logger.info("ratelimits: the store refuses Redis Functions (%s); sending it scripts (EVALSHA) instead", exc)
        return True

    def not_run(self, exc: redis.ResponseError) -> bool:
        """Whether ``exc`` says a Function call did not run, so sending it again cannot charge twice:
        the store has no such function loaded (restarted, flushed, a new master), or refuses Functions."""
        return str(exc).startswith("Function not found") or self.refused(exc)


ADD_USAGE = Script.load("add_usage.lua")
PUBLISH_VERSION = Script.load("publish_version.lua")
RELEASE = Script.load("release.lua")
RENEW = Script.load("renew.lua")
REFUND = Script.load("refund.lua")
#: What a script cache holds the decide script under (tests look for it there).
DECIDE_SHA = DECIDE.sha
#: The wait the decide script answers for a check it could not decide (see ``lua/decide.lua``).
_FAILED = -1
#: The usage hashes' TTL as ``add_usage.lua`` is passed it, converted once.
_USAGE_TTL = str(layout.USAGE_TTL_S)


def _glob_escaped(text: str) -> str:
    """``text`` matched literally in a Redis glob pattern (``MATCH``): its special characters escaped."""
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


class RedisBackend(LeaseSupport, SettleSupport, UsageSupport, BulletinSupport, RegionSupport, HealthSupport):
    """Shared state in Redis, one round trip per decision.

    The client has tight timeouts and no retries: redis-py would otherwise resend a command
    after a timeout, and a consume that may already have run must never be sent twice.
    The decide script runs as a Redis Function where the store has them (``FCALL``); a store that
    lost it (restart, failover, ``FUNCTION FLUSH``) costs one ``FUNCTION LOAD`` first. Other
    scripts go by ``EVALSHA``: a lost script cache (``SCRIPT FLUSH`` too) costs one ``EVAL`` instead.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str = "rl",
        clock: Callable[[], int] | None = None,
        usage_cap: int | None = None,
        timeouts: tuple[float, float] | None = None,
    ) -> None:
        self.client = client
        #: (socket, connect) timeouts of the decision path's connections, whatever the client says;
        #: ``None``: the client's own.
        self.timeouts = timeouts
        self.prefix = prefix
        #: ``None`` lets the script read Redis ``TIME``; otherwise integer microseconds.
        self.clock = clock
        #: The store's clock, as far as the scripts' deadlines need it (:mod:`.deadline`).
        self.store_clock = StoreClock(in_step=clock is not None)
        #: The most rows a minute of usage counts (``USAGE['MAX_SUBJECTS']``).
        self.usage_cap = conf.usage.max_subjects if usage_cap is None else usage_cap
        self.version_key = layout.version_key(prefix)
        #: Checks (by their ids) -> what every decide call of them says (:class:`_Compiled`).
        self._compiled: dict[int | tuple[int, ...], _Compiled] = {}
        #: The last minute a decision counted usage in, and its usage hash's key.
        self._minute_key: tuple[int, str] = (-1, "")
        self._connections = ThreadConnections(self._new_connection)
        #: This process's subscribers, told of its own publications at once (the others by the
        #: channel); held weakly, as the subscriptions hold them.
        self._subscribers: list[Callable[[], Callable[[bytes | None], None] | None]] = []
        self._publish_refused = False
        self.functions = Functions()

    @classmethod
    def from_settings(cls) -> RedisBackend:
        options = cls.options_from_settings()
        socket_timeout, connect_timeout = options["timeouts"]
        url, redis_options = conf.redis.address
        client = conf.redis.client or make_client(url, socket_timeout, connect_timeout, redis_options)
        return cls(client, **options)  # type: ignore[arg-type]

    @staticmethod
    def options_from_settings() -> dict[str, Any]:
        """The constructor's options from settings: the key prefix, the clock, the decision path's timeouts."""
        clock = None if conf.redis.use_redis_time else (lambda: time.time_ns() // 1000)
        timeouts = (conf.redis.socket_timeout, conf.redis.connect_timeout)
        return {"prefix": conf.redis.key_prefix, "clock": clock, "timeouts": timeouts}

    def decide(self, checks: Sequence[Check], *, consume: bool = True, usage: Usage | None = None) -> Decision:
        return self._decided(checks, consume=consume, usage=usage)[0]

    def lease(
        self, checks: Sequence[Check], wants: Sequence[int], *, usage: Usage | None = None
    ) -> tuple[Decision, list[Grant]]:
        return _granted(checks, *self._decided(checks, consume=True, usage=usage, wants=wants))

    async def adecide(self, checks: Sequence[Check], *, consume: bool = True, usage: Usage | None = None) -> Decision:
        client = self._loop_client()
        if client is None:
            return await super().adecide(checks, consume=consume, usage=usage)  # in a thread
        return (await self._adecided(client, checks, consume=consume, usage=usage))[0]

    def decide_to_settle(self, checks: Sequence[Check], *, usage: Usage | None = None) -> Decision:
        decision, reply = self._decided(checks, consume=True, usage=usage, refundable=True)
        return with_spent(decision, reply[0], reply[-1])

    async def adecide_to_settle(self, checks: Sequence[Check], *, usage: Usage | None = None) -> Decision:
        client = self._loop_client()
        if client is None:
            return await super().adecide_to_settle(checks, usage=usage)  # in a thread
        decision, reply = await self._adecided(client, checks, consume=True, usage=usage, refundable=True)
        return with_spent(decision, reply[0], reply[-1])

    def settle(
        self,
        changes: Sequence[tuple[Spent, int]],
        usage: Usage | None = None,
        tokens: int = 0,
        *,
        counted_by: Check | None = None,
    ) -> int:
        """Give back or charge with ``lua/refund.lua``, in one call."""
        counted = (self._usage_key(usage.minute), usage, tokens) if usage is not None and tokens else None
        if not changes and counted is None:
            return 0
        keys, args = settle_call(changes, self.prefix, self.clock, counted)
        return int(self._run(REFUND, keys, args))

    async def alease(
        self, checks: Sequence[Check], wants: Sequence[int], *, usage: Usage | None = None
    ) -> tuple[Decision, list[Grant]]:
        client = self._loop_client()
        if client is None:
            return await super().alease(checks, wants, usage=usage)  # in a thread
        return _granted(checks, *await self._adecided(client, checks, consume=True, usage=usage, wants=wants))

    def _loop_client(self) -> Any:
        """The running loop's ``redis.asyncio`` client; ``None`` where the store is asked from a
        thread: ``redis.asyncio`` cannot make its connections, or the loop serves only this call."""
        clients = self._async
        return None if clients is None else clients.current()

    def _decided(
        self,
        checks: Sequence[Check],
        *,
        consume: bool,
        usage: Usage | None,
        wants: Sequence[int] | None = None,
        refundable: bool = False,
    ) -> tuple[Decision, Any]:
        """One decide call: the decision, and the script's reply as it came."""
        call = self._call_for(checks, consume=consume, usage=usage, wants=wants, refundable=refundable)
        try:
            reply = self._run(DECIDE, call.keys, call.args, call.stamped if consume else None)
        except BackendUnavailable as exc:
            call.failed(exc)
            raise
        self._observe(call.sent, reply)
        return call.decision(reply), reply

    async def _adecided(
        self,
        client: Any,
        checks: Sequence[Check],
        *,
        consume: bool,
        usage: Usage | None,
        wants: Sequence[int] | None = None,
        refundable: bool = False,
    ) -> tuple[Decision, Any]:
        """:meth:`_decided` on the running event loop's ``redis.asyncio`` client."""
        call = self._call_for(checks, consume=consume, usage=usage, wants=wants, refundable=refundable)
        stamp = None
        if consume:
            # Sent once the loop's pool gives it a connection (and it is connected): the worker
            # waits that long on top of its socket timeout, and so may the script.
            timeouts = self.timeouts or (0.0, 0.0)
            waiting_s = 2 * timeouts[1]

            def stamp(args: Sequence[Any]) -> Sequence[Any]:
                return call.stamped(args, waiting_s=waiting_s)

        try:
            reply = await _arun(client, DECIDE, call.keys, call.args, self.functions, stamp)
        except BackendUnavailable as exc:
            call.failed(exc)
            raise
        except asyncio.CancelledError:
            # Cancelled while the script was out (the limiter shields calls that take slots: here,
            # the loop is closing): it may have taken the slot, and nobody will hold it.
            if call.slot:
                store_threads().submit(self.release_quietly, call.slot, call.held)
            raise
        self._observe(call.sent, reply)
        return call.decision(reply), reply

    def _call_for(
        self,
        checks: Sequence[Check],
        *,
        consume: bool,
        usage: Usage | None,
        wants: Sequence[int] | None,
        refundable: bool = False,
    ) -> _DecideCall:
        compiled = self._compiled_for(checks)
        slot = new_slot(compiled.checks) if consume and compiled.held else None  # held: it takes slots
        script_keys, args = self._call_of(
            compiled, consume=consume, usage=usage, slot=slot, wants=wants, refundable=refundable
        )
        return _DecideCall(self, checks, script_keys, args, slot, compiled.held if slot else ())

    def _compiled_for(self, checks: Sequence[Check]) -> _Compiled:
        """What every decide call of ``checks`` says, whoever makes it: made once per list of checks.

        A caller's checks are the same objects request after request (the resolver's), so they
        are known by their ids; an entry holds them, so the ids stay theirs. A list with a sharded
        budget's check is made afresh each time and not kept: its shard is picked per request, so
        it would fill the memo with lists that never come back. Checks made for one call only (a
        failed authentication's) are kept like any, until the memo starts over (it is bounded).
        """
        # A resolution the policy snapshot keeps is one object (its id is enough); others are
        # known by their checks' ids.
        kept = checks if type(checks) is KeptChecks else None
        key: int | tuple[int, ...] = id(kept) if kept is not None else tuple(map(id, checks))
        try:
            return self._compiled[key]
        except KeyError:
            pass
        # A kept resolution is held as itself, so its id stays its own while the entry lives.
        compiled = _Compiled.of(kept if kept is not None else tuple(checks), self.prefix)
        if any(check.policy.is_shard for check in checks):
            return compiled
        return remember(self._compiled, key, compiled)

    def deadline(self, sent_us: int, waiting_s: float = 0.0) -> int:
        """The store-clock moment by which a call sent at ``sent_us`` must run (0: none known yet)."""
        return self.store_clock.deadline_us(sent_us, self.timeouts[0] if self.timeouts else None, waiting_s)

    def _observe(self, sent_us: int, reply: Any) -> None:
        """A decide script's reply: under Redis ``TIME``, its first item is the store's clock when it ran."""
        if self.clock is None and sent_us:  # a peek is not stamped: no send time to bound from
            self.store_clock.observe(sent_us, int(reply[0]))

    @cached_property
    def _async(self) -> AsyncClients | None:
        """The event loops' clients, or ``None`` where ``redis.asyncio`` cannot make this client's connections."""
        if type(self.client) is not redis.Redis:
            return None  # a cluster's, or a client of the project's own kind (REDIS['CLIENT'])
        factory = async_pool_factory(self.client.connection_pool, self.timeouts)
        return AsyncClients(factory) if factory is not None else None

    def decide_call(
        self,
        checks: Sequence[Check],
        *,
        consume: bool,
        usage: Usage | None,
        slot: str | None,
        tag: str | None = None,
        refundable: bool = False,
        wants: Sequence[int] | None = None,
        deadline: int = 0,
    ) -> tuple[list[str], list[Any]]:
        """The decide script's KEYS and ARGV for these checks (``lua/decide.lua`` says what each is).

        ``tag``: on a cluster, the slot tag of the checks' keys, whose copy of the version stamp
        and usage hash the call uses (:mod:`.layout`). ``refundable``: the reply also says what
        ``lua/refund.lua`` needs to give back what the call consumed. ``wants``: a leasing call,
        taking up to that many tokens more from each check (its reply says how many it took).
        ``deadline``: the store-clock moment (us) after which the script does nothing (0: none).
        """
        return self._call_of(
            self._compiled_for(checks),
            consume=consume,
            usage=usage,
            slot=slot,
            tag=tag,
            refundable=refundable,
            wants=wants,
            deadline=deadline,
        )

    def _call_of(
        self,
        compiled: _Compiled,
        *,
        consume: bool,
        usage: Usage | None,
        slot: str | None,
        tag: str | None = None,
        refundable: bool = False,
        wants: Sequence[int] | None = None,
        deadline: int = 0,
    ) -> tuple[list[str], list[Any]]:
        """:meth:`decide_call` of checks compiled: the request's own parts filled in."""
        now = -1.0 if self.clock is None else self.clock()  # negative: the script reads Redis TIME
        mode = (3 if wants is not None else 2 if refundable else 1) if consume else 0
        script_keys = [self.version_key if tag is None else layout.version_key(self.prefix, tag), *compiled.keys]
        shares = compiled.shares
        if shares:
            # The second of the app's clock even under Redis TIME: the key is named before the
            # script runs, and the reconciler reads the seconds that are over by its own clock.
            second = int(now // 1_000_000) if now >= 0 else int(time.time())
            script_keys += shares
            script_keys.append(layout.demand_key(self.prefix, second, tag))
        overflow = usage.overflow.encode() if usage else b""
        header = REQUEST.pack(
            now,
            mode,
            usage.tokens if usage else 1,
            layout.USAGE_TTL_S,
            self.usage_cap,
            len(shares),
            len(overflow),
            deadline,
        )
        records = compiled.records
        if compiled.periods:  # a quota by billing period: the starts around now follow its record
            records = compiled.records_at(int(now) if now >= 0 else time.time_ns() // 1000)
        args: list[Any] = [
            b"".join((header, records, overflow, slot.encode() if slot else b"")),
            usage.field if usage else "",
        ]
        if wants is not None:
            args.append(b"".join(LEASE.pack(want) for want in wants))
        if usage:
            script_keys.append(
                self._usage_key(usage.minute) if tag is None else layout.usage_key(self.prefix, usage.minute, tag)
            )
        return script_keys, args

    def _usage_key(self, minute: int) -> str:
        """The key of ``minute``'s usage hash, made once a minute (every decision names it)."""
        kept = self._minute_key
        if kept[0] != minute:
            self._minute_key = kept = (minute, layout.usage_key(self.prefix, minute))
        return kept[1]

    def give_back(self, grants: Sequence[tuple[Grant, int]]) -> int:
        """Give ``(grant, unused tokens)`` back to their buckets with ``lua/refund.lua``: no more than time has
        not yet refilled of them (so a bucket never holds more than it would had they never been taken).
        """
        keys, args = give_back_call(grants, self.prefix, self.clock)
        return int(self._run(REFUND, keys, args))

    def claim_usage(self, before_minute: int) -> list[tuple[str, int]]:
        live, draining = layout.usage_prefix(self.prefix), layout.drain_prefix(self.prefix)
        batches = []
        with self._store():
            for key in self.client.scan_iter(match=f"{live}*", count=1000):
                minute = _minute(key, live)
                if minute is not None and minute < before_minute:
                    # RENAME is atomic: of two drains racing for a minute, one gets it; the other
                    # sees the key gone. Counts arriving late start a fresh key for that minute.
                    with contextlib.suppress(redis.ResponseError):
                        self.client.rename(key, layout.drain_key(self.prefix, minute, uuid.uuid4().hex))
            for key in self.client.scan_iter(match=f"{draining}*", count=1000):
                name = _text(key)
                minute = _minute(name.rsplit(":", 1)[0], draining)
                if minute is not None:
                    batches.append((name, minute))
        return sorted(batches, key=lambda batch: batch[1])

    def lease_usage(self, batch: str, seconds: float) -> dict[str, int] | None:
        lease = layout.lease_key(self.prefix, batch)
        with self._store():
            if not self.client.set(lease, "1", nx=True, px=max(int(seconds * 1000), 1)):
                return None
            # HSCAN, not HGETALL: a busy minute's hash can take longer than the limiter's tight
            # socket timeout to send in one reply, and would then never drain. A claimed batch
            # is no longer written to, so the scan sees every field (a repeat is the same value).
            counts = {_text(f): int(v) for f, v in self.client.hscan_iter(batch, count=1000)}
            if not counts:  # finished by another drain since it was claimed: nothing to hold
                self.client.delete(lease)
                return None
        return counts

    def peek_usage(self, minutes: Sequence[int], max_fields: int, *, row_prefix: str = "") -> UsagePeek:
        counts: dict[int, dict[str, int]] = {}
        left = max_fields
        keys = [layout.usage_key(self.prefix, minute) for minute in minutes]
        with self._store():
            # Which minutes have counters, in one round trip: a reader asks for up to an hour of them,
            # of which a drain that keeps up leaves one or two.
            with self.client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.exists(key)
                present = pipe.execute()
            for minute, key, exists in zip(minutes, keys, present, strict=True):
                if not exists:
                    continue
                fields, complete = self._scan_hash(key, left, row_prefix)
                if fields:
                    counts[minute] = fields
                    left -= len(fields)
                if not complete:
                    return UsagePeek(counts, truncated=True)
        return UsagePeek(counts)

    def _scan_hash(self, key: str, limit: int, prefix: str = "") -> tuple[dict[str, int], bool]:
        """At most ``limit`` of the hash's ``{field: count}`` (those starting with ``prefix``), and whether that is all.

        ``HSCAN``, as :meth:`lease_usage` reads, and for the same reason; a field the scan returns
        twice (the hash grew meanwhile) is kept once, at its later count. Redis still walks the
        whole hash for a ``prefix`` (``MATCH``), but sends only the fields that match.
        """
        fields: dict[str, int] = {}
        cursor = 0
        match = _glob_escaped(prefix) + "*" if prefix else None
        while True:
            reply = self.client.hscan(key, cursor, match=match, count=min(max(limit, 1), 1000))
            cursor, found = cast("tuple[int, dict[bytes | str, bytes | str]]", reply)  # with no_values=False
            for field, value in found.items():
                fields[_text(field)] = int(value)
            if len(fields) > limit:
                return dict(itertools.islice(fields.items(), limit)), False
            if cursor == 0:
                return fields, True
            if len(fields) == limit:
                return fields, False  # more may follow, and none may be read

    def finish_usage(self, batch: str) -> None:
        with self._store(), self.client.pipeline(transaction=False) as pipe:
            # UNLINK frees a busy minute's hash off the main thread: a DEL of it would hold up every
            # decision on this Redis (and outlast their socket timeout) while it ran.
            pipe.unlink(batch)
            pipe.delete(layout.lease_key(self.prefix, batch))
            pipe.execute()

    def add_usage(self, counts: Mapping[tuple[int, str], int]) -> None:
        minutes, args = self.add_usage_call(counts)
        if minutes:
            # One script for every minute: each new row is capped as a decision's is, and the
            # counts are added all at once or not at all.
            self._run(ADD_USAGE, [layout.usage_key(self.prefix, minute) for minute in minutes], args)

    def add_usage_call(self, counts: Mapping[tuple[int, str], int]) -> tuple[list[int], list[Any]]:
        """The minutes whose hashes ``lua/add_usage.lua`` adds ``counts`` to (its KEYS, in order), and its ARGV."""
        keys: dict[int, int] = {}  # minute -> its key's index in KEYS
        # Counted once: a flush that times out is kept and sent again, so one that ran late must do nothing.
        args: list[Any] = [_USAGE_TTL, self.usage_cap, self.deadline(self.store_clock.now_us())]
        for (minute, field), n in counts.items():
            overflow = overflow_of(field)
            if overflow is not None:
                index = keys.setdefault(minute, len(keys) + 1)
                args += (index, field[:-1], field[-1], overflow, n)
        return list(keys), args

    def release(self, slot: str, keys: Sequence[str]) -> int:
        return int(self._run(RELEASE, list(keys), [slot]))

    def renew(self, held: Mapping[str, Sequence[str]], lease_us: int) -> int:
        keys, args = renew_call(held, lease_us, self.clock)
        return int(self._run(RENEW, keys, args)) if keys else 0

    def clear(self, checks: Sequence[Check]) -> None:
        with self._store():
            self.client.delete(*[check.key(self.prefix) for check in checks])
        self.announce_reset()

    def shares(self, checks: Sequence[Check]) -> dict[str, ShareRecord]:
        keys = [check.key(self.prefix) for check in checks if check.policy.is_global]
        if not keys:
            return {}
        with self._store():
            values = self._read_many([layout.share_key(key) for key in keys])
        found = {key: ShareRecord.read(value) for key, value in zip(keys, values, strict=True)}
        return {key: record for key, record in found.items() if record is not None}

    def last_reconciliation(self) -> dict[str, Any] | None:
        with self._store():
            value = self.client.get(layout.reconciled_key(self.prefix))
        try:
            status = json.loads(value) if value else None
        except ValueError:
            return None
        return status if isinstance(status, dict) else None

    def publish_worker(self, worker: str, state: Mapping[str, Any], ttl_s: float) -> None:
        """One hash field per worker, stamped with when it expires: a worker that stops drops out
        after ``ttl_s``, and the hash itself once no worker has published for that long."""
        key = layout.workers_key(self.prefix)
        ttl_ms = max(int(ttl_s * 1000), 1)
        value = json.dumps({**state, "expires": time.time() + ttl_s})
        with self._store():
            pipe = self.client.pipeline(transaction=False)
            pipe.hset(key, worker, value)
            pipe.pttl(key)
            _, left = pipe.execute()
            # Renewed once half of it has gone (-1: no expiry yet), never shortened by a shorter-lived worker.
            if int(left) < ttl_ms // 2:
                self.client.pexpire(key, ttl_ms)

    def workers(self) -> list[dict[str, Any]]:
        key = layout.workers_key(self.prefix)
        with self._store():
            fields = self.client.hgetall(key)
        now = time.time()
        found, expired = [], []
        for field, value in sorted(fields.items()):
            name = field.decode() if isinstance(field, bytes) else str(field)
            try:
                state = json.loads(value)
            except ValueError:
                state = None
            if isinstance(state, dict) and isinstance(state.get("expires"), (int, float)) and state["expires"] > now:
                found.append({**state, "worker": name})
            else:
                expired.append(field)
        if expired:  # workers that stopped (restarted ones come back under new names): tidy up
            with self._store():
                self.client.hdel(key, *expired)
        return found

    def _read_many(self, keys: list[str]) -> list[Any]:
        return list(self.client.mget(keys))

    def announce_reset(self) -> None:
        """Tell every process a reset happened; a reset that could not be told is still done (warned of)."""
        try:
            self.publish(RESET)
        except BackendUnavailable as exc:
            logger.warning(
                "ratelimits: counters reset, but not announced (%s): other workers may refuse the subject "
                "from memory until their denials end",
                exc,
            )

    def publish_version(self, version: int) -> str:
        stamp = str(int(self._run(PUBLISH_VERSION, [self.version_key], [version, layout.VERSION_TTL_S])))
        self.publish(version_message(version))
        return stamp

    def subscribe(
        self,
        on_message: Callable[[bytes | None], None],
        *,
        wait: bool = True,
        on_tick: Callable[[], None] | None = None,
    ) -> Subscription:
        self._subscribers = [s for s in self._subscribers if s() is not None] + [held(on_message)]
        return Subscription(self.subscription_connection, channel(self.prefix), on_message, wait=wait, on_tick=on_tick)

    def subscription_connection(self) -> Any:
        """A new connection for the invalidation channel, made as the decisions' are."""
        return self._new_connection(self.client.connection_pool)

    def publish(self, message: bytes) -> None:
        """Tell every process, this one first, that what it remembers is stale (:mod:`.invalidation`).

        A store that refuses the channel (an ACL without it) is warned of once: its processes can
        never subscribe either, so none of them answers from memory.
        """
        for subscriber in [s() for s in self._subscribers]:
            if subscriber is not None:
                subscriber(message)
        try:
            with self._store():
                self.client.publish(channel(self.prefix), message)
        except BackendUnavailable as exc:
            if not isinstance(exc.__cause__, redis.exceptions.NoPermissionError):
                raise
            if not self._publish_refused:
                self._publish_refused = True
                logger.warning("ratelimits: the store refuses the invalidation channel (%s): no local fast path", exc)

    def store_health(self) -> StoreHealth:
        """The eviction policy (``CONFIG GET``, else ``INFO memory``, which managed Redis allows more
        often) and ``INFO stats``' ``evicted_keys``. A figure the server refuses to give is ``None``.
        """
        with self._store():
            policy = _refused_is_none(lambda: self.client.config_get("maxmemory-policy").get("maxmemory-policy"))
            memory = _refused_is_none(lambda: self.client.info("memory")) or {}
            stats = _refused_is_none(lambda: self.client.info("stats")) or {}
        policy = policy or memory.get("maxmemory_policy")
        return StoreHealth(
            maxmemory_policy=str(policy) if policy else None,
            maxmemory=_int(memory.get("maxmemory")),
            used_memory=_int(memory.get("used_memory")),
            evicted_keys=_int(stats.get("evicted_keys")),
        )

    @contextlib.contextmanager
    def _store(self) -> Iterator[None]:
        """The error boundary of every call but the scripts': see :data:`STORE_ERRORS`."""
        try:
            yield
        except STORE_ERRORS as exc:
            raise unavailable(exc) from exc

    def _run(
        self,
        script: Script,
        script_keys: Sequence[str],
        args: Sequence[Any],
        stamp: Callable[[Sequence[Any]], Sequence[Any]] | None = None,
    ) -> Any:
        """Run ``script`` on this thread's connection: FCALL if it is a Function the store runs
        (loading it first if the store lost it), else EVALSHA, and EVAL if Redis lost its script cache.

        ``stamp(args)``: the arguments as sent, made as each send goes out, once the connection is
        ready: a deadline counts from the send, not from before a connect, nor from an earlier send
        the store did not run (the worker waits its timeout from the new one). The same boundary as
        :meth:`_store`, written out: this is every decision's path, and a context manager costs a
        microsecond.
        """
        try:
            connection = self._connection()
            if script.function and self.functions.enabled:
                sent = _stamped(args, stamp)
                try:
                    return call(connection, "FCALL", script.function, len(script_keys), *script_keys, *sent)
                except redis.ResponseError as exc:
                    if not self.functions.not_run(exc):
                        raise
                # The function did not run, so sending it again cannot charge twice.
                if self.functions.enabled and load_function(connection, script, self.functions):
                    sent = _stamped(args, stamp)
                    return call(connection, "FCALL", script.function, len(script_keys), *script_keys, *sent)
            sent = _stamped(args, stamp)
            try:
                return call(connection, "EVALSHA", script.sha, len(script_keys), *script_keys, *sent)
            except redis.exceptions.NoScriptError:
                # The script did not run, so sending it again cannot charge twice.
                sent = _stamped(args, stamp)
                return call(connection, "EVAL", script.text, len(script_keys), *script_keys, *sent)
        except STORE_ERRORS as exc:
            raise script_error(script, exc) from exc

    def _connection(self) -> Any:
        """This thread's own connection to Redis, made with the client's settings (:mod:`.transport`)."""
        return self._connections.own(self.client.connection_pool)

    def _thread_connection(self, name: str, pool: Any, **address: Any) -> Any:
        """This thread's own connection ``name`` (a cluster node's), made with ``pool``'s settings and ``address``."""
        return self._connections.node(name, pool, **address)

    def _new_connection(self, pool: Any, **address: Any) -> Any:
        # Replies are read as bytes whatever the client decodes (REDIS['CLIENT'] may decode them).
        kwargs = {**pool.connection_kwargs, **address, "decode_responses": False}
        if self.timeouts is not None:
            # A client the project built (REDIS['CLIENT']) keeps its address, credentials and TLS;
            # a decision still gets the limiter's timeouts and is never retried.
            kwargs.update(tight(*self.timeouts))
        return pool.connection_class(**kwargs)


def _stamped(args: Sequence[Any], stamp: Callable[[Sequence[Any]], Sequence[Any]] | None) -> Sequence[Any]:
    """``args`` as a send goes out now: stamped with its deadline, if the call has one."""
    return args if stamp is None else stamp(args)


def renew_call(
    held: Mapping[str, Sequence[str]], lease_us: int, clock: Callable[[], int] | None
) -> tuple[list[str], list[Any]]:
    """``lua/renew.lua``'s KEYS and ARGV for the slots ``held`` (slot id -> its keys)."""
    keys: list[str] = []
    slots: list[str] = []
    for slot, held_under in held.items():
        keys += held_under
        slots += [slot] * len(held_under)
    return keys, [-1 if clock is None else clock(), lease_us, *slots]


def give_back_call(
    grants: Sequence[tuple[Grant, int]], prefix: str, clock: Callable[[], int] | None
) -> tuple[list[str], list[Any]]:
    """``lua/refund.lua``'s KEYS and ARGV giving ``(grant, unused tokens)`` back to their buckets."""
    records = [REFUND_NOW.pack(-1.0 if clock is None else clock())]
    keys = []
    for grant, unused in grants:
        policy = grant.check.policy
        rate = policy.rate
        record = (policy.algorithm.code, rate.limit, rate.period_us, unused, grant.taken_us, policy.burst)
        records.append(REFUND_CHECK.pack(*record) + REFUNDABLE.pack(grant.spent_tat, grant.given_back))
        keys.append(grant.check.key(prefix))
    return keys, [b"".join(records), "", ""]


def settle_call(
    changes: Sequence[tuple[Spent, int]],
    prefix: str,
    clock: Callable[[], int] | None,
    usage: tuple[str, Usage, int] | None = None,
) -> tuple[list[str], list[Any]]:
    """``lua/refund.lua``'s KEYS and ARGV changing what each spend cost by ``(spent, tokens)``
    (fewer give back, more charge), and with ``usage`` (its minute's hash key, the row, and the
    tokens it gains), the request's usage row."""
    records = [REFUND_NOW.pack(-1.0 if clock is None else clock())]
    keys = []
    for spent, change in changes:
        policy = spent.check.policy
        rate = policy.rate
        record = (policy.algorithm.code, rate.limit, rate.period_us, -change, spent.taken_us, policy.burst)
        records.append(REFUND_CHECK.pack(*record) + REFUNDABLE.pack(spent.spent_tat, spent.given_back))
        keys.append(spent.check.key(prefix))
    args: list[Any] = [b"".join(records), "", "", "", "", 1, ""]
    if usage is not None:
        key, row, tokens = usage
        keys.append(key)
        args[2:] = [row.field, "a", "", row.tokens, row.overflow, tokens]
    return keys, args


def with_spent(decision: Decision, now_us: int, report: bytes) -> Decision:
    """An admission of a refundable decide call with what each of its rate checks spent, as the
    call's report says (``REFUNDABLE`` per check, in their order); a denial as it is."""
    if not decision.allowed:
        return decision
    spent = []
    for i, result in enumerate(decision.results):
        check = result.check
        if result.allowed and not check.policy.holds_slots:
            spent_tat, given_back = REFUNDABLE.unpack_from(report, REFUNDABLE.size * i)
            spent.append(Spent(check, check.cost, now_us, spent_tat, given_back))
    return replace(decision, spent=tuple(spent))


#: What means the store could not answer: Redis' errors (timeouts, refused connections, a read-only
#: replica; a script's own error is told apart: :func:`script_failed`) and the socket's. redis-py
#: drops the connection on timeouts and socket errors (it reconnects on the next use), so a late
#: reply is never read as a later call's answer.
STORE_ERRORS = (redis.RedisError, OSError)


#: Where the deadline is in a decide call's packed request: its header's last number.
_DEADLINE_AT = REQUEST.size - DEADLINE.size


def with_deadline(args: Sequence[Any], deadline: int) -> list[Any]:
    """A decide call's ``args`` with ``deadline`` in its packed request (0: none)."""
    record = args[0]
    return [b"".join((record[:_DEADLINE_AT], DEADLINE.pack(deadline), record[REQUEST.size :])), *args[1:]]


def deadline_of(args: Sequence[Any]) -> int:
    """The deadline a decide call's ``args`` carry (0: none)."""
    (deadline,) = DEADLINE.unpack_from(args[0], _DEADLINE_AT)
    return int(deadline)


class _Compiled(NamedTuple):
    """What every decide call of one list of checks says: their keys, records and slot keys."""

    #: The checks (held: the memo knows them by their ids, or a :class:`KeptChecks` by its own).
    checks: tuple[Check, ...]
    #: Each check's state key, in order (the script's KEYS after the version stamp).
    keys: tuple[str, ...]
    #: Each check's packed record, in order (``lua/decide.lua``'s CHECK).
    records: bytes
    #: The share keys of the global checks, in order.
    shares: tuple[str, ...]
    #: The keys a consuming call holds its slot under (empty: it takes none).
    held: tuple[str, ...]
    #: Whether a check is a quota by billing period, whose record each call completes (:meth:`records_at`).
    periods: bool

    @classmethod
    def of(cls, checks: tuple[Check, ...], prefix: str) -> _Compiled:
        """``checks`` compiled for a backend whose keys start with ``prefix``."""
        keys = tuple(check.key(prefix) for check in checks)
        return cls(
            checks,
            keys,
            b"".join(map(check_record, checks)),
            tuple(layout.share_key(key) for check, key in zip(checks, keys, strict=True) if check.policy.is_global),
            slot_keys(checks, keys),
            any(check.policy.period is not None for check in checks),
        )

    def records_at(self, now_us: int) -> bytes:
        """The records with each billing period's starts around ``now_us`` (the app's clock; the
        script picks among them by its own)."""
        parts = []
        for check in self.checks:
            parts.append(check_record(check))
            period = check.policy.period
            if period is not None:
                parts.append(PERIOD.pack(*period.bounds(now_us)))
        return b"".join(parts)


#: ``Result(...)`` without the Python-level ``__new__`` a NamedTuple has: one per check of every decision.
_result = tuple.__new__


@dataclass(slots=True)
class _DecideCall:
    """One decide script call, made: its keys and arguments, and the slot it would take."""

    backend: RedisBackend
    checks: Sequence[Check]
    keys: list[str]
    args: list[Any]
    slot: str | None
    held: tuple[str, ...]
    #: When it was sent, on this process's wall clock (us): what its reply's time is an offset bound from.
    sent: int = 0

    def stamped(self, args: Sequence[Any], *, waiting_s: float = 0.0) -> list[Any]:
        """``args`` with the call's deadline, from now, its send (``lua/decide.lua``'s REQUEST, last)."""
        self.sent = sent = self.backend.store_clock.now_us()
        return with_deadline(args, self.backend.deadline(sent, waiting_s))

    def failed(self, exc: BackendUnavailable) -> None:
        """Tell ``exc`` what it means for this call."""
        if isinstance(exc, PolicyFailed):
            exc.checks = tuple(self.checks)  # the script failed outside any one check: every check is suspect
        elif self.slot:
            # A store that timed out may still run the script and take the slot: hand its id
            # back so the request's end releases it (releasing is idempotent).
            exc.stray_slot = (self.slot, self.held)

    def decision(self, reply: Any) -> Decision:
        """The script's ``reply`` read into a decision (:func:`decide_results`, then
        :meth:`Decision.from_results`, in one pass: this is every decision's path)."""
        results = []
        refused = False
        at = 2
        for check in self.checks:
            retry = reply[at + 2]
            if retry:
                refused = True
            results.append(_result(Result, (check, retry == 0, reply[at], reply[at + 1], retry)))
            at += 3
        version = reply[1]
        policy_version = version.decode() if isinstance(version, bytes) else None
        if not refused:  # every check allowed: the common case
            return admitted(tuple(results), reply[0], policy_version, self.slot, self.held)
        failed = [result.check for result in results if result.retry_us == _FAILED]
        if failed:
            raise policy_failed(failed)
        return Decision.from_results(
            results, now_us=reply[0], policy_version=policy_version, slot=self.slot, slot_keys=self.held
        )


def _granted(checks: Sequence[Check], decision: Decision, reply: Any) -> tuple[Decision, list[Grant]]:
    """A leasing call's decision, and the tokens it took beyond each check's cost."""
    spent, taken = reply[-2], reply[-1]
    grants = []
    for i, check in enumerate(checks):
        (tokens,) = LEASE.unpack_from(taken, LEASE.size * i)
        if tokens > 0:
            spent_tat, given_back = REFUNDABLE.unpack_from(spent, REFUNDABLE.size * i)
            grants.append(Grant(check, int(tokens), reply[0], spent_tat, given_back))
    return decision, grants


def load_function(connection: Any, script: Script, functions: Functions) -> bool:
    """Load ``script``'s library on ``connection``'s store; ``False`` if the store refuses Functions."""
    try:
        call(connection, "FUNCTION", "LOAD", "REPLACE", script.library)
    except redis.ResponseError as exc:
        if functions.refused(exc):
            return False
        raise
    return True


async def _arun(
    client: Any,
    script: Script,
    script_keys: Sequence[str],
    args: Sequence[Any],
    functions: Functions,
    stamp: Callable[[Sequence[Any]], Sequence[Any]] | None = None,
) -> Any:
    """:meth:`RedisBackend._run` on a ``redis.asyncio`` client: the same errors mean the same, and
    each send is stamped as it goes out."""
    try:
        if script.function and functions.enabled:
            try:
                sent = _stamped(args, stamp)
                return await client.execute_command("FCALL", script.function, len(script_keys), *script_keys, *sent)
            except redis.ResponseError as exc:
                if not functions.not_run(exc):
                    raise
            if functions.enabled:
                try:
                    await client.execute_command("FUNCTION", "LOAD", "REPLACE", script.library)
                except redis.ResponseError as exc:
                    if not functions.refused(exc):
                        raise
                else:
                    sent = _stamped(args, stamp)
                    return await client.execute_command("FCALL", script.function, len(script_keys), *script_keys, *sent)
        try:
            sent = _stamped(args, stamp)
            return await client.execute_command("EVALSHA", script.sha, len(script_keys), *script_keys, *sent)
        except redis.exceptions.NoScriptError:
            # The script did not run, so sending it again cannot charge twice.
            sent = _stamped(args, stamp)
            return await client.execute_command("EVAL", script.text, len(script_keys), *script_keys, *sent)
    except STORE_ERRORS as exc:
        raise script_error(script, exc) from exc


def script_error(script: Script, exc: BaseException) -> BackendUnavailable:
    """What a failed call of ``script`` tells the engine: the script's own failure (a policy's
    state or arguments it cannot use) is a :class:`PolicyFailed`; anything else, the store's."""
    if isinstance(exc, redis.ResponseError) and script_failed(exc):
        return PolicyFailed(f"{script.name} failed: {exc}", ())
    return unavailable(exc)


def decide_results(checks: Sequence[Check], reply: Sequence[Any]) -> tuple[list[Result], list[Check]]:
    """The decide script's reply read: each check's result, and the checks it could not decide."""
    results = []
    failed = []
    at = 2
    for check in checks:
        retry = reply[at + 2]
        if retry == _FAILED:
            failed.append(check)
        results.append(Result(check, retry == 0, reply[at], reply[at + 1], retry))
        at += 3
    return results, failed


def policy_failed(failed: Sequence[Check]) -> PolicyFailed:
    names = ", ".join(f"{check.policy.name} of {check.subject}" for check in failed)
    return PolicyFailed(f"the store could not decide {names} (a key of another type, or bad arguments)", tuple(failed))


def script_failed(exc: redis.ResponseError) -> bool:
    """Whether a script's error is its own (a key of another type, a bad value, a Lua error).

    Redis suffixes every error raised inside a script with ``@user_script`` (inside a Function,
    ``@user_function``); redis-py gives the
    store's own conditions (OOM, READONLY, NOPERM, MASTERDOWN, ...) their own classes, and the
    rest (BUSY, MISCONF, NOREPLICAS, ...) their own codes: all of those still mean the store
    cannot answer now.
    """
    message = str(exc)
    if type(exc) is not redis.ResponseError or not ("@user_script" in message or "@user_function" in message):
        return False
    return message.startswith(("ERR ", "WRONGTYPE ", "user_script:", "user_function:"))


def unavailable(exc: BaseException) -> BackendUnavailable:
    """The one way a store error is reported to the engine (which degrades by fail mode)."""
    return BackendUnavailable(f"{type(exc).__name__}: {exc}")


def _refused_is_none(command: Callable[[], Any]) -> Any:
    """``command()``, or ``None`` if the server refuses it (renamed away, or denied by an ACL)."""
    try:
        return command()
    except redis.ResponseError:
        return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _minute(key: bytes | str, prefix: str) -> int | None:
    name = _text(key)
    suffix = name[len(prefix) :]
    return int(suffix) if name.startswith(prefix) and suffix.isdigit() else None


_clients: dict[tuple[Any, ...], redis.Redis | RedisCluster] = {}


def make_client(
    url: str, socket_timeout: float, connect_timeout: float, options: Mapping[str, Any] | None = None
) -> redis.Redis | RedisCluster:
    """A process-wide client per URL, timeouts and options (redis-py pools reset themselves after fork).

    See :mod:`ratelimits.backends.connection` for what the URL and options may say.
    """
    key = (url, socket_timeout, connect_timeout, tuple(sorted((options or {}).items())))
    client = _clients.get(key)
    if client is None:
        client = _clients[key] = new_client(url, socket_timeout, connect_timeout, options)
    return client
