"""What the tests start and drive: real servers, processes, clients and clocks (bench/ has its own, bench/support).

- ``processes``: one supervisor for every server process (gunicorn, Celery, redis-server).
- ``redis_server``: a private redis-server on a free port.
- ``postgres``: a throwaway PostgreSQL database.
- ``browser``: Debian's Chromium driven by Playwright.
- ``docs_site``: the documentation site, built as ``make docs`` builds it.
- ``http``: plain HTTP requests, and the Django admin's forms as a browser posts them.
- ``storm``: worker processes deciding against one Redis.
- ``gate`` and ``bursts``: requests held inside a view, and bursts of concurrent requests.
- ``clock``: a clock that moves only when told.
- ``celery_settings``, ``propagation_settings``: the demo's settings for the processes tests start.
"""
