"""The ``mxfp8-plugin`` console script: ``demo``, ``check``, ``doctor``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(
        world_size=args.world_size, train_iters=args.train_iters, eval_interval=args.eval_interval
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mxfp8-plugin", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="reference vs plugin off vs plugin on, on CPU with 2 ranks")
    demo.add_argument("--world-size", type=int, default=2)
    demo.add_argument("--train-iters", type=int, default=9)
    demo.add_argument("--eval-interval", type=int, default=3)
    demo.set_defaults(func=_cmd_demo)
    try:
        from .check import add_check_parser

        add_check_parser(sub)
    except ImportError:
        pass
    try:
        from .doctor import add_doctor_parser

        add_doctor_parser(sub)
    except ImportError:
        pass
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
