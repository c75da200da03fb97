"""ratelimits_client against real local servers: when retries go out, which are sent at all, and what it raises.

Every scenario runs through the three clients (``session()``, ``httpx_transport()``,
``async_httpx_transport()``) against a scripted ``ThreadingHTTPServer`` that records when each
request arrived (monotonic and wall clock). Waits are the behaviour under test, never a way to
synchronise. Nothing here needs Django: ``make test-client`` runs these tests where only the
client, requests, httpx and pytest are installed. Against django-ratelimits' own 429 (a live
server, the demo): the app's tests/test_client.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import logging
import math
import random
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from ratelimits_client import (
    AdaptiveThrottle,
    ClientError,
    OverloadedError,
    RateLimitedError,
    Retrier,
    RetryBudget,
    RetryError,
    RetryOptions,
    ThrottledLocally,
    async_httpx_transport,
    httpx_transport,
    session,
)
from ratelimits_client.policy import (
    LONGEST_SLEEP,
    Advice,
    parse_problem,
    parse_ratelimit_reset,
    parse_retry_after,
    problem_retry_after,
)

KINDS = ["requests", "httpx", "httpx-async"]
PROBLEM = "application/problem+json"


# --- The scripted server ---------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    status: int
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""

    @classmethod
    def problem(cls, status: int, document: Any, **headers: str) -> Reply:
        return cls(status, {"Content-Type": PROBLEM, **headers}, json.dumps(document).encode())


OK = Reply(200, {"Content-Type": "text/plain"}, b"ok")


@dataclass(frozen=True)
class Arrival:
    method: str
    path: str
    headers: Mapping[str, str]
    body: bytes
    at: float  # time.monotonic() when the request had been read
    wall: float  # time.time() at the same moment


class Scripted:
    """A local HTTP/1.1 server answering from a script: the n-th request gets the n-th reply, the last repeats.

    A reply may be a callable, called when the request arrives (for replies that name a time).
    """

    def __init__(self) -> None:
        self.arrivals: list[Arrival] = []
        self._replies: list[Reply | Callable[[], Reply]] = [OK]
        self._served = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.scripted = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def script(self, *replies: Reply | Callable[[], Reply]) -> None:
        with self._lock:
            self._replies = list(replies)
            self._served = 0

    def gaps(self) -> list[float]:
        """Seconds between consecutive arrivals."""
        return [b.at - a.at for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]

    def answer(self, arrival: Arrival) -> Reply:
        with self._lock:
            self.arrivals.append(arrival)
            reply = self._replies[min(self._served, len(self._replies) - 1)]
            self._served += 1
        return reply() if callable(reply) else reply

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the clients' pools expect
    # Headers and body go out in two writes: without this, Nagle holds the body for the client's delayed ACK.
    disable_nagle_algorithm = True

    def _serve(self) -> None:
        body = self._body()
        arrival = Arrival(self.command, self.path, dict(self.headers.items()), body, time.monotonic(), time.time())
        reply = self.server.scripted.answer(arrival)  # type: ignore[attr-defined]
        self.send_response(reply.status)
        for name, value in reply.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(reply.body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(reply.body)

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0], 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            self.rfile.readline()
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_OPTIONS = do_PATCH = _serve

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[Scripted]:
    scripted = Scripted()
    yield scripted
    scripted.stop()


# --- One call into each client ------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    status: int
    body: bytes


class Client:
    """One of the three clients (built with the public factories), behind one blocking call."""

    def __init__(self, kind: str, **options: Any) -> None:
        self.kind = kind
        self._runner: asyncio.Runner | None = None
        if kind == "requests":
            self._session = session(**options)
        elif kind == "httpx":
            self._client = httpx.Client(transport=httpx_transport(**options))
        else:
            # One event loop for the client's life, as an application has: its pool lives on it.
            self._runner = asyncio.Runner()
            self._async = self._runner.run(self._make_async(options))

    @staticmethod
    async def _make_async(options: dict[str, Any]) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=async_httpx_transport(**options))

    def send(
        self,
        method: str,
        url: str,
        *,
        headers: dict[str, str] | None = None,
        content: bytes | list[bytes] | None = None,
    ) -> Result:
        """``content`` as a list is sent as a stream (chunked), which cannot be sent twice."""
        if self.kind == "requests":
            data = iter(content) if isinstance(content, list) else content
            response = self._session.request(method, url, headers=headers, data=data, timeout=10)
            return Result(response.status_code, response.content)
        if self.kind == "httpx":
            reply = self._client.request(
                method, url, headers=headers, content=iter(content) if isinstance(content, list) else content
            )
            return Result(reply.status_code, reply.content)
        assert self._runner is not None
        return self._runner.run(self._send_async(method, url, headers, content))

    async def _send_async(
        self, method: str, url: str, headers: dict[str, str] | None, content: bytes | list[bytes] | None
    ) -> Result:
        async def stream(parts: list[bytes]) -> AsyncIterator[bytes]:
            for part in parts:
                yield part

        body = stream(content) if isinstance(content, list) else content
        reply = await self._async.request(method, url, headers=headers, content=body)
        return Result(reply.status_code, reply.content)

    def close(self) -> None:
        if self.kind == "requests":
            self._session.close()
        elif self.kind == "httpx":
            self._client.close()
        else:
            assert self._runner is not None
            self._runner.run(self._async.aclose())
            self._runner.close()


@pytest.fixture(params=KINDS)
def make_client(request: pytest.FixtureRequest, server: Scripted) -> Iterator[Callable[..., Client]]:
    """Build the parametrized kind of client with these options; closed after the test (before the server)."""
    made: list[Client] = []

    def make(**options: Any) -> Client:
        made.append(Client(request.param, **options))
        return made[-1]

    yield make
    for client in made:
        client.close()


# --- Never before the advice ---------------------------------------------------------------------


def _http_date_in_two_seconds() -> Reply:
    return Reply(429, {"Retry-After": email.utils.formatdate(math.floor(time.time()) + 2, usegmt=True)})


ADVICE = {
    # name: (the 429, the least gap the retry must keep)
    "retry-after seconds": (Reply(429, {"Retry-After": "1"}), 1.0),
    "ratelimit t": (Reply(429, {"RateLimit": '"tier:free";r=0;t=1', "RateLimit-Policy": '"tier:free";q=5;w=1'}), 1.0),
    "problem retry_after_ms": (Reply.problem(429, {"status": 429, "retry_after_ms": 700}), 0.7),
    "503 retry_after_ms": (Reply.problem(503, {"status": 503, "retry_after_ms": 400}), 0.4),
    # Retry-After and the body disagree beyond Retry-After's rounding: the longer; t is not read.
    "disagreeing advice": (
        Reply.problem(
            429,
            {"retry_after_ms": 1400},
            **{"Retry-After": "1", "RateLimit": '"a";r=0;t=1, "b";r=3;t=9'},
        ),
        1.4,
    ),
    # The draft: Retry-After wins over RateLimit. A t of 9 s (a bucket's refill) is not waited.
    "retry-after over t": (Reply(429, {"Retry-After": "1", "RateLimit": '"a";r=0;t=9'}), 1.0),
}


@pytest.mark.parametrize("case", ADVICE)
def test_a_retry_is_never_sent_before_the_advice(
    server: Scripted, make_client: Callable[..., Client], case: str
) -> None:
    refusal, least = ADVICE[case]
    server.script(refusal, OK)
    # A narrow spread keeps the test short; what is under test is the floor.
    result = make_client(advice_spread=0.1).send("GET", server.url + "/r")
    assert result.status == 200
    [gap] = server.gaps()
    assert least <= gap < least + 0.75  # the floor, its spread (0.1-0.14 s), and room for a slow machine
    # (Far below the 9 s that "retry-after over t" would wait, were t read.)


def test_an_http_date_is_waited_for(server: Scripted, make_client: Callable[..., Client]) -> None:
    server.script(_http_date_in_two_seconds, OK)
    assert make_client(advice_spread=0.1).send("GET", server.url + "/date").status == 200
    first, retry = server.arrivals
    named = math.floor(first.wall) + 2  # what the server named (or a second later, if it crossed one)
    assert retry.wall >= named
    assert retry.wall < named + 2


def test_without_advice_backoff_is_exponential_under_the_ceiling(
    server: Scripted, make_client: Callable[..., Client]
) -> None:
    server.script(Reply(503), Reply(503), Reply(503), OK)
    assert make_client(jitter=False).send("GET", server.url + "/b").status == 200
    gaps = server.gaps()
    for gap, ceiling in zip(gaps, [0.1, 0.2, 0.4], strict=True):
        assert ceiling <= gap < ceiling + 0.3


# --- Which requests are retried --------------------------------------------------------------------


def test_a_post_without_idempotency_key_is_never_retried(server: Scripted, make_client: Callable[..., Client]) -> None:
    server.script(Reply.problem(429, {"status": 429, "retry_after_ms": 10}, **{"Retry-After": "1"}))
    with pytest.raises(RateLimitedError) as raised:
        make_client().send("POST", server.url + "/charges", content=b'{"amount": 5}')
    assert len(server.arrivals) == 1
    error = raised.value
    # The exact 10 ms: Retry-After's 1 s is it rounded up (this app never names less than 1 s).
    assert (error.status, error.reason, error.attempts, error.retry_after) == (429, "not_retryable", 1, 0.01)


def test_a_post_with_idempotency_key_is_retried(server: Scripted, make_client: Callable[..., Client]) -> None:
    server.script(Reply(429, {"Retry-After": "0"}), OK)
    result = make_client().send(
        "POST", server.url + "/charges", headers={"Idempotency-Key": "k-1"}, content=b'{"amount": 5}'
    )
    assert result.status == 200
    assert [(a.method, a.headers.get("Idempotency-Key"), a.body) for a in server.arrivals] == [
        ("POST", "k-1", b'{"amount": 5}')
    ] * 2


@pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS", "PUT", "DELETE"])
def test_idempotent_methods_are_retried(server: Scripted, make_client: Callable[..., Client], method: str) -> None:
    server.script(Reply(503, {"Retry-After": "0"}), OK)
    assert make_client().send(method, server.url + "/x", content=b"same" if method == "PUT" else None).status == 200
    assert [a.method for a in server.arrivals] == [method, method]


def test_patch_is_not_retried(server: Scripted, make_client: Callable[..., Client]) -> None:
    server.script(Reply(503, {"Retry-After": "0"}))
    with pytest.raises(OverloadedError):
        make_client().send("PATCH", server.url + "/x", content=b"{}")
    assert len(server.arrivals) == 1


def test_a_streamed_body_is_not_sent_twice(server: Scripted, make_client: Callable[..., Client]) -> None:
    server.script(Reply(503, {"Retry-After": "0"}), OK)
    with pytest.raises(OverloadedError) as raised:
        make_client().send("PUT", server.url + "/upload", content=[b"part one, ", b"part two"])
    assert raised.value.reason == "not_retryable"
    assert [a.body for a in server.arrivals] == [b"part one, part two"]


def test_other_statuses_are_returned_untouched(server: Scripted, make_client: Callable[..., Client]) -> None:
    server.script(Reply.problem(400, {"status": 400}), Reply(500), Reply(502, {"Retry-After": "0"}))
    client = make_client()
    assert [client.send("GET", server.url + "/x").status for _ in range(3)] == [400, 500, 502]
    assert len(server.arrivals) == 3


# --- The typed errors -------------------------------------------------------------------------------


def test_giving_up_raises_with_the_parsed_problem(server: Scripted, make_client: Callable[..., Client]) -> None:
    document = {
        "type": "https://iana.org/assignments/http-problem-types#quota-exceeded",
        "title": "Too many requests",
        "status": 429,
        "retry_after_ms": 50,
        "violated-policies": ["tier:free"],
    }
    server.script(Reply.problem(429, document, RateLimit='"tier:free";r=0;t=0'))
    with pytest.raises(RateLimitedError) as raised:
        make_client(max_retries=2).send("GET", server.url + "/limited")
    error = raised.value
    assert isinstance(error, RetryError) and isinstance(error, ClientError)
    assert (error.status, error.reason, error.attempts) == (429, "retries_exhausted", 3)
    assert error.problem == document
    assert error.retry_after == 0.05
    assert error.response.status_code == 429
    assert json.loads(error.response.content) == document  # read, and still readable
    assert len(server.arrivals) == 3
    assert "429" in str(error) and "retries_exhausted" in str(error)


def test_a_503_raises_overloaded(server: Scripted, make_client: Callable[..., Client]) -> None:
    server.script(Reply.problem(503, {"status": 503, "title": "Service temporarily reducing load"}))
    with pytest.raises(OverloadedError) as raised:
        make_client(max_retries=0).send("GET", server.url + "/busy")
    assert not isinstance(raised.value, RateLimitedError)
    assert raised.value.problem == {"status": 503, "title": "Service temporarily reducing load"}
    assert raised.value.retry_after is None


def test_advice_beyond_max_wait_raises_at_once(server: Scripted, make_client: Callable[..., Client]) -> None:
    server.script(Reply(429, {"Retry-After": "3600"}))
    started = time.monotonic()
    with pytest.raises(RateLimitedError) as raised:
        make_client(max_wait=60).send("GET", server.url + "/later")
    assert time.monotonic() - started < 5
    assert (raised.value.reason, raised.value.retry_after, raised.value.attempts) == ("wait_too_long", 3600.0, 1)
    assert len(server.arrivals) == 1


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def retries_logged() -> Iterator[list[logging.LogRecord]]:
    """The client's DEBUG records, on its own logger (``ratelimits.client``, its name from when it was
    a module of the app: the app's test settings stop the "ratelimits" logger's propagation)."""
    handler = Records()
    logger = logging.getLogger("ratelimits.client")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_retries_are_logged_at_debug(server: Scripted, make_client: Callable[..., Client]) -> None:
    server.script(Reply(429, {"Retry-After": "0"}), OK)
    with retries_logged() as records:
        make_client().send("GET", server.url + "/logged")
    [record] = records
    assert record.levelno == logging.DEBUG
    assert "/logged answered 429 (attempt 1): retrying in" in record.getMessage()


# --- Malformed advice --------------------------------------------------------------------------------

MALFORMED = {
    "retry-after words": Reply(429, {"Retry-After": "soon"}),
    "retry-after negative": Reply(429, {"Retry-After": "-5"}),
    "retry-after exponent": Reply(429, {"Retry-After": "1e3"}),
    "retry-after nan": Reply(429, {"Retry-After": "nan"}),
    "retry-after empty": Reply(429, {"Retry-After": ""}),
    "retry-after bad date": Reply(429, {"Retry-After": "Wed, 99 Foo 2015 25:61:00 GMT"}),
    "retry-after two values": Reply(429, {"Retry-After": "1, 2"}),
    "ratelimit negative t": Reply(429, {"RateLimit": '"a";r=0;t=-5'}),
    "ratelimit open quote": Reply(429, {"RateLimit": '"a;r=0;t=1'}),
    "ratelimit words": Reply(429, {"RateLimit": '"a";r=none;t=soon'}),
    "ratelimit punctuation": Reply(429, {"RateLimit": ";;;,,,==;"}),
    "ratelimit huge t": Reply(429, {"RateLimit": '"a";r=0;t=99999999999999999999'}),
    "body not json": Reply(503, {"Content-Type": PROBLEM}, b"{not json"),
    "body a list": Reply(503, {"Content-Type": PROBLEM}, b"[1, 2]"),
    "body invalid utf-8": Reply(503, {"Content-Type": PROBLEM}, b'{"retry_after_ms": "\xff"}'),
    "retry_after_ms a string": Reply.problem(503, {"retry_after_ms": "100"}),
    "retry_after_ms a bool": Reply.problem(503, {"retry_after_ms": True}),
    "retry_after_ms negative": Reply.problem(503, {"retry_after_ms": -5}),
    "body nested deep": Reply(503, {"Content-Type": PROBLEM}, b"[" * 100_000 + b"]" * 100_000),
    "html error page": Reply(503, {"Content-Type": "text/html"}, b"<h1>Service Unavailable</h1>"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_advice_is_ignored(server: Scripted, make_client: Callable[..., Client], case: str) -> None:
    """No usable advice: the client backs off on its own (under 100 ms for a first retry) and retries."""
    server.script(MALFORMED[case], OK)
    assert make_client().send("GET", server.url + "/m").status == 200
    [gap] = server.gaps()
    assert gap < 0.1 + 0.5


#: Advice too large to count: an infinite wait, so the client gives up at once (never a quick retry).
TOO_LONG = {
    "retry-after 400 digits": Reply(429, {"Retry-After": "9" * 400}),
    "retry-after year 9999": Reply(429, {"Retry-After": "Fri, 31 Dec 9999 23:59:59 GMT"}),
    "retry_after_ms infinite": Reply(503, {"Content-Type": PROBLEM}, b'{"retry_after_ms": 1e999}'),
    "retry_after_ms huge int": Reply(503, {"Content-Type": PROBLEM}, b'{"retry_after_ms": 1' + b"0" * 400 + b"}"),
}


@pytest.mark.parametrize("case", TOO_LONG)
def test_advice_too_large_to_count_gives_up_even_without_a_max_wait(
    server: Scripted, make_client: Callable[..., Client], case: str
) -> None:
    server.script(TOO_LONG[case], OK)
    with pytest.raises(RetryError) as raised:
        make_client(max_wait=math.inf).send("GET", server.url + "/far")
    assert raised.value.reason == "wait_too_long"
    assert raised.value.retry_after is not None and raised.value.retry_after > LONGEST_SLEEP
    assert len(server.arrivals) == 1


# --- The budget ----------------------------------------------------------------------------------------


def test_the_budget_caps_retries(server: Scripted, make_client: Callable[..., Client]) -> None:
    """M originals, each refused: the server sees at most M x (1 + ratio) + reserve requests.

    Requests go one after another here, so the budget's arithmetic is exact. It starts full, with
    2 tokens: the first request's deposit overflows, its two retries take both, and from then on
    every fifth request has saved one token (five deposits of 0.2): 2 + 5 retries.
    """
    server.script(Reply.problem(503, {"retry_after_ms": 1}))
    client = make_client(max_retries=2, budget_ratio=0.2, budget_reserve=2, backoff_base=0.01)
    reasons = []
    for _ in range(30):
        with pytest.raises(OverloadedError) as raised:
            client.send("GET", server.url + "/down")
        reasons.append(raised.value.reason)
    assert len(server.arrivals) == 30 + 2 + 5 <= 30 * (1 + 0.2) + 2
    assert reasons[0] == "retries_exhausted"
    assert reasons[1:] == ["budget_exhausted"] * 29


def test_the_budget_holds_across_threads(server: Scripted) -> None:
    """One requests session shared by 8 threads: the bound holds for the whole session."""
    server.script(Reply.problem(503, {"retry_after_ms": 1}))
    shared = session(max_retries=5, budget_ratio=0.1, budget_reserve=3, backoff_base=0.01)
    originals = 8 * 10

    def work() -> None:
        for _ in range(10):
            with pytest.raises(OverloadedError):
                shared.get(server.url + "/down", timeout=10)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    shared.close()
    assert originals < len(server.arrivals) <= originals * 1.1 + 3


def test_retry_budget_arithmetic() -> None:
    budget = RetryBudget(ratio=0.2, reserve=2)
    assert budget.tokens == 2
    assert [budget.withdraw(), budget.withdraw(), budget.withdraw()] == [True, True, False]
    for _ in range(4):
        budget.deposit()
    assert not budget.withdraw()  # 0.8 of a token
    budget.deposit()
    assert budget.withdraw()
    for _ in range(100):
        budget.deposit()
    assert budget.tokens == 2  # never more than the reserve


# --- Adaptive throttling ------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class Draws(random.Random):
    """Randomness that always draws ``value``."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


def test_adaptive_throttling_rejects_locally_and_recovers(server: Scripted, make_client: Callable[..., Client]) -> None:
    clock = Clock()
    client = make_client(adaptive=True, max_retries=0, clock=clock, rng=random.Random(7))
    server.script(Reply(503, {"Retry-After": "0"}))
    local = 0
    for _ in range(60):
        try:
            client.send("GET", server.url + "/x")
        except ThrottledLocally:
            local += 1
        except OverloadedError:
            pass
    sent = len(server.arrivals)
    assert sent + local == 60
    # Refused every time, requests - 2 x accepts keeps growing: the n-th is sent with probability 1/(n+1).
    assert sent <= 20 and local >= 40

    server.script(OK)
    clock.now += 120  # the refusals leave the window
    assert [client.send("GET", server.url + "/x").status for _ in range(30)] == [200] * 30
    assert len(server.arrivals) == sent + 30


def test_adaptive_throttling_is_off_by_default(server: Scripted, make_client: Callable[..., Client]) -> None:
    server.script(Reply(503, {"Retry-After": "0"}))
    client = make_client(max_retries=0)
    for _ in range(30):
        with pytest.raises(OverloadedError):
            client.send("GET", server.url + "/x")
    assert len(server.arrivals) == 30


def test_the_throttle_formula_and_window() -> None:
    clock = Clock()
    throttle = AdaptiveThrottle(k=2.0, window=120.0, clock=clock)
    for _ in range(10):
        throttle.admit(Draws(1.0))  # counted, never rejected
    for _ in range(3):
        throttle.accepted()
    assert throttle.counts() == (10, 3)
    assert throttle.probability(10, 3) == pytest.approx((10 - 6) / 11)
    assert throttle.probability(10, 5) == 0.0  # half accepted: K = 2 lets it all through
    with pytest.raises(ThrottledLocally) as raised:
        throttle.admit(Draws(0.0))
    assert (raised.value.requests, raised.value.accepts) == (10, 3)
    clock.now += 60
    assert throttle.counts() == (11, 3)
    clock.now += 61
    assert throttle.counts() == (0, 0)


# --- Options ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error", "names"),
    [
        ({"max_retries": -1}, ValueError, "max_retries"),
        ({"max_retries": 1.5}, TypeError, "max_retries"),
        ({"max_retries": True}, TypeError, "max_retries"),
        ({"backoff_base": 0}, ValueError, "backoff_base"),
        ({"backoff_base": "0.1"}, TypeError, "backoff_base"),
        ({"backoff_cap": 0.05}, ValueError, "backoff_cap"),
        ({"backoff_cap": math.inf}, ValueError, "backoff_cap"),
        ({"jitter": 1}, TypeError, "jitter"),
        ({"advice_spread": -0.1}, ValueError, "advice_spread"),
        ({"max_wait": math.nan}, ValueError, "max_wait"),
        ({"max_wait": -1}, ValueError, "max_wait"),
        ({"retry_statuses": [429, 200]}, ValueError, "retry_statuses"),
        ({"retry_statuses": "429"}, TypeError, "retry_statuses"),
        ({"budget_ratio": 1.5}, ValueError, "budget_ratio"),
        ({"budget_ratio": -0.1}, ValueError, "budget_ratio"),
        ({"budget_reserve": 0.5}, ValueError, "budget_reserve"),
        ({"adaptive": "yes"}, TypeError, "adaptive"),
        ({"adaptive_k": 0.5}, ValueError, "adaptive_k"),
        ({"adaptive_window": 0}, ValueError, "adaptive_window"),
        ({"rng": 42}, TypeError, "rng"),
        ({"clock": 1.0}, TypeError, "clock"),
    ],
)
def test_bad_options_are_refused_by_name(options: dict[str, Any], error: type[Exception], names: str) -> None:
    with pytest.raises(error, match=f"RetryOptions.{names}"):
        RetryOptions(**options)


def test_unknown_options_are_refused() -> None:
    with pytest.raises(TypeError, match="max_retry"):
        session(max_retry=3)


def test_options_defaults() -> None:
    options = RetryOptions()
    assert (options.max_retries, options.backoff_base, options.backoff_cap, options.jitter) == (3, 0.1, 20.0, True)
    assert (options.advice_spread, options.max_wait, options.retry_statuses) == (0.5, 60.0, frozenset({429, 503}))
    assert (options.budget_ratio, options.budget_reserve) == (0.2, 10.0)
    assert (options.adaptive, options.adaptive_k, options.adaptive_window) == (False, 2.0, 120.0)
    assert RetryOptions(retry_statuses=[429]).retry_statuses == frozenset({429})
    assert RetryOptions(max_wait=math.inf).max_wait == math.inf


# --- The pure parts -----------------------------------------------------------------------------------

NOW = 1_800_000_000.0


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("0", 0.0),
        ("1", 1.0),
        (" 120 ", 120.0),
        ("1.5", 1.5),
        (email.utils.formatdate(NOW + 30, usegmt=True), 30.0),
        (email.utils.formatdate(NOW - 30, usegmt=True), 0.0),  # in the past: now
        (email.utils.formatdate(NOW + 30), 30.0),  # "-0000": UTC, no zone claimed
        (None, None),
        ("", None),
        ("soon", None),
        ("-1", None),
        ("1e3", None),
        ("inf", None),
        ("\u0661", None),  # an Arabic-Indic digit is not a digit here
        ("Fri, 31 Dec 9999 23:59:59 GMT", 253402300799.0 - NOW),
        ("Sat, 32 Dec 99999 99:99:99 GMT", None),
    ],
)
def test_parse_retry_after(value: str | None, seconds: float | None) -> None:
    assert parse_retry_after(value, NOW) == (pytest.approx(seconds) if seconds is not None else None)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ('"tier:free";r=0;t=1', 1.0),
        ('"a";r=0;t=5, "b";r=0;t=60', 60.0),
        ('"a";r=0;t=5, "b";r=4;t=60', 5.0),  # b has quota left
        ('"a";r=3;t=5', None),
        ('"a";r=0', None),
        ('"a, with a comma";r=0;t=7', 7.0),
        ('"a \\" quote";r=0;t=8', 8.0),
        ('"a";R=0;T=9', 9.0),
        ("token;r=0;t=2", 2.0),
        ('"a";r=0;t=2, garbage, "c";r=0;t=x', 2.0),
        ('"a";r=0;t=-1', None),
        ('"a;r=0;t=1', None),
        ("", None),
        (None, None),
    ],
)
def test_parse_ratelimit_reset(value: str | None, seconds: float | None) -> None:
    assert parse_ratelimit_reset(value) == seconds


@pytest.mark.parametrize(
    ("advice", "wait"),
    [
        (Advice(retry_after=1.0, problem=0.42), 0.42),  # Retry-After is the exact wait rounded up
        (Advice(retry_after=1.0, problem=1.0), 1.0),
        (Advice(retry_after=3.0, problem=2.001), 2.001),
        (Advice(retry_after=3.0, problem=2.0), 3.0),  # a second or more above: a jitter, waited in full
        (Advice(retry_after=1.0, problem=1.4), 1.4),  # the body's is longer: never early
        (Advice(retry_after=1.0, ratelimit_reset=9.0), 1.0),  # the draft: Retry-After over RateLimit
        (Advice(problem=0.42, ratelimit_reset=9.0), 0.42),
        (Advice(ratelimit_reset=9.0), 9.0),  # t only when nothing else advises
        (Advice(retry_after=0.0, problem=0.0), 0.0),
        (Advice(), None),
    ],
)
def test_the_wait_is_retry_after_to_the_millisecond_then_t(advice: Advice, wait: float | None) -> None:
    assert advice.wait == wait


def test_parse_problem_and_its_wait() -> None:
    assert parse_problem(PROBLEM, b'{"retry_after_ms": 66}') == {"retry_after_ms": 66}
    assert parse_problem("application/json; charset=utf-8", b'{"a": 1}') == {"a": 1}
    assert parse_problem("application/vnd.api+json", b'{"a": 1}') == {"a": 1}
    assert parse_problem("text/plain", b'{"a": 1}') is None
    assert parse_problem(None, b'{"a": 1}') is None
    assert parse_problem(PROBLEM, b'{"a": "' + b"x" * 70_000 + b'"}') is None  # too large to parse
    assert problem_retry_after({"retry_after_ms": 66}) == 0.066
    assert problem_retry_after({"retry_after_ms": 2.5}) == 0.0025
    assert problem_retry_after({"retry_after_ms": None}) is None
    assert problem_retry_after({}) is None
    assert problem_retry_after(None) is None


def test_delays() -> None:
    retrier = Retrier(rng=random.Random(3))
    for retry in range(1, 12):
        ceiling = min(20.0, 0.1 * 2 ** (retry - 1))
        assert all(0 <= retrier.delay(retry, None) <= ceiling for _ in range(200))
    assert all(1.0 <= retrier.delay(1, 1.0) < 1.5 for _ in range(200))
    assert all(0.42 <= retrier.delay(1, 0.42) < 0.63 for _ in range(200))
    assert all(0.0 <= retrier.delay(1, 0.0) < 0.1 for _ in range(200))  # the spread is at least backoff_base
    assert all(60.0 <= retrier.delay(1, 60.0) < 80.0 for _ in range(200))  # and at most backoff_cap
    exact = Retrier(jitter=False)
    assert [exact.delay(retry, None) for retry in (1, 2, 3, 10)] == [0.1, 0.2, 0.4, 20.0]
    assert exact.delay(5, 1.5) == 1.5
    assert Retrier().delay(10_000, None) <= 20.0  # no overflow for absurd attempt counts


# --- Imports ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "absent"),
    [
        ("ratelimits_client", ["django", "requests", "httpx", "redis"]),
        ("ratelimits_client._requests", ["django", "httpx", "redis"]),
        ("ratelimits_client._httpx", ["django", "requests", "redis"]),
    ],
)
def test_the_client_imports_nothing_it_does_not_need(module: str, absent: list[str]) -> None:
    """Plain Python clients: no Django, no redis-py, nothing of the app's package (``ratelimits``, where
    its checkout or wheel is importable too), and one HTTP library never needs the other."""
    check = (
        f"import sys, {module}; "
        f"loaded = [m for m in {absent!r} if m in sys.modules]; "
        "others = [m for m in sys.modules if m == 'ratelimits' or m.startswith('ratelimits.')]; "
        "assert not loaded and not others, (loaded, others)"
    )
    # Run from the repository's root, where the app's package is importable: the client must not import it.
    subprocess.run([sys.executable, "-c", check], check=True, timeout=60, cwd=Path(__file__).resolve().parents[3])
