"""The ``packkit`` command.

Each subcommand is a module of this package exposing ``cli_main(argv) -> int`` over the library
functions of the module that owns its subject; this file only dispatches, and turns the errors a user can fix into one line and a non-zero exit
(never a traceback; ``PACKKIT_DEBUG=1`` re-raises them, for a bug report):

    packkit waste [FILE]          padding waste of each batching strategy (the main job)
    packkit pack IN OUT -w W      offline packing of a dataset
    packkit plan [FILE]           effective batch, tokens per step, steps per epoch, advice
"""

from __future__ import annotations

import importlib
import os
import sys

SUBCOMMANDS = {
    "waste": ("packkit.cli.waste", "padding waste of each batching strategy, with a table and a plot"),
    "pack": ("packkit.cli.pack", "pack a dataset offline into windows (jsonl, parquet, arrow, datasets folder)"),
    "plan": ("packkit.cli.plan", "effective batch, tokens per step and steps per epoch, with advice"),
}

USAGE = "usage: packkit {" + ",".join(SUBCOMMANDS) + "} [options]   (packkit COMMAND --help for more)\n\n" + "\n".join(
    f"  {name:<7} {help_}" for name, (_, help_) in SUBCOMMANDS.items()
)


class CLIError(Exception):
    """An error the user can fix: printed as one line, exit code 2."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version"):
        from .. import __version__

        print(f"packkit {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"packkit: error: unknown command {name!r}; choose one of {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    try:
        return int(module.cli_main(rest) or 0)
    except (CLIError, ValueError, TypeError, KeyError, FileNotFoundError, IsADirectoryError,
            PermissionError, ImportError) as exc:
        if os.environ.get("PACKKIT_DEBUG"):
            raise
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"packkit {name}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
