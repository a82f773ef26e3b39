"""``packkit plan --loss-weighting MODE [--weight-plot PNG]``: the share of the loss weight by length decile
(:func:`packkit.weighting.weight_shares`), the hook ``plan`` calls."""

from __future__ import annotations

import argparse

from ._exits import UsageError
from ..choices import LENGTH_MODES, LOSS_WEIGHTINGS, loss_weighting_spec as checked_spec


def loss_weighting_spec(text: str) -> str:
    """``--loss-weighting``'s value, checked (:func:`packkit.choices.loss_weighting_spec`)."""
    try:
        return checked_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_weighting_arguments(p) -> None:
    p.add_argument("--loss-weighting", type=loss_weighting_spec, metavar="MODE", help="also show the share of the "
                   f"loss weight by length decile under MODE ({', '.join(LOSS_WEIGHTINGS)}, or "
                   f"{':L, '.join(LENGTH_MODES)}:L with L the constant length) beside the token mean")
    p.add_argument("--weight-plot", metavar="PNG", help="with --loss-weighting: write those shares as a bar chart")
    p.add_argument("--overwrite-plot", action="store_true", help="replace an existing --weight-plot file")


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
