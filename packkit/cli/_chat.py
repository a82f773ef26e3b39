"""The tokenizer and chat-template options that ``packkit waste``, ``plan`` and ``pack`` share."""

from __future__ import annotations

import argparse

from ..chat import CHAT_FORMATS, ChatOptions


def add_tokenizer_arguments(parser: argparse.ArgumentParser, *, default: str | None) -> None:
    """``--tokenizer`` and the chat-template options (:func:`packkit.chat.tokenize_chat`)."""
    what = "'bytes' (default), " if default == "bytes" else ""
    parser.add_argument(
        "--tokenizer", default=default, metavar="PATH_OR_ID",
        help=f"{what}a local tokenizer.json, a tokenizer folder, or a model id; conversational data (messages, "
             "conversations, prompt + completion) goes through its chat template")
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


def chat_options(args: argparse.Namespace, *, num_proc: int | None = None) -> ChatOptions:
    """The :class:`packkit.chat.ChatOptions` that the options above give (``num_proc``: processes that render)."""
    return ChatOptions(chat_template=args.chat_template, assistant_only_loss=args.assistant_only_loss,
                       completion_only_loss=args.completion_only_loss, trust_remote_code=args.trust_remote_code,
                       format=args.format, num_proc=num_proc)
