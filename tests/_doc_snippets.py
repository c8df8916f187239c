"""The fenced ```python blocks of README.md and docs/: found, classified, and run (``python -m tests._doc_snippets``).

A block is either *run*: self-contained, it is executed as it stands, on one rank (``RANK=0``, ``WORLD_SIZE=1``,
a free ``MASTER_PORT``: what ``torchrun`` sets, so a block may call ``init_process_group``), in a fresh temp
folder, each block in a fresh namespace, any process group it left destroyed and Accelerate's process-wide state
reset after it; or an *excerpt*: its first line is ``# excerpt: examples/<file>.py``, every other non-blank line of
it, stripped, is a stripped line of that file, and the tests run that file. So no block in the docs can drift from
code that runs.

The fenced shell blocks cannot run here: ``tests/_doc_shell.py`` checks them.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

from multidc.hierarchical.tools.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
EXCERPT = re.compile(r"#\s*excerpt:\s*(\S+)\s*$")
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)\s*(?P<info>[^\s`]*)")


@dataclass(frozen=True)
class Block:
    """One fenced block: its file (relative to the repository root), first code line (1-based), code and info string
    (``python``, ``bash``, ...)."""

    path: str
    line: int
    code: str
    info: str = "python"

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def excerpt_of(self) -> str | None:
        """``examples/<file>.py`` for an excerpt block, else None (a block that is run)."""
        first = self.code.lstrip("\n").splitlines()[0] if self.code.strip() else ""
        match = EXCERPT.match(first.strip())
        return match.group(1) if match else None


def doc_files() -> list[Path]:
    """README.md and every Markdown page of the docs site."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks(path: Path) -> list[Block]:
    """The ```python blocks of ``path``, in order (any fence length, indented fences too)."""
    return fenced_blocks(path, ("python", "py"))


def fenced_blocks(path: Path, infos: tuple[str, ...]) -> list[Block]:
    """The fenced blocks of ``path`` whose info string is one of ``infos``, in order."""
    blocks, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, indent, start = opening.group("fence"), len(opening.group("indent")), i + 1
        i = start
        while i < len(lines) and not lines[i].strip().startswith(fence):
            i += 1
        if opening.group("info") in infos:
            code = "\n".join(line[indent:] for line in lines[start:i])
            blocks.append(Block(str(path.relative_to(ROOT)), start + 1, code + "\n", opening.group("info")))
        i += 1
    return blocks


def all_blocks() -> list[Block]:
    return [block for path in doc_files() for block in python_blocks(path)]


def excerpt_mismatches(block: Block) -> list[str]:
    """Lines of an excerpt block that its example file does not hold (stripped, whole lines)."""
    source = {line.strip() for line in (ROOT / block.excerpt_of).read_text().splitlines()}
    body = block.code.lstrip("\n").splitlines()[1:]
    return [line for line in body if line.strip() and line.strip() not in source]


def run_block(block: Block) -> str | None:
    """Execute one block as described above; the traceback if it raised, else None."""
    import torch.distributed as dist

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    here = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="multidc-snippet-") as folder:
        os.chdir(folder)
        try:
            exec(compile(block.code, block.where, "exec"), {"__name__": "__main__"})
        except BaseException:  # noqa: B036  (SystemExit too: a block must run to its end)
            return traceback.format_exc()
        finally:
            os.chdir(here)
            if dist.is_initialized():
                dist.destroy_process_group()
            _reset_accelerate()
    return None


def _reset_accelerate() -> None:
    """Forget the Accelerate singletons a block's ``Accelerator`` set up: the next block's starts afresh."""
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def main() -> int:
    """Run every block that is not an excerpt; print one line per block; exit 1 if any failed."""
    failed = 0
    for block in all_blocks():
        if block.excerpt_of:
            continue
        error = run_block(block)
        print(f"{'FAIL' if error else 'ok'}  {block.where}", flush=True)
        if error:
            failed += 1
            print(error, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
