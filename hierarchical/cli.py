"""The ``multidc`` command: ``multidc bench allreduce``, ``multidc doctor``, ``multidc demo``.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``; this file
only wires them up. Those modules import optional frameworks (Lightning, Accelerate) inside ``run`` only.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand path -> (module, help)
_COMMANDS = {
    ("bench", "allreduce"): ("multidc.hierarchical.bench", "time flat vs hierarchical all-reduce over a lab WAN"),
    ("doctor",): ("multidc.hierarchical.doctor", "print the detected sites and measure intra/inter-site bandwidth"),
    ("demo",): ("multidc.hierarchical.demo", "run the main demo (what `make demo` runs)"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="multidc", description="multidc: train one model across datacenters.")
    top = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, (module_name, help_text) in _COMMANDS.items():
        if len(path) == 1:
            sub = top.add_parser(path[0], help=help_text, description=help_text)
        else:
            if path[0] not in groups:
                groups[path[0]] = top.add_parser(path[0]).add_subparsers(dest="subcommand", required=True)
            sub = groups[path[0]].add_parser(path[1], help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
