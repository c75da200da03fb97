"""The demo project. Loads its Celery app at start-up, as Celery's Django guide does."""

from .celery import app as celery_app

__all__ = ["celery_app"]
