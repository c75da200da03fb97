"""What ``REDIS['URL']`` and ``REDIS['OPTIONS']`` may say: checked at start-up, never at request time.

``REDIS['URL']`` takes ``redis://`` and ``rediss://`` (TLS), ``unix://``,
``redis+sentinel://host:port[,host:port...]/service_name``: a Sentinel deployment, whose master
is found through the sentinels and followed through failovers (decisions are never read from a
replica), and ``redis+cluster://host:port[,host:port...]`` (``rediss+cluster://`` with TLS): a
Redis Cluster, found through any of its startup nodes. Credentials may be in the URL
(``redis://user:password@host``) or in ``REDIS['OPTIONS']``, with the TLS files.
:mod:`ratelimits.backends.connection` makes the client.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit, urlunsplit

from redis.connection import parse_url

__all__ = [
    "CERT_REQS",
    "CLUSTER_SCHEMES",
    "OPTIONS",
    "SCHEMES",
    "RedisTarget",
    "check_options",
    "parse_redis_url",
    "target_of_cache",
]

#: The URL schemes ``REDIS['URL']`` takes.
SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "redis+cluster", "rediss+cluster")
#: The schemes of a Redis Cluster (:attr:`RedisTarget.cluster`).
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
#: ``REDIS['OPTIONS']`` keys and the type each takes; all are redis-py's own connection arguments,
#: but for the sentinels' own credentials.
OPTIONS: dict[str, type | tuple[type, ...]] = {
    "username": str,
    "password": str,
    "ssl_ca_certs": str,
    "ssl_certfile": str,
    "ssl_keyfile": str,
    "ssl_cert_reqs": str,
    "ssl_check_hostname": bool,
    "sentinel_username": str,
    "sentinel_password": str,
}
#: What ``ssl_cert_reqs`` may say.
CERT_REQS = ("required", "optional", "none")


@dataclass(frozen=True)
class RedisTarget:
    """A parsed ``REDIS['URL']``: one server, the sentinels of a master, or a cluster's startup nodes."""

    url: str
    scheme: str
    #: For ``redis+sentinel://``: the sentinels; for a cluster, its startup nodes.
    addresses: tuple[tuple[str, int], ...] = ()
    #: For ``redis+sentinel://``: the master's service name.
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None

    @property
    def cluster(self) -> bool:
        return self.scheme in CLUSTER_SCHEMES


def parse_redis_url(url: str) -> RedisTarget:
    """``url`` checked and taken apart; a :class:`ValueError` saying what is wrong with it."""
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme not in SCHEMES:
        raise ValueError(f"the scheme must be one of {', '.join(s + '://' for s in SCHEMES)}")
    if scheme not in ("redis+sentinel", *CLUSTER_SCHEMES):
        parse_url(url)  # type: ignore[no-untyped-call]  # redis-py's own parser, as from_url reads it
        return RedisTarget(url, scheme)
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":") if userinfo else ("", "", "")
    credentials: dict[str, Any] = {"username": unquote(username) or None, "password": unquote(password) or None}
    query = parse_qs(parts.query)
    if scheme in CLUSTER_SCHEMES:
        nodes = tuple(_address(host, "cluster node") for host in hosts.split(","))
        if parts.path.strip("/") or query:
            # A cluster has one database, and nothing else to choose in its URL.
            raise ValueError("a cluster URL names its startup nodes only: redis+cluster://host:port[,host:port...]")
        return RedisTarget(url, scheme, addresses=nodes, **credentials)
    sentinels = tuple(_address(host, "sentinel") for host in hosts.split(","))
    service = unquote(parts.path.strip("/"))
    if not service or "/" in service:
        raise ValueError("name the master's service after the sentinels: redis+sentinel://host:port/service_name")
    unknown = sorted(set(query) - {"db"})
    if unknown:
        raise ValueError(f"unknown parameter {unknown[0]!r} (only 'db' is read from a sentinel URL)")
    db = query.get("db", ["0"])[-1]
    if not db.isdigit():
        raise ValueError(f"db must be a database number, got {db!r}")
    return RedisTarget(url, scheme, addresses=sentinels, service=service, db=int(db), **credentials)


def _address(host: str, what: str) -> tuple[str, int]:
    name, sep, port = host.rpartition(":")
    if not sep or not name or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"each {what} is host:port, got {host!r}")
    return name.strip("[]"), int(port)  # an IPv6 address comes in brackets


def check_options(options: object, field: str) -> dict[str, Any]:
    """``REDIS['OPTIONS']`` validated: known keys with values of their type (a :class:`ValueError` otherwise)."""
    if not isinstance(options, Mapping):
        raise ValueError(f"{field} must be a dict, got {type(options).__name__}")
    for key, value in options.items():
        expected = OPTIONS.get(key)
        if expected is None:
            raise ValueError(f"{field}: unknown option {key!r}; the options are {', '.join(OPTIONS)}")
        if not isinstance(value, expected):
            raise ValueError(f"{field}['{key}'] must be a {getattr(expected, '__name__', expected)}, got {value!r}")
    if options.get("ssl_cert_reqs", "required") not in CERT_REQS:
        raise ValueError(f"{field}['ssl_cert_reqs'] must be one of {', '.join(CERT_REQS)}")
    return dict(options)


#: The cache backends whose Redis the limiter can share (``REDIS['CACHE']``).
DJANGO_REDIS = "django_redis.cache.RedisCache"
DJANGO_BUILTIN = "django.core.cache.backends.redis.RedisCache"
#: redis-py's TLS arguments, which a cache's options may hold and the limiter's connections need too.
_TLS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")


def target_of_cache(alias: str, cache: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The limiter's Redis (a ``REDIS['URL']`` and its ``OPTIONS``) read from the cache ``CACHES[alias]``.

    django-redis' ``RedisCache`` (its default, herd and Sentinel clients) and Django's own
    ``RedisCache`` are read: the first ``LOCATION`` (the primary: decisions never read a
    replica), the credentials, the TLS files, and django-redis' sentinels. Timeouts, pools and
    retries are not taken: the limiter keeps its own. A :class:`ValueError` says what cannot be used.
    """
    backend = cache.get("BACKEND")
    if backend not in (DJANGO_REDIS, DJANGO_BUILTIN):
        raise ValueError(f"CACHES[{alias!r}] is a {backend!r}, not a Redis cache ({DJANGO_REDIS} or {DJANGO_BUILTIN})")
    location = cache.get("LOCATION")
    if isinstance(location, str):
        location = [part.strip() for part in location.replace(";", ",").split(",")]
    if not isinstance(location, (list, tuple)) or not location or not isinstance(location[0], str):
        raise ValueError(f"CACHES[{alias!r}]['LOCATION'] must be a Redis URL (or a list of them), got {location!r}")
    url = location[0]
    options = cache.get("OPTIONS") or {}
    if not isinstance(options, Mapping):
        raise ValueError(f"CACHES[{alias!r}]['OPTIONS'] must be a dict, got {options!r}")
    if backend == DJANGO_BUILTIN:
        given = {key: options[key] for key in ("username", "password", *_TLS) if key in options}
        parts = urlsplit(url)
        if "db" in options and not parts.path.strip("/") and "db" not in parse_qs(parts.query):
            url = urlunsplit(parts._replace(path=f"/{options['db']}"))
    else:
        client = str(options.get("CLIENT_CLASS", ""))
        if client.endswith("ShardClient"):
            raise ValueError(f"CACHES[{alias!r}] shards keys over several servers; the limiter needs one Redis")
        pool = options.get("CONNECTION_POOL_KWARGS") or {}
        given = {key: pool[key] for key in _TLS if key in pool}
        for ours, theirs in (("username", "USERNAME"), ("password", "PASSWORD")):
            if options.get(theirs):
                given[ours] = options[theirs]
        if options.get("SENTINELS"):
            url, sentinel = _sentinel_url(alias, url, options["SENTINELS"], options.get("SENTINEL_KWARGS") or {})
            given.update(sentinel)
    if "ssl_cert_reqs" in given:
        given["ssl_cert_reqs"] = _cert_reqs(given["ssl_cert_reqs"])
    try:
        parse_redis_url(url)
        return url, check_options(given, f"CACHES[{alias!r}]['OPTIONS']")
    except ValueError as exc:
        raise ValueError(f"CACHES[{alias!r}]: {exc}") from None


def _sentinel_url(alias: str, url: str, sentinels: Any, kwargs: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """django-redis' Sentinel client: ``redis://service_name/db`` and the sentinels as ``redis+sentinel://``."""
    parts = urlsplit(url)
    try:
        hosts = ",".join(f"{host}:{int(port)}" for host, port in sentinels)
    except (TypeError, ValueError):
        raise ValueError(f"CACHES[{alias!r}]['OPTIONS']['SENTINELS'] must be (host, port) pairs") from None
    userinfo = parts.netloc.rpartition("@")[0]
    db = parts.path.strip("/") or parse_qs(parts.query).get("db", ["0"])[-1]
    target = f"redis+sentinel://{userinfo + '@' if userinfo else ''}{hosts}/{parts.hostname}?db={db}"
    own = {f"sentinel_{key}": kwargs[key] for key in ("username", "password") if kwargs.get(key)}
    return target, own


def _cert_reqs(value: Any) -> str:
    """A cache's ``ssl_cert_reqs`` (an ``ssl.CERT_*`` constant, a name or ``None``) as ``REDIS['OPTIONS']`` says it."""
    import ssl

    names = {ssl.CERT_NONE: "none", ssl.CERT_OPTIONAL: "optional", ssl.CERT_REQUIRED: "required", None: "none"}
    if isinstance(value, str):
        return value.lower()
    return names.get(value, repr(value))
