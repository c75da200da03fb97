"""The documentation site, built as ``make docs`` builds it (strictly), for the tests that read it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .processes import REPO

__all__ = ["built_site"]


@pytest.fixture(scope="session")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory of a site built from docs/ with mkdocs.yml; a warning fails the build, and the test."""
    site = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    return site
