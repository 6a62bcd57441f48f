"""The ``mxfp8-plugin`` console script: ``demo``, ``check``, ``doctor``.

Exit codes, the same for every subcommand: 0 ok, 1 problems found, 2 could not run (a bad
argument, a missing dependency, unreadable input). Every failure is one line on stderr, never a
traceback; set MXFP8_PLUGIN_TRACEBACK=1 to see the traceback of an unexpected error.
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import re
import sys
from collections.abc import Sequence
from typing import NoReturn, TextIO, cast

from ..common.argtypes import positive_int

EXIT_OK, EXIT_PROBLEMS, EXIT_COULD_NOT_RUN = 0, 1, 2

#: subcommand -> (module, function adding its parser); a module is imported only when its
#: subcommand runs (or for ``--help``), so ``check`` never pays for what ``demo`` needs.
_SUBCOMMANDS = {
    "demo": ("cli", "_add_demo_parser"),
    "check": ("check", "add_check_parser"),
    "doctor": ("doctor", "add_doctor_parser"),
}

#: top-level module a subcommand failed to import -> what to install
_INSTALL_HINT = {
    "torch": "pip install torch",
    "megatron": "pip install megatron-core",
    "yaml": "pip install pyyaml",
    "omegaconf": "pip install 'omegaconf>=2.3,<2.4'",
    "hydra": "pip install 'hydra-core>=1.3,<1.4'",
}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the usage block argparse prints first would bury the reason."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_COULD_NOT_RUN, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def _get_formatter(self) -> argparse.HelpFormatter:
        # argparse builds a formatter for every add_argument; without a width it imports shutil
        # (and with it bz2, lzma, zlib) to ask the terminal, a tenth of check's own time.
        return self.formatter_class(prog=self.prog, width=_terminal_columns() - 2)  # type: ignore[call-arg]


def _terminal_columns() -> int:
    """The width ``shutil.get_terminal_size`` reports: $COLUMNS, else the terminal's, else 80."""
    try:
        return int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        pass
    try:
        return os.get_terminal_size(sys.__stdout__.fileno()).columns or 80  # type: ignore[union-attr]
    except (AttributeError, ValueError, OSError):
        return 80


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(
        world_size=args.world_size, train_iters=args.train_iters, eval_interval=args.eval_interval
    )


def _check_demo_args(args: argparse.Namespace) -> str | None:
    if args.eval_interval >= args.train_iters:
        return (
            f"--eval-interval {args.eval_interval} leaves no training step after an eval in "
            f"--train-iters {args.train_iters}, so the demo would show nothing; use an eval interval "
            f"below the train iterations (e.g. --train-iters {args.train_iters} "
            f"--eval-interval {max(1, args.train_iters // 3)})"
        )
    return None


def _add_demo_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    demo: argparse.ArgumentParser = sub.add_parser(
        "demo",
        help="reference vs plugin off vs plugin on, on CPU with 2 ranks "
        "(exit 0 plugin matches the reference, 1 it does not, 2 could not run)",
        description="Train -> eval -> train three times on CPU ranks (reference, plugin off, plugin on) "
        "with real megatron-core and emulated MXFP8 params, and compare the losses.",
    )
    demo.add_argument(
        "--world-size", type=positive_int("--world-size", 2), default=2, help="ranks to spawn (default 2)"
    )
    demo.add_argument(
        "--train-iters", type=positive_int("--train-iters", 9), default=9, help="training steps (default 9)"
    )
    demo.add_argument(
        "--eval-interval",
        type=positive_int("--eval-interval", 3),
        default=3,
        help="evaluate every N steps (default 3)",
    )
    demo.set_defaults(func=_cmd_demo, check_args=_check_demo_args)
    return demo


_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?\.?([^`<]*?)\s*(?:<[^>]*>)?`")
_TILDE_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~\.?(?:[\w.]*\.)?(\w+)`")


def plain_text(text: str | None) -> str | None:
    """Docstring reST made readable in a terminal: roles to their names, ``literals`` unquoted."""
    if not text:
        return text
    text = _TILDE_ROLE.sub(r"\1", text)  # :func:`~pkg.mod.name` -> name, as Sphinx shows it
    text = _ROLE.sub(r"\1", text)  # :mod:`.config.read` -> config.read, :ref:`text <target>` -> text
    return text.replace("``", "")


def _plain_help(parser: argparse.ArgumentParser) -> None:
    parser.description = plain_text(parser.description)
    parser.epilog = plain_text(parser.epilog)
    for action in parser._actions:
        if isinstance(action.help, str):
            action.help = plain_text(action.help)
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                choice.help = plain_text(choice.help)
            for sub in action.choices.values():
                _plain_help(sub)


def _version() -> str:
    from .. import __version__

    return f"mxfp8-plugin {__version__}"


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser with every subcommand, or with ``only`` that one (the others' modules unimported)."""
    parser = _Parser(
        prog="mxfp8-plugin", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=_version())
    # prog given: argparse would otherwise lay out a usage block (and compile its regexes) to make it
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{demo,check,doctor}", prog=parser.prog
    )
    for name, (module, adder) in _SUBCOMMANDS.items():
        if only is not None and name != only:
            continue
        getattr(importlib.import_module(f".{module}", __package__), adder)(sub)
    _plain_help(parser)
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Options and positionals in any order after the subcommand (``check R --dp-size 8 k=v``)."""
    argv = list(argv)
    only = argv[0] if argv and argv[0] in _SUBCOMMANDS else None
    parser = build_parser(only)
    if only is None:  # --version, --help, or a mistake: the top-level parser says which
        return parser.parse_args(argv)
    # argparse cannot intermix across a subparser action, so the subcommand's parser runs alone.
    subparser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[only]
    args = subparser.parse_intermixed_args(argv[1:])
    args.command = only
    check_args = getattr(args, "check_args", None)
    problem = check_args(args) if check_args else None
    if problem:
        subparser.error(problem)
    return args


class _PipeSafeStdout(io.TextIOBase):
    """stdout that goes quiet when the reader leaves (``doctor --json | head -1``).

    The command still runs to its end, so the exit code is its verdict; fd 1 is pointed at
    /dev/null so the interpreter's closing flush cannot raise either.
    """

    def __init__(self, inner: TextIO) -> None:
        self._inner = inner
        self._gone = False

    def _reader_gone(self) -> None:
        self._gone = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._inner.fileno())
            os.close(devnull)
        except (OSError, ValueError):  # not a real file: nothing will flush it at exit
            pass

    def write(self, s: str) -> int:
        if not self._gone:
            try:
                self._inner.write(s)
            except BrokenPipeError:
                self._reader_gone()
        return len(s)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._inner.flush()
            except BrokenPipeError:
                self._reader_gone()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self._inner.isatty()

    def fileno(self) -> int:
        return self._inner.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._inner.encoding


def _prog(command: str) -> str:
    return f"mxfp8-plugin {command}".rstrip()


def _one_line(exc: Exception, command: str) -> str:
    module = (getattr(exc, "name", None) or "").split(".")[0]
    if isinstance(exc, ModuleNotFoundError) and module and module != __package__:
        hint = _INSTALL_HINT.get(module, f"pip install {module}")
        return f"{_prog(command)}: error: needs the Python package {module!r}, which is not installed; {hint}"
    # A rank's failure carries the rank's traceback text: keep its headline and the error itself.
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(("Traceback", "File ", "^", "~"))]
    message = " ... ".join(dict.fromkeys([lines[0], lines[-1]])) if lines else "(no message)"
    return (
        f"{_prog(command)}: error: {type(exc).__name__}: {message} "
        "(set MXFP8_PLUGIN_TRACEBACK=1 for the traceback)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    stdout = sys.stdout
    if not isinstance(stdout, _PipeSafeStdout):
        sys.stdout = cast(TextIO, _PipeSafeStdout(stdout))
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in _SUBCOMMANDS else ""
    if command != "check":  # check logs nothing (its verdicts are its output): no logging import
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    debug = os.environ.get("MXFP8_PLUGIN_TRACEBACK", "") not in ("", "0")
    try:
        args = parse_args(argv)
        command = args.command
        return int(args.func(args))
    except SystemExit as exc:  # argparse: --help / --version (0) or a one-line error (2)
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or EXIT_OK
        print(exc.code, file=sys.stderr)
        return EXIT_COULD_NOT_RUN
    except KeyboardInterrupt:
        print(f"{_prog(command)}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # the promise is one line, never a traceback
        if debug:
            raise
        print(_one_line(exc, command), file=sys.stderr)
        return EXIT_COULD_NOT_RUN
    finally:
        sys.stdout.flush()
        sys.stdout = stdout


def console_main() -> NoReturn:
    """The console script (and ``python -m``): :func:`main`, then :func:`leave` (fast for
    ``check``, whose every file is written and closed before it returns)."""
    code = main()
    leave(code, fast=sys.argv[1:2] == ["check"])


def leave(code: int, *, fast: bool = True) -> NoReturn:
    """Exit with ``code``; with ``fast``, without the interpreter's module teardown.

    Tearing down the ~250 modules ``check`` has loaded (OmegaConf, its ANTLR parser, PyYAML) costs
    15-18 ms on a 2-core machine: more than half of what issue 30 allows ``check`` above its floor,
    and all of it spent freeing memory the OS frees at exit anyway. What a normal exit does for
    others still happens: the streams are flushed and every ``atexit`` handler runs (logging's
    shutdown, coverage's save). Only where another thread is alive (a normal exit would wait for
    it) or the interpreter lacks CPython's ``atexit`` hooks does it exit as usual.
    """
    import atexit

    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    threads = sys.modules.get("threading")
    if not fast or run_exit_handlers is None or (threads is not None and threads.active_count() > 1):
        sys.exit(code)
    _flush()
    run_exit_handlers()
    _flush()
    os._exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that left, a closed stream: nothing to keep
            pass


if __name__ == "__main__":
    console_main()
