"""The client distribution (clients/python) needs nothing of the app: its wheel, alone in a virtualenv.

The wheel is built from a copy of clients/python (as tests/test_packaging.py builds the app's) and
installed with ``--no-index`` into a virtualenv made without the system's site packages: it needs
nothing, so the wheel alone installs. Then its two extras and its test tools
(clients/python/requirements-test.txt, from the package index): still no Django, DRF or redis-py
there, and the client's own tests pass against the installed wheel (a src layout: the checkout's
package is not on the path). ``make test-client`` does the same in a virtualenv it keeps.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from .support.processes import REPO

pytestmark = pytest.mark.slow

CLIENT = REPO / "clients" / "python"
#: What the app brings, and the client must not: checked by distribution and by import name.
THE_APPS = {"django", "djangorestframework", "redis", "django-ratelimits"}
THE_APPS_MODULES = ["django", "rest_framework", "redis", "ratelimits"]


def run(argv: list[str], *, cwd: Path | None = None, timeout: float = 300) -> str:
    # None of this suite's paths or settings: the virtualenv sees only what is installed in it.
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"} and not k.startswith("DJANGO")}
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert result.returncode == 0, f"{' '.join(argv)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def installed(python: Path) -> set[str]:
    """The distributions in a virtualenv, by their normalised names."""
    listed = run([str(python), "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"])
    return {re.split(r"==| @ ", line)[0].lower().replace("_", "-") for line in listed.splitlines() if line.strip()}


def pins(path: Path) -> dict[str, str]:
    found = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", path.read_text(), flags=re.MULTILINE)
    return {name.lower(): version for name, version in found}


def test_the_test_tools_are_pinned_as_the_apps_suite_pins_them() -> None:
    ours, ci = pins(CLIENT / "requirements-test.txt"), pins(REPO / "requirements" / "ci.txt")
    shared = set(ours) & set(ci)
    assert {"pytest", "requests", "httpx"} <= shared
    assert {name: ours[name] for name in shared} == {name: ci[name] for name in shared}


def test_the_client_wheel_alone_needs_neither_django_nor_redis(tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(CLIENT, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".*_cache"))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(source)])
    [wheel] = tmp_path.glob("ratelimits_client-*.whl")

    # The package and its py.typed, nothing else; no requirement but those of its two extras.
    with zipfile.ZipFile(wheel) as archive:
        names = {name for name in archive.namelist() if not name.startswith("ratelimits_client-")}
        [metadata] = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
        headers = Parser().parsestr(archive.read(metadata).decode())
    package = CLIENT / "src"
    expected = {
        p.relative_to(package).as_posix() for p in package.rglob("*") if p.is_file() and p.suffix in {".py", ".typed"}
    }
    assert names == expected and "ratelimits_client/py.typed" in names
    assert (headers["Name"], headers["Version"]) == ("ratelimits-client", "0.1.0")
    assert sorted(headers.get_all("Provides-Extra", [])) == ["httpx", "requests"]
    requires = headers.get_all("Requires-Dist", [])
    assert requires and all("extra ==" in requirement for requirement in requires), requires

    # Installed alone, from the wheel and no index: it needs nothing.
    run([sys.executable, "-m", "venv", str(tmp_path / "venv")], timeout=120)
    python = tmp_path / "venv" / "bin" / "python"
    run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-index", str(wheel)])
    assert installed(python) - {"pip", "setuptools"} == {"ratelimits-client"}

    # With its extras and the test tools: still nothing of the app's.
    run(
        [
            str(python),
            *("-m", "pip", "install", "--disable-pip-version-check", "-q"),
            *("-r", str(CLIENT / "requirements-test.txt"), f"{wheel}[requests,httpx]"),
        ]
    )
    everything = installed(python)
    assert {"ratelimits-client", "requests", "httpx", "pytest"} <= everything
    assert not everything & THE_APPS, everything & THE_APPS
    found = run(
        [str(python), "-c", f"import importlib.util as u; print([m for m in {THE_APPS_MODULES!r} if u.find_spec(m)])"],
        cwd=tmp_path,
    )
    assert found.strip() == "[]"

    # The client's own tests, there, against the installed wheel.
    where = run([str(python), "-c", "import ratelimits_client; print(ratelimits_client.__file__)"], cwd=source)
    assert Path(where.strip()).is_relative_to(tmp_path / "venv"), where
    output = run([str(python), "-m", "pytest", "-q", "-n", "4"], cwd=source, timeout=600)
    assert re.search(r"\b\d+ passed\b", output), output
