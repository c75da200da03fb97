"""Write every rate limit policy to a JSON document that ``ratelimits_import`` reads in another environment."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from ...store.portability import SECTIONS, export_policies


class Command(BaseCommand):
    help = (
        "Export tiers, subject assignments, endpoint policies, overrides and fleet settings as JSON "
        "(natural keys, no database ids), to stdout or a file."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--output", "-o", metavar="FILE", help="Write to FILE instead of stdout.")

    def handle(self, *args: Any, **options: Any) -> None:
        document = export_policies()
        text = json.dumps(document, indent=2, ensure_ascii=False) + "\n"
        output = options.get("output")
        if not output or output == "-":
            self.stdout.write(text, ending="")
            return
        try:
            with open(output, "w", encoding="utf-8") as handle:
                handle.write(text)
        except OSError as exc:
            raise CommandError(f"Cannot write {output}: {exc.strerror or exc}") from None
        counts = ", ".join(f"{len(document[section])} {section}" for section in SECTIONS)
        fleet = "fleet settings" if document["fleet"] is not None else "no fleet settings"
        self.stdout.write(f"Exported {counts} and {fleet} to {output}.")
