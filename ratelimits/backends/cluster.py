"""Redis Cluster backend: a decision's checks grouped by slot, one script call per group, all sent at once.

A subject's keys share its hash tag, so a request touches one slot for its caller's own policies
and one for each shared subject (its IP, organisation, an endpoint-wide limit). Each group is one
call of ``lua/decide.lua`` on the master of its slot (``FCALL`` of its Function, ``EVALSHA`` where
a node refuses Functions); the calls go out to their nodes
before any reply is read, so a decision costs about one round trip however many groups it has.

All or nothing across groups: when a group denies, the groups that admitted are given back what
they consumed by ``lua/refund.lua``. A refund gives back only what the state still holds of the
request's own consumption, so it never creates a token; meanwhile a concurrent request may have
been denied for want of it (a brief under-admission, never an over-admission).

Token leases work as on one Redis, per slot group: a leasing call takes each group's tokens in
that group's script, so a request one group denies gives back what the others took for it,
leases and all, by the same refund; and a lease's unused tokens go back to their buckets with
one refund call per slot group, the calls sent at once.

Redirects: a ``MOVED`` reply (the slot moved, or a replica was promoted), an ``ASK`` reply (the
slot is being migrated) and ``TRYAGAIN`` (a migration has moved some of the call's keys, not all)
mean the script did not run: the call is sent again where the reply says (after a short pause for
``TRYAGAIN``), a few times at most. A call that timed out is never sent again: it may have
consumed. Everything else (a node lost mid-call, ``CLUSTERDOWN``) is the store being unavailable,
and the request follows its policies' fail modes.
"""

from __future__ import annotations

import contextlib
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import redis
from redis.cluster import RedisCluster

from ..algorithms import Algorithm
from ..conf import conf
from ..counters import Usage
from ..decisions import Decision, Result, Spent
from ..exceptions import BackendUnavailable
from ..policies.values import Check
from . import layout
from .base import Grant, PolicyFailed, StoreHealth, UsagePeek, new_slot, slot_keys
from .codec import LEASE, REFUND_CHECK, REFUND_NOW, REFUNDABLE
from .invalidation import version_message
from .redis import (
    ADD_USAGE,
    DECIDE,
    PUBLISH_VERSION,
    REFUND,
    RELEASE,
    RENEW,
    STORE_ERRORS,
    RedisBackend,
    Script,
    deadline_of,
    decide_results,
    give_back_call,
    load_function,
    make_client,
    policy_failed,
    renew_call,
    script_error,
    settle_call,
    unavailable,
    with_deadline,
)
from .transport import read, send

__all__ = ["REFUND", "ClusterBackend"]

T = TypeVar("T")

#: How many copies of the version stamp one round of :meth:`ClusterBackend.publish_version` writes.
PUBLISH_BATCH = 2048
#: Replies saying the store did not run a call: it may be sent again (:meth:`ClusterBackend._send_again`).
NOT_RUN = (redis.exceptions.NoScriptError, redis.exceptions.AskError, redis.exceptions.TryAgainError)
#: How many times a call the store did not run is sent again, and the pause after a TRYAGAIN
#: (a slot's migration moves its keys within milliseconds).
SEND_AGAIN = 4
TRY_AGAIN_PAUSE_S = 0.002
#: The shortest pause between two refreshes of the slot map after a node failed to answer.
REFRESH_EVERY_S = 0.2


@dataclass(frozen=True, slots=True)
class _Recount:
    """The first group's count of a request, to be moved from the ``counted`` metric to ``metric`` ("": none)."""

    call: _Call
    usage: Usage
    counted: str
    metric: str


def _limited(result: Result) -> bool:
    """Whether ``result`` denies the request as over a limit (429), rather than shed by the fleet (503)."""
    policy = result.check.policy
    return not result.allowed and not policy.shadow and policy.algorithm is not Algorithm.FLEET


@dataclass(slots=True)
class _Call:
    """One script call to one slot's master, and what came back (a reply, or the error)."""

    slot: int
    keys: list[str]
    args: list[Any]
    #: Indices, into the request's checks, of the checks this call decides.
    indices: list[int] = field(default_factory=list)
    reply: Any = None
    error: BaseException | None = None
    #: A decide call's reply read: its checks' results, and those it could not decide.
    results: list[Result] = field(default_factory=list)
    failed: list[Check] = field(default_factory=list)


class ClusterBackend(RedisBackend):
    """Shared state on a Redis Cluster: one script call per slot group, sent concurrently.

    ``client`` is a :class:`redis.RedisCluster`, or a function making one: the cluster is first
    reached when the limiter first needs it, so an unreachable cluster degrades requests by
    their fail modes instead of failing the process at start-up.
    """

    #: Asked from a thread on the async path: the slot groups' calls are the sync client's (and
    #: reading ``client`` here would connect to the cluster, on the event loop).
    _async = None

    def __init__(
        self,
        client: RedisCluster | Callable[[], RedisCluster],
        *,
        prefix: str = "rl",
        clock: Callable[[], int] | None = None,
        usage_cap: int | None = None,
        timeouts: tuple[float, float] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        # The rest as on one Redis; the client is set through the property's setter. (The single
        # version key goes unused: on a cluster each slot has its copy.)
        super().__init__(client, prefix=prefix, clock=clock, usage_cap=usage_cap, timeouts=timeouts)  # type: ignore[arg-type]
        #: When the slot map was last refreshed after a node failed (monotonic seconds).
        self._refreshed_at = -REFRESH_EVERY_S
        self._stale_map = False
        self._template_pool: Any = None
        self._usage_pattern = re.compile(rf"{re.escape(prefix)}:\{{([0-9a-f]+)\}}#usage:(\d+)")
        self._drain_pattern = re.compile(rf"{re.escape(prefix)}:\{{[0-9a-f]+\}}#usage-drain:(\d+):[0-9a-f]+")

    @classmethod
    def from_settings(cls) -> ClusterBackend:
        """For ``REDIS['CLIENT']`` (a :class:`redis.RedisCluster`) or a cluster's URL: reached on first use."""
        options = cls.options_from_settings()
        client = conf.redis.client
        url, redis_options = conf.redis.address
        socket_timeout, connect_timeout = options["timeouts"]
        if isinstance(client, RedisCluster):
            return cls(client, **options)
        return cls(lambda: make_client(url, socket_timeout, connect_timeout, redis_options), **options)  # type: ignore[arg-type, return-value]

    _cluster: RedisCluster | None
    _connect: Callable[[], RedisCluster] | None

    @property  # type: ignore[override]
    def client(self) -> RedisCluster:
        """The cluster client, made (its slot map read) on first use; unavailable if the cluster cannot be reached."""
        cluster = self._cluster
        if cluster is None:
            with self._lock:
                if self._cluster is None:
                    assert self._connect is not None
                    try:
                        self._cluster = self._connect()
                    except (*STORE_ERRORS, redis.exceptions.RedisClusterException) as exc:
                        raise unavailable(exc) from exc
                cluster = self._cluster
        return cluster

    @client.setter  # type: ignore[override]
    def client(self, client: RedisCluster | Callable[[], RedisCluster]) -> None:
        if isinstance(client, RedisCluster):
            self._cluster, self._connect = client, None
        else:
            self._cluster, self._connect = None, client

    # -- decisions ---------------------------------------------------------------------------------

    def decide(self, checks: Sequence[Check], *, consume: bool = True, usage: Usage | None = None) -> Decision:
        return self._decided(checks, consume=consume, usage=usage)[0]

    def lease(
        self, checks: Sequence[Check], wants: Sequence[int], *, usage: Usage | None = None
    ) -> tuple[Decision, list[Grant]]:
        return self._decided(checks, consume=True, usage=usage, wants=wants)

    def decide_to_settle(self, checks: Sequence[Check], *, usage: Usage | None = None) -> Decision:
        return self._decided(checks, consume=True, usage=usage, refundable=True)[0]

    def settle(
        self,
        changes: Sequence[tuple[Spent, int]],
        usage: Usage | None = None,
        tokens: int = 0,
        *,
        counted_by: Check | None = None,
    ) -> int:
        """One refund call per hash slot the spends' keys are in, sent at once. The usage row's
        tokens change in the hash of ``counted_by``'s slot (the first check's group counts a
        request), in its group's call, or a call of its own."""
        prefix = self.prefix
        groups: dict[int, list[tuple[Spent, int]]] = _by_slot(changes, lambda change: change[0].check.key(prefix))
        counted_in = None
        if usage is not None and tokens:
            first = counted_by or (changes[0][0].check if changes else None)
            if first is not None:
                counted_in = layout.key_slot(first.key(prefix).encode())
                groups.setdefault(counted_in, [])
        calls = []
        for hash_slot, group in groups.items():
            counted = None
            if usage is not None and hash_slot == counted_in:
                counted = (layout.usage_key(prefix, usage.minute, layout.slot_tag(hash_slot)), usage, tokens)
            calls.append(_Call(hash_slot, *settle_call(group, prefix, self.clock, counted)))
        return self._run_counted(REFUND, calls) if calls else 0

    def _decided(
        self,
        checks: Sequence[Check],
        *,
        consume: bool,
        usage: Usage | None,
        wants: Sequence[int] | None = None,
        refundable: bool = False,
    ) -> tuple[Decision, list[Grant]]:
        """One call per slot group, sent at once: the decision, and what a leasing call (``wants``)
        took; ``refundable``, an admission records what each rate check spent (``Decision.spent``)."""
        slot = new_slot(checks) if consume else None
        sent = self.store_clock.now_us()
        calls = self.decide_calls(
            checks, consume=consume, usage=usage, slot=slot, wants=wants, refundable=True if refundable else None
        )
        self._run_calls(DECIDE, calls)
        for call in calls:
            if call.error is None:
                self._observe(sent, call.reply)  # the masters' clocks differ: the least bound is kept
        held = _held(checks, calls) if slot else ()
        results: list[Result | None] = [None] * len(checks)
        failed: list[Check] = []
        errors = []
        admitted = []  # the calls that consumed: every enforced check in them allowed
        for call in calls:
            if call.error is not None:
                errors.append(call)
                continue
            call.results, call.failed = decide_results([checks[i] for i in call.indices], call.reply)
            failed += call.failed
            for i, result in zip(call.indices, call.results, strict=True):
                results[i] = result
            if consume and not call.failed and all(r.allowed or r.check.policy.shadow for r in call.results):
                admitted.append(call)
        decided = [r for r in results if r is not None]
        if errors or failed:
            # Nothing of this request may stand: what the other groups consumed goes back, and so
            # does the first group's count of it (the engine counts the request as it decides it).
            stray = self._refund(checks, admitted, usage=self._recount(calls, usage, None), slot=slot)
            lost = [call for call in errors if not isinstance(call.error, PolicyFailed)]
            if lost or stray:  # the store could not answer for some: every check goes by its fail mode
                exc = lost[0].error if lost else unavailable(ConnectionError("a refund did not get through"))
                assert isinstance(exc, BackendUnavailable)
                if slot and any(checks[i].policy.holds_slots for call in lost for i in call.indices):
                    exc.stray_slot = (slot, held)  # a timed-out group may still take the slot
                elif stray:
                    exc.stray_slot = stray
                raise exc
            # Only these checks' scripts failed: the engine decides again without them.
            suspect = [checks[i] for call in errors for i in call.indices] + failed
            failure = errors[0].error if errors else policy_failed(failed)
            assert isinstance(failure, PolicyFailed)
            failure.checks = tuple(suspect)
            raise failure
        now_us = calls[0].reply[0]
        version = max((_stamp(call.reply[1]) for call in calls), key=_stamp_order)
        if len(admitted) < len(calls) and consume:
            denied_by_rate = any(_limited(r) for r in decided)
            recount = self._recount(calls, usage, "l" if denied_by_rate else "s")
            stray = self._refund(checks, admitted, usage=recount, slot=slot)
            decision = Decision.from_results(decided, now_us=now_us, policy_version=version)
            return (decision if stray is None else _with_stray(decision, stray)), []
        decision = Decision.from_results(decided, now_us=now_us, policy_version=version, slot=slot, slot_keys=held)
        if refundable:
            decision = replace(decision, spent=_spent(calls))
        return decision, _grants(checks, calls) if wants is not None else []

    @staticmethod
    def _recount(calls: Sequence[_Call], usage: Usage | None, metric: str | None) -> _Recount | None:
        """How the first group's count of the request must change, if it must: to ``metric``, or away (``None``).

        The first group counts the request as its own checks decided it (``lua/decide.lua``);
        the request ended otherwise when another group denied it, or failed.
        """
        first = calls[0]
        if usage is None or first.error is not None:
            return None
        if first.failed:
            return None  # a group with a failed check counts nothing
        denied = [r for r in first.results if not r.allowed and not r.check.policy.shadow]
        counted = "a" if not denied else "l" if any(_limited(r) for r in denied) else "s"
        if counted == metric:
            return None
        return _Recount(first, usage, counted, metric or "")

    def decide_calls(
        self,
        checks: Sequence[Check],
        *,
        consume: bool,
        usage: Usage | None,
        slot: str | None,
        refundable: bool | None = None,
        wants: Sequence[int] | None = None,
    ) -> list[_Call]:
        """One decide script call per slot among ``checks``' keys; the first check's group counts ``usage``.

        The calls report what a refund needs when there are several (``refundable``, if not said),
        and when they lease (``wants``: per check, the tokens to take beyond its cost).
        """
        groups = self._slot_groups(checks)
        calls = []
        if refundable is None:
            refundable = len(groups) > 1  # what a group consumed may have to be given back
        # One deadline for every group: a group that runs late does nothing, and is refunded as a
        # group that failed (what the others consumed goes back).
        deadline = self.deadline(self.store_clock.now_us()) if consume else 0
        for n, (hash_slot, indices) in enumerate(groups.items()):
            keys, args = self.decide_call(
                [checks[i] for i in indices],
                consume=consume,
                usage=usage if n == 0 else None,
                slot=slot,
                tag=layout.slot_tag(hash_slot),
                refundable=refundable,
                wants=None if wants is None else [wants[i] for i in indices],
                deadline=deadline,
            )
            calls.append(_Call(hash_slot, keys, args, indices))
        return calls

    def call_groups(self, checks: Sequence[Check]) -> list[list[int]] | None:
        groups = list(self._slot_groups(checks).values())
        return groups if len(groups) > 1 else None

    def _slot_groups(self, checks: Sequence[Check]) -> dict[int, list[int]]:
        """``checks``' indices by the hash slot of their keys, in the order of their first check."""
        prefix = self.prefix
        return _by_slot(range(len(checks)), lambda i: checks[i].key(prefix))

    def _refund(
        self,
        checks: Sequence[Check],
        admitted: Sequence[_Call],
        *,
        usage: _Recount | None,
        slot: str | None,
    ) -> tuple[str, tuple[str, ...]] | None:
        """Give back what ``admitted`` consumed, and count the usage anew; the slot keys still held if a refund failed.

        What a leasing call took for the worker goes back with the request's own cost. A refund
        that fails leaves tokens spent (under-admission only).
        """
        refunds: dict[int, _Call] = {}  # by the decide call's slot
        for call in admitted:
            now_us = call.reply[0]
            records = [REFUND_NOW.pack(-1.0 if self.clock is None else self.clock())]
            keys = []
            spent_all, taken = _reply_tail(call)
            for n, result in enumerate(call.results):
                if not result.allowed:
                    continue  # a shadow check that would have denied wrote nothing
                check = result.check
                policy, rate = check.policy, check.policy.rate
                spent = spent_all[REFUNDABLE.size * n : REFUNDABLE.size * (n + 1)]  # as the decide call reported it
                tokens = check.cost + (LEASE.unpack_from(taken, LEASE.size * n)[0] if taken else 0)
                record = (policy.algorithm.code, rate.limit, rate.period_us, tokens, now_us, policy.burst)
                records.append(REFUND_CHECK.pack(*record) + spent)
                keys.append(check.key(self.prefix))
            refunds[call.slot] = _Call(call.slot, keys, [b"".join(records), slot or "", "", "", "", 1, ""])
        if usage is not None:
            refund = refunds.setdefault(
                usage.call.slot, _Call(usage.call.slot, [], [REFUND_NOW.pack(-1.0), "", "", "", "", 1, ""])
            )
            refund.keys.append(usage.call.keys[-1])
            refund.args[2:] = [usage.usage.field, usage.counted, usage.metric, usage.usage.tokens, usage.usage.overflow]
        if not refunds:
            return None
        self._run_calls(REFUND, list(refunds.values()))
        held = _held(checks, [call for call in admitted if refunds[call.slot].error is not None])
        return (slot, held) if slot and held else None

    def _run_calls(self, script: Script, calls: Sequence[_Call]) -> None:
        """Run ``script`` once per call, each on its slot's master: every call sent before any reply is read.

        Each call ends with its ``reply`` or its ``error`` (a :class:`BackendUnavailable` or
        :class:`PolicyFailed`); none is ever sent twice unless the store said it did not run it.
        """
        self._refresh_if_stale()
        # Each node's connection is taken once per round: taking it again would ask whether it
        # has something to read, and the replies of this round's earlier calls are just that.
        connections: dict[tuple[str, int], Any] = {}
        # A node whose connection failed this round: what failed. Calls already sent on it may have
        # run, and get no reply; later calls are not sent (nor is a dead node dialled again).
        broken: dict[tuple[str, int], BaseException] = {}
        sent: list[tuple[_Call, tuple[str, int], Any]] = []
        try:
            for call in calls:
                try:
                    address = self._address_of(call.slot)
                except STORE_ERRORS as exc:
                    call.error = self._failed(script, exc)
                    continue
                try:
                    if address in broken:
                        raise broken[address]
                    connection = connections.get(address)
                    if connection is None:
                        connection = connections[address] = self._address_connection(*address)
                    command = (*self._body(script), len(call.keys), *call.keys, *call.args)
                    send(connection, command)
                except STORE_ERRORS as exc:
                    broken.setdefault(address, exc)
                    call.error = self._failed(script, exc)
                    continue
                sent.append((call, address, connection))
            # Replies are read in the order sent: calls to one node share its connection, pipelined.
            # A call the store did not run is sent again only once every reply is in.
            again: list[tuple[_Call, BaseException]] = []
            for call, address, connection in sent:
                if address in broken:
                    call.error = self._failed(script, broken[address])
                    continue
                try:
                    call.reply = read(connection)
                except NOT_RUN as not_run:
                    again.append((call, not_run))
                except STORE_ERRORS as exc:
                    if isinstance(exc, redis.ResponseError):
                        # The node answered (an error): its connection is in step, and its next
                        # reply is the next call's. A Redis Function it lacks or refuses did not run.
                        if self.functions.not_run(exc):
                            again.append((call, exc))
                        else:
                            call.error = self._failed(script, exc)
                        continue
                    broken[address] = exc
                    call.error = self._failed(script, exc)
        except BaseException:
            # Something else went wrong with replies unread: none of them may be read as a later call's.
            for connection in connections.values():
                connection.disconnect()
            raise
        for call, reason in again:
            try:
                call.reply = self._send_again(script, call, reason)
            except STORE_ERRORS as exc:
                call.error = self._failed(script, exc)

    def _send_again(self, script: Script, call: _Call, reason: BaseException) -> Any:
        """Send a call the store said it did not run, where and as the store said; a few times at most.

        ``MOVED``: to the slot's new master (the slot map learns it). ``ASK``: to the node importing
        the slot, for this call only. ``NOSCRIPT``: the script in full. A Redis Function the node
        lacks (a promoted replica, a restart): its library loaded there first; one it refuses: the
        script in full from then on. ``TRYAGAIN`` (a migration has moved some of the call's keys
        and not others): after a pause, to the slot's master.
        """
        full = load = False
        address: tuple[str, int] | None = None  # the node an ASK named
        for attempt in range(SEND_AGAIN):
            if isinstance(reason, redis.exceptions.MovedError):
                self.client.nodes_manager.move_slot(reason)
                address = None
            elif isinstance(reason, redis.exceptions.AskError):
                address = (reason.host, reason.port)
            elif isinstance(reason, redis.exceptions.TryAgainError):
                time.sleep(TRY_AGAIN_PAUSE_S * (attempt + 1))
            elif isinstance(reason, redis.exceptions.NoScriptError) or not self.functions.enabled:
                full = True  # the node lacks the script, or refuses Functions: the script in full
            else:  # the node lacks the function
                load = True
            connection = self._address_connection(*(address or self._address_of(call.slot)))
            if load:
                load = False
                if not load_function(connection, script, self.functions):
                    full = True
            body = ("EVAL", script.text) if full else self._body(script)
            if script is DECIDE and deadline_of(call.args):
                # Sent again, so stamped again: the worker waits its timeout from this send.
                call.args = with_deadline(call.args, self.deadline(self.store_clock.now_us()))
            command = (*body, len(call.keys), *call.keys, *call.args)
            if address:
                send(connection, ("ASKING",), command)
            else:
                send(connection, command)
            try:
                if address:
                    read(connection)  # ASKING's OK
                return read(connection)
            except NOT_RUN as not_run:
                reason = not_run
            except redis.ResponseError as exc:
                if not self.functions.not_run(exc):
                    raise
                reason = exc
        raise reason

    def _body(self, script: Script) -> tuple[str, str]:
        """How ``script`` is called: ``FCALL`` of its function where the nodes run Functions, else ``EVALSHA``."""
        if script.function and self.functions.enabled:
            return ("FCALL", script.function)
        return ("EVALSHA", script.sha)

    def _failed(self, script: Script, exc: BaseException) -> BaseException:
        failure = script_error(script, exc)
        if isinstance(failure, PolicyFailed):
            return failure
        if not isinstance(exc, redis.ResponseError) or isinstance(exc, redis.exceptions.ClusterDownError):
            self._stale_map = True  # a node is gone, or the cluster is reconfiguring: read the map again
        return failure

    def _refresh_if_stale(self) -> None:
        """Read the slot map again after a node failed to answer: at most every ``REFRESH_EVERY_S``, one thread."""
        if not self._stale_map:
            return
        now = time.monotonic()
        if now - self._refreshed_at < REFRESH_EVERY_S or not self._lock.acquire(blocking=False):
            return
        try:
            self._refreshed_at = now
            self.client.nodes_manager.initialize()
            self._stale_map = False
        except (*STORE_ERRORS, redis.exceptions.RedisClusterException, BackendUnavailable):
            pass  # still stale: asked again after the pause
        finally:
            self._lock.release()

    def _address_of(self, hash_slot: int) -> tuple[str, int]:
        """Where the slot map says ``hash_slot``'s master is."""
        try:
            node = self.client.nodes_manager.get_node_from_slot(hash_slot)
        except redis.exceptions.SlotNotCoveredError as exc:
            raise redis.exceptions.ClusterDownError(str(exc)) from exc
        return node.host, node.port

    def _address_connection(self, host: str, port: int) -> Any:
        """This thread's connection to the node at ``host:port``, with the cluster's connection settings."""
        pool = self._template_pool
        if pool is None:
            # Any node's pool says how the cluster's connections are made (credentials, TLS): the
            # same for every node. Read once, from a copy: the slot map may be refreshed meanwhile.
            nodes = list(self.client.nodes_manager.nodes_cache.values())
            pool = next(n.redis_connection.connection_pool for n in nodes if n.redis_connection is not None)
            self._template_pool = pool
        return self._thread_connection(f"{host}:{port}", pool, host=host, port=port)

    def _connection(self) -> Any:  # pragma: no cover - every call on a cluster names its slot
        raise NotImplementedError("a cluster call is sent to its slot's master")

    # -- everything else ---------------------------------------------------------------------------

    def release(self, slot: str, keys: Sequence[str]) -> int:
        return self._run_counted(
            RELEASE, [_Call(hash_slot, group, [slot]) for hash_slot, group in _by_slot(keys).items()]
        )

    def renew(self, held: Mapping[str, Sequence[str]], lease_us: int) -> int:
        """As a single Redis's, one script per hash slot the keys are in."""
        owners = {key: slot for slot, keys in held.items() for key in keys}
        calls = []
        for hash_slot, group in _by_slot(list(owners)).items():
            keys, args = renew_call({owners[key]: [key] for key in group}, lease_us, self.clock)
            calls.append(_Call(hash_slot, keys, args))
        return self._run_counted(RENEW, calls)

    def give_back(self, grants: Sequence[tuple[Grant, int]]) -> int:
        """As a single Redis's, one refund call per hash slot the grants' buckets are in, sent at once.

        If one fails, its error is raised, though the others' tokens went back all the same (the
        local path then counts every token unreturned: a figure, not a loss).
        """
        prefix = self.prefix
        groups = _by_slot(grants, lambda grant: grant[0].check.key(prefix))
        calls = [_Call(hash_slot, *give_back_call(group, prefix, self.clock)) for hash_slot, group in groups.items()]
        return self._run_counted(REFUND, calls)

    def _run_counted(self, script: Script, calls: Sequence[_Call]) -> int:
        """Run ``script``'s ``calls``, each on its slot's master, all sent at once: the sum of their
        replies (what each counted); the first call's error if one failed (the others ran all the same)."""
        self._run_calls(script, calls)
        for call in calls:
            if call.error is not None:
                raise call.error
        return sum(int(call.reply) for call in calls)

    def clear(self, checks: Sequence[Check]) -> None:
        with self._store():
            for group in _by_slot([check.key(self.prefix) for check in checks]).values():
                self.client.delete(*group)
        self.announce_reset()

    def _read_many(self, keys: list[str]) -> list[Any]:
        return list(self.client.mget_nonatomic(keys))  # a key per slot: one MGET per node

    def subscription_connection(self) -> Any:
        """A connection to any node: a cluster's nodes pass every ``PUBLISH`` on to each other."""
        nodes = [n for n in self.client.nodes_manager.nodes_cache.values() if n.redis_connection is not None]
        node = random.choice(nodes)
        return self._new_connection(node.redis_connection.connection_pool, host=node.host, port=node.port)

    def publish_version(self, version: int) -> str:
        """Raise every slot's copy of the version stamp: the next request anywhere sees it."""
        with self._store():
            self.client.script_load(PUBLISH_VERSION.text)  # on every master: each copy is then one EVALSHA
        args = [version, layout.VERSION_TTL_S]
        stamps = []
        for start in range(0, layout.REDIS_CLUSTER_HASH_SLOTS, PUBLISH_BATCH):
            calls = [
                _Call(s, [layout.version_key(self.prefix, layout.slot_tag(s))], args)
                for s in range(start, min(start + PUBLISH_BATCH, layout.REDIS_CLUSTER_HASH_SLOTS))
            ]
            self._run_calls(PUBLISH_VERSION, calls)
            for call in calls:
                if call.error is not None:
                    raise call.error
                stamps.append(int(call.reply))
        self.publish(version_message(version))
        return str(min(stamps))

    def add_usage(self, counts: Mapping[tuple[int, str], int]) -> None:
        minutes, args = self.add_usage_call(counts)
        if minutes:
            # Every minute's hash in one slot, any slot: one script, and the counts spread.
            hash_slot = random.randrange(layout.REDIS_CLUSTER_HASH_SLOTS)
            tag = layout.slot_tag(hash_slot)
            calls = [_Call(hash_slot, [layout.usage_key(self.prefix, m, tag) for m in minutes], args)]
            self._run_calls(ADD_USAGE, calls)
            if calls[0].error is not None:
                raise calls[0].error

    def claim_usage(self, before_minute: int) -> list[tuple[str, int]]:
        """Every slot's usage hash of a finished minute, renamed out of the live set in its own slot."""
        batches = []
        with self._store():
            client = self.client
            for key in client.scan_iter(match=f"{self.prefix}:{{*}}#usage:*", count=1000):
                found = self._usage_pattern.fullmatch(_text(key))
                if found and int(found[2]) < before_minute:
                    tag, minute = found[1], int(found[2])
                    with contextlib.suppress(redis.ResponseError):  # another drain renamed it first
                        client.rename(key, layout.drain_key(self.prefix, minute, uuid.uuid4().hex, tag))
            for key in client.scan_iter(match=f"{self.prefix}:{{*}}#usage-drain:*", count=1000):
                name = _text(key)
                found = self._drain_pattern.fullmatch(name)
                if found:
                    batches.append((name, int(found[1])))
        return sorted(batches, key=lambda batch: batch[1])

    def peek_usage(self, minutes: Sequence[int], max_fields: int, *, row_prefix: str = "") -> UsagePeek:
        """Every slot's hash of ``minutes``, found as :meth:`claim_usage` finds them, read in the minutes' order.

        Not for one caller's rows (``row_prefix``): a caller's counters may be in any slot's hash, and
        finding them would scan every master's keyspace on each customer read.
        """
        if row_prefix:
            raise NotImplementedError(
                "a Redis Cluster does not read one caller's live counters (it would scan every node): "
                "the minutes drained so far only"
            )
        wanted = {minute: n for n, minute in enumerate(minutes)}
        keys: list[tuple[int, int, str]] = []  # (the minute's place in ``minutes``, minute, key)
        counts: dict[int, dict[str, int]] = {}
        left = max_fields
        with self._store():
            for key in self.client.scan_iter(match=f"{self.prefix}:{{*}}#usage:*", count=1000):
                found = self._usage_pattern.fullmatch(_text(key))
                if found and int(found[2]) in wanted:
                    keys.append((wanted[int(found[2])], int(found[2]), _text(key)))
            for _, minute, key in sorted(keys):
                fields, complete = self._scan_hash(key, left, row_prefix)
                merged = counts.setdefault(minute, {})
                for name, count in fields.items():
                    # The slot's own row count and markers are summed too: the report reads only the metrics.
                    merged[name] = merged.get(name, 0) + count
                left -= len(fields)
                if not complete:
                    return UsagePeek({m: c for m, c in counts.items() if c}, truncated=True)
        return UsagePeek({m: c for m, c in counts.items() if c})

    def finish_usage(self, batch: str) -> None:
        with self._store():
            self.client.unlink(batch)
            self.client.delete(layout.lease_key(self.prefix, batch))

    def store_health(self) -> StoreHealth:
        """As a single Redis's, over every master: the loosest eviction policy, the tightest memory."""
        healths = []
        with self._store():
            for node in self.client.get_primaries():  # type: ignore[no-untyped-call]
                single = RedisBackend(node.redis_connection, prefix=self.prefix)
                healths.append(single.store_health())
        policies = [h.maxmemory_policy for h in healths]
        evicting = [p for p in policies if p is not None and p != "noeviction"]
        known = [p for p in policies if p is not None]
        return StoreHealth(
            maxmemory_policy=(evicting or known or [None])[0],  # type: ignore[list-item]
            maxmemory=_least([h.maxmemory for h in healths]),
            used_memory=_most([h.used_memory for h in healths]),
            evicted_keys=_sum([h.evicted_keys for h in healths]),
        )


def _held(checks: Sequence[Check], calls: Sequence[_Call]) -> tuple[str, ...]:
    """The keys under which ``calls`` take the request's slot (a call's state keys follow the stamp's)."""
    return tuple(
        key
        for call in calls
        for key in slot_keys([checks[i] for i in call.indices], call.keys[1 : len(call.indices) + 1])
    )


def _reply_tail(call: _Call) -> tuple[bytes, bytes]:
    """What a refundable decide call's reply says a refund needs (``REFUNDABLE`` per check), and
    what a leasing one took beyond each check's cost (``LEASE`` per check; empty if it did not lease)."""
    at = 2 + 3 * len(call.indices)  # after the clock, the stamp and each check's three numbers
    reply = call.reply
    return reply[at], (reply[at + 1] if len(reply) > at + 1 else b"")


def _grants(checks: Sequence[Check], calls: Sequence[_Call]) -> list[Grant]:
    """A leasing decision's grants, in the order of their checks (as a single Redis's are): what
    each group's call took beyond its checks' costs."""
    grants = []
    for call in calls:
        spent, taken = _reply_tail(call)
        for n, i in enumerate(call.indices):
            (tokens,) = LEASE.unpack_from(taken, LEASE.size * n)
            if tokens > 0:
                spent_tat, given_back = REFUNDABLE.unpack_from(spent, REFUNDABLE.size * n)
                grants.append((i, Grant(checks[i], int(tokens), call.reply[0], spent_tat, given_back)))
    return [grant for _, grant in sorted(grants, key=lambda pair: pair[0])]


def _spent(calls: Sequence[_Call]) -> tuple[Spent, ...]:
    """What each rate check of an admission spent, in the order of the checks, as each group's
    refundable call reported it (``REFUNDABLE`` per check of the group)."""
    found = []
    for call in calls:
        report, _ = _reply_tail(call)
        for n, (i, result) in enumerate(zip(call.indices, call.results, strict=True)):
            check = result.check
            if result.allowed and not check.policy.holds_slots:
                spent_tat, given_back = REFUNDABLE.unpack_from(report, REFUNDABLE.size * n)
                found.append((i, Spent(check, check.cost, call.reply[0], spent_tat, given_back)))
    return tuple(spent for _, spent in sorted(found, key=lambda pair: pair[0]))


def _by_slot(items: Iterable[T], key: Callable[[T], str] = str) -> dict[int, list[T]]:
    """``items`` by the hash slot of their keys (``key(item)``; the item itself by default), in
    the order of each slot's first item."""
    groups: dict[int, list[T]] = {}
    for item in items:
        groups.setdefault(layout.key_slot(key(item).encode()), []).append(item)
    return groups


def _stamp(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else None


def _stamp_order(stamp: str | None) -> int:
    """Which copy of the version stamp is newest (each group brings its slot's copy back)."""
    return int(stamp) if stamp is not None and stamp.isdigit() else -1


def _with_stray(decision: Decision, stray: tuple[str, tuple[str, ...]]) -> Decision:
    return replace(decision, stray_slot=stray)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _least(values: Sequence[int | None]) -> int | None:
    known = [v for v in values if v]
    return min(known) if known else (0 if values and all(v == 0 for v in values) else None)


def _most(values: Sequence[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _sum(values: Sequence[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None
