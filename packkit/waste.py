"""How much padding a batching strategy wastes on your data, and what packing buys.

``packkit waste [FILE]`` (or :func:`measure_waste` on an array of lengths) runs every strategy over
the same example lengths at a batch size and a window ``W``:

============== =================================================================================
``pad_longest`` every example padded to the longest one in the dataset, ``batch_size`` a step
``random``      random batches of ``batch_size``, each padded to its longest example
``grouped``     length-grouped batches (``packkit.sampler.LengthGroupedSampler``), padded to their longest
``bfd``         packed into windows of ``W``, best-fit decreasing over the whole dataset
``shuffle_ff``  packed, first fit in a random order
``next_fit``    packed, next fit in dataset order (concatenate, close the window when full)
``stream``      packed while streaming, best fit inside a buffer of ``buffer_size`` examples
============== =================================================================================

A packed step is ``windows_per_step`` windows (default ``batch_size``: the ``[batch_size, W]`` shape of a
padded step at ``max_length=W``). Examples longer than ``W`` are handled first, alike for every strategy
(``overflow="split"`` by default; the cut tokens are reported). Figures, per strategy: the padding fraction
``1 - real tokens / token slots`` (slots: ``rows x padded length``, or ``windows x W``); rows (padded examples
or windows) and steps per epoch; real tokens per step; and the attention cost against ``pad_longest``'s, varlen
attention costing ``sum L^2`` over a row's segments (``P^2`` for a row padded to ``P``; a window
``sum(segment lengths^2) + (W - load)^2``, its padding tail its own segment)::

      attention vs padded = sum over rows of cost(row) / (num_examples * longest**2)

    >>> r = measure_waste([3, 1, 4, 1, 5, 9, 2, 6], window=10, batch_size=2, strategies=("pad_longest", "bfd"))
    >>> [(s.name, s.rows, round(s.padding_fraction, 3)) for s in r.strategies]
    [('pad_longest', 8, 0.569), ('bfd', 4, 0.225)]
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .costs import CostModel, step_figures
from .binpack import DEFAULT_OVERFLOW, check_overflow, check_window, overflow_note, pack, stream_windows, windows_plan
from .cp_layouts import check_cp_window, cp_multiples
from .epoch import Dealt, Units, deal, packed_units, read_lengths_object, trains_on_nothing
from .errors import ArgumentError, DataError, Message, Where, arg, check_int
from .plots import plot_waste  # the report drawn: its own room, importable here as before
from .progress import progress_bar
from .records import record
from .sampler import batch_sums
from .csr import padded_rows

__all__ = ["WASTE_STRATEGIES", "StrategyWaste", "WasteReport", "measure_waste", "format_table",
           "plot_waste", "preference_waste", "format_preference_waste"]

LABELS = {
    "pad_longest": "pad to dataset's longest",
    "random": "random batches, padded",
    "grouped": "length-grouped batches",
    "bfd": "packed: best fit decreasing",
    "shuffle_ff": "packed: first fit, random order",
    "next_fit": "packed: next fit, in order",
    "stream": "packed: streaming best fit",
}
WASTE_STRATEGIES = tuple(LABELS)
#: Show progress bars from this many examples on.
PROGRESS_EXAMPLES = 200_000


@record
class StrategyWaste:
    """The figures of one strategy over one epoch.

    Fields:
        name, label: strategy key and a readable label; packed: windows of ``W`` (True) or padded batches
        rows, steps: padded examples or windows, and optimiser steps of ``world_size`` ranks, in an epoch
        real_tokens, slot_tokens: tokens of the examples, and of the padded tensors (rows x padded length)
        attention: sum over rows of the attention cost (module docstring)
        row_fill: (rows,) float64, real tokens / padded length of every row (for the plot)
        compute_imbalance, examples_per_step_cv: :class:`~packkit.sampler.EpochStats`' of the schedule packkit's
            sampler deals (:func:`packkit.epoch.deal`) for ``grouped`` and the packed strategies; for ``pad_longest``
            and ``random``, a plain DataLoader's batches, a step's rows in turn (:func:`packkit.costs.step_figures`)
        loss_free_rows, loss_free_steps: rows and steps that hold no loss token (a step of them has loss 0)
    """

    name: str
    label: str
    packed: bool
    rows: int
    steps: int
    real_tokens: int
    slot_tokens: int
    attention: float
    row_fill: np.ndarray = dataclasses.field(repr=False, compare=False)
    compute_imbalance: float = 1.0
    examples_per_step_cv: float = 0.0
    loss_free_rows: int = 0
    loss_free_steps: int = 0

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.real_tokens / self.slot_tokens if self.slot_tokens else 0.0

    @property
    def fill(self) -> float:
        return 1.0 - self.padding_fraction

    @property
    def tokens_per_step(self) -> float:
        return self.real_tokens / self.steps if self.steps else 0.0


@record
class WasteReport:
    """Every strategy's figures over the same lengths, and how those lengths were made.

    ``lengths``: the pieces (examples after the overflow policy) every strategy packed or padded;
    ``input_lengths``, ``examples``, ``input_tokens``: the input; ``cut_tokens``, ``overflow_examples``: what the
    policy did; ``baseline_attention = len(lengths) * max(lengths)**2`` (``pad_longest``'s cost). ``loss_tokens``:
    those that train once packed, each piece's first excluded (:func:`packkit.segments.piece_loss_tokens`, as
    ``packkit plan`` and ``pack`` report), ``loss_tokens_assumed`` with no labels or loss mask (every token but a
    piece's first); ``loss_free_pieces``: pieces with no loss token, ``dropped_pieces`` / ``dropped_tokens`` those
    ``drop_loss_free`` left out.
    """

    source: str
    unit: str
    window: int
    batch_size: int
    windows_per_step: int
    overflow: str
    buffer_size: int
    seed: int
    examples: int
    input_tokens: int
    cut_tokens: int
    overflow_examples: int
    loss_tokens: int
    lengths: np.ndarray = dataclasses.field(repr=False, compare=False)
    input_lengths: np.ndarray = dataclasses.field(repr=False, compare=False)
    strategies: tuple = ()
    world_size: int = 1
    balance: str | None = None
    cp_size: int = 1
    cp_layout: str = "hybrid"
    loss_tokens_assumed: bool = False
    loss_free_pieces: int = 0
    dropped_pieces: int = 0
    dropped_tokens: int = 0

    @property
    def baseline_attention(self) -> float:
        return float(self.lengths.size) * float(self.lengths.max()) ** 2 if self.lengths.size else 0.0

    def attention_vs_padded(self, s: StrategyWaste) -> float:
        return s.attention / self.baseline_attention if self.baseline_attention else 0.0

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("lengths", "input_lengths", "strategies")}
        return {
            **d, "longest_example": int(self.input_lengths.max()),
            "longest_piece": int(self.lengths.max()),
            "strategies": [
                {"name": s.name, "label": s.label, "packed": s.packed, "padding_fraction": round(s.padding_fraction, 6),
                 "rows": s.rows, "steps": s.steps, "tokens_per_step": round(s.tokens_per_step, 2),
                 "real_tokens": s.real_tokens, "slot_tokens": s.slot_tokens,
                 "attention_vs_padded": round(self.attention_vs_padded(s), 6),
                 "compute_imbalance": round(s.compute_imbalance, 6),
                 "examples_per_step_cv": round(s.examples_per_step_cv, 6),
                 "loss_free_rows": s.loss_free_rows, "loss_free_steps": s.loss_free_steps}
                for s in self.strategies
            ],
        }


def loss_free(row_loss: np.ndarray, per_step: int) -> tuple[int, int]:
    """``(rows, steps)`` with no loss token, rows taken ``per_step`` a step in order:
    ``loss_free([0, 3, 0, 0], 2) -> (3, 1)``."""
    row_loss = np.asarray(row_loss)
    if row_loss.size == 0:
        return 0, 0
    steps = np.add.reduceat(row_loss, np.arange(0, row_loss.size, per_step))
    return int((row_loss == 0).sum()), int((steps == 0).sum())


def _figures(name: str, label: str, real: np.ndarray, slots, attention: float, steps: int, stats: tuple,
             free: tuple) -> StrategyWaste:
    """Figures of rows holding ``real`` tokens in ``slots`` (each row's padded length, or the window); ``stats``: the
    steps' ``(compute_imbalance, examples_per_step_cv)``, ``free``: the (rows, steps) that hold no loss token."""
    return StrategyWaste(
        name=name, label=label, packed=name not in ("pad_longest", "random", "grouped"), rows=int(real.size),
        steps=steps, real_tokens=int(real.sum()), slot_tokens=int(np.sum(slots)), attention=attention,
        row_fill=real / slots, compute_imbalance=stats[0], examples_per_step_cv=stats[1], loss_free_rows=free[0],
        loss_free_steps=free[1],
    )


def stream_plan(lengths: np.ndarray, *, window: int, buffer_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(example of every segment, window offsets)`` of :func:`packkit.binpack.stream_windows` over ``lengths``
    in order: ``stream_plan(np.array([3, 4, 2]), window=5, buffer_size=2) -> ([0, 2, 1], [0, 2, 3])``."""
    seg, ptr = [], [0]
    for win in stream_windows(enumerate(lengths.tolist()), window=window, buffer_size=buffer_size):
        seg.extend(win)
        ptr.append(len(seg))
    return np.asarray(seg, np.int64), np.asarray(ptr, np.int64)


def measure_waste(lengths, *, window: int = 2048, batch_size: int = 8, windows_per_step: int | None = None,
                  overflow: str = DEFAULT_OVERFLOW, buffer_size: int = 1000, seed: int = 0,
                  strategies=WASTE_STRATEGIES, progress: bool | None = None, world_size: int = 1,
                  balance: str | None = None, cp_size: int = 1, cp_layout: str = "hybrid",
                  drop_loss_free: bool = False) -> WasteReport:
    """Measure every strategy in ``strategies`` over ``lengths`` (module docstring): a frozen :class:`WasteReport`.

    Args:
        lengths: (num_examples,) ints >= 1, or a lengths object (:class:`packkit.epoch.Lengths`: its source, unit,
            and the exact loss tokens of every piece by ``loss_lengths`` or ``targets``).
        window: ``W``, tokens per packed window (and ``max_length`` of the padded strategies).
        batch_size, windows_per_step: padded examples, and windows (default ``batch_size``), per step.
        overflow: examples longer than ``W``: ``"split"`` (default), ``"truncate"``, ``"drop"``, ``"error"``.
        buffer_size: examples held by the streaming packer.
        seed: random batches, length grouping and first-fit order.
        drop_loss_free: leave out the pieces that hold no loss token (:class:`WasteReport`'s ``dropped_pieces``).
        world_size, balance: data-parallel ranks, each taking a step's rows; the samplers' ``balance``.
        cp_size, cp_layout: context parallelism (:mod:`packkit.cp_plan`): ``"zigzag"`` pads every example to a
            multiple of ``2 * cp_size`` before it is packed or padded (the padding fills window slots); the other
            layouts cut a row in ``cp_size`` pieces (a padded row rounded up to a multiple of ``cp_size``). ``W``
            must be a multiple of what the layout needs.
    """
    data = read_lengths_object(lengths)
    window = check_cp_window(check_window(window), cp_size=cp_size, cp_layout=cp_layout)
    batch_size, buffer_size = check_int(batch_size, "batch_size"), check_int(buffer_size, "buffer_size")
    k = batch_size if windows_per_step is None else check_int(windows_per_step, "windows_per_step")
    strategies = tuple(strategies)
    unknown = [s for s in strategies if s not in WASTE_STRATEGIES]
    if unknown or not strategies:
        raise ArgumentError("unknown strategies {bad}; choose from {choices}", bad=unknown,
                            choices=arg("strategies", ",".join(WASTE_STRATEGIES)))
    doc_multiple, row_multiple = cp_multiples(cp_size=cp_size, cp_layout=cp_layout)
    p = packed_units(data, window=window, overflow=overflow, doc_multiple=doc_multiple, drop_loss_free=drop_loss_free)
    dealing = dict(world_size=check_int(world_size, "world_size"), balance=balance, seed=seed, cp_size=cp_size)
    results = []
    enabled = p.tokens.size >= PROGRESS_EXAMPLES if progress is None else progress
    with progress_bar(total=len(strategies), unit="strategy", enabled=enabled, desc="waste") as bar:
        for name in strategies:
            results.append(_strategy(name, p, window=window, batch_size=batch_size, k=k, buffer_size=buffer_size,
                                     row_round=doc_multiple * row_multiple, dealing=dealing))
            bar.update(1)
    return WasteReport(
        source=data.source, unit=data.unit, window=window, batch_size=batch_size, windows_per_step=k,
        overflow=overflow, buffer_size=buffer_size, seed=seed, examples=int(data.lengths.size),
        input_tokens=int(data.lengths.sum()), cut_tokens=p.cut_tokens, overflow_examples=p.overflow_examples,
        lengths=p.tokens, strategies=tuple(results), loss_tokens=int(p.loss.sum()),
        world_size=dealing["world_size"], balance=balance, cp_size=cp_size, cp_layout=cp_layout,
        input_lengths=data.lengths, loss_tokens_assumed=data.loss_lengths is None and data.targets is None,
        loss_free_pieces=p.free, dropped_pieces=p.dropped, dropped_tokens=p.dropped_tokens,
    )


def _strategy(name: str, p: Units, *, window: int, batch_size: int, k: int, buffer_size: int, row_round: int,
              dealing: dict) -> StrategyWaste:
    """One strategy's figures over the pieces ``p`` (:func:`measure_waste`). A packed strategy's sampler deals
    piece ``piece_of[e]`` as its element ``e``; its windows hold the planned, CP-padded length, the padding a slot,
    not a token."""
    L, planned, R = p.tokens, p.planned, dealing["world_size"]
    if name in ("pad_longest", "random"):  # a plain DataLoader's batches, in order: no packkit sampler deals them
        rng = np.random.default_rng(dealing["seed"])
        order = np.arange(L.size) if name == "pad_longest" else rng.permutation(L.size)
        padded = np.full(L.size, L.max()) if name == "pad_longest" else padded_rows(L, order, batch_size)[0]
        padded = -(-padded // row_round) * row_round  # a padded row is one sequence, cut by the CP layout
        figures = step_figures(CostModel(cp_size=dealing["cp_size"]).costs(padded), np.ones(L.size), ranks=R,
                               per_rank=batch_size)
        return _figures(name, LABELS[name], L[order], padded, float(np.sum(padded.astype(np.float64) ** 2)),
                        math.ceil(L.size / (batch_size * R)), figures, loss_free(p.loss[order], batch_size * R))
    if name == "grouped":  # as a LengthGroupedSampler deals them, each batch padded to its longest
        dealt = Dealt.of(deal(L, per_rank=batch_size, **dealing))
        order, sched = dealt.schedule.flat, dealt.schedule
        padded = -(-np.repeat(sched.longest(L[order]), sched.sizes) // row_round) * row_round
        return _figures(name, LABELS[name], L[order], padded, float(np.sum(padded.astype(np.float64) ** 2)),
                        dealt.steps, (dealt.stats.compute_imbalance, dealt.stats.examples_per_step_cv),
                        dealt.loss_free(p.loss[order], p.loss))
    if name == "stream":
        piece_of, ptr = stream_plan(planned, window=window, buffer_size=buffer_size)
        sampler = deal(windows_plan(planned[piece_of], ptr, window=window, strategy="stream"), per_rank=k, **dealing)
    else:  # bfd, ffd, shuffle_ff, next_fit: element i of the sampler is piece i
        sampler, piece_of = deal(planned, per_rank=k, window=window, strategy=name, **dealing), np.arange(L.size)
    dealt, plan = Dealt.of(sampler), sampler.plan()
    piece = piece_of[plan.seg_example]
    loads, tail = batch_sums(L[piece], plan.window_ptr), window - batch_sums(plan.seg_length, plan.window_ptr)
    attention = float(np.sum(plan.seg_length.astype(np.float64) ** 2) + np.sum(tail.astype(np.float64) ** 2))
    label = f"{LABELS[name]} (buffer {buffer_size:,})" if name == "stream" else LABELS[name]
    return _figures(name, label, loads, np.full(loads.size, window), attention, dealt.steps,
                    (dealt.stats.compute_imbalance, dealt.stats.examples_per_step_cv),
                    dealt.loss_free(batch_sums(p.loss[piece], plan.window_ptr), p.loss[piece_of]))


#: What ``overflow`` may say for preference pairs: a pair is packed whole (the collator refuses a longer one).
PREFERENCE_OVERFLOW = ("drop", "error")


def preference_waste(prompt, chosen, rejected, *, window: int, batch_size: int = 8, seed: int = 0,
                     overflow: str = "drop") -> dict:
    """Tokens computed per pair by each way of batching preference pairs (:mod:`packkit.preference`'s layouts),
    on lengths only. ``prompt``, ``chosen``, ``rejected``: ``(P,)`` token counts (prompt may be 0, completions >= 1).

    ====================  ==========================================================================
    row                   tokens computed
    ====================  ==========================================================================
    ``trl_padded``        TRL's ``DataCollatorForPreference``: ``2 * B * longest`` per batch of
                          ``batch_size`` pairs in a seeded random order
    ``trl_padding_free``  TRL's padding-free layout: each pair as two sequences with their prompt,
                          no padding (``2 * prompt + chosen + rejected``), batches of any length
    ``packkit_pairs``     the same sequences, pairs kept whole in windows of ``window`` (best fit)
    ``packkit_tree``      the prompt once (``prompt + chosen + rejected``), trees in windows
    ====================  ==========================================================================

    Each row: ``tokens`` computed (padding included), ``real`` tokens, ``per_pair`` (tokens / pairs),
    ``real_per_pair`` (the layout's own tokens a pair), ``fill`` (real / tokens); windowed rows also ``windows``,
    ``lower_bound`` (``ceil(real / window)``) and ``dropped`` pairs longer than the window (left out of every row).
    ``preference_waste([3], [2], [4], window=16)["rows"]["packkit_tree"]["per_pair"] -> 16.0``.

    ``overflow``: a pair that does not fit the window whole is left out and counted (``"drop"``), or the error
    naming it (``"error"``, as :class:`packkit.preference.PreferenceCollator` does); a pair is never split or
    truncated (those policies are refused). Every pair left out is an error too: there would be nothing to measure.
    """
    window = check_window(window)
    if overflow not in PREFERENCE_OVERFLOW:
        check_overflow(overflow)
        raise ArgumentError("{got}: a preference pair is packed whole, never split or truncated (the collator refuses "
                            "a longer pair); pass {fix}, or raise {w}", got=arg("overflow", overflow),
                            fix=arg("overflow", *PREFERENCE_OVERFLOW), w=arg("window"))
    p, c, r = (np.asarray(x, np.int64) for x in (prompt, chosen, rejected))
    if not (p.shape == c.shape == r.shape) or p.ndim != 1 or p.size == 0:
        raise ValueError(f"prompt, chosen and rejected need one length each per pair, got shapes {p.shape}, "
                         f"{c.shape}, {r.shape}")
    if (bad := (p < 0) | (c < 1) | (r < 1)).any():
        i = int(np.argmax(bad))
        raise DataError("{i} has a prompt of {p:,} tokens, chosen {c:,} and rejected {r:,}: a pair needs a prompt of "
                        ">= 0 tokens and completions of >= 1 token", i=Where(i), p=int(p[i]), c=int(c[i]), r=int(r[i]))
    pairs_len = 2 * p + c + r
    use = pairs_len <= window  # then each sequence and the tree (prompt once) fit too
    dropped = int((~use).sum())
    if dropped and (overflow == "error" or dropped == use.size):
        i, error = int(np.argmin(use)), overflow == "error"
        raise DataError(("" if error else "every pair is longer than the window ({dropped:,} of them), so none is left "
                         "to measure: ") + "{i} has {n:,} tokens as two sequences with their prompt (prompt {p:,} "
                        "twice, chosen {c:,}, rejected {r:,}) > {window}; raise {w}"
                        + (", or pass {drop} (left out, counted)" if error else ""), dropped=dropped, i=Where(i),
                        n=int(pairs_len[i]), p=int(p[i]), c=int(c[i]), r=int(r[i]), window=arg("window", window),
                        w=arg("window"), drop=arg("overflow", "drop"))
    p, c, r = p[use], c[use], r[use]
    n = p.size  # >= 1: no pair, or no pair that fits, is an error above
    # TRL pads both sequences of every pair of a batch to the batch's longest
    padded, _ = padded_rows(np.maximum(p + c, p + r), np.random.default_rng(seed).permutation(n), batch_size)
    real_pairs, real_tree = int((2 * p + c + r).sum()), int((p + c + r).sum())

    def row(tokens, real, **extra):
        return {"tokens": int(tokens), "real": int(real), "per_pair": tokens / n, "real_per_pair": real / n,
                "fill": real / tokens, **extra}

    rows = {"trl_padded": row(2 * int(padded.sum()), real_pairs), "trl_padding_free": row(real_pairs, real_pairs)}
    seqs = np.stack([p + c, p + r], 1).reshape(-1)
    for name, plan, real in (("packkit_pairs", pack(seqs, window=window, group_sizes=np.full(n, 2)), real_pairs),
                             ("packkit_tree", pack(p + c + r, window=window), real_tree)):
        w = plan.num_windows
        rows[name] = row(w * window, real, windows=w, lower_bound=-(-real // window), dropped=dropped)
    return {"pairs": n, "window": window, "batch_size": batch_size, "dropped": dropped, "rows": rows}


def format_preference_waste(report: dict) -> str:
    """:func:`preference_waste` as a table, one row per way of batching."""
    lines = [f"{report['pairs']:,} pairs, window {report['window']:,}, {report['batch_size']} pairs a padded batch"
             + (f"; {report['dropped']:,} pairs longer than the window left out" if report["dropped"] else ""),
             f"{'layout':<18} {'real/pair':>10} {'tokens/pair':>12} {'fill':>8} {'windows':>9} {'lower bound':>12}"]
    for name, r in report["rows"].items():
        w = f"{r['windows']:>9,} {r['lower_bound']:>12,}" if "windows" in r else f"{'-':>9} {'-':>12}"
        lines.append(f"{name:<18} {r['real_per_pair']:>10.1f} {r['per_pair']:>12.1f} {r['fill']:>8.2%} {w}")
    return "\n".join(lines)


def _percentiles(values, q) -> np.ndarray:
    """``np.percentile(values, q)`` (linear, its default) by the same float operations, without the
    ``np.unique`` inside it, which imports numpy.ma (10 ms of CPU, a twentieth of ``packkit waste``)."""
    a = np.sort(np.asarray(values).ravel())
    if not a.size:
        return np.percentile(values, q)
    v = (a.size - 1) * np.true_divide(q, 100)
    lo = np.floor(v).astype(np.intp)
    hi = np.where(v >= a.size - 1, -1, lo + 1)
    lo[v >= a.size - 1] = -1
    t = v - lo
    prev, diff = a[lo], a[hi] - a[lo]
    out = np.add(prev, diff * t)
    np.subtract(a[hi], diff * (1 - t), out=out, where=t >= 0.5, casting="unsafe", dtype=out.dtype)
    return out


def length_stats(lengths) -> str:
    """``median 145, p90 256, p99 256, longest 256`` of ``lengths``."""
    q = _percentiles(lengths, [50, 90, 99]).astype(int).tolist()
    return f"median {q[0]:,}, p90 {q[1]:,}, p99 {q[2]:,}, longest {int(np.max(lengths)):,}"


def format_table(report: WasteReport, *, options=None) -> str:
    """The terminal table of a report, with the formulas under it (``options``: ``packkit.errors.Arg.render``'s,
    to name arguments in the command line's syntax)."""
    u, before = report.unit, report.input_lengths
    lines = [f"packkit waste: {report.source}",
             f"{report.examples:,} examples, {report.input_tokens:,} {u}; {length_stats(before)} (examples as given)"]
    if report.lengths.size != before.size or report.cut_tokens or report.dropped_pieces:
        lines.append(Message("{n:,} pieces after {overflow}: ", n=report.lengths.size,
                             overflow=arg("overflow", report.overflow)).render(options) + length_stats(report.lengths))
    lines.append(f"window W={report.window:,}; a step is {report.batch_size} padded examples or "
                 f"{report.windows_per_step} packed windows"
                 + (f" on each of {report.world_size} ranks" if report.world_size > 1 else ""))
    how = ("no labels or loss mask: every token but each piece's first" if report.loss_tokens_assumed
           else "labels or a loss mask, the first token of each piece excluded, as packed")
    lines.append(f"loss tokens {report.loss_tokens:,} ({report.loss_tokens / report.input_tokens:.1%} of the {u}; "
                 f"{how})")
    note = overflow_note(report.overflow, over=report.overflow_examples, examples=report.examples,
                         cut=report.cut_tokens, tokens=report.input_tokens, unit=u)
    if note is not None:
        lines.append(note.render(options))
    # the rows without a loss token of bfd (what packkit pack writes), else of the first strategy that has some
    s = min(report.strategies, key=lambda s: (not s.loss_free_rows, s.name != "bfd"))
    free = 0 if report.loss_tokens_assumed else report.loss_free_pieces
    lines.extend(m.render(options) for m in trains_on_nothing(
        dropped=(report.dropped_pieces, report.dropped_tokens), pieces=(free, report.lengths.size), unit=u,
        rows=(s.loss_free_rows, s.rows), steps=(s.loss_free_steps, s.steps), what="windows" if s.packed else "rows",
        label=s.label, window=s.packed))
    if report.cp_size > 1:
        doc_multiple, row_multiple = cp_multiples(cp_size=report.cp_size, cp_layout=report.cp_layout)
        if doc_multiple > 1:
            extra = int((-report.lengths % doc_multiple).sum())
            lines.append(f"context parallel, cp={report.cp_size} {report.cp_layout}: every example padded to a "
                         f"multiple of {doc_multiple} ({extra:,} {u}, {extra / report.lengths.sum():.2%}), counted as "
                         f"padding")
        else:
            lines.append(f"context parallel, cp={report.cp_size} {report.cp_layout}: rows cut in {row_multiple} "
                         f"pieces (padded rows rounded up to a multiple of {row_multiple}; windows of W need none)")
    lines.append("")
    head = ("strategy", "padding", "rows/epoch", "steps/epoch", f"{u}/step", "attention vs padded",
            "imbalance", "examples/step cv")
    rows = [(s.label, f"{s.padding_fraction:.1%}", f"{s.rows:,}", f"{s.steps:,}", f"{s.tokens_per_step:,.0f}",
             f"{report.attention_vs_padded(s):.3f}", f"{s.compute_imbalance:.3f}", f"{s.examples_per_step_cv:.2f}")
            for s in report.strategies]
    widths = [max(len(head[i]), *(len(r[i]) for r in rows)) for i in range(len(head))]
    fmt = "  ".join(["{:<%d}" % widths[0]] + ["{:>%d}" % w for w in widths[1:]])
    lines += [
        fmt.format(*head), "  ".join("-" * w for w in widths), *(fmt.format(*r) for r in rows), "",
        "padding = 1 - real / (rows x padded length); packed rows are windows of W.",
        "attention vs padded = sum over rows of cost / (examples x longest^2), where a padded row costs "
        "P^2 and a packed window sum(L_i^2) + (W - load)^2 (varlen attention).",
        f"imbalance = sum over steps of the slowest of {report.world_size} rank(s) / sum of the mean rank, a "
        f"document costing 24576 L + L^2{f' / {report.cp_size}' if report.cp_size > 1 else ''}, in the steps "
        f"packkit's sampler deals (balance {report.balance or 'none'}; random batches: a plain DataLoader's); "
        "examples/step cv = std / mean of the examples a step holds over all ranks (full steps).",
    ]
    if u == "bytes":
        lines.append("lengths are UTF-8 bytes (byte-level tokenizer); pass --tokenizer tokenizer.json "
                     "for a model's token counts.")
    return "\n".join(lines)
