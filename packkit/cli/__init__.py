"""The ``packkit`` command (its subcommands: :data:`SUBCOMMANDS`; exit codes: :data:`EXIT_CODES`, printed by every
``--help``, and their table in ``docs/cli.md``).

Each subcommand is a module of this package with ``parser() -> Parser`` and ``run(args, options) -> int`` over the
library functions of the module that owns its subject; the options several commands share are defined once, in
:mod:`packkit.cli._options` and :mod:`packkit.cli._chat`. This file parses, dispatches, and turns every error a user
can cause into one line on stderr and an exit code, never a traceback (``PACKKIT_DEBUG=1`` re-raises, for a bug
report; the verdicts are :mod:`packkit.cli._failures`'). Library messages name arguments through
:func:`packkit.errors.arg`; they are rendered here with the command's own options (``--overflow split``, not
``overflow='split'``), for every message at once. A stop signal removes every temporary file first
(:mod:`packkit.interrupts`); a closed output pipe exits quietly, as a Unix tool killed by SIGPIPE.

``packkit --help``, ``--version`` and a wrong command compile this file and :mod:`packkit.cli._exits` only: the
shared options and the failures are imported with a subcommand or an error, and lent here under their old
address (``packkit.cli.Parser``, ``packkit.cli.classify``).
"""

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

#: ``{name: module}``: what this module lends from the modules a subcommand or a failure imports.
_LENT = {
    **dict.fromkeys(("DEFAULT_WINDOW", "DEFAULT_OVERFLOW", "BALANCE_NAMES", "add_window_arguments",
                     "add_output_switches", "add_cp_arguments", "add_dealing_arguments", "Parser", "require",
                     "options_of", "_Formatter", "_balance"), "_options"),
    **dict.fromkeys(("install_hint", "classify", "_extra_for", "_SYSTEM_ERRNOS"), "_failures"),
}


def __getattr__(name: str):
    """``packkit.cli.Parser`` -> ``packkit.cli._options.Parser``, ``packkit.cli.classify`` ->
    ``packkit.cli._failures.classify``: the shared options and the failures under their old address."""
    if _LENT.get(name) == "_options":
        from . import _options  # lazy: the shared options, compiled with a subcommand (not at --help)
        return getattr(_options, name)
    if _LENT.get(name) == "_failures":
        from . import _failures  # lazy: the verdicts on errors, compiled where a command fails
        return getattr(_failures, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _one_line(text: str) -> str:
    return " ".join(str(text).split()) or "error"


def _top(argv: list[str]) -> int | None:
    """``packkit``, ``packkit --help``, ``--version`` and unknown commands; None for a subcommand."""
    if not argv:
        print(USAGE, file=sys.stderr)
        return EXIT_USAGE
    if argv[0] in ("-h", "--help"):
        print(USAGE)
        return EXIT_OK
    if argv[0] in ("-V", "--version"):
        print(f"packkit {__version__}")
        return EXIT_OK
    if argv[0] not in SUBCOMMANDS:
        print(f"packkit: error: unknown command {argv[0]!r}; choose one of {', '.join(SUBCOMMANDS)}",
              file=sys.stderr)
        return EXIT_USAGE
    return None


def main(argv: list[str] | None = None) -> int:
    argv, process = list(sys.argv[1:] if argv is None else argv), argv is None  # process: packkit, python -m
    try:
        with signals_raise():  # SIGTERM and SIGHUP run every cleanup too, as Ctrl-C does
            return _main(argv, process)
    except KeyboardInterrupt as exc:  # a stop signal outside _run's handlers: entering or leaving its blocks
        return _stopped((argv or ["packkit"])[0], exc)


def _stopped(name: str, exc: KeyboardInterrupt) -> int:
    """:func:`packkit.cli._failures.stopped`: one line, and the exit code of the stop."""
    from ._failures import stopped  # lazy: for a stop signal only
    return stopped(name, exc)


def _pipe_closed() -> int:
    """:func:`packkit.cli._failures.pipe_closed`: stdout to /dev/null, and the exit code."""
    from ._failures import pipe_closed  # lazy: for a closed pipe only
    return pipe_closed()


def _one_line_warnings(name: str, state: dict):
    """Warnings as ``packkit NAME: warning: ...`` on stderr, one line each (not Python's format, with
    its source path and line), for as long as the command runs; a warning whose text is a
    :class:`~packkit.errors.Message` names arguments as the command spells them (``state["options"]``)."""

    def show(message, category, filename, lineno, file=None, line=None):
        from ..errors import Message  # lazy: for a warning only (not at --help)
        text = message.args[0] if isinstance(message, Warning) and message.args else message
        text = text.render(state.get("options")) if isinstance(text, Message) else str(text)
        with contextlib.suppress(OSError, ValueError):
            print(f"packkit {name}: warning: {_one_line(text)}", file=sys.stderr)

    return show


def _main(argv: list[str], process: bool = False) -> int:
    name, state = (argv or ["packkit"])[0], {}
    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warnings(name, state)
        return _run(argv, name, state, process)


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
        code = _top(argv)
        if code is None:
            module = _import_command(SUBCOMMANDS[name][0], process=process)
            from ._options import options_of  # lazy: imported with the command's module already
            parser = module.parser()
            options = state["options"] = options_of(parser, getattr(module, "ALIASES", None))
            args = parser.parse_args(argv[1:])
            code = int(module.run(args, options) or 0)
        sys.stdout.flush()  # a closed pipe shows here, inside the handlers, not at exit
        return code
    except SystemExit as exc:  # argparse's --help: flushed here too, so a closed pipe is quiet
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            return _pipe_closed()
        raise exc
    except BrokenPipeError:
        return _pipe_closed()
    except KeyboardInterrupt as exc:
        return _stopped(name, exc)
    except Exception as exc:
        if (stop := swallowed(exc)) is not None:  # a library caught the signal's exception and failed in its stead
            return _stopped(name, stop)
        if os.environ.get("PACKKIT_DEBUG"):
            raise
        from ._failures import classify  # lazy: for an error only
        verdict = classify(exc, options)
        if verdict is None:
            raise
        code, message = verdict
        try:
            print(f"packkit {name}: error: {_one_line(message)}", file=sys.stderr)
        except BrokenPipeError:
            pass
        return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
