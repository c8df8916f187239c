"""The ``multidc`` command: ``multidc bench allreduce|diloco`` (``diloco --heterogeneous``: unequal sites;
``diloco --auto``: "auto" settings against a grid),
``multidc lab run``, ``multidc lighthouse``, ``multidc doctor``, ``multidc plan``, and the commands the installed
layers above declare under the ``multidc.commands`` entry point group (``multidc ckpt ls|verify|rm``, from
``multidc.plugins``: this layer names none of them).

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``; this file
only wires them up and imports just the module of the subcommand being run.
"""

from __future__ import annotations

import argparse
import importlib
import sys

_GROUP = "multidc.commands"

# subcommand path -> (module, help)
_COMMANDS = {
    ("bench", "allreduce"): ("multidc.hierarchical.tools.bench", "time flat vs hierarchical all-reduce over a lab WAN"),
    ("bench", "diloco"): ("multidc.hierarchical.tools.bench_diloco",
                          "hierarchical DDP vs DiLoCo vs streaming DiLoCo vs sites alone over a lab WAN"),
    ("lab", "run"): ("multidc.hierarchical.tools.launch", "run a command as several sites over a lab WAN"),
    ("lighthouse",): ("multidc.hierarchical.tools.lighthouse",
                      "run the torchft lighthouse that keeps elastic sites' quorum"),
    ("doctor",): ("multidc.hierarchical.tools.doctor",
                  "print the detected sites and measure intra/inter-site bandwidth"),
    ("plan",): ("multidc.hierarchical.tools.plan",
                "predict which cross-site method and settings keep the compute busy on a given WAN"),
}

# A flag that turns a subcommand into another benchmark with its own options: subcommand path -> (flag, module)
_VARIANTS = {("bench", "diloco"): (("--heterogeneous", "multidc.hierarchical.tools.bench_diloco_hetero"),
                                   ("--auto", "multidc.hierarchical.tools.bench_diloco_auto"))}


def _commands() -> dict[tuple[str, ...], tuple[str, str]]:
    """This layer's commands, then those declared by the installed package under ``multidc.commands`` (name ->
    module; not imported here: their help is their own)."""
    from importlib.metadata import entry_points

    declared = {(ep.name,): (ep.value, f"see: multidc {ep.name} --help") for ep in entry_points(group=_GROUP)}
    return {**_COMMANDS, **{path: spec for path, spec in declared.items() if path not in _COMMANDS}}


def _parser(selected: tuple[str, ...] | None, argv: list[str] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="multidc", description="multidc: train one model across datacenters.")
    top = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, (module_name, help_text) in _commands().items():
        if len(path) == 1:
            sub = top.add_parser(path[0], help=help_text, description=help_text)
        else:
            if path[0] not in groups:
                groups[path[0]] = top.add_parser(path[0], help=f"{path[0]} commands").add_subparsers(
                    dest="subcommand", required=True)
            sub = groups[path[0]].add_parser(path[1], help=help_text, description=help_text)
        if path == selected:
            variant = next((name for flag, name in _VARIANTS.get(path, ()) if flag in argv), module_name)
            module = importlib.import_module(variant)
            if path not in _COMMANDS and module.__doc__:  # a declared command describes itself
                sub.description = module.__doc__.split("\n\n")[0].replace("``", "")
            module.add_arguments(sub)
            sub.set_defaults(_run=module.run)
    return parser


def _selected(argv: list[str]) -> tuple[str, ...] | None:
    words = [a for a in argv if not a.startswith("-")]
    for path in _commands():
        if tuple(words[: len(path)]) == path:
            return path
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser(_selected(argv), argv).parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except ValueError as exc:  # user mistakes: one clear line, not a traceback
        print(f"multidc {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
