"""ratelimits: one-round-trip rate limiting for Django REST framework APIs."""

__version__ = "0.1.0"
