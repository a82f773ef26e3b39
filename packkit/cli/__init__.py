"""The ``packkit`` command: :data:`SUBCOMMANDS`, each a module of this package with ``parser() -> Parser`` and
``run(args, options) -> int`` over the library (the options several share: :mod:`packkit.cli._options`,
:mod:`packkit.cli._chat`); exit codes :data:`EXIT_CODES`, printed by every ``--help`` and tabled in ``docs/cli.md``.

This file parses, dispatches, and turns every error a user can cause into one line on stderr and an exit code
(:mod:`packkit.cli._failures`), never a traceback (``PACKKIT_DEBUG=1`` re-raises); library messages name arguments
as the command spells them (``--overflow split``, not ``overflow='split'``). A stop signal removes every temporary
file first (:mod:`packkit.interrupts`); a closed output pipe exits quietly, as a Unix tool killed by SIGPIPE.
``packkit --help``, ``--version`` and a wrong command compile this file and :mod:`packkit.cli._exits` only."""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import sys
import warnings

from .. import __version__
from ..interrupts import signals_raise, swallowed
from ._exits import (EXIT_BROKEN_PIPE, EXIT_BUG, EXIT_CODES, EXIT_DATA, EXIT_INTERRUPTED, EXIT_OK, EXIT_SYSTEM,
                     EXIT_USAGE, UsageError)

SUBCOMMANDS = {
    "waste": ("packkit.cli.waste", "padding waste of each batching strategy, with a table and a plot"),
    "pack": ("packkit.cli.pack", "pack a dataset offline into windows (parquet, jsonl, arrow, datasets folder)"),
    "plan": ("packkit.cli.plan", "effective batch, tokens per step and steps per epoch, with advice"),
    "tokenize": ("packkit.cli.tokenize", "tokenize text or chat data once (input_ids, TRL's loss mask) for the others"),
}

USAGE = ("usage: packkit {" + ",".join(SUBCOMMANDS) + "} [options]   (packkit COMMAND --help for more)\n\n"
         + "\n".join(f"  {name:<{max(map(len, SUBCOMMANDS))}}  {help_}" for name, (_, help_) in SUBCOMMANDS.items())
         + "\n\n" + EXIT_CODES)

#: ``{name: module}``: what this module lends under its old address, from the modules a subcommand or a failure imports.
_LENT = {**dict.fromkeys(("DEFAULT_WINDOW", "DEFAULT_OVERFLOW", "BALANCE_NAMES", "add_window_arguments",
                          "add_output_switches", "add_cp_arguments", "add_dealing_arguments", "Parser", "require",
                          "options_of", "_Formatter", "_balance"), "_options"),
         **dict.fromkeys(("install_hint", "classify", "_extra_for", "_SYSTEM_ERRNOS"), "_failures")}


def __getattr__(name: str):
    """A name of :data:`_LENT`, from its module, imported on first use (not at ``--help``)."""
    if name not in _LENT:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LENT[name]}"), name)


def _one_line(text: str) -> str:
    return " ".join(str(text).split()) or "error"


def main(argv: list[str] | None = None) -> int:
    argv, process = list(sys.argv[1:] if argv is None else argv), argv is None  # process: packkit, python -m
    name, state = (argv or ["packkit"])[0], {}

    def show(message, category, filename, lineno, file=None, line=None):
        """Warnings as ``packkit NAME: warning: ...`` on stderr, one line each (not Python's format, with its source
        path and line), while the command runs; a :class:`~packkit.errors.Message` names arguments as the command
        spells them (``state["options"]``)."""
        from ..errors import Message  # lazy: for a warning only (not at --help)
        text = message.args[0] if isinstance(message, Warning) and message.args else message
        text = text.render(state.get("options")) if isinstance(text, Message) else str(text)
        with contextlib.suppress(OSError, ValueError):
            print(f"packkit {name}: warning: {_one_line(text)}", file=sys.stderr)

    try:  # SIGTERM and SIGHUP run every cleanup too, as Ctrl-C does
        with signals_raise(), warnings.catch_warnings():
            warnings.showwarning = show
            return _run(argv, name, state, process)
    except KeyboardInterrupt as exc:  # a stop signal, in the command or entering or leaving these blocks
        from ._failures import stopped  # lazy: for a stop signal only
        return stopped(name, exc)


def _import_command(module: str, *, process: bool = False):
    """The command's module, imported with the collector paused (collections among its objects, which live as long as
    the process, were 3.5% of ``plan --synthetic``'s instructions) and, as the ``process``, frozen (``gc.freeze``:
    the command's collections traversed them again, 533 M -> 494 M); not for a caller of main (its cycles stay)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        return importlib.import_module(module)
    finally:
        if collecting:
            gc.enable()
            if process:
                gc.freeze()


def _run(argv: list[str], name: str, state: dict, process: bool = False) -> int:
    options = None
    try:
        if not argv:
            print(USAGE, file=sys.stderr)
            code = EXIT_USAGE
        elif name in ("-h", "--help", "-V", "--version"):
            print(USAGE if name in ("-h", "--help") else f"packkit {__version__}")
            code = EXIT_OK
        elif name not in SUBCOMMANDS:
            print(f"packkit: error: unknown command {name!r}; choose one of {', '.join(SUBCOMMANDS)}", file=sys.stderr)
            code = EXIT_USAGE
        else:
            module = _import_command(SUBCOMMANDS[name][0], process=process)
            from ._options import options_of  # lazy: imported with the command's module already
            parser = module.parser()
            options = state["options"] = options_of(parser, getattr(module, "ALIASES", None))
            code = int(module.run(parser.parse_args(argv[1:]), options) or 0)
        sys.stdout.flush()  # a closed pipe shows here, inside the handlers, not at exit
        return code
    except (SystemExit, BrokenPipeError) as exc:  # SystemExit: argparse's --help, flushed so a closed pipe is quiet
        with contextlib.suppress(BrokenPipeError):
            if isinstance(exc, SystemExit):
                sys.stdout.flush()
                raise
        from ._failures import pipe_closed  # lazy: for a closed pipe only
        return pipe_closed()
    except Exception as exc:
        from ._failures import classify  # lazy: for an error only
        if (stop := swallowed(exc)) is not None:  # a library caught the signal's exception and failed in its stead
            raise stop from None  # said once, by main
        if os.environ.get("PACKKIT_DEBUG"):
            raise
        verdict = classify(exc, options)
        if verdict is None:
            raise
        code, message = verdict
        with contextlib.suppress(BrokenPipeError):
            print(f"packkit {name}: error: {_one_line(message)}", file=sys.stderr)
        return code
