"""The fenced shell blocks (```bash, ```sh, ```shell, ```console) of README.md and docs/: they cannot run here
(launches across sites, installs, root-only lab commands), so ``shell_lines`` and ``check_shell_line`` check what
rots instead: see ``check_shell_line``."""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from tests._doc_snippets import ROOT, doc_files, fenced_blocks

SHELL_INFOS = ("bash", "sh", "shell", "console")
# Commands a shell line may start with that nothing here checks (installs, the shell, the lab's root tools).
SKIPPED = frozenset({"pip", "pip3", "uv", "cd", "export", "source", "echo", "ls", "cat", "mkdir", "rm", "cp", "mv",
                     "git", "curl", "wget", "ip", "tc", "ss", "kill", "apt", "apt-get", "nvidia-smi", "aws", "ssh",
                     "docker", "mkdocs", "ruff"})
_PLACEHOLDER = re.compile(r"<[A-Za-z][\w.-]*>|\$\{[A-Za-z_]\w*\}|\$[A-Za-z_]\w*")
_SEPARATORS = {"&&", "||", ";", "|", "&"}
_REDIRECTS = {">", ">>", "<", "2>", "2>&1", ">&"}
_PYTHON = re.compile(r"python(\d(\.\d+)?)?$")


@dataclass(frozen=True)
class ShellLine:
    """One command line of a shell block: its file, first physical line (1-based) and text (continuations joined)."""

    path: str
    line: int
    text: str

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def shell_lines() -> list[ShellLine]:
    """The command lines of the shell blocks of README.md and docs/.

    In a ```console block a command line starts with ``$ `` (the prompt is dropped) and every other line is output;
    in ```bash / ```sh / ```shell every line is a command (output belongs in a ```text block). Lines ending in ``\\``
    are joined with the next; blank lines and whole-line ``#`` comments are left out.
    """
    found = []
    for path in doc_files():
        for block in fenced_blocks(path, SHELL_INFOS):
            console = block.info == "console"
            pending: tuple[int, str] | None = None
            for offset, raw in enumerate(block.code.splitlines()):
                if pending is None:
                    text = raw.strip()
                    if console:
                        if not text.startswith("$ "):
                            continue
                        text = text[2:]
                    if not text or text.startswith("#"):
                        continue
                    pending = (block.line + offset, "")
                else:
                    text = raw.strip()
                if text.endswith("\\"):
                    pending = (pending[0], pending[1] + text[:-1] + " ")
                    continue
                found.append(ShellLine(block.path, pending[0], pending[1] + text))
                pending = None
    return found


def check_shell_line(text: str) -> list[tuple[str, str | None]]:
    """Check one shell command line without running it; returns ``(rule, problem or None)`` per check made.

    Placeholders (``<site>``, ``$SITE``, ``${HOST0}``) become ``1`` and a ``...`` word is dropped; the line is split
    into commands at ``&&``, ``||``, ``;``, ``|``, a redirection ends a command's words, and leading ``NAME=value``
    words and ``sudo`` / ``env`` are dropped. Then, by the command's first word:

    - ``make T...``: each target is a target of the Makefile (rule ``make``);
    - ``python [-m M] X``, ``torchrun``, ``accelerate launch``, ``pytest``: a script, ``--config_file`` or test path
      with a ``/`` in it exists in the repository (rule ``path``; a bare name such as ``train.py`` is the reader's
      own file); torchrun's and accelerate's own options parse with their real parsers (rule ``launcher``);
    - every option given to a repository script is the name of one of its ``add_argument`` calls, read from its
      source without running it (rule ``script flags``; values are not checked);
    - ``multidc ...`` and ``python -m multidc.<module> ...``: the words parse with the real CLI parser (rule
      ``multidc``); the words after `` -- `` of ``multidc lab run`` are a command of their own, checked alike;
    - a command of ``SKIPPED`` is not checked (rule ``skipped``); any other first word is a problem: a command
      nothing checks, or output that belongs in a ```text block.
    """
    try:
        lexer = shlex.shlex(_PLACEHOLDER.sub("1", text), posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = [word for word in lexer if word != "..."]
    except ValueError as exc:
        return [("shell", f"does not split as shell words: {exc}")]
    results, command = [], []
    for word in [*words, ";"]:
        if word in _SEPARATORS:
            results += _check_command(command)
            command = []
        else:
            command.append(word)
    return results


def _check_command(words: list[str]) -> list[tuple[str, str | None]]:
    for i, word in enumerate(words):
        if word in _REDIRECTS or word.startswith((">", "2>")):
            words = words[:i]
            break
    while words and (re.match(r"[A-Za-z_]\w*=", words[0]) or words[0] in ("sudo", "env", "-E")):
        words = words[1:]
    if not words:
        return []
    name = Path(words[0]).name
    if name == "make":
        return _check_make(words[1:])
    if _PYTHON.match(name):
        return _check_python(words[1:])
    if name == "torchrun":
        return _check_torchrun(words[1:])
    if name == "accelerate" and words[1:2] == ["launch"]:
        return _check_accelerate(words[2:])
    if name == "multidc":
        return _check_multidc(words[1:])
    if name == "pytest":
        return _check_pytest(words[1:])
    if name in SKIPPED or name == "accelerate":
        return [("skipped", None)]
    return [("command", f"`{name}` is no command these checks know: add it to SKIPPED in tests/_doc_snippets.py, "
                        "or put output in a ```text block")]


def _check_make(args: list[str]) -> list[tuple[str, str | None]]:
    makefile = (ROOT / "Makefile").read_text()
    targets = {t for line in makefile.splitlines() if (m := re.match(r"([\w.-][\w. -]*):(?!=)", line))
               for t in m.group(1).split()}
    return [("make", None if target in targets else f"make: no target `{target}` in the Makefile")
            for target in args if not target.startswith("-") and "=" not in target]


def _check_path(word: str, what: str) -> list[tuple[str, str | None]]:
    if "/" not in word or "://" in word or word.startswith(("/", "~")):
        return []
    path = word.split("::")[0]
    return [("path", None if (ROOT / path).exists() else f"{what} `{path}` does not exist in the repository")]


def _check_python(args: list[str]) -> list[tuple[str, str | None]]:
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-m", "-c"):
        i += 2 if args[i] in ("-W", "-X") else 1
    if i >= len(args) or args[i] == "-c":
        return [("skipped", None)]
    if args[i] == "-m":
        return _check_module(args[i + 1], args[i + 2:]) if i + 1 < len(args) else [("python", "python -m: no module")]
    return _check_script(args[i], args[i + 1:])


def _check_module(module: str, args: list[str]) -> list[tuple[str, str | None]]:
    if module == "torch.distributed.run":
        return _check_torchrun(args)
    if module == "pytest":
        return _check_pytest(args)
    if module in ("multidc", "multidc.hierarchical.tools.cli"):
        return _check_multidc(args)
    if not module.startswith("multidc."):
        return [("skipped", None)]
    if importlib.util.find_spec(module) is None:
        return [("multidc", f"python -m {module}: no such module")]
    parser = argparse.ArgumentParser(prog=f"python -m {module}")
    for name in (module, f"{module}.cli"):
        with contextlib.suppress(ImportError):
            add_arguments = getattr(importlib.import_module(name), "add_arguments", None)
            if add_arguments is not None:
                add_arguments(parser)
                return [("multidc", _parse_error(parser, args))]
    return [("multidc", f"python -m {module}: found no add_arguments(parser) to check its arguments with")]


def _check_script(script: str, args: list[str]) -> list[tuple[str, str | None]]:
    results = _check_path(script, "script")
    if not results or results[0][1] or not script.endswith(".py"):
        return results
    flags = script_flags(ROOT / script) | {"-h", "--help"}
    for arg in args:
        if arg == "--":
            break
        flag = arg.split("=")[0]
        if re.match(r"-[A-Za-z-]", flag):
            results.append(("script flags", None if flag in flags else f"{script} has no option `{flag}`"))
    return results


def script_flags(script: Path) -> set[str]:
    """The option strings of every ``*.add_argument("-...", ...)`` call in ``script`` (its source, not run)."""
    flags = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
    return flags


def _check_torchrun(args: list[str]) -> list[tuple[str, str | None]]:
    from torch.distributed.run import get_args_parser

    return _launched(get_args_parser(), "torchrun", args)


def _check_accelerate(args: list[str]) -> list[tuple[str, str | None]]:
    from accelerate.commands.launch import launch_command_parser

    results = _launched(launch_command_parser(), "accelerate launch", args)
    with contextlib.suppress(SystemExit):
        with contextlib.redirect_stderr(io.StringIO()):
            config = launch_command_parser().parse_args(args).config_file
        if config:
            results += _check_path(config, "--config_file")
    return results


def _launched(parser: argparse.ArgumentParser, launcher: str, args: list[str]) -> list[tuple[str, str | None]]:
    """A launcher's own options parse with ``parser``; then its program is checked (a script, ``-m``, a command)."""
    error = _parse_error(parser, args)
    if error:
        return [("launcher", f"{launcher}: {error}")]
    with contextlib.redirect_stderr(io.StringIO()):
        parsed = parser.parse_args(args)
    program = [parsed.training_script, *parsed.training_script_args]
    if getattr(parsed, "no_python", False):
        return [("launcher", None), *_check_command(program)]
    if getattr(parsed, "module", False):
        return [("launcher", None), *_check_module(program[0], program[1:])]
    return [("launcher", None), *_check_script(program[0], program[1:])]


def _check_multidc(args: list[str]) -> list[tuple[str, str | None]]:
    from multidc.hierarchical.tools.cli import _parser, _selected

    results = [("multidc", _parse_error(_parser(_selected(args), args), args, prog="multidc"))]
    if "--" in args:
        results += _check_command(args[args.index("--") + 1:])
    return results


def _parse_error(parser: argparse.ArgumentParser, args: list[str], prog: str = "") -> str | None:
    """argparse's error for ``args`` (what it would print before exiting), or None when they parse."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(args)
    except SystemExit as exc:
        if exc.code:
            return (err.getvalue().strip().splitlines() or [f"{prog} exited {exc.code}"])[-1]
    return None


def _check_pytest(args: list[str]) -> list[tuple[str, str | None]]:
    return [result for arg in args if not arg.startswith("-") for result in _check_path(arg, "test path")]
