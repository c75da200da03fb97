"""The decisions' transport (``ratelimits/backends/transport.py``) on the redis-py versions the package supports.

The transport is the one module below redis-py's client API. Its contract is run here against a
real server twice: with the redis-py this suite installs (the newest), and, in a virtualenv of
its own, with the oldest release ``pyproject.toml``'s ``redis>=`` floor admits, the module loaded
by its path with nothing but redis-py beside it.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ratelimits.backends import transport

from .support.redis_server import RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent

#: The contract, as a script: ``python CONTRACT <transport.py> <port> <a closed port>`` prints ``ok`` or fails.
CONTRACT = textwrap.dedent(
    """
    import importlib.util, os, sys
    import redis

    spec = importlib.util.spec_from_file_location("transport", sys.argv[1])
    transport = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(transport)
    pool = redis.ConnectionPool(host="127.0.0.1", port=int(sys.argv[2]), socket_timeout=5)
    made = []

    def make(pool, **address):
        made.append(pool.connection_class(**{**pool.connection_kwargs, **address}))
        return made[-1]

    connections = transport.ThreadConnections(make)
    first = connections.own(pool)
    assert transport.connected(first)
    assert transport.call(first, "PING") in (b"PONG", "PONG")
    # Two commands in one write, their replies read in order.
    transport.send(first, ("SET", "transport-key", "1"), ("INCR", "transport-key"))
    assert transport.read(first) in (b"OK", "OK") and transport.read(first) == 2
    try:
        transport.call(first, "INCR", "no", "such", "arity")
    except redis.ResponseError:
        pass  # an error reply raises, and the connection stays in step
    else:
        raise AssertionError("an error reply did not raise")
    assert transport.call(first, "GET", "transport-key") in (b"2", "2")
    assert connections.own(pool) is first and len(made) == 1

    # The server closes a connection unused for a while: it is found closed, and connected anew.
    client_id = transport.call(first, "CLIENT", "ID")
    transport.call(connections.node("admin", pool), "CLIENT", "KILL", "ID", client_id)
    transport.IDLE_CHECK_S = -1.0  # every use counts as after a pause
    again = connections.own(pool)
    assert again is first and transport.connected(again)
    assert transport.call(again, "CLIENT", "ID") != client_id

    first.disconnect()
    assert not transport.connected(first)
    assert connections.own(pool) is first and transport.connected(first)
    # A store that refuses connections: each use says so, as redis-py does.
    closed = redis.ConnectionPool(host="127.0.0.1", port=int(sys.argv[3]), socket_connect_timeout=5)
    refused = transport.ThreadConnections(make)
    for _ in range(2):
        try:
            refused.own(closed)
        except redis.ConnectionError:
            pass
        else:
            raise AssertionError("a connection to a closed port was made")
        try:
            refused.node("closed", closed)
        except redis.ConnectionError:
            pass
        else:
            raise AssertionError("a connection to a closed port was made")
    del made[2:]

    # A forked child makes connections of its own; the parent keeps using its.
    node = connections.node("admin", pool)
    child = os.fork()
    if child == 0:
        mine = connections.own(pool)
        fresh = mine is not first and connections.node("admin", pool) is not node
        os._exit(0 if fresh and transport.call(mine, "PING") in (b"PONG", "PONG") else 1)
    assert os.waitpid(child, 0)[1] == 0, "the forked child used its parent's connections"
    assert connections.own(pool) is first and connections.node("admin", pool) is node
    assert transport.call(first, "PING") in (b"PONG", "PONG") and len(made) == 2
    print("ok")
    """
)


def test_the_transport_imports_nothing_of_the_package() -> None:
    """What lets the oldest redis-py's virtualenv load it with nothing else installed."""
    tree = ast.parse(Path(transport.__file__).read_text())
    imported = [
        node.module or "." if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    relative = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level]
    assert not relative and not [name for name in imported if name.split(".")[0] == "ratelimits"], imported


def test_the_transport_keeps_its_contract_on_this_redis_py(redis_server: RedisServer, tmp_path: Path) -> None:
    script = tmp_path / "contract.py"
    script.write_text(CONTRACT)
    result = subprocess.run(
        [sys.executable, str(script), transport.__file__, str(redis_server.port), str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def oldest_redis_py() -> str:
    """The requirement the package's ``redis>=`` floor names, as the oldest release series it admits."""
    found = re.search(r'"redis>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert found is not None, "pyproject.toml names no redis>= floor"
    return f"redis=={found.group(1)}.*"


@pytest.mark.slow
def test_the_transport_keeps_its_contract_on_the_oldest_redis_py(redis_server: RedisServer, tmp_path: Path) -> None:
    """The oldest redis-py the package admits, alone in a virtualenv (its connections have no ``is_connected``)."""
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True, timeout=120)
    python = tmp_path / "venv" / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", oldest_redis_py()],
        check=True,
        timeout=300,
    )
    script = tmp_path / "contract.py"
    script.write_text(CONTRACT)
    version = subprocess.run(
        [str(python), "-c", "import redis; print(redis.__version__)"], capture_output=True, text=True, check=True
    ).stdout.strip()
    result = subprocess.run(
        [str(python), str(script), transport.__file__, str(redis_server.port), str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", f"redis-py {version}: {result.stderr}"
