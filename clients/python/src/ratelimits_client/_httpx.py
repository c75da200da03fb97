"""The retrying client for httpx: sync and async transports that back off on 429 and 503."""

from __future__ import annotations

import time
from typing import Any

import anyio
import httpx

from ratelimits_client.policy import IDEMPOTENCY_KEY, Retrier, RetryOptions, Verdict

__all__ = ["AsyncRetryTransport", "RetryTransport", "async_httpx_transport", "httpx_transport"]


def _retryable(retrier: Retrier, request: httpx.Request) -> bool:
    # A ByteStream (content, json, data, no body) can be sent again; a generator or multipart upload cannot.
    replayable = isinstance(request.stream, httpx.ByteStream)
    return retrier.retryable(request.method, IDEMPOTENCY_KEY in request.headers, replayable)


def _assess(retrier: Retrier, response: httpx.Response, attempts: int, retryable: bool) -> Verdict:
    return retrier.assess(
        attempts=attempts,
        retryable=retryable,
        retry_after=response.headers.get("Retry-After"),
        ratelimit=response.headers.get("RateLimit"),
        content_type=response.headers.get("Content-Type"),
        body=response.content,
    )


class RetryTransport(httpx.BaseTransport):
    """Wraps a sync transport (a new ``httpx.HTTPTransport`` by default) and retries 429 and 503."""

    def __init__(self, transport: httpx.BaseTransport | None = None, retrier: Retrier | None = None) -> None:
        self.transport = transport or httpx.HTTPTransport()
        self.retrier = retrier or Retrier()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request``; on a retry status wait and send it again, or raise a :class:`RetryError`."""
        retrier = self.retrier
        retrier.begin()
        retryable = _retryable(retrier, request)
        attempts = 0
        while True:
            attempts += 1
            response = self.transport.handle_request(request)
            if not retrier.refused(response.status_code):
                return response
            try:
                response.read()
            finally:
                response.close()
            verdict = _assess(retrier, response, attempts, retryable)
            if verdict.delay is None:
                response.request = request
                raise retrier.error(response.status_code, verdict, attempts, response)
            retrier.log_retry(request.method, request.url, response.status_code, attempts, verdict)
            time.sleep(verdict.delay)

    def close(self) -> None:
        self.transport.close()


class AsyncRetryTransport(httpx.AsyncBaseTransport):
    """Wraps an async transport (a new ``httpx.AsyncHTTPTransport`` by default) and retries 429 and 503.

    It sleeps with ``anyio.sleep``, so it runs wherever httpx does (asyncio or trio).
    """

    def __init__(self, transport: httpx.AsyncBaseTransport | None = None, retrier: Retrier | None = None) -> None:
        self.transport = transport or httpx.AsyncHTTPTransport()
        self.retrier = retrier or Retrier()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request``; on a retry status wait and send it again, or raise a :class:`RetryError`."""
        retrier = self.retrier
        retrier.begin()
        retryable = _retryable(retrier, request)
        attempts = 0
        while True:
            attempts += 1
            response = await self.transport.handle_async_request(request)
            if not retrier.refused(response.status_code):
                return response
            try:
                await response.aread()
            finally:
                await response.aclose()
            verdict = _assess(retrier, response, attempts, retryable)
            if verdict.delay is None:
                response.request = request
                raise retrier.error(response.status_code, verdict, attempts, response)
            retrier.log_retry(request.method, request.url, response.status_code, attempts, verdict)
            await anyio.sleep(verdict.delay)

    async def aclose(self) -> None:
        await self.transport.aclose()


def httpx_transport(
    options: RetryOptions | None = None, /, *, transport: httpx.BaseTransport | None = None, **overrides: Any
) -> RetryTransport:
    """A transport for ``httpx.Client(transport=...)``, wrapping ``transport`` (a new ``httpx.HTTPTransport``)."""
    return RetryTransport(transport, Retrier(options, **overrides))


def async_httpx_transport(
    options: RetryOptions | None = None, /, *, transport: httpx.AsyncBaseTransport | None = None, **overrides: Any
) -> AsyncRetryTransport:
    """A transport for ``httpx.AsyncClient(transport=...)``, wrapping ``transport`` (a new ``AsyncHTTPTransport``)."""
    return AsyncRetryTransport(transport, Retrier(options, **overrides))
