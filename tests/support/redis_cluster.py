"""A private Redis Cluster: six ``redis-server`` processes (3 masters, 3 replicas) on free loopback ports.

Made with ``redis-cli --cluster create`` as an operator would, with a short
``cluster-node-timeout`` so a killed master is replaced within seconds. Every server is stopped by
PID; the machine's own Redis is never touched.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

import redis

from .redis_server import RedisServer, free_port

__all__ = ["NODE_TIMEOUT_MS", "Cluster"]

#: How long a master may be unreachable before its replica takes over (cluster-node-timeout).
NODE_TIMEOUT_MS = 1000


class Cluster:
    """``masters`` masters, each with ``replicas`` replicas; :attr:`url` is the ``redis+cluster://`` of all of them."""

    def __init__(
        self, masters: int = 3, *, replicas: int = 1, config: Sequence[str] = (), tls: Path | None = None
    ) -> None:
        """``tls``: a directory with ``server.pem``, ``server.key`` and ``ca.pem``. Then clients and the
        cluster bus speak TLS on a port of each node's own (the plain port stays, for the helpers).
        """
        self.tls = tls
        if tls is not None:
            config = (
                *config,
                *("--tls-cluster", "yes", "--tls-replication", "yes", "--tls-auth-clients", "no"),
                *("--tls-cert-file", str(tls / "server.pem"), "--tls-key-file", str(tls / "server.key")),
                *("--tls-ca-cert-file", str(tls / "ca.pem")),
            )
        cluster_config = (
            "--cluster-enabled",
            "yes",
            "--cluster-node-timeout",
            str(NODE_TIMEOUT_MS),
            "--cluster-config-file",
            "nodes.conf",
            # A replica whose master is lost promotes itself however long it was cut off.
            "--cluster-replica-validity-factor",
            "0",
            "--repl-diskless-sync-delay",
            "0",
            *config,
        )
        self._config = cluster_config
        count = masters * (1 + replicas)
        self.tls_ports = [free_port() for _ in range(count)] if tls is not None else []
        self.servers = [self._server(n) for n in range(count)]
        self.replicas = replicas
        self.masters_count = masters

    @property
    def url(self) -> str:
        if self.tls is not None:
            return "rediss+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.tls_ports)
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    def _server(self, n: int) -> RedisServer:
        """Node ``n``, on free ports: its own, its cluster bus's (the default, port + 10000, may be taken), TLS's."""
        tls = ("--tls-port", str(self.tls_ports[n])) if self.tls is not None else ()
        return RedisServer(config=(*self._config, "--cluster-port", str(free_port()), *tls))

    def start(self, timeout: float = 30.0) -> None:
        for n in range(len(self.servers)):
            self._start_node(n)
        nodes = [f"127.0.0.1:{port}" for port in self.tls_ports or [s.port for s in self.servers]]
        tls = ("--tls", "--cacert", str(self.tls / "ca.pem")) if self.tls is not None else ()
        create = ("--cluster", "create", *nodes, "--cluster-replicas", str(self.replicas), "--cluster-yes")
        subprocess.run(
            ["redis-cli", *tls, *create],
            check=True,
            capture_output=True,
            timeout=timeout,
        )
        self.wait_healthy(timeout)

    def _start_node(self, n: int, tries: int = 3) -> None:
        """Start node ``n``; on fresh ports again if one was taken meanwhile (a free port is only free when asked)."""
        for attempt in range(tries):
            try:
                self.servers[n].start()
                return
            except AssertionError as exc:
                if "Address already in use" not in str(exc) or attempt == tries - 1:
                    raise
                self.servers[n].stop()
                if self.tls is not None:
                    self.tls_ports[n] = free_port()
                self.servers[n] = self._server(n)

    def wait_healthy(self, timeout: float) -> None:
        """Until every live node says the cluster is ok and every replica is in sync (bounded)."""

        def healthy() -> bool:
            for server in self.live():
                try:
                    client = server.client()
                    info = client.cluster("info")
                    replication = client.info("replication")
                except redis.RedisError:
                    return False
                finally:
                    client.close()
                if info.get("cluster_state") != "ok":
                    return False
                if replication.get("role") == "slave" and replication.get("master_link_status") != "up":
                    return False
            return True

        self.servers[0].service.wait_until(healthy, timeout, "cluster state ok", every=0.05)

    def live(self) -> list[RedisServer]:
        return [s for s in self.servers if s.process is not None and s.process.poll() is None]

    def masters(self) -> list[RedisServer]:
        """The live servers that are masters now (failovers change which)."""
        found = []
        for server in self.live():
            client = server.client()
            try:
                if client.info("replication").get("role") == "master":
                    found.append(server)
            finally:
                client.close()
        return found

    def client(self) -> redis.RedisCluster:
        server = self.live()[0]
        return redis.RedisCluster(host="127.0.0.1", port=server.port, socket_timeout=5)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
