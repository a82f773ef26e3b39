"""``packkit plan``: effective batch, tokens per optimiser step, steps per epoch, and advice; with
``--loss-weighting MODE [--weight-plot PNG]`` the share of the loss weight by length decile
(:func:`packkit.weighting.weight_shares`)."""

from __future__ import annotations

import argparse
import json

from ._exits import UsageError
from ._options import (DEFAULT_WINDOW, Parser, add_cp_arguments, add_dealing_arguments, add_output_switches,
                       add_window_arguments)
from ..binpack import PLAN_BYTES_PER_ITEM, check_seed, check_window, memory_available
from ..budget import AdviceOptions, plan_budget, synthetic_sft_lengths
from ..choices import LENGTH_MODES, LOSS_WEIGHTINGS, loss_weighting_spec as checked_spec
from ..epoch import Lengths
from ._chat import add_input_arguments, input_lengths, lines_named

#: The library's argument names that this command spells otherwise.
ALIASES = {"target_tokens_per_step": "target_tokens"}


def parser() -> Parser:
    p = Parser(prog="packkit plan",
               description="Effective batch, tokens per optimiser step, steps per epoch, and advice, for your lengths.")
    add_input_arguments(p, optional=True, help="; labels or a completion_mask / assistant_masks column give the loss "
                        "tokens, as does a chat template (--tokenizer) on conversational data")
    p.add_argument("--synthetic", type=int, metavar="N", help="N synthetic SFT-like examples instead of a file")
    p.add_argument("-b", "--per-device-batch", type=int, default=1,
                   help="windows (packed) or examples (padded) per device per micro-batch (default 1)")
    p.add_argument("-a", "--accumulation-steps", type=int, default=1,
                   help="micro-batches accumulated per optimiser step (default 1)")
    add_dealing_arguments(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("-w", "--window", type=int, help=f"pack into windows of W tokens (default {DEFAULT_WINDOW})")
    g.add_argument("--padded", action="store_true", help="padded batches instead of packed windows")
    add_window_arguments(p, window=False)
    p.add_argument("--lora", action="store_true", help="an adapter (LoRA) run: adds the large-batch advice")
    p.add_argument("--target-tokens", type=int, metavar="T", help="tokens per step to reach")
    p.add_argument("--drop-last", action="store_true", help="leave out the last partial step")
    p.add_argument("--seed", type=int, default=0, help="seed of the window order and synthetic data (default 0)")
    add_cp_arguments(p)
    add_output_switches(p, instead_of="the table")
    p.add_argument("--loss-weighting", type=loss_weighting_spec, metavar="MODE", help="also show the share of the "
                   f"loss weight by length decile under MODE ({', '.join(LOSS_WEIGHTINGS)}, or "
                   f"{':L, '.join(LENGTH_MODES)}:L with L the constant length) beside the token mean")
    p.add_argument("--weight-plot", metavar="PNG", help="with --loss-weighting: write those shares as a bar chart")
    p.add_argument("--overwrite-plot", action="store_true", help="replace an existing --weight-plot file")
    return p


def loss_weighting_spec(text: str) -> str:
    """``--loss-weighting``'s value, checked (:func:`packkit.choices.loss_weighting_spec`)."""
    try:
        return checked_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def weighting_report(args, data):
    """The :class:`~packkit.weighting.WeightShares` asked for (None without ``--loss-weighting``), its plot written when
    asked; the loss tokens are the data's (labels, a loss mask, a chat template), else all but each example's first."""
    if args.loss_weighting is None:
        if args.weight_plot:
            raise UsageError("--weight-plot draws the --loss-weighting shares: pass --loss-weighting MODE too")
        return None
    from ..weighting import DrGRPO, SeqSumNorm, plot_weight_shares, weight_shares  # lazy: 3 ms at start otherwise
    loss = data.loss_lengths if data.loss_lengths is not None else data.lengths - 1
    name, _, length = args.loss_weighting.partition(":")
    mode = {"seq-mean-token-sum-norm": SeqSumNorm, "dr_grpo": DrGRPO}[name](int(length)) if length else name
    shares = weight_shares(data.lengths, loss, mode)
    if args.weight_plot:
        plot_weight_shares(shares, args.weight_plot, overwrite=args.overwrite_plot)
    return shares


def _synthetic(n: int, seed: int) -> Lengths:
    """``--synthetic N``: N SFT-like lengths, refused before drawing when they would not fit in memory (numpy would
    ask for it all at once)."""
    if n < 1:
        raise UsageError(f"--synthetic must be at least 1 example, got {n}")
    need, have = n * PLAN_BYTES_PER_ITEM, memory_available()
    if have is not None and need > have:
        raise UsageError(f"--synthetic {n:,} examples need about {need / 2**30:,.1f} GiB to draw and plan "
                         f"({PLAN_BYTES_PER_ITEM} bytes each), more than the {have / 2**30:,.1f} GiB of memory "
                         "available; ask for fewer")
    lengths, loss = synthetic_sft_lengths(n, seed=seed)
    return Lengths(lengths, f"{n:,} synthetic examples", loss_lengths=loss)


def run(args, options=None) -> int:
    """``packkit plan [FILE | --synthetic N] -b B -a A -d D [-w W | --padded] [--lora] [--target-tokens T]``."""
    # -- checks that cost nothing, before anything is read --
    if (args.input is None) == (args.synthetic is None):
        raise UsageError("give a lengths FILE or --synthetic N (one of them; see packkit plan --help)")
    window = None if args.padded else (DEFAULT_WINDOW if args.window is None else check_window(args.window))
    check_seed(args.seed)
    with lines_named(args.input):
        data = input_lengths(args) if args.synthetic is None else _synthetic(args.synthetic, args.seed)
        # the advice is printed below, once, with the table: no warnings
        advice = AdviceOptions(lora=args.lora, target_tokens_per_step=args.target_tokens, warn=False)
        report = plan_budget(data, per_device_batch=args.per_device_batch, accumulation_steps=args.accumulation_steps,
                             world_size=args.world_size, window=window, strategy=args.strategy, overflow=args.overflow,
                             balance=args.balance, drop_loss_free=args.drop_loss_free, drop_last=args.drop_last,
                             seed=args.seed, cp_size=args.cp_size, cp_layout=args.cp_layout, advice=advice)
    shares = weighting_report(args, data)
    print(json.dumps({**report.as_dict(), **({"loss_weighting": shares.as_dict()} if shares else {})}) if args.json
          else report.table(options=options) + ("\n\n" + shares.table() if shares else ""))
    return 0
