"""``packkit waste [FILE]``: padding waste of each batching strategy, a table (or ``--json``) and a plot."""

from __future__ import annotations

import argparse
import json

from ..binpack import OVERFLOW_POLICIES
from ..waste import WASTE_STRATEGIES, format_table, measure_waste, plot_waste
from ._chat import add_tokenizer_arguments, chat_options


def cli_main(argv=None) -> int:
    """``packkit waste [FILE]``: the table (or ``--json``) and optionally ``--plot PNG``."""
    parser = argparse.ArgumentParser(
        prog="packkit waste",
        description="Padding waste of each batching strategy on your data (the bundled sample without FILE).",
    )
    parser.add_argument("input", nargs="?", default=None,
                        help="jsonl, parquet, arrow, a save_to_disk folder, .txt (one example a line), or "
                             ".npy of lengths; omitted: the bundled sample")
    parser.add_argument("-w", "--window", type=int, default=2048, help="tokens per window (default 2048)")
    parser.add_argument("-b", "--batch-size", type=int, default=8, help="examples per padded step (default 8)")
    parser.add_argument("--windows-per-step", type=int, default=None,
                        help="windows per packed step (default: the batch size)")
    parser.add_argument("--overflow", default="truncate", choices=OVERFLOW_POLICIES,
                        help="examples longer than the window (default: truncate)")
    parser.add_argument("--buffer-size", type=int, default=1000, help="examples held by the streaming packer")
    parser.add_argument("--strategies", default=",".join(WASTE_STRATEGIES),
                        help=f"comma-separated subset of {','.join(WASTE_STRATEGIES)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--column", default="input_ids", help="token-id list column (or an integer column of lengths)")
    parser.add_argument("--text-column", default="text", help="text column, tokenized when there are no token ids")
    add_tokenizer_arguments(parser, default="bytes")
    parser.add_argument("--split", default=None, help="split of a saved DatasetDict (default: train)")
    parser.add_argument("--plot", default=None, metavar="PNG", help="write the length histogram and fill plot")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)

    from ..io import read_lengths

    data = read_lengths(args.input, column=args.column, text_column=args.text_column, tokenizer=args.tokenizer,
                        split=args.split, progress=not args.quiet and not args.json, chat=chat_options(args))
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if args.plot and not args.plot.lower().endswith(".png"):
        raise ValueError(f"--plot writes a PNG: give a file name ending in .png, got {args.plot!r}")
    report = measure_waste(
        data.lengths, window=args.window, batch_size=args.batch_size, windows_per_step=args.windows_per_step,
        overflow=args.overflow, buffer_size=args.buffer_size, seed=args.seed, strategies=strategies,
        source=data.source, unit=data.unit, progress=None if not args.quiet else False,
        loss_lengths=data.loss_lengths)
    if args.plot:
        try:
            plot_waste(report, args.plot)
        except ImportError:
            raise ImportError("--plot needs matplotlib: pip install 'packkit[plot]'") from None
    if args.json:
        out = report.to_dict()
        if args.plot:
            out["plot"] = args.plot
        print(json.dumps(out))
    else:
        print(format_table(report))
        if args.plot:
            print(f"\nwrote {args.plot}")
    return 0
