"""docs/configuration.md lists every setting exactly as ``ratelimits.conf`` declares it."""

from __future__ import annotations

from ratelimits.conf import SETTINGS

from .support.reference import PAGE, spliced


def test_the_settings_tables_are_written_from_the_declarations() -> None:
    text = PAGE.read_text(encoding="utf-8")
    assert text == spliced(text), "docs/configuration.md is out of date: run `make settings-reference`"


def test_every_setting_and_its_id_is_on_the_page() -> None:
    text = PAGE.read_text(encoding="utf-8")
    for setting in SETTINGS.values():
        assert f"| `{setting.key}` |" in text and f"`{setting.id}`" in text, setting.name
