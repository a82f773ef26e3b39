"""``packkit waste [FILE]``: padding waste of each batching strategy, a table (or ``--json``) and a plot."""

from __future__ import annotations

import json

from ._options import (DEFAULT_OVERFLOW, Parser, add_cp_arguments, add_dealing_arguments, add_output_switches,
                       add_window_arguments, require)
from ..binpack import check_seed, check_window
from ..errors import ArgumentError, DataError, arg
from ..waste import (PREFERENCE_OVERFLOW, WASTE_STRATEGIES, format_preference_waste, format_table, measure_waste,
                     plot_waste, preference_waste)
from ._chat import add_input_arguments, input_lengths, lines_named


class _Default(str):
    """An option's default, told apart from the same value passed (``--preference`` reads ``--overflow``'s
    default as drop, and refuses ``--overflow split`` passed)."""


def parser() -> Parser:
    p = Parser(prog="packkit waste",
               description="Padding waste of each batching strategy on your data (the bundled sample without FILE).")
    add_input_arguments(p, optional=True, help="; omitted: the bundled sample")
    add_window_arguments(p, strategy=False, overflow_default=_Default(DEFAULT_OVERFLOW),
                         overflow_help="; with --preference, drop (default there) or error: a pair is packed whole")
    p.add_argument("-b", "--batch-size", type=int, default=8, help="examples per padded step (default 8)")
    p.add_argument("--windows-per-step", type=int, default=None,
                   help="windows per packed step (default: the batch size)")
    add_dealing_arguments(p)
    p.add_argument("--buffer-size", type=int, default=1000, help="examples held by the streaming packer (default 1000)")
    p.add_argument("--strategies", default=",".join(WASTE_STRATEGIES),
                   help=f"comma-separated subset of {','.join(WASTE_STRATEGIES)}")
    p.add_argument("--seed", type=int, default=0, help="seed of the random batches and orders (default 0)")
    add_cp_arguments(p)
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="write the length histogram and fill plot to PNG (its folder must exist)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --plot PNG")
    p.add_argument("--preference", action="store_true", help="preference pairs (prompt_ids, chosen_ids, rejected_ids; "
                   "or prompt, chosen, rejected, tokenized with --tokenizer): tokens per pair of TRL's layouts and of "
                   "packkit's pairs and shared-prompt trees")
    p.add_argument("--turns", action="store_true", help="messages trained turn by turn (one sample an assistant turn, "
                   "its history rendered by the chat template, as Qwen3's needs): tokens forwarded with every turn "
                   "whole and with shared histories once (prefix trees)")
    add_output_switches(p, instead_of="the table")
    return p


def run(args, options=None) -> int:
    # -- checks that cost nothing, before anything is read --
    check_window(args.window)
    check_seed(args.seed)
    if args.preference:
        return _preference(args)
    if args.turns:
        return _turns(args)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]  # measure_waste names a bad one
    if args.plot:
        from ..fileio import check_plot  # lazy: as waste.plot_waste's png_figure
        check_plot(args.plot, "plot", inputs=[args.input] if args.input else [], overwrite=args.overwrite)
        require("matplotlib")
    with lines_named(args.input):
        report = measure_waste(
            input_lengths(args), window=args.window, batch_size=args.batch_size, windows_per_step=args.windows_per_step,
            overflow=args.overflow, buffer_size=args.buffer_size, seed=args.seed, strategies=strategies,
            progress=None if not args.quiet else False, world_size=args.world_size, balance=args.balance,
            cp_size=args.cp_size, cp_layout=args.cp_layout, drop_loss_free=args.drop_loss_free)
    if args.plot:
        plot_waste(report, args.plot, overwrite=args.overwrite)
    print(json.dumps({**report.to_dict(), **({"plot": args.plot} if args.plot else {})}) if args.json
          else format_table(report, options=options) + (f"\n\nwrote {args.plot}" if args.plot else ""))
    return 0


def _preference(args) -> int:
    """``packkit waste FILE --preference``: :func:`packkit.waste.preference_waste` of the file's pairs."""
    if args.input is None:
        raise ArgumentError("{pref} reads a file of preference pairs: give FILE", pref=arg("preference"))
    overflow = "drop" if isinstance(args.overflow, _Default) else args.overflow  # a pair is never split
    if overflow not in PREFERENCE_OVERFLOW:  # refused before the file is read
        preference_waste([0], [1], [1], window=args.window, overflow=overflow)
    from ..datafiles import read_preference_lengths  # lazy: the readers, off the start of waste without a file
    with lines_named(args.input):  # a pair is a row: its line too
        prompt, chosen, rejected, source = read_preference_lengths(
            args.input, split=args.split, tokenizer=args.tokenizer, trust_remote_code=args.trust_remote_code)
        report = preference_waste(prompt, chosen, rejected, window=args.window, batch_size=args.batch_size,
                                  seed=args.seed, overflow=overflow)
    print(json.dumps({"source": source, **report}) if args.json else f"{source}\n{format_preference_waste(report)}")
    return 0


def _turns(args) -> int:
    """``packkit waste FILE --turns --tokenizer TOK``: :func:`packkit.prefixtree.turn_tokens` of the file's
    ``messages``."""
    if args.input is None or args.tokenizer in (None, "bytes"):
        raise ArgumentError("{turns} renders the conversations of FILE through a chat template: give FILE and "
                            "{tok}", turns=arg("turns"), tok=arg("tokenizer", "PATH_OR_ID"))
    from ..datafiles import load_table  # lazy: the readers, off the start of waste without a file
    from ..prefixtree import turn_tokens  # lazy: torch, only for --turns

    with lines_named(args.input):  # a conversation is a row: its line too
        table = load_table(args.input, split=args.split)
        if "messages" not in table.column_names:
            fix = ("its 'conversations' look like ShareGPT's from/value turns: write them as 'messages' of "
                   "role/content ('human' -> 'user', 'gpt' -> 'assistant')" if "conversations" in table.column_names
                   else "write each conversation as 'messages', a list of role/content messages")
            raise DataError(f"{args.input} has no 'messages' column (its columns: {table.column_names}): --turns "
                            f"reads conversations as lists of role/content messages; {fix}")
        report = turn_tokens(table.column("messages").to_pylist(), args.tokenizer, chat_template=args.chat_template)
    print(json.dumps({"source": str(args.input), **report}) if args.json
          else f"{args.input}: {report['conversations']:,} conversations, {report['turns']:,} assistant turns\n"
               f"  tokens forwarded, every turn whole:        {report['turn_tokens']:,}\n"
               f"  tokens forwarded, shared histories once:   {report['tree_tokens']:,} "
               f"({report['ratio']:.2f}x fewer; prefix trees, packkit.prefixtree)")
    return 0
