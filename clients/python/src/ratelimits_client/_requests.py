"""The retrying client for requests: an ``HTTPAdapter`` that backs off on 429 and 503, and a session using it."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import requests
from requests.adapters import HTTPAdapter

from ratelimits_client.policy import IDEMPOTENCY_KEY, Retrier, RetryOptions

__all__ = ["RetryAdapter", "session"]


class RetryAdapter(HTTPAdapter):
    """An ``HTTPAdapter`` that retries 429 and 503 as its :class:`Retrier` says.

    Keyword arguments other than ``retrier`` go to ``HTTPAdapter`` (pool sizes; its own
    ``max_retries`` is urllib3's, for connection errors, and stays 0 by default).
    """

    def __init__(self, retrier: Retrier | None = None, **kwargs: Any) -> None:
        self.retrier = retrier or Retrier()
        super().__init__(**kwargs)

    def send(
        self,
        request: requests.PreparedRequest,
        stream: bool = False,
        timeout: float | tuple[float, float] | tuple[float, None] | None = None,
        verify: bool | str = True,
        cert: bytes | str | tuple[bytes | str, bytes | str] | None = None,
        proxies: Mapping[str, str] | None = None,
    ) -> requests.Response:
        """Send ``request``; on a retry status wait and send it again, or raise a :class:`RetryError`."""
        retrier = self.retrier
        retrier.begin()
        # Only a body held in memory can be sent twice; a file or generator has been consumed.
        retryable = retrier.retryable(
            request.method or "GET",
            IDEMPOTENCY_KEY in request.headers,
            request.body is None or isinstance(request.body, bytes | str),
        )
        attempts = 0
        while True:
            attempts += 1
            response = super().send(request, stream=stream, timeout=timeout, verify=verify, cert=cert, proxies=proxies)
            if not retrier.refused(response.status_code):
                return response
            body = response.content  # read whole, so the connection goes back to the pool
            verdict = retrier.assess(
                attempts=attempts,
                retryable=retryable,
                retry_after=response.headers.get("Retry-After"),
                ratelimit=response.headers.get("RateLimit"),
                content_type=response.headers.get("Content-Type"),
                body=body,
            )
            if verdict.delay is None:
                raise retrier.error(response.status_code, verdict, attempts, response)
            response.close()
            retrier.log_retry(request.method or "GET", request.url, response.status_code, attempts, verdict)
            time.sleep(verdict.delay)


def session(options: RetryOptions | None = None, /, **overrides: Any) -> requests.Session:
    """A ``requests.Session`` whose http and https adapters share one :class:`Retrier` (one budget)."""
    retrier = Retrier(options, **overrides)
    client = requests.Session()
    for prefix in ("http://", "https://"):
        client.mount(prefix, RetryAdapter(retrier))
    return client
