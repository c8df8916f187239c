"""The documentation: ``make docs``'s strict build, every ```python block of README.md and docs/ runs, and every
shell command line in them names what exists (make targets, repository files, options of our scripts and CLI).

A block either runs as it stands (on one rank, in a subprocess: ``tests/_doc_snippets.py``) or is an excerpt of an
example in ``examples/`` that the tests run; see ``tests/_doc_snippets.py`` for the rule. Shell lines are checked
without running them (``check_shell_line`` there says what is checked and what is skipped).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._doc_shell import check_shell_line, shell_lines
from tests._doc_snippets import ROOT, all_blocks, excerpt_mismatches
from tests._resources import require_module

BLOCKS = all_blocks()
EXCERPTS = [block for block in BLOCKS if block.excerpt_of]
API_PAGES = sorted((ROOT / "docs" / "api").glob("*.md"))


def _output(proc: subprocess.CompletedProcess) -> str:
    return (proc.stdout + proc.stderr)[-6000:]


def test_docs_build_strict(tmp_path):
    """``mkdocs build --strict`` (what ``make docs`` runs) succeeds: no broken link, reference or docstring."""
    require_module("mkdocs", "docs")
    require_module("mkdocstrings_handlers.python", "docs")
    mkdocs = Path(sys.executable).with_name("mkdocs")
    proc = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, _output(proc)
    assert (tmp_path / "site" / "api" / "hierarchical" / "index.html").exists()


def test_python_blocks_that_are_not_excerpts_run():
    """Each such block of README.md and docs/ runs to its end on one rank (all of them in one interpreter)."""
    for module, extra in (("lightning", "lightning"), ("accelerate", "accelerate"), ("torchft", "elastic")):
        require_module(module, extra)  # the blocks use every extra
    run = [block for block in BLOCKS if not block.excerpt_of]
    assert len(run) >= 10, "the README and the guides lost their runnable blocks"
    proc = subprocess.run([sys.executable, "-m", "tests._doc_snippets"], cwd=ROOT, capture_output=True, text=True,
                          timeout=180, env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, _output(proc)
    for block in run:
        assert f"ok  {block.where}" in proc.stdout, f"{block.where} did not run\n{_output(proc)}"


@pytest.mark.parametrize("block", EXCERPTS, ids=[block.where for block in EXCERPTS])
def test_excerpt_quotes_an_example_the_tests_run(block):
    """An excerpt's lines are lines of its example, and some test runs that example."""
    example = ROOT / block.excerpt_of
    assert block.excerpt_of.startswith("examples/") and example.is_file(), f"{block.where}: no {block.excerpt_of}"
    missing = excerpt_mismatches(block)
    assert not missing, f"{block.where}: lines not in {block.excerpt_of}: {missing}"
    tests = [p for p in (ROOT / "tests").rglob("*.py") if p.name != "test_docs.py"]
    named = re.compile(rf"[\"']{re.escape(example.name)}[\"']")  # a string literal: not a longer name, not prose
    assert any(named.search(p.read_text()) for p in tests), f"{block.excerpt_of}: no test runs it"


def test_shell_lines_name_existing_targets_files_and_options():
    """Each command line of a ```bash / ```sh / ```console block names a Makefile target, repository paths, script
    options and ``multidc`` arguments that exist and parse; every kind of check ran at least once."""
    problems, ran = [], collections.Counter()
    for line in shell_lines():
        for rule, problem in check_shell_line(line.text):
            ran[rule] += 1
            if problem:
                problems.append(f"{line.where}: {problem}\n    {line.text}")
    assert not problems, "\n".join(problems)
    missing = {"make", "path", "script flags", "launcher", "multidc"} - set(ran)
    assert not missing, f"no shell line exercised the checks {sorted(missing)}: did the block parsing break? {ran}"


@pytest.mark.parametrize("text,problem", [
    ("make demoo", "no target `demoo`"),
    ("python examples/nope.py", "`examples/nope.py` does not exist"),
    ("python examples/gpt_3d.py --pipeline 2", "has no option `--pipeline`"),
    ("torchrun --nproc-per-node 4 --bogus 1 examples/demo.py", "unrecognized arguments: --bogus"),
    ("MULTIDC_SITE=<site> torchrun --nnodes 2 --no-python multidc doctorr", "invalid choice: 'doctorr'"),
    ("accelerate launch --config_file examples/no.yaml examples/accelerate_hierarchical.py", "`examples/no.yaml`"),
    ("multidc lab run ... -- python examples/lightning_diloco.py --sync 2", "has no option `--sync`"),
    ("multidc ckpt list s3://bucket/$RUN", "invalid choice: 'list'"),
    ("python -m multidc.plugins.checkpoint verify s3://b/r --stepp 3", "unrecognized arguments: --stepp"),
    ("pytest tests/gpux -k gpu", "`tests/gpux` does not exist"),
    ("site  name  ranks", "no command these checks know"),
])
def test_shell_line_check_names_what_is_wrong(text, problem):
    """A wrong line gets exactly one problem, which names what is wrong."""
    problems = [found for _, found in check_shell_line(text) if found]
    assert len(problems) == 1 and problem in problems[0], problems


def test_shell_line_check_passes_placeholders_and_skips_other_commands():
    line = "multidc lighthouse --bind $HOST:29510 --min-sites ${N} && make lint"
    assert [rule for rule, problem in check_shell_line(line) if not problem] == ["multidc", "make"]
    assert check_shell_line('pip install "multidc[all]"  # extras') == [("skipped", None)]


@pytest.mark.parametrize("package", ["multidc.hierarchical", "multidc.strategies", "multidc.plugins"])
def test_api_reference_documents_every_public_name(package):
    """Every name in a package's ``__all__`` has a ``::: <defining module>.<name>`` entry in docs/api/."""
    import importlib

    require_module("lightning", "lightning")  # multidc.strategies' names are defined by Lightning strategies
    module = importlib.import_module(package)
    documented = {line.removeprefix("::: ").strip() for page in API_PAGES
                  for line in page.read_text().splitlines() if line.startswith("::: ")}
    missing = [name for name in module.__all__
               if f"{getattr(module, name).__module__}.{name}" not in documented]
    assert not missing, f"{package}: not in docs/api/*.md: {missing}"


def test_readme_stays_short_and_links_existing_pages():
    """The README sells and starts (at most about 250 lines); the docs pages it links exist."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert links and not missing, missing
