"""Each crossing of a customer's quota reaches their webhook once: through gunicorn, RabbitMQ, a
Celery worker and beat, a receiver down for a while, and a worker killed in the middle of a send.

The demo runs under gunicorn (2 workers of 4 threads) on a private Redis and a throwaway
PostgreSQL database; a Celery worker and beat (``tests.support.celery_settings``: the demo's
settings, a queue of this run's own, notices swept every half second and retried after 1 s, at
most 2 s apart) share both. Globex is put on a plan of 10 requests a month with a webhook endpoint
at a receiver this test runs over HTTP on a loopback port.

1. Eight requests: the 80% notice is delivered, signed.
2. The receiver goes down. Four more requests: 200, 200 (the 100% crossing), 429, 429. Its delivery
   fails at connect, and is retried.
3. The receiver comes back, holding its answers; once the worker's attempt has reached it, the
   worker (main process and pool) is SIGKILLed mid-send and a new one started. The killed attempt
   was never answered; its claim lapses and the new worker sends it again.

Each notice is answered exactly once, each signature verifies with the endpoint's secret, and
sweeps after the last delivery send nothing more. Every wait is a bounded poll of a condition;
every process started here is stopped by its PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets

import psycopg
import pytest

from ratelimits.webhooks import EVENT_HEADER, SIGNATURE_HEADER, verify

from .support.celery_app import BROKER_URL, broker_reachable, celery_env, celery_processes
from .support.demo import demo_server
from .support.http import fetch
from .support.polling import wait_until
from .support.processes import REPO, manage
from .support.receiver import Received, Receiver

pytestmark = pytest.mark.slow

NOTICES = {
    "EVERY": "500ms",
    "RETRY_FIRST": "1s",
    "RETRY_LONGEST": "2s",
    "TIMEOUT": "3s",
    "ALLOW_PRIVATE_URLS": True,  # the receiver is on loopback
}
GLOBEX = "sk_std_demo_globex_000000000"
START_TIMEOUT = 60.0
#: A sweep every 0.5 s, retries at most 2 s apart: 30 s is ample on a loaded machine.
DELIVERY_TIMEOUT = 30.0
#: The killed attempt's claim: its TIMEOUT (3 s) plus the claim's margin (10 s), then a sweep.
RESENT_TIMEOUT = 45.0
SWEEP_DONE = re.compile(r"Task ratelimits\.send_notices\[[0-9a-f-]+\] succeeded")

SETUP = """
from project.payments.models import ApiKey
from ratelimits.models import SubjectAssignment, Tier, WebhookEndpoint
key = ApiKey.objects.get(name__startswith="Globex")
tier = Tier.objects.create(name="metered", rate="100/s", burst=100, quota="10/month")
SubjectAssignment.objects.create(subject_kind="api_key", subject_id=f"ApiKey:{key.pk}", tier=tier)
endpoint = WebhookEndpoint.objects.create(subject_kind="api_key", subject_id=f"ApiKey:{key.pk}", url=URL)
print(endpoint.secret)
"""


def thresholds(received: list[Received], *, answered: bool = True) -> list[int]:
    return [json.loads(r.body)["data"]["threshold"] for r in received if r.answered or not answered]


def deliveries(database_url: str) -> list[tuple[int, str, int, int]]:
    """(threshold, state, attempts, logged attempts) of each delivery, by threshold."""
    with psycopg.connect(database_url, connect_timeout=10) as conn:
        rows = conn.execute(
            "SELECT n.threshold, d.state, d.attempts, "
            "(SELECT count(*) FROM ratelimits_deliveryattempt a WHERE a.delivery_id = d.id) "
            "FROM ratelimits_delivery d JOIN ratelimits_notice n ON n.id = d.notice_id ORDER BY n.threshold"
        ).fetchall()
    return [(int(t), str(s), int(a), int(n)) for t, s, a, n in rows]


def test_each_crossing_reaches_the_receiver_once_through_an_outage_and_a_killed_worker() -> None:
    if not broker_reachable():
        pytest.skip(f"no AMQP broker at {BROKER_URL} (set RATELIMITS_TEST_BROKER_URL)")
    token = secrets.token_hex(4)
    queue = f"ratelimits-test-{token}"
    shared = {
        "DJANGO_SETTINGS_MODULE": "tests.support.celery_settings",
        "RATELIMITS_TEST_CELERY_QUEUE": queue,
        "RATELIMITS_TEST_NOTICES": json.dumps(NOTICES),
        "CELERY_BROKER_URL": BROKER_URL,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
    }
    with contextlib.ExitStack() as cleanup:
        receiver = cleanup.enter_context(Receiver())
        demo = cleanup.enter_context(demo_server(f"notices_{token}", workers=2, threads=4, env=shared))
        env = celery_env(
            database_url=demo.database_url, redis_url=demo.redis.url, queue=queue, **{k: shared[k] for k in shared}
        )
        secret = manage(env, "shell", "-c", f"URL = {receiver.url!r}\n{SETUP}").stdout.strip().splitlines()[-1]
        processes = celery_processes(cleanup, queue=queue, node=f"ratelimits-notices-{token}")
        try:
            _, worker, beat = processes
            worker.start(env)
            worker.wait_for_log(r"@\S+ ready\.", START_TIMEOUT, "ready line")
            beat.start(env)
            beat.wait_for_log("beat: Starting", START_TIMEOUT, "start")
            headers = {"Authorization": f"Bearer {GLOBEX}"}

            def spend(requests: int) -> list[int]:
                return [fetch(demo.port, "GET", "/v1/customers", headers=headers).status for _ in range(requests)]

            # 1. The 80% notice, delivered.
            assert spend(8) == [200] * 8
            receiver.wait_for(lambda got: thresholds(got) == [80], DELIVERY_TIMEOUT, "the 80% notice")

            # 2. The receiver down: the 100% notice fails at connect, and is retried.
            receiver.down()
            assert spend(4) == [200, 200, 429, 429]
            assert wait_until(
                lambda: any(t == 100 and s == "pending" and a >= 2 for t, s, a, _ in deliveries(demo.database_url)),
                DELIVERY_TIMEOUT,
            ), deliveries(demo.database_url)

            # 3. Back, holding its answer: the worker is killed mid-send, and a new one takes over.
            receiver.hold()
            receiver.up()
            receiver.wait_for(lambda got: 100 in thresholds(got, answered=False), DELIVERY_TIMEOUT, "an attempt")
            worker.kill()
            receiver.release()
            worker.start(env)
            worker.wait_for_log(r"@\S+ ready\.", START_TIMEOUT, "ready line after the kill")
            got = receiver.wait_for(lambda got: thresholds(got) == [80, 100], RESENT_TIMEOUT, "the 100% notice")
            # Sweeps after it send nothing more: three more succeed, and the receiver has what it had.
            sweeps = len(SWEEP_DONE.findall(worker.log_text()))
            worker.wait_until(
                lambda: len(SWEEP_DONE.findall(worker.log_text())) >= sweeps + 3, DELIVERY_TIMEOUT, "three more sweeps"
            )
            final = receiver.received
            states = deliveries(demo.database_url)
        except BaseException:
            processes.print_logs()
            raise

    answered = [r for r in final if r.answered]
    assert thresholds(final) == [80, 100]  # each once
    # And the attempt the killed worker never heard back on (more than one if an attempt held there
    # reached its deadline before the kill, and the next came to the held receiver too).
    unanswered = [r.headers[EVENT_HEADER] for r in final if not r.answered]
    assert unanswered and set(unanswered) == {answered[1].headers[EVENT_HEADER]}
    assert len({r.headers[EVENT_HEADER] for r in answered}) == 2
    for delivery in answered:
        assert verify(secret, delivery.body, delivery.headers[SIGNATURE_HEADER])
    assert got == final[: len(got)]
    assert [(t, s) for t, s, _, _ in states] == [(80, "delivered"), (100, "delivered")]
    [(_, _, attempts, logged)] = [row for row in states if row[0] == 100]
    # Two or more refused at connect, any held attempts that reached their deadline, the one answered;
    # the killed attempt is in neither count.
    assert attempts >= 3 and logged == attempts
