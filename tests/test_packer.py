"""packer: pack_columns / pack_arrays / gather_index against a slow, obvious reference, and bad input.

The reference walks the plan segment by segment and token by token in Python: it is what the
vectorised gathers must reproduce exactly (integer outputs, compared exactly).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from packkit.binpack import pack
from packkit.packer import (MASK_KEYS, check_offsets, first_bad_label, gather_index, label_dtype, loss_labels,
                            pack_arrays, pack_columns)
from packkit.segments import IGNORE_INDEX


def packed_ref(plan, ids, labels, mask, offsets, *, mask_first_label=True):
    """Nested loops: ``(input_ids, labels | None, row_lengths, seq_lengths)`` of every window, as lists."""
    out_ids, out_labels, rows, seqs = [], [], [], []
    for w in range(plan.num_windows):
        row = 0
        for e, s, n in zip(*plan.segments(w)):
            for k in range(n):
                t = offsets[e] + s + k
                out_ids.append(int(ids[t]))
                if labels is not None or mask is not None:
                    lab = int(ids[t]) if labels is None else int(labels[t])
                    if mask is not None and mask[t] == 0:
                        lab = IGNORE_INDEX
                    if k == 0 and mask_first_label:
                        lab = IGNORE_INDEX
                    out_labels.append(lab)
            row += n
            seqs.append(int(n))
        rows.append(row)
    has = labels is not None or mask is not None
    return out_ids, (out_labels if has else None), rows, seqs


W_CASES = [1, 7, 8, 17]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=0, max_size=25),
    window=st.sampled_from(W_CASES),
    overflow=st.sampled_from(["split", "truncate", "drop"]),
    with_labels=st.booleans(),
    with_mask=st.booleans(),
    mask_first_label=st.booleans(),
    seed=st.integers(0, 3),
)
@example(lengths=[], window=1, overflow="split", with_labels=True, with_mask=True, mask_first_label=True, seed=0)
@example(lengths=[40], window=1, overflow="split", with_labels=False, with_mask=True, mask_first_label=False, seed=1)
@example(lengths=[8] * 5, window=8, overflow="drop", with_labels=True, with_mask=False, mask_first_label=True, seed=2)
def test_pack_columns_matches_reference(lengths, window, overflow, with_labels, with_mask, mask_first_label, seed):
    """Tokens, labels (given, from a loss mask, first label masked) and row/segment layout, exactly."""
    rng = np.random.default_rng(seed)
    lengths = np.array(lengths, np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    total = int(offsets[-1])
    ids = rng.integers(0, 1000, total).astype(np.int32)
    labels = np.where(rng.random(total) < 0.3, IGNORE_INDEX, rng.integers(0, 1000, total)) if with_labels else None
    mask = rng.integers(0, 2, total).astype(np.int8) if with_mask else None
    plan = pack(lengths, window=window, overflow=overflow, strategy="bfd").shuffled(seed)
    cols = {"input_ids": (ids, offsets[:-1])}
    if labels is not None:
        cols["labels"] = (labels, offsets[:-1])
    if mask is not None:
        cols["completion_mask"] = (mask, offsets[:-1])
    got = pack_columns(plan, cols, loss_mask="completion_mask" if with_mask else None,
                       mask_first_label=mask_first_label)
    want_ids, want_labels, rows, seqs = packed_ref(plan, ids, labels, mask, offsets,
                                                   mask_first_label=mask_first_label)
    print(f"windows {plan.num_windows}, tokens {len(want_ids)}")
    assert got.columns["input_ids"].tolist() == want_ids
    assert got.columns["input_ids"].dtype == np.int32
    if want_labels is None:
        assert "labels" not in got.columns
    else:
        assert got.columns["labels"].tolist() == want_labels
    assert "completion_mask" not in got.columns
    assert np.diff(got.row_offsets).tolist() == rows
    assert got.seq_lengths.tolist() == seqs
    assert np.diff(got.seq_offsets).tolist() == plan.segments_per_window.tolist()


def test_pack_arrays_rejects_offsets_that_disagree_with_the_plan():
    """Before the fix, pack_arrays/gather_index never compared ``offsets`` with ``plan.lengths``, so a plan made
    from other lengths duplicated or lost tokens in silence: pack([3, 2]) with offsets [0, 2, 5] gave
    [0, 1, 2, 2, 3] (token 2 twice, token 4 lost)."""
    plan = pack([3, 2], window=4)
    with pytest.raises(ValueError, match=r"example 0 has 2 tokens in offsets but 3 in the plan"):
        pack_arrays(plan, np.arange(5), [0, 2, 5])
    with pytest.raises(ValueError, match=r"example 0 has 2 tokens in offsets but 3 in the plan"):
        gather_index(plan, [0, 2, 5])
    with pytest.raises(ValueError, match=r"offsets end at 5 but there are only 4 values"):
        pack_arrays(plan, np.arange(4), [0, 3, 5])
    with pytest.raises(ValueError, match=r"num_examples \+ 1 = 3 entries"):
        pack_arrays(plan, np.arange(5), [0, 5])
    assert pack_arrays(plan, np.arange(5), [0, 3, 5]).input_ids.tolist() == [0, 1, 2, 3, 4]


def test_pack_columns_rejects_examples_outside_their_values():
    """A start past the end of a column's values names the example (no out-of-range copy)."""
    plan = pack([3, 2], window=8)
    with pytest.raises(ValueError, match=r"example 1 of 'labels' \(start 4, 2 tokens\) lies outside its 5"):
        pack_columns(plan, {"input_ids": (np.arange(5), [0, 3]), "labels": (np.arange(5), [0, 4])})
    with pytest.raises(KeyError, match="loss_mask 'completion_mask' is not one of the columns"):
        pack_columns(plan, {"input_ids": (np.arange(5), [0, 3])}, loss_mask="completion_mask")


def test_pack_arrays_labels_stay_int64_and_mask_first_label():
    plan = pack([2, 3], window=8, strategy="next_fit")
    rows = pack_arrays(plan, np.arange(5, dtype=np.int32), [0, 2, 5], np.arange(5, dtype=np.uint8))
    assert rows.labels.dtype == np.int64 and rows.labels.tolist() == [-100, 1, -100, 3, 4]
    assert rows.input_ids.dtype == np.int32


def test_small_label_helpers():
    assert loss_labels([5, 6, 7], mask=[0, 1, 1]).tolist() == [-100, 6, 7]
    assert loss_labels([5, 6, 7], [1, 2, 3], [True, False, True]).tolist() == [1, -100, 3]
    assert loss_labels(np.array([5, 6], np.uint8), mask=[1, 0]).dtype == np.int64  # -100 must fit
    assert label_dtype(np.int32) == np.int32 and label_dtype(np.uint16) == np.int64 and label_dtype(np.int8) == np.int64
    assert first_bad_label([3, -100, -5]) == 2
    assert first_bad_label([3, -100, 0]) is None and first_bad_label(np.zeros(0, np.int64)) is None
    assert check_offsets(pack([3, 2], window=4), [0, 3, 5]).tolist() == [0, 3, 5]


def test_mask_keys_are_the_collators():
    """The offline packers read the same loss-mask columns as the collators (one tuple, not two drifting)."""
    collate = pytest.importorskip("packkit.collate")
    from packkit import rules
    assert MASK_KEYS is collate.MASK_KEYS is rules.MASK_KEYS  # one definition, packkit.rules



@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(1, 40)), max_size=80), st.sampled_from([1, 10**9]),
       st.integers(1, 2))
@example([], 1, 2)  # nothing to copy
@example([(200, 40)] * 3, 1, 1)  # the same segment three times, the last values of the source
def test_copy_segments_strided_groups_and_slices_agree(segs, min_segments, threads):
    """Both ways copy_segments copies (strided length groups, single slices) put every segment at its
    destination; the threshold is forced to send every group one way or the other."""
    from unittest import mock

    import packkit.packer as packer

    values = np.arange(300, dtype=np.int64) * 7
    segs = [(s, min(n, 300 - s)) for s, n in segs]
    lengths = [n for _, n in segs]
    dst = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64) if segs else np.zeros(0, np.int64)
    perm = np.random.default_rng(len(segs)).permutation(len(segs))  # destinations in any order
    out = np.full(sum(lengths) + 3, -1, np.int64)
    with mock.patch.object(packer, "STRIDED_MIN_SEGMENTS", min_segments):
        packer.copy_segments(out, dst[perm], values, np.array([s for s, _ in segs], np.int64)[perm],
                             np.array(lengths, np.int64)[perm], num_threads=threads)
    ref = [t for s, n in segs for t in values[s: s + n].tolist()]
    assert out[: len(ref)].tolist() == ref and (out[len(ref):] == -1).all()
