"""The benchmarks' request maker: one HTTP request on a fresh loopback connection."""

from __future__ import annotations

import http.client

__all__ = ["request", "serving"]


def request(
    port: int, method: str, path: str, *, key: str | None = None, body: bytes | None = None, timeout: float
) -> tuple[int, http.client.HTTPResponse]:
    """``method path`` to ``127.0.0.1:port`` with ``Connection: close``; ``key`` as a bearer token, ``body`` as JSON.

    The response's body is read (and dropped) before the connection closes; its status and headers are returned.
    """
    headers = {"Connection": "close"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    if body is not None:
        headers["Content-Type"] = "application/json"
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        response.read()
        return response.status, response
    finally:
        connection.close()


def serving(port: int, path: str = "/admin/login/") -> bool:
    """Whether the server on ``port`` answers ``path`` with a 200 yet (the admin's login page: no limit applies)."""
    try:
        return request(port, "GET", path, timeout=10)[0] == 200
    except (OSError, http.client.HTTPException):
        return False
