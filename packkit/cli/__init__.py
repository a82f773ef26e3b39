"""The ``packkit`` command (its subcommands: :data:`SUBCOMMANDS`; exit codes: :data:`EXIT_CODES`, printed by every
``--help``, and their table in ``docs/cli.md``).

Each subcommand is a module of this package with ``parser() -> Parser`` and ``run(args, options) -> int`` over the
library functions of the module that owns its subject; the options several commands share are defined once, here
and in :mod:`packkit.cli._chat`. This file parses, dispatches, and turns every error a user can cause into one
line on stderr and an exit code, never a traceback (``PACKKIT_DEBUG=1`` re-raises, for a bug report). Library
messages name arguments through :func:`packkit.errors.arg`; they are rendered here with the command's own options
(``--overflow split``, not ``overflow='split'``), for every message at once. A stop signal removes every
temporary file first (:mod:`packkit.interrupts`); a closed output pipe exits quietly, as a Unix tool killed by
SIGPIPE.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import gc
import importlib
import os
import re
import signal
import sys
import warnings

from .. import __version__
from ..choices import BALANCE, CP_LAYOUTS, DEFAULT_OVERFLOW, OVERFLOW_POLICIES, STRATEGIES  # numpy-free
from ..interrupts import Interrupted, signals_raise, swallowed

SUBCOMMANDS = {
    "waste": ("packkit.cli.waste", "padding waste of each batching strategy, with a table and a plot"),
    "pack": ("packkit.cli.pack", "pack a dataset offline into windows (parquet, jsonl, arrow, datasets folder)"),
    "plan": ("packkit.cli.plan", "effective batch, tokens per step and steps per epoch, with advice"),
    "tokenize": ("packkit.cli.tokenize", "tokenize text or chat data once (input_ids, TRL's loss mask) for the others"),
}

EXIT_OK, EXIT_BUG, EXIT_USAGE, EXIT_DATA, EXIT_SYSTEM = 0, 1, 2, 3, 4
EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 130, 141

EXIT_CODES = """exit codes:
  0    success
  1    a bug in packkit (a traceback is printed: please report it)
  2    usage: the command line is wrong (bad option or value, OUT exists or is IN)
  3    data: the input cannot be read or holds an example packkit refuses
  4    system: a missing optional package, out of memory, disk full
  130  interrupted (143 SIGTERM, 129 SIGHUP); 141 the output pipe was closed (quietly)"""

USAGE = ("usage: packkit {" + ",".join(SUBCOMMANDS) + "} [options]   (packkit COMMAND --help for more)\n\n"
         + "\n".join(f"  {name:<{max(map(len, SUBCOMMANDS))}}  {help_}" for name, (_, help_) in SUBCOMMANDS.items())
         + "\n\n" + EXIT_CODES)

#: Default of ``--window`` for every command (``pack``, ``waste`` and ``plan`` read the same data the same way).
DEFAULT_WINDOW = 2048


def add_window_arguments(parser: argparse.ArgumentParser, *, window: bool = True, strategy: bool = True,
                         overflow_default: str = DEFAULT_OVERFLOW, overflow_help: str = "") -> None:
    """``-w/--window`` (without ``window``: ``plan`` sets it beside ``--padded``), ``--strategy``, ``--overflow`` and
    ``--drop-loss-free``: how ``waste``, ``plan`` and ``pack`` cut the examples into windows, defined once.

    >>> p = argparse.ArgumentParser(); add_window_arguments(p, strategy=False)
    >>> a = p.parse_args(["--overflow", "drop"]); a.window, a.overflow, a.drop_loss_free
    (2048, 'drop', False)
    """
    if window:
        parser.add_argument("-w", "--window", type=int, default=DEFAULT_WINDOW,
                            help=f"tokens per window (default {DEFAULT_WINDOW}, in packkit waste, plan and pack)")
    if strategy:
        parser.add_argument("--strategy", default="bfd", choices=STRATEGIES,
                            help="bin packing: bfd (best-fit decreasing, default), ffd, shuffle_ff, next_fit")
    parser.add_argument("--overflow", default=overflow_default, choices=OVERFLOW_POLICIES,
                        help="examples longer than the window: split (default: every token kept, the example "
                             "continues in the next window), truncate or drop (the tokens cut are counted and "
                             "printed), error (refuse them)" + overflow_help)
    parser.add_argument("--drop-loss-free", action="store_true",
                        help="leave out the pieces (examples after --overflow) that hold no loss token: they would "
                             "train on nothing, and a step of them has loss 0 (counted and printed)")


def add_output_switches(parser: argparse.ArgumentParser, *, instead_of: str) -> None:
    """``--json`` (one JSON line instead of ``instead_of``) and ``-q/--quiet`` (no progress bar), in every command."""
    parser.add_argument("--json", action="store_true", help=f"print one JSON line instead of {instead_of}")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def add_cp_arguments(parser: argparse.ArgumentParser, *,
                     cp_help: str = "context-parallel ranks a row is cut across (default 1; -d stays the data-parallel "
                                    "count): counts the padding the layout adds",
                     layout_help: str = "zigzag pads every example to a multiple of 2*N (counted as padding); "
                                        "contiguous, ulysses and hybrid cut rows in N pieces and need W to be a "
                                        "multiple of N (default hybrid)") -> None:
    """``--cp N`` (``dest="cp_size"``, default 1) and ``--cp-layout`` (default hybrid): how ``waste`` and ``plan``
    count a context-parallel group (``pack`` says what it writes for one).

    >>> p = argparse.ArgumentParser(); add_cp_arguments(p, cp_help="ranks", layout_help="layout")
    >>> p.parse_args(["--cp", "2"]).cp_size, p.parse_args([]).cp_layout
    (2, 'hybrid')
    """
    parser.add_argument("--cp", type=int, default=1, dest="cp_size", metavar="N", help=cp_help)
    parser.add_argument("--cp-layout", default="hybrid", choices=CP_LAYOUTS, help=layout_help)


#: ``--balance``'s words: the samplers' policies, ``none`` for None.
BALANCE_NAMES = ("none", *BALANCE[1:])


def _balance(value: str):
    """``--balance``'s value as the samplers take it (``none`` is None)."""
    if value not in BALANCE_NAMES:
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {', '.join(BALANCE_NAMES)})")
    return None if value == "none" else value


def add_dealing_arguments(parser: argparse.ArgumentParser) -> None:
    """``--world-size N`` (aliases ``-d``, ``--devices``, ``--ranks``; the samplers' ``world_size``) and ``--balance``
    (the samplers' ``balance``; ``none`` is None): how ``plan`` and ``waste`` deal the epoch to the ranks.

    >>> p = argparse.ArgumentParser(); add_dealing_arguments(p)
    >>> p.parse_args(["--ranks", "4", "--balance", "compute"]).world_size, p.parse_args([]).balance
    (4, None)
    """
    parser.add_argument("-d", "--world-size", "--devices", "--ranks", type=int, default=1, dest="world_size",
                        metavar="N", help="data-parallel ranks (devices) the sampler deals each step to: the compute "
                                          "imbalance is across them (default 1)")
    parser.add_argument("--balance", type=_balance, default=None, metavar="{" + ",".join(BALANCE_NAMES) + "}",
                        help="the samplers' balance policy; the figures are those of the schedule it deals (default "
                             "none)")


class UsageError(Exception):
    """The command line is wrong: one line, exit code 2."""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """argparse's, as wide as ``shutil.get_terminal_size`` says, read as it reads it but without importing shutil
    (and lzma and bz2 with it: 1% of ``packkit plan``'s instructions), which argparse's own does for every
    ``add_argument`` (it formats each option's metavar to check it)."""

    def __init__(self, prog, indent_increment=2, max_help_position=24, width=None):
        if width is None:
            try:
                columns = int(os.environ["COLUMNS"])
            except (KeyError, ValueError):
                columns = 0
            if columns <= 0:
                try:
                    columns = os.get_terminal_size(sys.__stdout__.fileno()).columns or 80
                except (AttributeError, ValueError, OSError):
                    columns = 80
            width = columns - 2
        super().__init__(prog, indent_increment, max_help_position, width)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (and exit code 2), not a usage block and a line."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("epilog", EXIT_CODES)
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")


def require(*modules: str) -> None:
    """Raise ``ModuleNotFoundError`` for the first of ``modules`` that is not installed (before any work;
    :func:`main` turns it into ``pip install 'packkit[EXTRA]'``)."""
    import importlib.util

    for m in modules:
        if importlib.util.find_spec(m) is None:
            raise ModuleNotFoundError(f"No module named {m!r}", name=m)


def options_of(parser: argparse.ArgumentParser, aliases: dict | None = None) -> dict:
    """``{argument name: (flag, takes_value[, negative flag])}`` of a parser's options, for
    ``packkit.errors.Arg.render``: the library's ``window`` is ``--window``; a ``--x/--no-x`` switch
    carries its ``--no-x``; ``aliases`` maps other library names to an option's dest."""
    out = {}
    for action in parser._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if not longs or action.dest == "help":
            continue
        out[action.dest] = (longs[0], action.nargs != 0) + tuple(s for s in longs[1:] if s.startswith("--no-"))[:1]
    for name, dest in (aliases or {}).items():
        if dest in out:
            out[name] = out[dest]
    return out


# ----------------------------------------------------------------------------------------------
# one line for every error
# ----------------------------------------------------------------------------------------------

_SYSTEM_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS, errno.EMFILE, errno.ENFILE, errno.ENOMEM,
                  errno.EACCES, errno.EPERM}


def install_hint(exc: ImportError) -> str:
    """``No module named 'datasets'`` -> ``...: pip install 'packkit[datasets]'`` (the extra that holds the
    module, from packkit's own metadata), unless the message already says what to install."""
    text = str(exc)
    if "pip install" in text:
        return text
    module = (getattr(exc, "name", None) or "").split(".")[0]
    if not module:
        return text
    extra = _extra_for(module)
    return f"{text}: pip install " + (f"'packkit[{extra}]'" if extra else module.replace("_", "-"))


def _extra_for(module: str) -> str | None:
    """The smallest user extra of packkit that installs ``module`` (``test`` and ``bench`` last)."""
    try:
        from importlib.metadata import requires
        reqs = requires("packkit") or []
    except Exception:  # not installed as a distribution (a source tree on sys.path)
        return None
    want = module.lower().replace("-", "_")
    found: dict[str, int] = {}
    for req in reqs:
        m = re.match(r"\s*([A-Za-z0-9_.\-]+).*extra\s*==\s*['\"]([^'\"]+)['\"]", req)
        if m and m.group(1).lower().replace("-", "_") == want:
            extra = m.group(2)
            found[extra] = sum(1 for r in reqs if re.search(r"extra\s*==\s*['\"]%s['\"]" % re.escape(extra), r))
    if not found:
        return None
    return min(found, key=lambda e: (e in ("test", "bench"), e != want, found[e], e))


def classify(exc: BaseException, options: dict | None = None) -> tuple[int, str] | None:
    """``(exit code, one-line message)`` for an error a user can cause; None for a bug (re-raised)."""
    from ..errors import ArgumentError, OutputError, PackkitError  # lazy: for an error only (not at --help)
    if isinstance(exc, UsageError):
        return EXIT_USAGE, str(exc)
    if isinstance(exc, PackkitError):
        code = EXIT_USAGE if isinstance(exc, (ArgumentError, OutputError)) else EXIT_DATA
        return code, exc.render(options)
    if isinstance(exc, MemoryError):
        detail = str(exc) or "an allocation failed"
        return EXIT_SYSTEM, f"out of memory ({detail}); free memory, or process a smaller input"
    if isinstance(exc, ImportError) and ((exc.name or "").split(".")[0] not in ("", "packkit")
                                         or "pip install" in str(exc)):
        return EXIT_SYSTEM, install_hint(exc)  # an ImportError inside packkit is a bug: re-raised
    if isinstance(exc, OSError):
        text = str(exc)
        if exc.errno is not None and exc.strerror and exc.filename is not None:
            text = f"{exc.filename!s}: {exc.strerror}"
        if exc.errno in _SYSTEM_ERRNOS:
            return EXIT_SYSTEM, text
        if isinstance(exc, FileExistsError):
            return EXIT_USAGE, text
        return EXIT_DATA, text
    if isinstance(exc, KeyError):
        return EXIT_DATA, str(exc.args[0]) if exc.args else "missing key"
    if isinstance(exc, (ValueError, TypeError)) or type(exc).__module__.startswith("pyarrow"):
        return EXIT_DATA, str(exc)
    return None


def _one_line(text: str) -> str:
    return " ".join(str(text).split()) or "error"


def _pipe_closed() -> int:
    """After a broken pipe: stdout pointed at /dev/null so that the flush at exit cannot fail again; the exit code."""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # stdout is not a real file (captured in tests)
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    return EXIT_BROKEN_PIPE


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
    """Say that a stop signal ended the command, in one line; its exit code (130 for Ctrl-C, 128 + signum)."""
    if os.environ.get("PACKKIT_DEBUG"):
        raise exc
    stopped = isinstance(exc, Interrupted) and exc.signum != signal.SIGINT
    with contextlib.suppress(OSError, ValueError):
        print(f"packkit {name}: " + (f"stopped by {exc.name}" if stopped else "interrupted"), file=sys.stderr)
    return exc.exit_code if stopped else EXIT_INTERRUPTED


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
