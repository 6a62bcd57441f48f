"""The ``mxfp8-plugin`` console script: ``demo``, ``check``, ``doctor``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

#: subcommand -> (module, function adding its parser); a module is imported only when its
#: subcommand runs (or for ``--help``), so ``check`` never pays for what ``demo`` needs.
_SUBCOMMANDS = {
    "demo": ("cli", "_add_demo_parser"),
    "check": ("check", "add_check_parser"),
    "doctor": ("doctor", "add_doctor_parser"),
}


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(
        world_size=args.world_size, train_iters=args.train_iters, eval_interval=args.eval_interval
    )


def _add_demo_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    demo = sub.add_parser("demo", help="reference vs plugin off vs plugin on, on CPU with 2 ranks")
    demo.add_argument("--world-size", type=int, default=2)
    demo.add_argument("--train-iters", type=int, default=9)
    demo.add_argument("--eval-interval", type=int, default=3)
    demo.set_defaults(func=_cmd_demo)
    return demo


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser with every subcommand, or with ``only`` that one (the others' modules unimported)."""
    parser = argparse.ArgumentParser(prog="mxfp8-plugin", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, adder) in _SUBCOMMANDS.items():
        if only is not None and name != only:
            continue
        getattr(importlib.import_module(f".{module}", __package__), adder)(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    only = argv[0] if argv and argv[0] in _SUBCOMMANDS else None
    args = build_parser(only).parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
