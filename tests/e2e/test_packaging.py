"""The built wheel: ``multidc.*`` packages from the root folders, the ``multidc`` console script, nothing else.
And the layering of the packages: what each one may import.

The wheel is built from a copy of the working tree in a temp dir, so the repository gets no build/ or
egg-info litter and parallel builds do not collide.
"""

from __future__ import annotations

import ast
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


# Folder -> module prefixes its modules may never import, also inside functions. The training-job core of
# hierarchical never reaches the tools; the parallel layout and the checkpoint engine never reach a framework;
# plugins reach strategies only through the framework-free layout, so the two packages form no cycle.
_FRAMEWORKS = ("lightning", "pytorch_lightning", "accelerate")
_FORBIDDEN = {
    "hierarchical": (*_FRAMEWORKS, "multidc.hierarchical.tools", "multidc.strategies", "multidc.plugins"),
    "strategies/parallel": (*_FRAMEWORKS, "multidc.hierarchical.tools", "multidc.plugins",
                            "multidc.strategies.hierarchical_ddp", "multidc.strategies.parallel_3d",
                            "multidc.strategies._checkpointing", "multidc.strategies._wan_metrics"),
    "strategies": ("multidc.hierarchical.tools", "multidc.plugins.accelerate"),
    "plugins/checkpoint": (*_FRAMEWORKS, "multidc.hierarchical.tools", "multidc.strategies",
                           "multidc.plugins.accelerate", "multidc.plugins.lightning_checkpoint_io"),
    "plugins/accelerate": ("lightning", "pytorch_lightning", "multidc.hierarchical.tools",
                           "multidc.strategies.hierarchical_ddp", "multidc.strategies.parallel_3d",
                           "multidc.strategies._checkpointing", "multidc.strategies._wan_metrics"),
    "plugins": ("multidc.hierarchical.tools", "multidc.strategies.hierarchical_ddp", "multidc.strategies.parallel_3d",
                "multidc.strategies._checkpointing", "multidc.strategies._wan_metrics"),
}


def _imports(path: Path) -> set[str]:
    """Every absolute module a file imports (``from multidc.strategies import x`` counts as ``...strategies.x``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("folder", sorted(_FORBIDDEN))
def test_no_module_imports_what_its_layer_must_not_reach(folder):
    forbidden = _FORBIDDEN[folder]
    found = []
    for path in sorted((ROOT / folder).glob("*.py")):  # this folder's own modules; subfolders have their own rule
        for name in _imports(path):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not found, found


def _fresh_python(code: str, cwd: Path) -> str:
    """Run ``code`` in a new interpreter, outside the repository (its folders must not shadow the installed names)."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_importing_multidc_hierarchical_loads_no_tool_and_no_framework(tmp_path):
    loaded = _fresh_python(
        "import sys, multidc.hierarchical\n"
        "print([m for m in sys.modules if m.startswith(('multidc.hierarchical.tools', 'multidc.strategies', "
        "'multidc.plugins', 'lightning', 'pytorch_lightning', 'accelerate'))])",
        tmp_path,
    )
    assert loaded.strip() == "[]", loaded


def test_parallel_layout_and_checkpoint_engine_import_without_lightning_or_accelerate(tmp_path):
    loaded = _fresh_python(
        "import sys\n"
        "for name in ('lightning', 'pytorch_lightning', 'accelerate'):\n"
        "    sys.modules[name] = None  # any import of them raises ImportError\n"
        "import multidc.strategies.parallel, multidc.plugins.checkpoint\n"
        "from multidc.strategies.parallel import ParallelLayout, parallelize\n"
        "from multidc.plugins.checkpoint import Checkpointer, ObjectStore\n"
        "print(sorted(m for m in sys.modules if m.startswith('multidc.')))",
        tmp_path,
    )
    assert "multidc.strategies.parallel.parallelize" in loaded and "multidc.plugins.checkpoint.checkpointer" in loaded
    assert "multidc.plugins.accelerate" not in loaded and "multidc.strategies.hierarchical_ddp" not in loaded


def test_the_accelerate_plugins_layout_path_leaves_lightning_unimported_and_unpatched(tmp_path):
    """Lightning installed but not imported: the parallel layout the Accelerate plugin uses must not import it (nor
    patch ``ModelCheckpoint``); the strategy names register once Lightning is imported later."""
    out = _fresh_python(
        "import sys\n"
        "from multidc.plugins.accelerate.plugin import MultiDCPlugin\n"
        "import multidc.strategies.parallel\n"
        "MultiDCPlugin(tensor_parallel_size=2)\n"
        "print('loaded', sorted(m for m in sys.modules if m.startswith(('lightning', 'pytorch_lightning'))))\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "print('registered', sorted(n for n in StrategyRegistry if n in ('hierarchical_ddp', 'parallel_3d')))\n",
        tmp_path,
    )
    assert "loaded []" in out, out
    assert "registered ['hierarchical_ddp', 'parallel_3d']" in out, out
