"""The packed rows of an index-only plan, read from the source as they are asked for.

:class:`PlannedDataset` is a map-style dataset: ``pd[r]`` is packed row ``r`` of a
:class:`~packkit.planindex.PlanIndex` (``input_ids``, ``labels``, ``seq_lengths`` as numpy arrays, the
rows ``pack_dataset`` writes), gathered from the source's memory-mapped columns; a DataLoader hands its
rows to :class:`packkit.collate.PackedRowsCollator` as it would rows packed offline::

    from torch.utils.data import DataLoader
    from packkit.collate import PackedRowsCollator
    from packkit.planned import PlannedDataset

    rows = PlannedDataset("train.packplan", ds)                  # ds: the datasets.Dataset planned
    loader = DataLoader(rows, batch_size=8, collate_fn=PackedRowsCollator(window=rows.window))
    rows = rows.replan(window=4096, seed=1)                      # from the lengths: no token rewritten

Opening reads the source's list offsets (and, with ``verify``, its tokens once) to check that the source
is the one planned: a source whose fingerprint differs is refused in one line.
"""

from __future__ import annotations

import numpy as np

from .errors import DataError
from .offline import PackedTable, plan_source
from .outputs import FORMATS
from .planindex import PlanIndex, fingerprint
from .sources import ArrowSource

__all__ = ["PlannedDataset"]


class PlannedDataset:
    """The rows of an index-only plan over ``data`` (module docstring).

    Args:
        plan: a :class:`~packkit.planindex.PlanIndex` or the path of a plan file.
        data: the source it was planned over: a ``datasets.Dataset`` or a pyarrow ``Table``.
        verify: also compare the source's tokens and loss counts with the plan's fingerprint (one pass over
            the tokens); without it only the lengths are compared.
    """

    def __init__(self, plan, data, *, verify: bool = True):
        self.index = plan if isinstance(plan, PlanIndex) else PlanIndex.load(plan)
        self._data, self._verify = data, verify
        source = (ArrowSource.from_table(data) if type(data).__name__ == "Table"
                  else ArrowSource.from_dataset(data))
        # the source scanned and checked as pack_dataset does; the plan made there is replaced by the index's
        scanned = plan_source(source, window=max(self.index.window, int(self.index.plan.lengths.max(initial=1))),
                              strategy="next_fit", overflow="split", columns=list(self.index.columns), shuffle=False,
                              mask_first_label=self.index.mask_first_label, progress=False, who="PlannedDataset")
        self._check(scanned, verify)
        self._planned(PackedTable(scanned.scan, scanned.spec, self.index.plan,
                                  mask_first_label=self.index.mask_first_label, example_ids=False))

    def _planned(self, table: PackedTable) -> None:
        """Read rows through ``table``; where the plan splits examples, the loss tokens of each piece's whole
        example (:meth:`PackedTable._whole_loss`: a pass over the pieces' loss columns), for the rows."""
        self._table, self._whole = table, table._whole_loss(table.chunk_tokens(None))

    def _check(self, scanned: PackedTable, verify: bool) -> None:
        lengths, want = scanned.plan.lengths, self.index.plan.lengths
        if lengths.shape != want.shape or not np.array_equal(lengths, want):
            n = min(lengths.size, want.size)
            diff = np.flatnonzero(lengths[:n] != want[:n])
            where = (f"example {int(diff[0])} has {int(lengths[diff[0]]):,} tokens, the plan says {int(want[diff[0]]):,}"
                     if diff.size else f"it has {lengths.size:,} examples, the plan {want.size:,}")
            plan = FORMATS["plan"].suffixes[0]
            raise DataError(f"the source is not the one planned ({where}); plan it again (packkit pack IN "
                            f"OUT{plan}, or pack_dataset(ds, output='OUT{plan}'))")
        if verify:
            loss, sums = scanned.example_stats(max_tokens=scanned.chunk_tokens(None))
            if fingerprint(lengths, loss, sums) != self.index.fingerprint:
                raise DataError(f"the source's tokens or labels are not those planned (fingerprint "
                                f"{fingerprint(lengths, loss, sums)} != {self.index.fingerprint}); plan it again")

    @property
    def window(self) -> int:
        return self.index.window

    def __len__(self) -> int:
        return self.index.num_rows

    def replan(self, **options) -> "PlannedDataset":
        """The same source under :meth:`PlanIndex.replan` (``window=``, ``seed=``, ...): no token read."""
        out = object.__new__(PlannedDataset)
        out.index, out._data, out._verify = self.index.replan(**options), self._data, self._verify
        t = self._table
        out._planned(PackedTable(t.scan, t.spec, out.index.plan, mask_first_label=t.mask_first_label, example_ids=False))
        return out

    def __getitems__(self, indices) -> list:
        """Rows ``indices`` gathered in one pass: a list of dicts of numpy arrays. Where the plan splits examples,
        each row records its documents' examples as ``pack_dataset`` writes them (``example_ids``,
        ``piece_offsets``, ``example_loss``: :func:`packkit.outputs.packed_schema`)."""
        indices = np.asarray(indices, np.int64)
        plan = self.index.plan.select(indices, allow_repeats=True)
        rows = self._table._rows(plan, self._table.scan.columns)
        if self._whole is not None:
            ptr = self.index.plan.window_ptr
            seg = [np.arange(ptr[r], ptr[r + 1]) for r in indices.tolist()]
            whole = self._whole[np.concatenate(seg) if seg else np.zeros(0, np.int64)]
            loss = np.where(whole >= 0, whole, self._table.segment_loss(rows)).astype(np.int32)
            docs = {"example_ids": plan.seg_example, "piece_offsets": plan.seg_start.astype(np.int32), "example_loss": loss}
        out = []
        for r in range(rows.num_rows):
            a, b = rows.row_offsets[r], rows.row_offsets[r + 1]
            row = {name: values[a:b] for name, values in rows.columns.items()}
            s, e = rows.seq_offsets[r], rows.seq_offsets[r + 1]
            row["seq_lengths"] = rows.seq_lengths[s:e]
            if self._whole is not None:
                row.update({k: v[s:e] for k, v in docs.items()})
            out.append(row)
        return out

    def __getitem__(self, i: int) -> dict:
        n = len(self)
        if not -n <= int(i) < n:
            raise IndexError(f"row {i} is outside a plan of {n:,} rows")
        return self.__getitems__([int(i) % n])[0]

    def __getstate__(self):
        return {"plan": self.index, "data": self._data, "verify": False}  # a worker rebuilds its views

    def __setstate__(self, state):
        self.__init__(state["plan"], state["data"], verify=state["verify"])

    def __repr__(self) -> str:
        return f"PlannedDataset({len(self):,} rows of window {self.window:,} over {self.index.plan.num_examples:,} examples)"
