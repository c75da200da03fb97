"""The demo project. Loads the Celery app when Celery is installed, as Celery's Django guide does."""

from .celery import app as celery_app

__all__ = ["celery_app"]
