"""An index-only plan: which pieces of which source rows make each packed row, and no token.

Packing rewrites every token once per window size and seed. A :class:`PlanIndex` keeps what a plan
needs instead: the source's example lengths and loss counts, a fingerprint of the source, and the plan's
indices (the source row of every piece, the pieces of every packed row, the start of a piece cut from a
longer example). A new window, seed or CP size is :meth:`PlanIndex.replan`: a plan from the lengths, no
token read or written. :class:`packkit.planned.PlannedDataset` reads the rows of a plan from the source
as they are asked for (a map-style dataset the collators take, ``PackedRowsCollator`` among them).

Written by ``packkit pack IN OUT.packplan`` or ``pack_dataset(ds, ..., output="OUT.packplan")``
(:mod:`packkit.outputs`), as one numpy ``.npz`` file (no pickle)::

    meta           JSON: version, window, cp_size, cp_layout, strategy, overflow, seed, shuffle,
                   mask_first_label, columns, source, fingerprint, cut_tokens
    lengths        (N,) int32 (int64 past 2**31 - 1): every source example's length
    loss           (N,) int32: its loss tokens when whole (labels other than -100, its first token masked)
    piece_row      (S,) uint32 (int64 past 2**32 - 1 examples): the source example of every piece, row by row
    row_ptr        (R + 1,) int32 or int64: packed row ``r`` is pieces ``row_ptr[r]:row_ptr[r + 1]``
    cut_piece      (k,) int64: the pieces that are not a whole example (split or truncated) ...
    cut_start      (k,) int64: ... the first token of each inside its example ...
    cut_length     (k,) int64: ... and its length
    overflow_examples, dropped_examples: (k,) int64, as in :class:`packkit.binpack.Plan`

About 13 bytes an example (4 + 4 + 4 and a row pointer per packed row; 24 bytes more per cut piece);
``benchmarks/bench_planindex.py`` measures it and the re-plan time on a million examples.

The fingerprint is a BLAKE2 digest of the lengths, the loss counts and a position-weighted sum of every
example's token ids, so a plan is never applied to another source: :class:`PlannedDataset` refuses a
source whose lengths differ, and (``verify=True``) one whose tokens or labels differ.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from .binpack import Plan, check_seed, check_strategy, check_window
from .cp_plan import plan_for_cp
from .errors import ArgumentError, DataError
from .atomic import atomic_output
from .segments import IGNORE_INDEX, lengths_to_offsets
from .states import StateError, StateFields

__all__ = ["PlanIndex", "write_plan", "example_stats", "fingerprint", "PLAN_VERSION"]

PLAN_VERSION = 1
#: Arrays of a plan file, in the order written.
_ARRAYS = ("lengths", "loss", "piece_row", "row_ptr", "cut_piece", "cut_start", "cut_length", "overflow_examples",
           "dropped_examples")
#: Token ids are weighted by their position (times this odd constant, plus one) before they are summed, so
#: a token moved inside its example changes the sum.
_MIX = np.uint64(0x9E3779B97F4A7C15)


def _small(values: np.ndarray, small, large) -> np.ndarray:
    """``values`` as ``small`` where every value fits it, else as ``large``."""
    values = np.asarray(values)
    info = np.iinfo(small)
    if values.size == 0 or (int(values.max()) <= info.max and int(values.min()) >= info.min):
        return values.astype(small)
    return values.astype(large)


def example_stats(plan: Plan, rows) -> tuple[np.ndarray, np.ndarray]:
    """Per example of ``plan``'s segments: ``(loss (N,) int64, sums (N,) uint64)``, from ``rows``
    (:class:`packkit.packer.PackedColumns` of ``plan`` gathered *without* masking each segment's first label).

    ``loss``: labels other than -100 (without labels: every token), less the example's first token;
    ``sums``: the position-weighted sum of the example's token ids (wrapping, uint64). Adding the results of
    every chunk of a plan gives each example's whole counts, however it was cut into pieces.
    """
    n = plan.num_examples
    seg_off = lengths_to_offsets(rows.seq_lengths)
    labels = rows.columns.get("labels")
    target = np.ones(seg_off[-1], bool) if labels is None else labels != IGNORE_INDEX
    csum = lengths_to_offsets(target)
    seg_loss = csum[seg_off[1:]] - csum[seg_off[:-1]]
    head = (plan.seg_start == 0) & (plan.seg_length > 0)  # the segment holds its example's first token
    seg_loss[head] -= target[seg_off[:-1][head]]
    loss = np.zeros(n, np.int64)
    np.add.at(loss, plan.seg_example, seg_loss)
    seg_of_token = np.repeat(np.arange(plan.seg_example.size), plan.seg_length)
    pos = (np.arange(seg_off[-1], dtype=np.int64) - seg_off[:-1][seg_of_token] + plan.seg_start[seg_of_token] + 1)
    weighted = rows.input_ids.astype(np.int64).view(np.uint64) * (pos.view(np.uint64) * _MIX + np.uint64(1))
    wsum = np.concatenate([[np.uint64(0)], np.cumsum(weighted, dtype=np.uint64)])
    sums = np.zeros(n, np.uint64)
    np.add.at(sums, plan.seg_example, wsum[seg_off[1:]] - wsum[seg_off[:-1]])
    return loss, sums


def fingerprint(lengths: np.ndarray, loss: np.ndarray, sums: np.ndarray) -> str:
    """The source's fingerprint: a BLAKE2b-128 hex digest of its lengths, loss counts and token sums."""
    h = hashlib.blake2b(digest_size=16)
    for part in (np.asarray(lengths, np.int64), np.asarray(loss, np.int64), np.asarray(sums, np.uint64)):
        h.update(np.ascontiguousarray(part).tobytes())
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class PlanIndex:
    """A plan over a source, by index only (module docstring). ``plan`` is the :class:`~packkit.binpack.Plan`
    (rows in their training order), ``loss`` each example's loss tokens when whole, ``options`` how the plan
    was made (``strategy``, ``overflow``, ``seed``, ``shuffle``, ``cp_size``, ``cp_layout``), ``columns`` the
    source columns read (the token column first), ``source`` what the source was (a description),
    ``fingerprint`` the source's (:func:`fingerprint`).
    """

    plan: Plan
    loss: np.ndarray
    options: dict
    columns: tuple
    mask_first_label: bool
    fingerprint: str
    source: str = ""

    @property
    def window(self) -> int:
        return self.plan.window

    @property
    def num_rows(self) -> int:
        return self.plan.num_windows

    def replan(self, *, window: int | None = None, seed: int | None = None, strategy: str | None = None,
               shuffle: bool | None = None, cp_size: int | None = None, cp_layout: str | None = None) -> "PlanIndex":
        """The same source planned again from its lengths (no token read): each argument left as None keeps
        this plan's. The result is the plan ``pack_dataset`` / ``packkit pack`` make with those arguments.
        ``loss`` and ``fingerprint`` describe the source and carry over."""
        o = dict(self.options)
        for key, value in (("seed", seed), ("strategy", strategy), ("shuffle", shuffle), ("cp_size", cp_size),
                           ("cp_layout", cp_layout)):
            if value is not None:
                o[key] = value
        window = self.window if window is None else check_window(window)
        check_strategy(o["strategy"])
        check_seed(o["seed"])
        plan = plan_for_cp(self.plan.lengths, window=window, cp_size=o["cp_size"], cp_layout=o["cp_layout"],
                           strategy=o["strategy"], overflow=o["overflow"], seed=o["seed"])
        if o["shuffle"]:
            plan = plan.shuffled(o["seed"])
        return dataclasses.replace(self, plan=plan, options=o)

    # -- the file -------------------------------------------------------------------------------

    def arrays(self) -> dict:
        """The arrays of the plan file (module docstring), each in its smallest stored type."""
        p = self.plan
        cut = np.flatnonzero((p.seg_start != 0) | (p.seg_length != p.lengths[p.seg_example]))
        return {"lengths": _small(p.lengths, np.int32, np.int64), "loss": _small(self.loss, np.int32, np.int64),
                "piece_row": _small(p.seg_example, np.uint32, np.int64),
                "row_ptr": _small(p.window_ptr, np.int32, np.int64), "cut_piece": cut.astype(np.int64),
                "cut_start": p.seg_start[cut].astype(np.int64), "cut_length": p.seg_length[cut].astype(np.int64),
                "overflow_examples": p.overflow_examples.astype(np.int64),
                "dropped_examples": p.dropped_examples.astype(np.int64)}

    def meta(self) -> dict:
        return {"version": PLAN_VERSION, "window": self.window, **self.options, "mask_first_label": self.mask_first_label,
                "columns": list(self.columns), "source": self.source, "fingerprint": self.fingerprint,
                "cut_tokens": int(self.plan.cut_tokens)}

    def nbytes(self) -> int:
        """Bytes of the arrays a plan file holds (the file adds a few hundred bytes of headers)."""
        return sum(a.nbytes for a in self.arrays().values())

    def save(self, target, *, overwrite: bool = False, inputs=(), overwrite_hint: str | None = None) -> Path:
        """Write the plan file at ``target`` beside it and rename it into place when complete
        (:func:`packkit.fileio.atomic_output`)."""
        arrays = self.arrays()
        with atomic_output(target, kind="file", inputs=inputs, overwrite=overwrite,
                           overwrite_hint=overwrite_hint) as tmp:
            with open(tmp, "wb") as f:
                np.savez(f, meta=np.array(json.dumps(self.meta())), **arrays)
        return Path(target)

    @classmethod
    def load(cls, path) -> "PlanIndex":
        """Read a plan file; every field is checked, and a bad one refused in one line that names it."""
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                data = {k: z[k] for k in z.files}
        except (OSError, ValueError) as exc:
            raise DataError(f"{str(path)!r} is not a packkit plan file ({exc})") from None
        for key in ("meta", *_ARRAYS):
            if key not in data:
                raise DataError(f"{str(path)!r}: a plan file has an array {key!r}; this one has none (written by "
                                "another program, or cut short)")
        try:
            meta = json.loads(str(data["meta"]))
        except ValueError:
            raise DataError(f"{str(path)!r}: the plan's 'meta' is not JSON") from None
        f = StateFields(meta, owner="plan", versions=(PLAN_VERSION,))
        window = f.int("window", low=1)
        options = {"strategy": f.text("strategy"), "overflow": f.text("overflow"), "seed": f.get("seed"),
                   "shuffle": f.get("shuffle"), "cp_size": f.int("cp_size", low=1), "cp_layout": f.text("cp_layout")}
        mask_first_label, columns, source = f.get("mask_first_label"), f.get("columns"), f.text("source")
        digest, cut_tokens = f.text("fingerprint"), f.int("cut_tokens")
        f.done()
        if not isinstance(columns, list) or not columns or not all(isinstance(c, str) for c in columns):
            f.fail("columns", f"must be a list of column names, got {columns!r}")
        plan = _plan_of(path, data, window=window, cut_tokens=cut_tokens, options=options)
        loss = data["loss"].astype(np.int64)
        if loss.shape != plan.lengths.shape or (loss.size and (loss.min() < 0 or (loss > plan.lengths).any())):
            raise StateError(f"plan file {str(path)!r}: 'loss' must hold one count per example, between 0 and its length")
        return cls(plan=plan, loss=loss, options=options, columns=tuple(columns),
                   mask_first_label=bool(mask_first_label), fingerprint=digest, source=source)


def _plan_of(path: Path, data: dict, *, window: int, cut_tokens: int, options: dict) -> Plan:
    """The :class:`~packkit.binpack.Plan` of a plan file's arrays, each checked against the others."""
    def fail(name, why):
        raise StateError(f"plan file {str(path)!r} array {name!r}: {why}")

    for name in _ARRAYS:
        if data[name].ndim != 1 or data[name].dtype.kind not in "iu":
            fail(name, f"must be one-dimensional integers, got {data[name].dtype} of shape {data[name].shape}")
    lengths = data["lengths"].astype(np.int64)
    if lengths.size and lengths.min() < 1:
        fail("lengths", "every example has at least one token")
    seg_example = data["piece_row"].astype(np.int64)
    if seg_example.size and (seg_example.min() < 0 or seg_example.max() >= lengths.size):
        fail("piece_row", f"names an example outside the {lengths.size:,} of the source")
    ptr = data["row_ptr"].astype(np.int64)
    if ptr.size == 0 or ptr[0] != 0 or ptr[-1] != seg_example.size or (np.diff(ptr) < 0).any():
        fail("row_ptr", "must start at 0, never decrease and end at the number of pieces")
    seg_start, seg_length = np.zeros(seg_example.size, np.int64), lengths[seg_example]
    cut = data["cut_piece"].astype(np.int64)
    if cut.shape != data["cut_start"].shape or cut.shape != data["cut_length"].shape:
        fail("cut_piece", "cut_piece, cut_start and cut_length must have one entry per cut piece")
    if cut.size and (cut.min() < 0 or cut.max() >= seg_example.size):
        fail("cut_piece", "names a piece outside the plan")
    seg_start[cut], seg_length[cut] = data["cut_start"], data["cut_length"]
    if seg_length.size and ((seg_start < 0).any() or (seg_length < 0).any() or (seg_length > window).any()
                            or (seg_start + seg_length > lengths[seg_example]).any()):
        fail("cut_length", f"a piece must lie inside its example and hold at most window={window:,} tokens")
    loads = np.add.reduceat(seg_length, ptr[:-1]) if seg_length.size else np.zeros(ptr.size - 1, np.int64)
    if ptr.size > 1 and ((np.diff(ptr) == 0).any() or (loads > window).any()):
        fail("row_ptr", f"every packed row holds at least one piece and at most window={window:,} tokens")
    return Plan(window=window, lengths=lengths, seg_example=seg_example, seg_start=seg_start, seg_length=seg_length,
                window_ptr=ptr, strategy=options["strategy"], overflow=options["overflow"], seed=options["seed"],
                overflow_examples=data["overflow_examples"].astype(np.int64),
                dropped_examples=data["dropped_examples"].astype(np.int64), cut_tokens=cut_tokens)


def write_plan(target, packed, *, max_tokens: int, inputs=(), overwrite: bool = False,
               overwrite_hint: str | None = None, before_save=None) -> Path:
    """Write the index-only plan of a planned source (:class:`packkit.outputs.PackedTable`) at ``target``.

    One pass over the token and loss columns (``max_tokens`` at a time) counts every example's loss tokens
    and sums its tokens for the fingerprint; no token is written. The packed table's ``loss_tokens`` and
    ``loss_free_windows`` are filled as writing the rows would. ``before_save`` runs after that pass.
    """
    if getattr(packed, "groups", None) is not None:
        raise ArgumentError("an index-only plan does not record groups (group_column): write the packed rows")
    if packed.dropped_pieces:
        raise ArgumentError(f"drop_loss_free left {packed.dropped_pieces:,} pieces out, and a plan file is planned "
                            "again from every example's length: write the packed rows, or plan without it")
    loss, sums = packed.example_stats(max_tokens=max_tokens)
    if before_save is not None:
        before_save()
    index = PlanIndex(plan=packed.plan, loss=loss, options=dict(packed.options), columns=tuple(packed.spec.read),
                      mask_first_label=packed.mask_first_label, fingerprint=fingerprint(packed.plan.lengths, loss, sums),
                      source=packed.scan_source)
    return index.save(target, overwrite=overwrite, inputs=inputs, overwrite_hint=overwrite_hint)
