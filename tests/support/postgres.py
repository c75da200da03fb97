"""A throwaway PostgreSQL database: created for a suite of processes that need one, dropped after."""

from __future__ import annotations

import contextlib
import os
import secrets
import urllib.parse
from collections.abc import Iterator

import psycopg

__all__ = ["POSTGRES_URL", "throwaway_database"]

#: The server to create databases on: the suite's own (``DATABASE_URL``, as the Makefile sets it).
POSTGRES_URL = (
    os.environ["DATABASE_URL"]
    if os.environ.get("DATABASE_URL", "").startswith(("postgres://", "postgresql://"))
    else "postgres://postgres@127.0.0.1:5432/postgres"
)


@contextlib.contextmanager
def throwaway_database(prefix: str) -> Iterator[str]:
    """A new, empty database named ``<prefix>_<random>``; yields its URL, drops it (forcibly) after."""
    name = f"{prefix}_{secrets.token_hex(4)}"
    with psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=10) as server:
        server.execute(f'CREATE DATABASE "{name}"')
    try:
        parts = urllib.parse.urlsplit(POSTGRES_URL)
        yield urllib.parse.urlunsplit(parts._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=10) as server:
            server.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
