"""One region's store as the reconciler reaches it: its demand, its share records, and writing new ones.

Any topology ``REDIS['URL']`` takes (one server, Sentinel, a cluster). On a cluster the demand
hashes are one per slot (:mod:`.layout`), and a share write runs once per slot of the subjects it
names.
"""

from __future__ import annotations

import contextlib
import struct
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException

from ..exceptions import BackendUnavailable
from ..shares import ShareRecord
from . import layout
from .redis import STORE_ERRORS, Script, make_client

__all__ = ["Demand", "RegionStore", "ShareWrite"]

RESHARE = Script.load("reshare.lua")
#: ``lua/reshare.lua``'s packed ARGV: the write's deadline (us); per subject, the epoch read and
#: the policy's rate (tokens per us) and burst, before its record.
_DEADLINE = struct.Struct("<d")
_SUBJECT = struct.Struct("<dddd")
#: ``lua/decide.lua``'s packed policy numbers in the demand hash (``<state key>#p``): rate per us,
#: burst, state TTL in ms.
_POLICY = struct.Struct("<ddd")
_POLICY_MARK = "#p"
#: Subjects per share-write script: a script holds its server while it runs (10-25 µs a
#: subject on a slow VM), so a batch delays the decisions behind it by a millisecond or two. The batches
#: are pipelined: their round trips overlap, and other clients' commands run between them.
WRITE_BATCH = 50
#: Keys per MGET of share records.
READ_BATCH = 1000


class ShareWrite(NamedTuple):
    """One subject's new record for one region, and what the write needs to convert its bucket."""

    state_key: str
    #: The record's epoch as read there (0: none): the write is refused if it moved on.
    epoch: int
    record: ShareRecord
    #: The policy's rate (tokens per us), burst and state TTL in ms (0 when not known: the
    #: state's own are used, and a bucket without state is not made).
    rate: float
    burst: float
    state_ttl_ms: float


@dataclass
class Demand:
    """One region's demand hash of one second."""

    #: Tokens asked, by state key.
    asked: dict[str, float]
    #: Each subject's policy numbers, ``(rate per us, burst, state TTL ms)``, by state key.
    policies: dict[str, tuple[float, float, float]]

    def add(self, field: bytes | str, value: bytes | str) -> None:
        name = _text(field)
        if name.endswith(_POLICY_MARK):
            raw = value if isinstance(value, bytes) else value.encode()
            if len(raw) == _POLICY.size:
                self.policies[name.removesuffix(_POLICY_MARK)] = _POLICY.unpack(raw)
            return
        with contextlib.suppress(ValueError):
            self.asked[name] = float(value)


class RegionStore:
    """The reconciler's client of one region's store (its own timeouts, longer than a decision's)."""

    def __init__(self, name: str, client: redis.Redis | RedisCluster, *, prefix: str) -> None:
        self.name = name
        self.client = client
        self.prefix = prefix
        self.cluster = isinstance(client, RedisCluster)

    @classmethod
    def from_url(cls, name: str, url: str, *, prefix: str, timeout: float, options: Mapping[str, Any]) -> RegionStore:
        return cls(name, make_client(url, timeout, timeout, options), prefix=prefix)

    def demand(self, second: int) -> Demand:
        """Tokens asked of each global subject (by state key) in ``second``, a second that is over,
        and each one's policy numbers (``lua/decide.lua`` writes both)."""
        keys = (
            [layout.demand_key(self.prefix, second, layout.slot_tag(s)) for s in range(layout.REDIS_CLUSTER_HASH_SLOTS)]
            if self.cluster
            else [layout.demand_key(self.prefix, second)]
        )
        demand = Demand({}, {})
        with _reached(self.name):
            if not self.cluster:  # HSCAN: a busy second's hash is too big for one reply in time
                for field, value in self.client.hscan_iter(keys[0], count=1000):
                    demand.add(field, value)
                return demand
            with self.client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.hgetall(key)
                for fields in pipe.execute():
                    for field, value in fields.items():
                        demand.add(field, value)
        return demand

    def records(self, state_keys: Sequence[str]) -> dict[str, ShareRecord]:
        """The share records these subjects have here (a subject without one holds the even split)."""
        found: dict[str, ShareRecord] = {}
        with _reached(self.name):
            for start in range(0, len(state_keys), READ_BATCH):
                batch = state_keys[start : start + READ_BATCH]
                keys = [layout.share_key(key) for key in batch]
                client = self.client
                values = client.mget_nonatomic(keys) if isinstance(client, RedisCluster) else client.mget(keys)
                for key, value in zip(batch, values, strict=True):
                    record = ShareRecord.read(value if isinstance(value, bytes) else None)
                    if record is not None:
                        found[key] = record
        return found

    def write(self, records: Iterable[ShareWrite], ttl_ms: int, deadline: float) -> dict[str, str]:
        """Write each new record where its subject's epoch is still the one read; per subject ``w``
        (written), ``c`` (its epoch moved on) or ``l`` (the write ran after its deadline).

        One script call per batch (per slot and batch on a cluster), all pipelined. A batch that
        runs after ``deadline`` (Unix seconds, this process's clock) is refused whole. If the store
        fails, nothing is answered: the outcome of every write is unknown, until the deadline.
        """
        groups: dict[int, list[ShareWrite]] = defaultdict(list)
        for entry in records:
            groups[layout.key_slot(entry.state_key.encode()) if self.cluster else 0].append(entry)
        batches = [
            entries[start : start + WRITE_BATCH]
            for entries in groups.values()
            for start in range(0, len(entries), WRITE_BATCH)
        ]
        written: dict[str, str] = {}
        with _reached(self.name):
            for attempt in range(2):
                try:
                    replies = self._run(batches, ttl_ms, deadline)
                    break
                except redis.exceptions.NoScriptError:
                    if attempt:
                        raise
                    self.client.script_load(RESHARE.text)  # the store restarted, or never had it
            for batch, reply in zip(batches, replies, strict=True):
                for entry, outcome in zip(batch, _text(reply), strict=True):
                    written[entry.state_key] = outcome
        return written

    def write_status(self, status: str, ttl_s: int) -> None:
        """What the last round did, for this region's admin and ``/v1/rate_limit``."""
        with _reached(self.name):
            self.client.set(layout.reconciled_key(self.prefix), status, ex=ttl_s)

    def _run(self, batches: list[list[ShareWrite]], ttl_ms: int, deadline: float) -> list[Any]:
        """Every batch's script call, pipelined: to the one server, or to each batch's node on a cluster
        (a cluster client pipelines no scripts; each batch's keys are in one slot, on one node)."""
        sent = _DEADLINE.pack(deadline * 1_000_000)
        calls = []
        for batch in batches:
            keys: list[str] = []
            args: list[Any] = [ttl_ms, sent]
            for entry in batch:
                keys += (entry.state_key, layout.share_key(entry.state_key))
                subject = _SUBJECT.pack(entry.epoch, entry.rate, entry.burst, entry.state_ttl_ms)
                args.append(subject + entry.record.pack())
            calls.append((keys, args))
        client = self.client
        if not isinstance(client, RedisCluster):
            return _pipelined(client, calls)
        by_node: dict[str, list[int]] = defaultdict(list)
        nodes = {}
        for i, (keys, _) in enumerate(calls):
            node = client.get_node_from_key(keys[0])  # type: ignore[no-untyped-call]
            nodes[node.name] = node
            by_node[node.name].append(i)
        replies: list[Any] = [None] * len(calls)
        for name, indexes in by_node.items():
            connection = client.get_redis_connection(nodes[name])
            for i, reply in zip(indexes, _pipelined(connection, [calls[i] for i in indexes]), strict=True):
                replies[i] = reply
        return replies


def _pipelined(client: redis.Redis, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
    with client.pipeline(transaction=False) as pipe:
        for keys, args in calls:
            pipe.evalsha(RESHARE.sha, len(keys), *keys, *args)
        return list(pipe.execute())


@contextlib.contextmanager
def _reached(name: str) -> Iterator[None]:
    """The store's errors as :class:`BackendUnavailable`, naming the region."""
    try:
        yield
    except (*STORE_ERRORS, redis.RedisError, RedisClusterException) as exc:
        raise BackendUnavailable(f"region {name}: {type(exc).__name__}: {exc}") from exc


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
