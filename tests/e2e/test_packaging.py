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
    # `multidc ckpt`: the plugins' command, declared for the CLI, which names no layer above its own
    assert dict(entry_points["multidc.commands"]) == {"ckpt": "multidc.plugins.checkpoint.cli"}
    assert "multidc/plugins/checkpoint/cli.py" in wheel.namelist()


def test_wheel_metadata_requires_torch_and_offers_the_extras(wheel):
    metadata = _dist_info(wheel, "METADATA")
    assert "Name: multidc" in metadata
    assert "Requires-Dist: torch>=2.7" in metadata
    extras = {line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Provides-Extra:")}
    assert {"lightning", "accelerate", "s3", "test", "all"} <= extras


# The one import rule: multidc.hierarchical <- multidc.plugins <- multidc.strategies. A module imports multidc's
# layers at or below its own only (also inside functions), and a framework only where it is driven: the training
# job's core never reaches the tools (the CLI, lab, benchmarks) that drive it.
_LAYERS = ("hierarchical", "plugins", "strategies")
_DRIVERS = {"lightning": ("strategies/", "plugins/lightning_checkpoint_io.py", "plugins/_lightning_patches.py"),
            "pytorch_lightning": (),
            "accelerate": ("plugins/accelerate/",), "multidc.hierarchical.tools": ("hierarchical/tools/",)}


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


def _reaches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("layer", _LAYERS)
def test_every_module_imports_only_its_layer_and_those_below_and_frameworks_only_where_driven(layer):
    above = _LAYERS[_LAYERS.index(layer) + 1:]
    found = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        where = path.relative_to(ROOT).as_posix()
        for name in sorted(_imports(path)):
            if any(_reaches(name, f"multidc.{upper}") for upper in above):
                found.append(f"{where} imports {name}, a layer above {layer}")
            for driven, drivers in _DRIVERS.items():
                if _reaches(name, driven) and not where.startswith(drivers):
                    found.append(f"{where} imports {name}, which only {drivers or 'nothing'} may")
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
        "import multidc.hierarchical.parallel, multidc.plugins.checkpoint\n"
        "from multidc.hierarchical.parallel import ParallelLayout, parallelize\n"
        "from multidc.plugins.checkpoint import Checkpointer, ObjectStore\n"
        "print(sorted(m for m in sys.modules if m.startswith('multidc.')))",
        tmp_path,
    )
    assert "multidc.hierarchical.parallel.parallelize" in loaded and "multidc.plugins.checkpoint.checkpointer" in loaded
    assert "multidc.plugins.accelerate" not in loaded and "multidc.strategies" not in loaded


def test_the_accelerate_plugins_layout_path_leaves_lightning_and_the_strategies_unimported(tmp_path):
    """Lightning installed but not imported: the Accelerate plugin's layout path imports neither it nor the
    strategies (nor patches ``ModelCheckpoint``); importing ``multidc.strategies`` registers the names."""
    out = _fresh_python(
        "import sys\n"
        "from multidc.plugins.accelerate.plugin import MultiDCPlugin\n"
        "import multidc.hierarchical.parallel\n"
        "MultiDCPlugin(tensor_parallel_size=2)\n"
        "print('loaded', sorted(m for m in sys.modules if m.startswith(('lightning', 'pytorch_lightning', "
        "'multidc.strategies'))))\n"
        "import multidc.strategies\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "print('registered', sorted(n for n in StrategyRegistry if n in ('hierarchical_ddp', 'parallel_3d')))\n",
        tmp_path,
    )
    assert "loaded []" in out, out
    assert "registered ['hierarchical_ddp', 'parallel_3d']" in out, out


def test_the_layouts_old_import_path_still_works_for_a_release_with_a_deprecation_warning(tmp_path):
    out = _fresh_python(
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    from multidc.strategies.parallel import ParallelLayout\n"
        "    from multidc.strategies.parallel.diloco import build_diloco\n"
        "    from multidc.strategies.parallel.parallelize import prepare_parallel\n"
        "import multidc.hierarchical.parallel as moved\n"
        "print(ParallelLayout is moved.ParallelLayout, build_diloco is moved.build_diloco, "
        "prepare_parallel is moved.prepare_parallel)\n"
        "print([str(w.message) for w in caught if issubclass(w.category, DeprecationWarning) and 'moved' in "
        "str(w.message)])\n",
        tmp_path,
    )
    assert "True True True" in out, out
    assert "multidc.strategies.parallel moved to multidc.hierarchical.parallel" in out, out


def test_the_tests_share_helpers_through_helper_modules_only():
    """A module of the tests imports helpers from ``tests/_*.py`` (or a script's or reference's module), never from
    a test module: importing one would collect, and run the module-level set-up of, another test file."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for name in sorted(_imports(path)):
            if name.startswith("tests.") and any(part.startswith("test_") for part in name.split(".")[1:]):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not found, found
