"""The built wheel: ``multidc.*`` packages from the root folders, the ``multidc`` console script, nothing else.

The wheel is built from a copy of the working tree in a temp dir, so the repository gets no build/ or
egg-info litter and parallel builds do not collide.
"""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"hierarchical": "multidc/hierarchical", "strategies": "multidc/strategies", "plugins": "multidc/plugins"}


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """A copy of what the build reads, taken once: the modules checked are exactly those built."""
    src = tmp_path_factory.mktemp("wheel") / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    for folder in PACKAGES:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return src


@pytest.fixture(scope="module")
def wheel(src) -> zipfile.ZipFile:
    out = src.parent / "dist"
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out)]
    done = subprocess.run([*command, str(src)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"wheel build failed:\n{done.stdout}\n{done.stderr}"
    (path,) = out.glob("multidc-*.whl")
    with zipfile.ZipFile(path) as archive:
        yield archive


def _dist_info(wheel: zipfile.ZipFile, name: str) -> str:
    (entry,) = [n for n in wheel.namelist() if n.endswith(f".dist-info/{name}")]
    return wheel.read(entry).decode()


def test_wheel_holds_every_module_of_the_three_packages_under_multidc(src, wheel):
    names = set(wheel.namelist())
    for folder, installed in PACKAGES.items():
        sources = sorted(p.relative_to(src / folder) for p in (src / folder).rglob("*.py"))
        assert sources, folder
        missing = [f"{installed}/{p.as_posix()}" for p in sources if f"{installed}/{p.as_posix()}" not in names]
        assert not missing, f"not in the wheel: {missing}"
    for required in ("hierarchical/__init__.py", "strategies/__init__.py", "plugins/__init__.py"):
        assert f"multidc/{required}" in names


def test_wheel_installs_no_top_level_package_but_multidc(wheel):
    payload = [n for n in wheel.namelist() if ".dist-info/" not in n]
    assert payload and all(n.startswith("multidc/") for n in payload), [
        n for n in payload if not n.startswith("multidc/")
    ]
    assert _dist_info(wheel, "top_level.txt").split() == ["multidc"]
    assert not any(n.startswith(("hierarchical/", "strategies/", "plugins/", "tests/")) for n in wheel.namelist())


def test_wheel_declares_the_multidc_console_script(wheel):
    entry_points = configparser.ConfigParser()
    entry_points.read_string(_dist_info(wheel, "entry_points.txt"))
    assert entry_points["console_scripts"]["multidc"] == "multidc.hierarchical.tools.cli:main"
    assert "multidc/hierarchical/tools/cli.py" in wheel.namelist()


def test_wheel_metadata_requires_torch_and_offers_the_extras(wheel):
    metadata = _dist_info(wheel, "METADATA")
    assert "Name: multidc" in metadata
    assert "Requires-Dist: torch>=2.7" in metadata
    extras = {line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Provides-Extra:")}
    assert {"lightning", "accelerate", "s3", "test", "all"} <= extras
