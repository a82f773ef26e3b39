"""The options several subcommands share (``--window``, ``--strategy``, ``--overflow``, ``--json``, ``--cp``,
``--world-size``, ``--balance``), the :class:`Parser` every subcommand builds, and :func:`options_of`, through which
library messages name arguments as the command spells them. Imported with a subcommand, not by ``packkit --help``."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from ..choices import BALANCE, CP_LAYOUTS, DEFAULT_OVERFLOW, OVERFLOW_POLICIES, STRATEGIES  # numpy-free
from ._exits import EXIT_CODES, UsageError

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


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """argparse's, as wide as ``shutil.get_terminal_size`` says (``COLUMNS`` when positive, else the terminal's, else
    80), read without importing shutil (with lzma and bz2: 1% of ``packkit plan``'s instructions), which argparse's
    own does for every ``add_argument`` (it formats each option's metavar to check it)."""

    def __init__(self, prog, indent_increment=2, max_help_position=24, width=None):
        if width is None:
            try:
                columns = int(os.environ["COLUMNS"])
            except (KeyError, ValueError):
                columns = 0
            with contextlib.suppress(AttributeError, ValueError, OSError):  # no terminal: 80
                columns = columns if columns > 0 else os.get_terminal_size(sys.__stdout__.fileno()).columns
            width = (columns if columns > 0 else 80) - 2
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
