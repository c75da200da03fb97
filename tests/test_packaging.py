"""The wheel: the package, every file it loads at run time, and the client's package; no demo, tests or docs."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from .support.processes import REPO


def test_the_wheel_holds_the_package_and_its_data_only(tmp_path: Path) -> None:
    # Built from a copy of the checkout: setuptools leaves build/ behind, and a stale build/lib
    # would go into the next wheel of the checkout itself.
    source = tmp_path / "source"
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(".git", ".venv*", ".*_cache", "build", "*.egg-info", "site", "__pycache__"),
    )
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), "."],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    [wheel] = tmp_path.glob("django_ratelimits-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        [metadata] = [name for name in names if name.endswith(".dist-info/METADATA")]
        headers = Parser().parsestr(archive.read(metadata).decode())

    package = REPO / "ratelimits"
    # Every file of the package: its modules, and the Lua scripts, templates and static files it loads.
    expected = {
        path.relative_to(REPO).as_posix()
        for path in package.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    # And the client distribution's package, as its own wheel holds it (CONTRIBUTING.md: "The client
    # distribution"), so that the deprecated ratelimits.client, which re-exports it, imports.
    client = REPO / "clients" / "python" / "src"
    expected |= {
        path.relative_to(client).as_posix()
        for path in (client / "ratelimits_client").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    assert {name for name in names if not name.startswith("django_ratelimits-")} == expected
    assert {"ratelimits/lua/decide.lua", "ratelimits/py.typed", "ratelimits_client/py.typed"} <= expected
    assert {"ratelimits/client/__init__.py", "ratelimits_client/__init__.py"} <= expected
    # Nothing else of the client distribution: its tests, its pyproject, its README.
    assert not any(name.startswith(("clients/", "tests/")) for name in names)

    urls = dict(value.split(", ", 1) for value in headers.get_all("Project-URL", []))
    assert sorted(urls) == ["Changelog", "Documentation", "Homepage", "Issues", "Source"]
