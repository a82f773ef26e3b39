"""The input options that ``packkit waste``, ``plan``, ``pack`` and ``tokenize`` share, defined once: the input, its
columns, ``--split``, and the tokenizer with its chat-template options."""

from __future__ import annotations

import argparse
import contextlib

from ..choices import CHAT_FORMATS
from ..epoch import Lengths
from ..sample import bundled_sample


class _Formats:
    """``%(formats)s`` of IN's help, the door in's :data:`~packkit.datafiles.INPUTS`: read as argparse prints it."""

    def __init__(self, npy: bool):
        self.npy = npy

    def __str__(self) -> str:  # ".parquet/.pq (Parquet), .arrow/.feather/.ipc (Arrow IPC), ..."
        from ..datafiles import INPUTS  # lazy: the door in, as the help is printed (no command's start imports it)
        kinds = {kind: [s for s, (k, _) in INPUTS.items() if k == kind] for kind, _ in INPUTS.values()}
        return ", ".join(f"{'/'.join(s)} ({INPUTS[s[0]][1]})" for k, s in kinds.items() if self.npy or k != "npy")


def add_input_arguments(parser: argparse.ArgumentParser, *, help: str = "", optional: bool = False,
                        column: bool = True, tokenizer: str | None = "bytes") -> None:
    """The input (the door in's formats, then ``help``; omitted when ``optional``), ``--column`` and ``.npy`` lengths
    (with ``column``; ``pack`` names its own columns), ``--text-column``, ``--split``, and ``--tokenizer`` (default
    ``tokenizer``) with the chat-template options (:func:`packkit.chat.tokenize_chat`)."""
    action = parser.add_argument("input", nargs="?" if optional else None, default=None)
    action.formats = _Formats(npy=column)  # argparse fills %(formats)s from the action's fields as it prints the help
    action.help = "%(formats)s, or a save_to_disk folder" + help  # once added: Python 3.14 expands a help on adding it
    if column:
        parser.add_argument("--column", default="input_ids", help="token-id list column (or an integer column of "
                                                                  "lengths)")
    parser.add_argument("--text-column", default="text", help="text column, tokenized when there are no token ids "
                                                              "and the data is not conversational")
    parser.add_argument("--split", default=None, help="split of a saved DatasetDict (default: train)")
    what = "'bytes' (default), " if tokenizer == "bytes" else ""
    parser.add_argument("--tokenizer", default=tokenizer, metavar="PATH_OR_ID",
                        help=f"{what}a local tokenizer.json, a tokenizer folder, or a model id; conversational data "
                             "(messages, conversations, prompt + completion) goes through its chat template")
    g = parser.add_argument_group("chat data (TRL's conversational formats)")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a .jinja chat template to use instead of the tokenizer's (conversations only; TRL's training "
                        "version is swapped in for a stock one, as SFTTrainer(assistant_only_loss=True) does)")
    g.add_argument("--assistant-only-loss", default=None, action=argparse.BooleanOptionalAction,
                   help="loss on assistant tokens only (needs {%% generation %%} markers in the template); "
                        "default: on for messages, off for prompt + completion")
    g.add_argument("--completion-only-loss", default=None, action=argparse.BooleanOptionalAction,
                   help="loss on the completion only, for prompt + completion data (default: on; refused on "
                        "messages, which have no completion)")
    g.add_argument("--format", default="auto", choices=("auto", *CHAT_FORMATS),
                   help="which columns to read as the conversation (default auto: TRL's precedence, prompt + "
                        "completion before messages when a row holds both)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="let a tokenizer run its own Python code (off by default)")


def chat_options(args: argparse.Namespace, *, num_proc: int | None = None):
    """The :class:`packkit.chatoptions.ChatOptions` the options above give (``num_proc``: processes that render)."""
    from ..chatoptions import ChatOptions  # lazy: off the start of waste and plan without a file
    return ChatOptions(args.chat_template, args.assistant_only_loss, args.completion_only_loss, args.trust_remote_code,
                       args.format, num_proc)


def input_lengths(args: argparse.Namespace) -> Lengths:
    """The lengths of the input the options above name (:func:`packkit.datafiles.read_lengths`), as ``waste`` and
    ``plan`` measure them (no input: the bundled sample, which has no chat to render, read without the readers)."""
    if args.input is None:
        return bundled_sample()
    from ..datafiles import read_lengths  # lazy: the readers, off the start of waste and plan without a file
    return read_lengths(args.input, column=args.column, text_column=args.text_column, tokenizer=args.tokenizer,
                        split=args.split, chat=chat_options(args), progress=not (args.quiet or args.json))


def lines_named(path):
    """:func:`packkit.datafiles.lines_named` for a file; nothing without one (no line to name, no readers)."""
    if path is None:
        return contextlib.nullcontext()
    from ..datafiles import lines_named  # lazy: the readers, for a file only
    return lines_named(path)
