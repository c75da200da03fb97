"""What the benchmarks start and stop: their own, apart from the test suite's ``tests/support``.

- ``processes``: a command in a session of its own, logging to a file, stopped by its PID and
  process group; gunicorn serving the demo.
- ``redis_server``: a private ``redis-server`` on a free loopback port (never 6379).
- ``redis_cluster``: a private Redis Cluster of such servers.
- ``http``: one request on a fresh connection, and whether a server answers yet.
- ``demo``: the seeded demo under gunicorn, on a private Redis and a temporary SQLite file.
- ``django_settings``: the Django settings of the scripts that decide in-process (sharding,
  eviction, hot keys, cluster, regions).
- ``regions``: two regions' stores, global shares in them, and demand that moves between them
  (``tests/test_regions_celery.py`` drives the same traffic with it).

Nothing here imports any other part of bench (``tests/test_bench_layout.py``).
"""
