"""Redis backend: every check of a request decided by one EVALSHA of ``lua/decide.lua``."""

from __future__ import annotations

import hashlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

try:
    import hiredis
except ImportError:  # optional: redis-py's own packer is used instead
    hiredis = None  # type: ignore[assignment]

from ..engine import Decision, Result
from ..exceptions import BackendUnavailable
from ..policies import Check
from ..usage import Usage
from .base import Backend, new_slot, slot_keys

__all__ = ["RedisBackend", "load_script"]


def load_script(name: str) -> str:
    """The text of a Lua script shipped in ``ratelimits/lua/``."""
    return resources.files("ratelimits").joinpath("lua", name).read_text(encoding="utf-8")


DECIDE = load_script("decide.lua")
DECIDE_SHA = hashlib.sha1(DECIDE.encode()).hexdigest()
#: How long the policy version stamp lives after its last publication. If it expires, workers
#: see it lag behind their snapshot and publish it again.
VERSION_TTL_S = 30 * 86_400
PUBLISH_VERSION = load_script("publish_version.lua")
RELEASE = load_script("release.lua")
#: Usage counters nobody drains expire after this (the decide script uses the same figure).
USAGE_TTL_S = 172_800


class RedisBackend(Backend):
    """Shared state in Redis, one round trip per decision.

    The client has tight timeouts and no retries: redis-py would otherwise resend a command
    after a timeout, and a consume that may already have run must never be sent twice.
    A lost script cache (restart, failover, ``SCRIPT FLUSH``) costs one ``EVAL`` instead.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str = "rl",
        clock: Callable[[], int] | None = None,
    ) -> None:
        self.client = client
        self.prefix = prefix
        #: ``None`` lets the script read Redis ``TIME``; otherwise integer microseconds.
        self.clock = clock
        self.version_key = f"{prefix}:policy-version"
        self._local = threading.local()

    @classmethod
    def from_settings(cls) -> RedisBackend:
        from ..conf import conf

        clock = None if conf.use_redis_time else (lambda: time.time_ns() // 1000)
        return cls(
            make_client(conf.redis_url, conf.redis_socket_timeout, conf.redis_connect_timeout),
            prefix=conf.key_prefix,
            clock=clock,
        )

    def decide(self, checks: Sequence[Check], *, consume: bool = True, usage: Usage | None = None) -> Decision:
        keys = [self.version_key]
        slot = new_slot(checks) if consume else None
        args: list[Any] = [
            "" if self.clock is None else self.clock(),
            "1" if consume else "0",
            slot or "",
            usage.field if usage else "",
            usage.tokens if usage else 0,
        ]
        for check in checks:
            keys.append(check.key(self.prefix))
            args += check.policy.script_args
            args.append(check.cost)
        if usage:
            keys.append(self.usage_key(usage.minute))
        try:
            reply = self._run(keys, args)
        except BackendUnavailable as exc:
            if slot:
                # A store that timed out may still run the script and take the slot: hand its id
                # back so the request's end releases it (releasing is idempotent).
                exc.stray_slot = (slot, slot_keys(checks, keys[1 : len(checks) + 1]))
            raise
        now_us, version = int(reply[0]), reply[1]
        results = [
            Result(check, bool(reply[3 + 4 * i]), int(reply[4 + 4 * i]), int(reply[5 + 4 * i]), int(reply[6 + 4 * i]))
            for i, check in enumerate(checks)
        ]
        return Decision.from_results(
            results,
            now_us=now_us,
            policy_version=version.decode() if isinstance(version, bytes) else None,
            slot=slot,
            slot_keys=slot_keys(checks, keys[1 : len(checks) + 1]) if slot else (),
        )

    def usage_key(self, minute: int) -> str:
        """The hash of one minute's usage counters."""
        return f"{self.prefix}:usage:{minute}"

    def claim_usage(self, before_minute: int) -> list[tuple[str, int, dict[str, int]]]:
        live, draining = f"{self.prefix}:usage:", f"{self.prefix}:usage-drain:"
        try:
            for key in self.client.scan_iter(match=f"{live}*", count=1000):
                minute = _minute(key, live)
                if minute is not None and minute < before_minute:
                    # RENAME is atomic: of two drains racing for a minute, one gets it; the other
                    # sees the key gone. Counts arriving late start a fresh key for that minute.
                    try:
                        self.client.rename(key, f"{draining}{minute}:{uuid.uuid4().hex}")
                    except redis.ResponseError:
                        continue
            batches = []
            for key in self.client.scan_iter(match=f"{draining}*", count=1000):
                name = _text(key)
                minute = _minute(name.rsplit(":", 1)[0], draining)
                if minute is None:
                    continue
                # HSCAN, not HGETALL: a busy minute's hash can take longer than the limiter's tight
                # socket timeout to send in one reply, and would then never drain. A claimed batch
                # is no longer written to, so the scan sees every field (a repeat is the same value).
                counts = {_text(f): int(v) for f, v in self.client.hscan_iter(name, count=1000)}
                batches.append((name, minute, counts))
        except redis.RedisError as exc:
            raise BackendUnavailable(f"{type(exc).__name__}: {exc}") from exc
        return sorted(batches, key=lambda batch: batch[1])

    def finish_usage(self, batch: str) -> None:
        try:
            # UNLINK frees a busy minute's hash off the main thread: a DEL of it would hold up every
            # decision on this Redis (and outlast their socket timeout) while it ran.
            self.client.unlink(batch)
        except redis.RedisError as exc:
            raise BackendUnavailable(f"{type(exc).__name__}: {exc}") from exc

    def add_usage(self, counts: Mapping[tuple[int, str], int]) -> None:
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for (minute, field), count in counts.items():
                    pipe.hincrby(self.usage_key(minute), field, count)
                    pipe.expire(self.usage_key(minute), USAGE_TTL_S)
                pipe.execute()
        except redis.RedisError as exc:
            raise BackendUnavailable(f"{type(exc).__name__}: {exc}") from exc

    def release(self, slot: str, keys: Sequence[str]) -> int:
        try:
            return int(self.client.eval(RELEASE, len(keys), *keys, slot))
        except redis.RedisError as exc:
            raise BackendUnavailable(f"{type(exc).__name__}: {exc}") from exc

    def clear(self, checks: Sequence[Check]) -> None:
        try:
            self.client.delete(*[check.key(self.prefix) for check in checks])
        except redis.RedisError as exc:
            raise BackendUnavailable(str(exc)) from exc

    def publish_version(self, version: int) -> str:
        try:
            stored = self.client.eval(PUBLISH_VERSION, 1, self.version_key, version, VERSION_TTL_S)
        except redis.RedisError as exc:
            raise BackendUnavailable(f"{type(exc).__name__}: {exc}") from exc
        return str(int(stored))

    def _run(self, keys: list[str], args: list[Any]) -> Any:
        connection = self._connection()
        try:
            try:
                return _call(connection, "EVALSHA", DECIDE_SHA, len(keys), *keys, *args)
            except redis.exceptions.NoScriptError:
                # The script did not run, so sending it again cannot charge twice.
                return _call(connection, "EVAL", DECIDE, len(keys), *keys, *args)
        except (redis.RedisError, OSError) as exc:
            # redis-py drops the connection on timeouts and socket errors (it reconnects on the
            # next use), so a late reply can never be read as the answer to a later request.
            raise BackendUnavailable(f"{type(exc).__name__}: {exc}") from exc

    def _connection(self) -> Any:
        """This thread's own connection to Redis, made with the client's settings.

        A decision is one packed write and one read on a connection nobody else uses: the
        client's generic command path and its pool's check-out bookkeeping cost more than the
        script itself on loopback. A connection inherited through ``fork`` is replaced, never
        used: parent and child would read each other's replies.
        """
        connection = getattr(self._local, "connection", None)
        if connection is None or connection.pid != os.getpid():
            pool = self.client.connection_pool
            connection = pool.connection_class(**pool.connection_kwargs)
            self._local.connection = connection
        elif connection._sock is not None:
            # An idle connection with something to read was closed by the server (a restart)
            # or holds a stray reply: start afresh, as redis-py's pool does on check-out.
            try:
                stale = connection.can_read()
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                stale = True
            if stale:
                connection.disconnect()
        return connection


def _call(connection: Any, *command: Any) -> Any:
    connection.send_packed_command(_pack(connection, command), check_health=False)
    return connection.read_response()


def _pack(connection: Any, command: tuple[Any, ...]) -> list[bytes]:
    if hiredis is not None:
        return [hiredis.pack_command(command)]
    return list(connection.pack_command(*command))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _minute(key: bytes | str, prefix: str) -> int | None:
    name = _text(key)
    suffix = name[len(prefix) :]
    return int(suffix) if name.startswith(prefix) and suffix.isdigit() else None


_clients: dict[tuple[str, float, float], redis.Redis] = {}


def make_client(url: str, socket_timeout: float, connect_timeout: float) -> redis.Redis:
    """A process-wide client per URL and timeouts (redis-py pools reset themselves after fork)."""
    key = (url, socket_timeout, connect_timeout)
    client = _clients.get(key)
    if client is None:
        client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
            single_connection_client=False,
        )
        _clients[key] = client
    return client
