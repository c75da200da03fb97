"""How long the package's client waits after a 429, against the server's exact wait, on the demo.

```sh
.venv/bin/python -m bench.client_wait            # 40 refusals (about 40 s with the demo's start)
.venv/bin/python -m bench.client_wait --rounds 100
```

The demo runs under gunicorn on a private Redis and a temporary SQLite file (``bench.support.demo``).
Acme's key on ``GET /v1/customers`` (an override of 2/s, burst 5) is spent, then a client made by
``ratelimits_client.session()`` with its default options (but a retry budget it cannot
exhaust) sends the next request: the server
refuses it with its exact wait (``retry_after_ms``; ``Retry-After`` is that rounded up to whole
seconds), the client sleeps and retries. Each retry's DEBUG line gives the advice it read and the
delay it chose. Printed: the ratio delay / exact wait (median, p90, max), and how many retries were
refused again (a retry sent early would be). The target (issue 26): median at most 1.5, never early.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

from ratelimits_client import session

from .support.demo import demo_server

#: The demo's seeded free key (project/payments/management/commands/seed_demo.py, the README).
ACME = "sk_free_demo_acme_0000000000"


class _Retries(logging.Handler):
    """The client's retry lines: (advised seconds, delay seconds) of each."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[float, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) == 6 and isinstance(args[5], str) and args[5].endswith(" s"):
            self.seen.append((float(args[5].removesuffix(" s")), float(args[4])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.client_wait", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40, help="refusals to retry through (default 40)")
    options = parser.parse_args(argv)
    acme = ACME
    retries = _Retries()
    logger = logging.getLogger("ratelimits.client")
    logger.addHandler(retries)
    logger.setLevel(logging.DEBUG)
    refused_again = 0
    started = time.monotonic()
    # Default options but the retry budget, which would (rightly) stop a client retrying this often.
    with demo_server("client-wait", workers=1, threads=2) as demo, session(budget_reserve=1e6) as client:
        url = f"http://127.0.0.1:{demo.port}/v1/customers"
        headers = {"Authorization": f"Bearer {acme}"}
        for n in range(options.rounds):
            before = len(retries.seen)
            while len(retries.seen) == before:  # spend the bucket until a request had to be retried
                response = client.get(url, headers=headers, timeout=10)
                if response.status_code != 200:
                    print(f"round {n}: gave up with {response.status_code}", file=sys.stderr)
                    return 1
            refused_again += len(retries.seen) - before - 1
    ratios = sorted(delay / advised for advised, delay in retries.seen if advised > 0)
    advised = sorted(a for a, _ in retries.seen)
    print(
        f"{len(ratios)} retries in {time.monotonic() - started:.0f} s; exact waits {advised[0]:.3f}-{advised[-1]:.3f} s"
    )
    print(
        f"delay / exact wait: median {statistics.median(ratios):.2f}, "
        f"p90 {ratios[int(0.9 * (len(ratios) - 1))]:.2f}, max {ratios[-1]:.2f}, min {ratios[0]:.2f}"
    )
    print(f"retries refused again (sent early): {refused_again}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
