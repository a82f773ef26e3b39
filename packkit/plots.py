"""The waste report drawn (:func:`plot_waste`, ``packkit waste --plot``): the examples' lengths and every
strategy's fill, written as a PNG beside the target and renamed into place (:func:`packkit.fileio.png_figure`, which imports
matplotlib when a plot is drawn, not with this module)."""

from __future__ import annotations

import numpy as np

__all__ = ["plot_waste"]


def plot_waste(report, path, *, overwrite: bool = False) -> None:
    """Write a PNG: the length histogram, and the fill of every strategy (its distribution over rows).

    Written beside ``path`` and renamed into place when complete (:func:`packkit.fileio.png_figure`);
    an existing ``path`` is replaced only with ``overwrite=True``.
    """
    from .atomic import png_figure  # lazy: packkit waste starts without it (and shutil), for --plot only
    with png_figure(path, overwrite=overwrite, ncols=2, figsize=(14, 5.6),
                    gridspec_kw={"width_ratios": [1, 1.35]}) as (fig, (ax1, ax2)):
        _plot_lengths(ax1, report)
        _plot_fill(ax2, report)
        for ax in (ax1, ax2):
            ax.spines[["top", "right"]].set_visible(False)
        fig.suptitle(f"packkit waste: {report.source}", fontsize=12.5, fontweight="bold")


def _plot_lengths(ax, report) -> None:
    """The examples' lengths before the overflow policy, in log-spaced bins, with ``W`` and the median marked."""
    L = report.input_lengths
    lo, hi = max(1, int(L.min())), int(L.max())
    bins = np.unique(np.geomspace(lo, max(hi, lo + 1), 40).round()) if hi > lo else 10
    ax.hist(L, bins=bins, color="#4C72B0", edgecolor="white", linewidth=0.5)
    ax.set_xscale("log")
    ax.axvline(report.window, color="#C44E52", linestyle="--", linewidth=1.5)
    ax.text(report.window, ax.get_ylim()[1] * 0.95, f" W = {report.window:,}", color="#C44E52", va="top",
            ha="right" if report.window >= hi else "left")
    med = float(np.median(L))
    ax.axvline(med, color="0.3", linestyle=":", linewidth=1.2)
    ax.text(med, ax.get_ylim()[1] * 0.85, f" median {med:,.0f}", color="0.3", va="top")
    ax.text(0.98, 0.65, f"loss on {report.loss_tokens / report.input_tokens:.1%} of the {report.unit}",
            transform=ax.transAxes, ha="right", va="top", color="0.3", fontsize=9)
    if report.overflow_examples:
        what = {"truncate": "truncated", "drop": "dropped", "split": "split"}[report.overflow]
        ax.text(0.98, 0.75, f"{report.overflow_examples:,} longer than W {what}", transform=ax.transAxes,
                ha="right", va="top", color="#C44E52", fontsize=9)
    ax.set_xlabel(f"example length before the overflow policy ({report.unit}, log scale)")
    ax.set_ylabel("examples")
    ax.set_title(f"{report.examples:,} examples, {report.input_tokens:,} {report.unit}", fontsize=11)
    ax.grid(axis="y", alpha=0.3)


def _plot_fill(ax, report) -> None:
    """Fill per strategy: the bar the overall fill, the line under it the 10th to 90th percentile over rows."""
    strategies = list(report.strategies)[::-1]
    y = np.arange(len(strategies))
    ax.barh(y, [s.fill for s in strategies], color=["#55A868" if s.packed else "#DD8452" for s in strategies],
            height=0.62)
    for yi, s in zip(y, strategies):
        p10, p90 = np.percentile(s.row_fill, [10, 90])
        ax.plot([p10, p90], [yi - 0.36, yi - 0.36], color="0.25", linewidth=1.6, solid_capstyle="butt")
        ax.text(max(s.fill, p90) + 0.015, yi, f"{s.fill:.1%} full · {s.steps:,} steps · attention "
                f"{report.attention_vs_padded(s):.2f}x", va="center", fontsize=9)
    ax.set_yticks(y, [s.label for s in strategies], fontsize=9.5)
    ax.set_xlim(0, 1.72)
    ax.set_xticks(np.linspace(0, 1, 6), [f"{v:.0%}" for v in np.linspace(0, 1, 6)])
    ax.axvline(1.0, color="0.6", linewidth=0.8)
    ax.set_xlabel("fill = real tokens / padded tokens   (line under a bar: 10th to 90th percentile of rows)")
    ax.set_title(f"fill per strategy: orange = batches of {report.batch_size} padded examples,\n"
                 f"green = {report.windows_per_step} packed windows of {report.window:,} per step", fontsize=11)
    ax.grid(axis="x", alpha=0.3)
