"""Latency benchmark of the ratelimits decision against a private redis-server: ``python -m bench``."""
