"""Import rate limit policies from a ``ratelimits_export`` document: validated first, applied all or nothing."""

from __future__ import annotations

import sys
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from ...store.portability import SECTIONS, ImportReport, PolicyImportError, import_policies, load_document


class Command(BaseCommand):
    help = (
        "Create or update the policies in FILE (matched by natural key) in one audited transaction. "
        "Every item is validated first; on any error nothing changes."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "file",
            metavar="FILE",
            help="A ratelimits_export document ('-' for stdin), at most RATELIMITS['POLICIES']['IMPORT_MAX_SIZE'] "
            "(default 10 MB).",
        )
        parser.add_argument("--reason", required=True, help="Why: recorded on every audit entry of the import.")
        parser.add_argument(
            "--replace", action="store_true", help="Also delete policies that are not in FILE (make the tables match)."
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="Validate and report what would change; write nothing."
        )
        parser.add_argument("--actor", metavar="USERNAME", help="The user the audit entries name (default: none).")

    def handle(self, *args: Any, **options: Any) -> None:
        reason = str(options["reason"]).strip()
        if not reason:
            raise CommandError("--reason: say why these policies are being imported; it goes into the audit trail.")
        data = self._read(str(options["file"]))
        actor = self._actor(options.get("actor"))
        try:
            report = import_policies(
                data, actor=actor, reason=reason, replace=options["replace"], dry_run=options["dry_run"]
            )
        except PolicyImportError as exc:
            lines = "\n".join(f"  {error}" for error in exc.errors)
            raise CommandError(f"Nothing was imported; fix these first:\n{lines}") from None
        self.stdout.write(summary(report))

    def _read(self, path: str) -> Any:
        try:
            if path == "-":
                return load_document(sys.stdin.buffer, name="stdin")
            with open(path, "rb") as handle:
                return load_document(handle, name=path)
        except OSError as exc:
            raise CommandError(f"Cannot read {path}: {exc.strerror or exc}") from None
        except PolicyImportError as exc:
            raise CommandError(str(exc)) from None

    def _actor(self, username: str | None) -> Any:
        if not username:
            return None
        user_model = get_user_model()
        try:
            return user_model._default_manager.get_by_natural_key(username)
        except user_model.DoesNotExist:
            raise CommandError(f"--actor: there is no user {username!r}.") from None


def summary(report: ImportReport) -> str:
    """The counts (and each change) of an import, as the command prints them."""
    verb = "Would create" if report.dry_run else "Created"
    lines = [
        f"{verb} {report.total_created}, {'update' if report.dry_run else 'updated'} {report.total_updated}, "
        f"{'delete' if report.dry_run else 'deleted'} {report.total_deleted} "
        f"({report.total_unchanged} unchanged)."
    ]
    for section in (*SECTIONS, "fleet"):
        counts = (
            report.created[section],
            report.updated[section],
            report.deleted[section],
            report.unchanged[section],
        )
        if any(counts):
            lines.append(
                f"  {section}: {counts[0]} created, {counts[1]} updated, {counts[2]} deleted, {counts[3]} unchanged"
            )
    lines.extend(f"  - {change}" for change in report.changes)
    if report.dry_run:
        lines.append("Dry run: nothing was written.")
    return "\n".join(lines)
