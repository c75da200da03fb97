"""A thundering herd: 1,000 clients told to retry after 3 s at the same instant, with and without jitter.

An asyncio server in a process of its own holds each client's first request until all 1,000 have
arrived, then answers them all at once (the release, at ``t0``) with a 429 and ``Retry-After: 3``,
records the arrival of every retry (and whose it is) on the system-wide monotonic clock, and answers
retries with 200. Each client is an ``httpx.AsyncClient`` with its own ``async_httpx_transport()``
(its own budget and randomness, as independent callers have) and default options, but for a spread
of the whole advice (``advice_spread=1.0``; the default is half of it): a herd spread over 3 s. The
clients' own DEBUG line per retry (logger ``ratelimits.client``: "retrying in X s") says when each
started waiting and for how long: the moment it chose.

**The statistic.** With ``advice_spread`` 1.0, a client told to wait F retries after F + U, U
uniform on [0, S) with S = F: spread evenly over S, the herd puts ``MEAN = N x 100 ms / S = 33.3``
retries in each 100 ms window. The flat check counts the moments the clients *chose*, F + U after
each started waiting, in 100 ms windows of U: the *peak* is the busiest of the 30. The arrivals
themselves are held to those moments: no retry arrives before the moment its client chose (so each
really waited it), nor before t0 + F.

**Why the chosen moments, not the arrivals.** On a machine whose cores are busy with other work
(the CPU hogs of ``make flake-check``, a loaded CI runner), the rig's own event loops stall for
hundreds of milliseconds: the timers that fell due meanwhile fire together and the server reads
their requests together, so the arrivals bunch by the rig's stalls, not by the client's choice
(a correct client's herd peaked at 3.75x the mean that way, in windows of 0 and 125). What the
client decides is what this test is about, and it is measured exactly.

**A correct client fails the flat check with probability below 1e-5.** Each of the N independent
clients' U falls in a given 100 ms window with probability p = 0.1 s / S = 1/30, so a window's
count is Binomial(1000, 1/30). ``peak <= 2 x MEAN`` fails only if some window holds 67 or more:
P(Bin(1000, 1/30) >= 67) = 1.06e-7 per window, below 30 x 1.06e-7 = 3.2e-6 for the 30 windows,
whatever the machine's load.

**Without jitter, the herd spikes.** Every client chooses exactly F (checked), and retries F after
it read its 429, so the herd arrives within the time the rig needs to read and send 1,000 requests
(0.4-0.5 s here). ``peak >= 2.5 x MEAN`` needs 84 in one window: a herd that arrives within 1 s
touches at most 11 windows, so one of them holds at least 91. These are the arrivals, counted on a
grid from t0 + F: a loaded rig reads the 429s over longer, but its stalls bunch the retries more,
never less (5.2 s and a peak of 6.3x with both cores hogged).

**Why not ``Retry-After: 1`` and peak <= 1.2 x mean.** With 1,000 clients in 100 ms windows,
1.2 x mean is about 2 standard deviations of a window's count when there are 10 windows (it
fails 1 run in 6); it fails under 1e-4 only with 3 windows or fewer (S <= 0.3 s), and then a
spike can never exceed 3x the mean. Nor can this 2-core machine make a sharper herd than its
0.4-0.5 s: a spread of 1 s leaves a herd without jitter at 2.5-4x a mean of 100, too close to
the flat check's ceiling. A 3 s advice and spread (S = 3 s) keep both checks far from failing,
with the other work on the machine too: the figures printed (``-s``) show by how much. (With the
default spread, S = 1.5 s, or a 6 s advice, the rig's own noise over the longer sleep put one
window at 2.2x once: the statistic is the spread's, not the default's.)

The process holds 2,000 sockets (1,000 each side): the open-file limit is raised for the test
when it is lower. The collector is paused during each herd, so its pauses do not bunch retries.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import resource
import ssl
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

import httpx
import pytest
from ratelimits_client import async_httpx_transport

pytestmark = pytest.mark.slow

N = 1000
ADVICE = 3  # the Retry-After the herd is given, in seconds
SPREAD = 1.0 * ADVICE  # advice_spread (1.0) times the advice
WINDOW = 0.1
MEAN = N * WINDOW / SPREAD
FLAT = 2.0  # the jittered herd's peak is at most this many means
SPIKE = 2.5  # the herd without jitter peaks at least this many means
TIMEOUT = 60.0

PROBLEM = b'{"status": 429, "title": "Too many requests"}'
TOO_MANY = (
    b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: %d\r\nContent-Type: application/problem+json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (ADVICE, len(PROBLEM), PROBLEM)
)
OK = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"


def serve(conn: Connection) -> None:
    """The herd's server (in a process of its own): sends its port, then (t0, retry arrival times)."""
    gc.disable()
    asyncio.run(_serve(conn))


async def _serve(conn: Connection) -> None:
    # Clients are told apart by their path: a retry may come on a new connection (httpx drops a
    # connection idle for 5 s), so a connection is not a client.
    told: set[bytes] = set()
    released: list[float] = []
    all_in = asyncio.Event()
    retries: list[tuple[str, float]] = []
    connections = 0
    finished = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")  # GETs: no body
                now = time.monotonic()
                client = head.split(b" ", 2)[1]
                if client in told:
                    retries.append((client.decode(), now))
                    writer.write(OK)
                else:
                    told.add(client)
                    if len(told) == N:
                        released.append(now)
                        all_in.set()
                    await all_in.wait()
                    writer.write(TOO_MANY)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed the connection
        finally:
            writer.close()
            connections -= 1
            if connections == 0 and len(retries) >= N:
                finished.set()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=2 * N)
    conn.send(server.sockets[0].getsockname()[1])
    try:
        await asyncio.wait_for(finished.wait(), TIMEOUT)
    finally:
        conn.send((released[0] if released else None, retries))
        server.close()


class Chosen(logging.Handler):
    """Each retry's DEBUG line (logger ``ratelimits.client``): by path, when it was logged and the delay it names."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.moments: dict[str, tuple[float, float]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        # "%s %s answered %d (attempt %d): retrying in %.3f s ...": logged just before the client sleeps.
        _, url, _, _, delay, _ = record.args  # type: ignore[misc]
        self.moments[httpx.URL(str(url)).path] = (time.monotonic(), float(delay))


async def herd(port: int, *, jitter: bool) -> None:
    """N independent clients, one GET each."""
    # One TLS context for all: an AsyncHTTPTransport builds its own otherwise (~30 ms each), even for http://.
    context = ssl.create_default_context()

    async def client(i: int) -> None:
        inner = httpx.AsyncHTTPTransport(verify=context)
        transport = async_httpx_transport(transport=inner, jitter=jitter, advice_spread=SPREAD / ADVICE)
        async with httpx.AsyncClient(transport=transport, timeout=TIMEOUT) as session:
            response = await session.get(f"http://127.0.0.1:{port}/{i}")
        assert response.status_code == 200

    await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(N))), TIMEOUT)


def run_herd(*, jitter: bool) -> tuple[float, dict[str, float], dict[str, tuple[float, float]]]:
    """One herd: the release instant t0, every retry's arrival by client (path), and each client's
    chosen moment: when it started waiting and for how long, on the monotonic clock."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    server = context.Process(target=serve, args=(theirs,), daemon=True)
    server.start()
    try:
        assert ours.poll(TIMEOUT), "the herd server did not start"
        port = ours.recv()
        chosen = Chosen()
        logger = logging.getLogger("ratelimits.client")
        level = logger.level
        logger.addHandler(chosen)
        logger.setLevel(logging.DEBUG)
        gc.disable()
        try:
            asyncio.run(herd(port, jitter=jitter))
        finally:
            gc.enable()
            logger.removeHandler(chosen)
            logger.setLevel(level)
        assert ours.poll(TIMEOUT), "the herd server did not report"
        t0, retries = ours.recv()
    finally:
        server.join(TIMEOUT)
        if server.is_alive():
            server.kill()
            server.join()
    arrivals = dict(retries)
    assert t0 is not None and len(retries) == len(arrivals) == N
    assert set(chosen.moments) == set(arrivals), "a retry without its client's line, or a line without its retry"
    return t0, arrivals, chosen.moments


def windows(t0: float, retries: list[float]) -> list[int]:
    """Retry arrivals per 100 ms window, on a grid starting at t0 + ADVICE."""
    counts: dict[int, int] = {}
    for arrival in retries:
        index = int((arrival - t0 - ADVICE) // WINDOW)
        counts[index] = counts.get(index, 0) + 1
    return [counts.get(i, 0) for i in range(min(counts), max(counts) + 1)]


@pytest.fixture
def sockets() -> Iterator[None]:
    """Room for 2,000 sockets and a few files, restored afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * N + 256
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"the open-file limit is {hard}; the herd needs {needed}")
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def spread_windows(moments: dict[str, tuple[float, float]]) -> list[int]:
    """The chosen delays beyond the advice (U), per 100 ms window of [0, SPREAD)."""
    counts = [0] * round(SPREAD / WINDOW)
    for _, delay in moments.values():
        counts[min(int((delay - ADVICE) // WINDOW), len(counts) - 1)] += 1
    return counts


def test_jitter_spreads_the_herd_and_without_it_the_herd_spikes(sockets: None) -> None:
    t0, arrivals, moments = run_herd(jitter=True)
    check_arrivals(t0, arrivals, moments)
    assert all(ADVICE <= delay < ADVICE + SPREAD for _, delay in moments.values())
    flat_counts = spread_windows(moments)
    flat = max(flat_counts) / MEAN
    arrived = max(windows(t0, list(arrivals.values()))) / MEAN  # shown, not held: the rig's stalls bunch it

    t0, arrivals, moments = run_herd(jitter=False)
    check_arrivals(t0, arrivals, moments)
    assert {delay for _, delay in moments.values()} == {ADVICE}  # the advice exactly: no spread
    spike_counts = windows(t0, list(arrivals.values()))
    spike = max(spike_counts) / MEAN
    report = (
        f"peak/mean with jitter {flat:.2f} (chosen, windows {flat_counts}; arrivals {arrived:.2f}), "
        f"without {spike:.2f} (arrivals, windows {spike_counts}); mean {MEAN:g} per 100 ms"
    )
    print(report)
    assert flat <= FLAT, report
    assert spike >= SPIKE, report


def check_arrivals(t0: float, arrivals: dict[str, float], moments: dict[str, tuple[float, float]]) -> None:
    """No retry came before Retry-After, nor before the moment its client chose (it waited what it said)."""
    assert min(arrivals.values()) >= t0 + ADVICE, "a retry came before Retry-After"
    early = {path: (at, moments[path]) for path, at in arrivals.items() if at < sum(moments[path])}
    assert not early, f"retries before their client's chosen moment: {list(early.items())[:5]}"
