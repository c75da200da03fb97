"""The DRF test client as an API caller: an optional API key, an optional client address."""

from __future__ import annotations

from rest_framework.test import APIClient

__all__ = ["client_for"]


def client_for(raw: str | None = None, address: str | None = None) -> APIClient:
    """A client sending ``Authorization: Bearer <raw>`` (none without ``raw``), from ``address`` if given."""
    client = APIClient(**({"REMOTE_ADDR": address} if address is not None else {}))
    if raw is not None:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client
