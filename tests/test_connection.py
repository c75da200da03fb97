"""Reaching Redis as deployments run it: ACL users, TLS, Sentinel. Each test starts its own servers."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from ratelimits import checks
from ratelimits.backends.cluster import ClusterBackend
from ratelimits.backends.redis import RedisBackend, make_client
from ratelimits.exceptions import BackendUnavailable
from ratelimits.identity import Subject, SubjectKind
from ratelimits.policies import Check, Policy
from ratelimits.rates import parse_rate
from ratelimits.redis_url import parse_redis_url

from .support.processes import Service
from .support.redis_cluster import Cluster
from .support.redis_server import RedisServer, free_port

CHECK = Check(Policy("p", parse_rate("100/s"), 100), Subject(SubjectKind.IP, "198.51.100.9"))


def decides(url: str, options: dict[str, Any] | None = None) -> bool:
    """Whether a decision through ``url`` is made by the store (and admitted)."""
    return RedisBackend(make_client(url, 2.0, 2.0, options)).decide([CHECK]).allowed


def store_errors(settings: Any, url: str, options: dict[str, Any] | None = None) -> list[Any]:
    settings.RATELIMITS = {"REDIS": {"URL": url, **({"OPTIONS": options} if options else {})}}
    return [message for message in checks.check_store() if message.id == checks.E004]


def test_a_sentinel_url_names_its_sentinels_service_and_database() -> None:
    target = parse_redis_url("redis+sentinel://lim:p%40ss@10.0.0.1:26379,[::1]:26380/primary?db=2")
    assert target.addresses == (("10.0.0.1", 26379), ("::1", 26380))
    assert (target.service, target.db, target.username, target.password) == ("primary", 2, "lim", "p@ss")


# -- ACL ----------------------------------------------------------------------------------------


@pytest.fixture
def acl_redis() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    admin = server.client()
    admin.acl_setuser("limiter", enabled=True, passwords=["+limiter-secret"], keys=["rl:*"], commands=["+@all"])
    admin.config_set("requirepass", "admin-secret")  # from now on, nobody gets in without a password
    try:
        yield server
    finally:
        server.stop()


def test_the_limiter_decides_as_its_acl_user_given_in_the_url_or_the_options(acl_redis: RedisServer) -> None:
    port = acl_redis.port
    assert decides(f"redis://limiter:limiter-secret@127.0.0.1:{port}/0")
    assert decides(f"redis://127.0.0.1:{port}/0", {"username": "limiter", "password": "limiter-secret"})


def test_missing_or_wrong_credentials_fail_the_checks_naming_the_setting(settings: Any, acl_redis: RedisServer) -> None:
    port = acl_redis.port
    for url in (f"redis://127.0.0.1:{port}/0", f"redis://limiter:wrong@127.0.0.1:{port}/0"):
        errors = store_errors(settings, url)
        assert len(errors) == 1 and "RATELIMITS['REDIS']" in errors[0].msg and "credentials" in errors[0].msg
    assert store_errors(settings, f"redis://limiter:limiter-secret@127.0.0.1:{port}/0") == []


def test_credentials_a_shared_cache_lacks_are_named_where_they_are_given(settings: Any, acl_redis: RedisServer) -> None:
    location = f"redis://127.0.0.1:{acl_redis.port}/0"
    settings.CACHES = {
        **settings.CACHES,
        "shared": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": location, "OPTIONS": {"PASSWORD": "no"}},
    }
    settings.RATELIMITS = {"REDIS": {"CACHE": "shared"}}
    errors = [message for message in checks.check_store() if message.id == checks.E004]
    assert len(errors) == 1 and errors[0].msg.startswith(
        "The limiter's Redis (CACHES['shared'], by RATELIMITS['REDIS']['CACHE']) refused the limiter's credentials"
    )
    assert (errors[0].hint or "").startswith("Give the credentials and TLS files in CACHES['shared']")
    settings.CACHES = {
        **settings.CACHES,
        "shared": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": f"redis://limiter:limiter-secret@127.0.0.1:{acl_redis.port}/0",
        },
    }
    assert [message for message in checks.check_store() if message.id == checks.E004] == []


def test_an_unreachable_store_is_no_check_error(settings: Any) -> None:
    """The first request degrades and says so; a deploy must not fail because Redis is down right now."""
    assert store_errors(settings, f"redis://127.0.0.1:{free_port()}/0") == []


# -- TLS ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA and a server certificate for 127.0.0.1, made with openssl."""
    path = tmp_path_factory.mktemp("tls")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=path, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=ratelimits test CA")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
            "-subj", "/CN=127.0.0.1")  # fmt: skip
    (path / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.pem", "-days", "2", "-extfile", "san.ext")  # fmt: skip
    return path


@pytest.fixture
def tls_redis(certificates: Path) -> Iterator[tuple[RedisServer, int]]:
    tls_port = free_port()
    tls = ("--tls-port", str(tls_port), "--tls-auth-clients", "no")
    files = ("--tls-cert-file", "server.pem", "--tls-key-file", "server.key", "--tls-ca-cert-file", "ca.pem")
    server = RedisServer(config=(*tls, *(str(certificates / f) if f.endswith(("pem", "key")) else f for f in files)))
    server.start()  # answers plain PING on its own port too, which is how it is seen to be up
    try:
        yield server, tls_port
    finally:
        server.stop()


def test_rediss_decides_over_tls_with_the_ca_given_in_the_options(
    tls_redis: tuple[RedisServer, int], certificates: Path
) -> None:
    _, tls_port = tls_redis
    assert decides(f"rediss://127.0.0.1:{tls_port}/0", {"ssl_ca_certs": str(certificates / "ca.pem")})


def test_a_certificate_that_cannot_be_verified_fails_the_checks(
    settings: Any, tls_redis: tuple[RedisServer, int], certificates: Path
) -> None:
    _, tls_port = tls_redis
    url = f"rediss://127.0.0.1:{tls_port}/0"
    errors = store_errors(settings, url)  # no CA: the server's certificate is unknown
    assert len(errors) == 1 and "TLS" in errors[0].msg
    assert store_errors(settings, url, {"ssl_ca_certs": str(certificates / "ca.pem")}) == []


# -- Sentinel -----------------------------------------------------------------------------------

#: How long the sentinels take to call a master down, and to finish a failover, in milliseconds.
DOWN_AFTER_MS, FAILOVER_TIMEOUT_MS = 400, 2000
#: The bound asserted on following a failover: noticing, electing, promoting, reconnecting.
FOLLOW_BOUND_S = 15.0


class Sentinels:
    """A master, its replica and three sentinels watching it as ``primary``, all on free loopback ports."""

    def __init__(self, root: Path) -> None:
        self.master = RedisServer(config=("--repl-diskless-sync-delay", "0"))
        self.master.start()
        self.replica = RedisServer(config=("--replicaof", "127.0.0.1", str(self.master.port)))
        self.replica.start()
        self.sentinels: list[Service] = []
        for n in range(3):
            port = free_port()
            directory = root / f"sentinel-{n}"
            directory.mkdir()
            conf = directory / "sentinel.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {directory}\n"
                f"sentinel monitor primary 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds primary {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout primary {FAILOVER_TIMEOUT_MS}\n"
            )
            service = Service(f"sentinel-{n}", ["redis-server", str(conf), "--sentinel"], directory, port=port)
            service.start()
            self.sentinels.append(service)
        for service in self.sentinels:
            client = redis.Redis(host="127.0.0.1", port=service.port, socket_timeout=0.5)
            service.wait_until(lambda c=client: _answers(c, "SENTINEL", "REPLICAS", "primary"), 10, "replica seen")

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels) + "/primary"

    def stop(self) -> None:
        for service in self.sentinels:
            service.stop(grace=5)
        self.replica.stop()
        self.master.stop()


def _answers(client: redis.Redis, *command: str) -> bool:
    try:
        return bool(client.execute_command(*command))
    except redis.RedisError:
        return False


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[Sentinels]:
    deployment = Sentinels(tmp_path)
    try:
        yield deployment
    finally:
        deployment.stop()


@pytest.mark.slow
def test_the_limiter_follows_a_sentinel_failover_within_a_bound(sentinels: Sentinels) -> None:
    backend = RedisBackend(make_client(sentinels.url, 0.2, 0.2))
    check = Check(Policy("hourly", parse_rate("100/h"), 100), CHECK.subject)  # no refill within the bound
    assert backend.decide([check]).allowed
    key = check.key(backend.prefix)
    assert sentinels.master.client().exists(key)  # decided on the master, never a replica
    replica = sentinels.replica.client()
    sentinels.replica.service.wait_until(
        lambda: replica.info("replication").get("master_link_status") == "up" and bool(replica.exists(key)),
        10,
        "replica in sync",
    )

    sentinels.master.kill()
    killed = time.monotonic()
    unavailable = 0
    while time.monotonic() - killed < FOLLOW_BOUND_S:
        try:
            decision = backend.decide([check])
        except BackendUnavailable:
            unavailable += 1  # the engine fails these by their policies' fail modes
            continue
        break
    else:
        pytest.fail(f"no decision from the promoted replica within {FOLLOW_BOUND_S} s ({unavailable} refused)")
    followed = time.monotonic() - killed
    print(f"\nsentinel failover followed in {followed:.2f} s ({unavailable} calls unavailable meanwhile)")
    assert decision.allowed
    assert replica.info("replication")["role"] == "master"
    assert decision.results[0].remaining == 100 - 2  # the promoted replica had the first decision's state


# -- ACL on a cluster ---------------------------------------------------------------------------


@pytest.fixture
def acl_cluster() -> Iterator[Cluster]:
    """A six-node cluster whose every node wants a password, with an ACL user ``limiter`` held to ``rl:*``."""
    with Cluster() as cluster:
        for server in cluster.servers:
            admin = server.client()
            admin.config_set("masterauth", "admin-secret")  # replicas keep replicating once the master wants it
            admin.acl_setuser("limiter", enabled=True, passwords=["+limiter-secret"], keys=["rl:*"], commands=["+@all"])
            admin.config_set("requirepass", "admin-secret")
            admin.close()
        yield cluster


def test_the_limiter_decides_on_a_cluster_as_its_acl_user_and_the_checks_fail_without(
    settings: Any, acl_cluster: Cluster
) -> None:
    nodes = acl_cluster.url.removeprefix("redis+cluster://")
    backend = ClusterBackend(make_client(f"redis+cluster://limiter:limiter-secret@{nodes}", 2.0, 2.0))  # type: ignore[arg-type]
    checks = [Check(Policy("p", parse_rate("5/m"), 5), Subject(SubjectKind.API_KEY, f"acl-{i}")) for i in range(12)]
    assert backend.decide(checks).allowed  # several slot groups, as the limiter's user
    assert backend.publish_version(2) == "2"
    backend = ClusterBackend(
        make_client(acl_cluster.url, 2.0, 2.0, {"username": "limiter", "password": "limiter-secret"})
    )  # type: ignore[arg-type]
    assert backend.decide(checks).results[0].remaining == 3
    for url in (acl_cluster.url, f"redis+cluster://limiter:wrong@{nodes}"):
        errors = store_errors(settings, url)
        assert len(errors) == 1 and "RATELIMITS['REDIS']" in errors[0].msg and "credentials" in errors[0].msg, errors
    assert store_errors(settings, f"redis+cluster://limiter:limiter-secret@{nodes}") == []


def test_rediss_cluster_decides_over_tls_with_the_ca_given_in_the_options(settings: Any, certificates: Path) -> None:
    with Cluster(tls=certificates) as cluster:
        assert cluster.url.startswith("rediss+cluster://")
        backend = ClusterBackend(make_client(cluster.url, 2.0, 2.0, {"ssl_ca_certs": str(certificates / "ca.pem")}))  # type: ignore[arg-type]
        checks = [Check(Policy("p", parse_rate("5/m"), 5), Subject(SubjectKind.API_KEY, f"tls-{i}")) for i in range(12)]
        assert backend.decide(checks).allowed  # several slot groups, every one over TLS
        assert {node.port for node in backend.client.get_primaries()} <= set(cluster.tls_ports)
        with pytest.raises(BackendUnavailable):  # without the CA the certificate cannot be verified
            ClusterBackend(lambda: make_client(cluster.url, 2.0, 2.0)).decide(checks)  # type: ignore[arg-type, return-value]
        errors = store_errors(settings, cluster.url)
        assert len(errors) == 1 and "over TLS" in errors[0].msg, errors
        ca = {"ssl_ca_certs": str(certificates / "ca.pem")}
        assert store_errors(settings, cluster.url, ca) == []
