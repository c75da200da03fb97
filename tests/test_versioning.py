"""The policy version stamp moves once per committed transaction, never for a rolled-back one."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import transaction

from ratelimits.engine import get_limiter
from ratelimits.models import Tier

pytestmark = pytest.mark.django_db


def version() -> int:
    return int(get_limiter().backend.version or 0)  # type: ignore[attr-defined]


def test_many_changes_in_one_transaction_bump_once(django_capture_on_commit_callbacks: Any) -> None:
    before = version()
    with django_capture_on_commit_callbacks(execute=True), transaction.atomic():
        for n in range(3):
            Tier.objects.create(name=f"bulk-{n}", rate="10/s")
        Tier.objects.filter(name__startswith="bulk-").update(shadow=True)
    assert version() == before + 1


def test_rolled_back_savepoint_keeps_the_bump_of_what_survives(django_capture_on_commit_callbacks: Any) -> None:
    before = version()
    with django_capture_on_commit_callbacks(execute=True), transaction.atomic():
        try:
            with transaction.atomic():
                Tier.objects.create(name="doomed", rate="10/s")
                raise RuntimeError("roll this savepoint back")
        except RuntimeError:
            pass
        Tier.objects.create(name="kept", rate="10/s")
    assert version() == before + 1
    assert not Tier.objects.filter(name="doomed").exists()


def test_nothing_committed_nothing_bumped(django_capture_on_commit_callbacks: Any) -> None:
    before = version()
    with django_capture_on_commit_callbacks(execute=True):
        try:
            with transaction.atomic():
                Tier.objects.create(name="gone", rate="10/s")
                raise RuntimeError("roll everything back")
        except RuntimeError:
            pass
    assert version() == before


def test_advance_counts_from_the_stored_value() -> None:
    from ratelimits.models import PolicyVersion

    from .factories import PolicyVersionFactory

    PolicyVersionFactory(value=41)
    PolicyVersion.advance()
    assert PolicyVersion.current() == 42
    PolicyVersion.objects.all().delete()
    assert PolicyVersion.current() == 0
    PolicyVersion.advance()  # the row is created when missing (a flushed test database)
    assert PolicyVersion.current() == 1
