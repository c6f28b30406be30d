"""The ``pyparallel`` command: ``plan`` (the cost model and search), ``bench`` and ``train``.

Imports stay inside the subcommands so that ``pyparallel plan`` never loads torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommands whose module owns its own argument parser: everything after the name is handed over.
_DELEGATED = {
    "bench": ("pyparallel.bench.cli", "run predictions and measurements side by side on this machine"),
    "train": ("pyparallel.train", "train a model with a chosen parallel layout"),
}


def build_parser() -> argparse.ArgumentParser:
    from pyparallel.planner.command import add_plan_arguments

    parser = argparse.ArgumentParser(prog="pyparallel", description="Data, ZeRO, tensor and pipeline "
                                     "parallel training: plan a layout, benchmark it, train with it.")
    subs = parser.add_subparsers(dest="command", metavar="{plan,bench,train}")
    plan = subs.add_parser("plan", help="predict memory, traffic and step time per layout; recommend one",
                           description="Search DP × TP × PP layouts, ZeRO stages, offload and micro-batch "
                           "sizes; rank those that fit by estimated step time.")
    add_plan_arguments(plan)
    for name, (_, helptext) in _DELEGATED.items():
        subs.add_parser(name, help=helptext, add_help=False)
    return parser


def _delegate(name: str, argv: list[str]) -> int:
    module_name = _DELEGATED[name][0]
    try:
        module = importlib.import_module(module_name)
        entry = module.main
    except (ImportError, AttributeError) as exc:
        print(f"pyparallel {name}: not available ({module_name}.main: {exc})", file=sys.stderr)
        return 2
    status = entry(argv)
    return status if isinstance(status, int) else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pyparallel`` console script; returns the exit status (2 for bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATED:
        return _delegate(argv[0], argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed usage and the error (2) or the help (0)
        return exc.code if isinstance(exc.code, int) else 2
    if args.command == "plan":
        from pyparallel.planner.command import run_plan

        return run_plan(args)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
