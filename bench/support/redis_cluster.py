"""A private Redis Cluster: ``masters`` masters with ``replicas`` replicas each, all on free loopback ports.

Built as an operator builds one (``redis-cli --cluster create``); each node is a
:class:`~bench.support.redis_server.RedisServer`, stopped by its PID.
"""

from __future__ import annotations

import subprocess

import redis

from .redis_server import RedisServer, free_port

__all__ = ["Cluster"]


class Cluster:
    """Nodes made at once, started by :meth:`start` (or ``with``); :attr:`url` names every node."""

    def __init__(self, masters: int = 3, *, replicas: int = 1) -> None:
        self.replicas = replicas
        node = (
            "--cluster-enabled",
            "yes",
            "--repl-diskless-sync-delay",
            "0",  # a replica syncs at once, not after 5 s
        )
        # The cluster bus's port would be the node's + 10000, which may be taken: each gets a free one.
        self.servers = [
            RedisServer(config=(*node, "--cluster-port", str(free_port()))) for _ in range(masters * (1 + replicas))
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{server.port}" for server in self.servers)

    def start(self, timeout: float = 60.0) -> None:
        """Start every node and make them a cluster; if anything fails, stop every node again."""
        try:
            for server in self.servers:
                server.start()
            nodes = [f"127.0.0.1:{server.port}" for server in self.servers]
            create = ["--cluster", "create", *nodes, "--cluster-replicas", str(self.replicas), "--cluster-yes"]
            subprocess.run(["redis-cli", *create], check=True, capture_output=True, timeout=timeout)
            self.servers[0].service.wait_until(self._ready, timeout, "every slot served and every replica in sync")
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        """Every node says the cluster is ok, and every replica's link to its master is up."""
        try:
            for server in self.servers:
                with server.client() as client:
                    if client.cluster("info").get("cluster_state") != "ok":
                        return False
                    replication = client.info("replication")
                    if replication["role"] == "slave" and replication.get("master_link_status") != "up":
                        return False
        except redis.RedisError:
            return False
        return True

    def masters(self) -> list[RedisServer]:
        """The nodes that are masters (as the cluster made them: nothing here fails one over)."""
        return [server for server in self.servers if _role(server) == "master"]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _role(server: RedisServer) -> str:
    with server.client() as client:
        return str(client.info("replication")["role"])
