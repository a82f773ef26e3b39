"""Collators against slow, obvious references (nested Python loops) and the invariants of DESIGN.md."""

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from packkit.collate import FixedWindowCollator, PackedRowsCollator, PaddedCollator, PaddingFreeCollator

PAD = 10**9  # a pad id no real token has, so real tokens can be told apart


# ----------------------------------------------------------------------------------------------
# slow references and checks
# ----------------------------------------------------------------------------------------------


def make_examples(lengths, *, kind="list", labels="none", seed=0):
    """Token ids ``offset + position`` (unique, so every token's origin is known); labels
    ``-100`` on a random prompt prefix, or a completion mask, or none."""
    rng = np.random.default_rng(seed)
    out, start = [], 0
    for n in lengths:
        ids = np.arange(start, start + n, dtype=np.int64)
        start += n
        ex = {"input_ids": ids}
        prompt = int(rng.integers(0, n + 1))
        if labels == "labels":
            lab = ids.copy()
            lab[:prompt] = -100
            ex["labels"] = lab
        elif labels == "mask":
            ex["completion_mask"] = (np.arange(n) >= prompt).astype(np.int64)
        out.append({k: convert(v, kind) for k, v in ex.items()})
    return out


def convert(a, kind):
    return {"list": a.tolist, "numpy": lambda: a, "tensor": lambda: torch.from_numpy(a),
            "int32": lambda: a.astype(np.int32)}[kind]()


def ref_labels(ex):
    """The labels an example should carry before first-label masking (nested loop)."""
    ids = list(np.asarray(ex["input_ids"]).tolist())
    if "labels" in ex:
        return list(np.asarray(ex["labels"]).tolist())
    if "completion_mask" in ex:
        mask = list(np.asarray(ex["completion_mask"]).tolist())
        return [t if m else -100 for t, m in zip(ids, mask)]
    return ids


def ref_padding_free(examples):
    ids, pos, labels, seq, cu = [], [], [], [], [0]
    for s, ex in enumerate(examples):
        toks = list(np.asarray(ex["input_ids"]).tolist())
        lab = ref_labels(ex)
        for j, t in enumerate(toks):
            ids.append(t)
            pos.append(j)
            labels.append(-100 if j == 0 else lab[j])
            seq.append(s)
        cu.append(cu[-1] + len(toks))
    return ids, pos, labels, seq, cu


def check_consistency(batch):
    """Invariant 3: cu_seqlens, position_ids, seq_idx and max_seqlen describe the same segments;
    dtypes and shapes as in the output conventions."""
    assert batch.input_ids.dtype == torch.int64 and batch.labels.dtype == torch.int64
    assert batch.position_ids.dtype == torch.int64 and batch.seq_idx.dtype == torch.int32
    assert batch.cu_seqlens.dtype == torch.int32 and batch.cu_seqlens.ndim == 1
    assert isinstance(batch.max_seqlen, int) and isinstance(batch.num_loss_tokens, int)
    shape = batch.input_ids.shape
    assert batch.labels.shape == batch.position_ids.shape == batch.seq_idx.shape == shape
    cu = batch.cu_seqlens.tolist()
    pos = batch.position_ids.reshape(-1).tolist()
    seq = batch.seq_idx.reshape(-1).tolist()
    assert cu[0] == 0 and cu[-1] == len(pos)
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    assert all(n >= 0 for n in lengths)
    width = shape[1]
    for s, (a, b) in enumerate(zip(cu, cu[1:])):
        for t in range(a, b):
            assert pos[t] == t - a and seq[t] == s
        if b > a:  # a segment never crosses a row
            assert a // width == (b - 1) // width
    assert batch.max_seqlen >= max(lengths)
    assert batch.num_loss_tokens == int((batch.labels != -100).sum())
    # invariant 5: a loss term (label at t, predicted from token t - 1) never crosses a segment
    flat_labels = batch.labels.reshape(-1).tolist()
    for t, lab in enumerate(flat_labels):
        if lab != -100:
            assert t % width != 0 and seq[t - 1] == seq[t]


def check_windows(batch, examples, window, *, num_windows=None, overflow="error"):
    """Invariants 1 and 2 for [B, W] batches of unique token ids: every token exactly once, in
    segments of consecutive tokens that start at an example start (or a split piece)."""
    B, W = batch.input_ids.shape
    assert W == window
    if num_windows is not None:
        assert B == num_windows
    ids = batch.input_ids.reshape(-1).tolist()
    labels = batch.labels.reshape(-1).tolist()
    real = [t for t in ids if t != PAD]
    lengths = [len(ex["input_ids"]) for ex in examples]
    starts = np.concatenate(([0], np.cumsum(lengths)))
    if overflow == "truncate":
        expect = [t for s, n in zip(starts, lengths) for t in range(s, s + min(n, window))]
    elif overflow == "drop":
        expect = [t for s, n in zip(starts, lengths) if n <= window for t in range(s, s + n)]
    else:
        expect = list(range(int(starts[-1])))
    assert sorted(real) == expect
    all_labels = {}
    for ex in examples:
        for t, lab in zip(np.asarray(ex["input_ids"]).tolist(), ref_labels(ex)):
            all_labels[t] = lab
    cu = batch.cu_seqlens.tolist()
    for a, b in zip(cu, cu[1:]):
        seg = ids[a:b]
        if not seg:
            continue
        if seg[0] == PAD:  # a padding tail: pad ids, no loss, reaches the end of its row
            assert set(seg) == {PAD} and all(lab == -100 for lab in labels[a:b]) and b % W == 0
            continue
        assert seg == list(range(seg[0], seg[0] + len(seg)))
        ex = int(np.searchsorted(starts, seg[0], side="right") - 1)
        offset = seg[0] - starts[ex]
        assert offset % window == 0 and (offset == 0 or overflow == "split")
        assert labels[a] == -100
        for t in range(a + 1, b):
            assert labels[t] == all_labels[ids[t]]


# ----------------------------------------------------------------------------------------------
# padding-free
# ----------------------------------------------------------------------------------------------

lengths_st = st.lists(st.integers(1, 40), min_size=1, max_size=12)
kinds = st.sampled_from(["list", "numpy", "tensor", "int32"])
label_kinds = st.sampled_from(["none", "labels", "mask"])


@given(lengths=lengths_st, kind=kinds, labels=label_kinds)
@example(lengths=[1], kind="list", labels="none")  # one one-token example: no loss token at all
@example(lengths=[1] * 12, kind="tensor", labels="mask")
@example(lengths=[40], kind="int32", labels="labels")
def test_padding_free_matches_reference(lengths, kind, labels):
    examples = make_examples(lengths, kind=kind, labels=labels)
    batch = PaddingFreeCollator()(examples)
    ids, pos, lab, seq, cu = ref_padding_free(examples)
    assert batch.input_ids.shape == (1, sum(lengths))
    assert batch.input_ids[0].tolist() == ids
    assert batch.position_ids[0].tolist() == pos
    assert batch.labels[0].tolist() == lab
    assert batch.seq_idx[0].tolist() == seq
    assert batch.cu_seqlens.tolist() == cu
    assert batch.max_seqlen == max(lengths)
    assert batch.num_loss_tokens == sum(t != -100 for t in lab)
    check_consistency(batch)


def test_padding_free_docstring_example():
    batch = PaddingFreeCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert batch.labels.tolist() == [[-100, 6, 7, -100, 9]]
    assert batch.cu_seqlens.tolist() == [0, 3, 5] and batch.max_seqlen == 3


def test_mixed_input_kinds_in_one_batch():
    examples = [{"input_ids": [1, 2], "labels": np.array([1, 2])},
                {"input_ids": torch.tensor([3, 4, 5]), "labels": [3, -100, 5]},
                {"input_ids": np.array([6], np.int32), "labels": torch.tensor([6])}]
    batch = PaddingFreeCollator()(examples)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6]]
    assert batch.labels.tolist() == [[-100, 2, -100, -100, 5, -100]]
    assert batch.num_loss_tokens == 2


def test_pre_shifted_labels_are_used_as_given():
    examples = [{"input_ids": [5, 6, 7], "labels": [6, 7, -100]}, {"input_ids": [8, 9], "labels": [9, -100]}]
    batch = PaddingFreeCollator(mask_first_label=False)(examples)
    assert batch.labels.tolist() == [[6, 7, -100, 9, -100]] and batch.num_loss_tokens == 3
    with pytest.raises(ValueError, match="example 0 has no 'labels'.*pre-shifted"):
        PaddingFreeCollator(mask_first_label=False)([{"input_ids": [1, 2]}])


def test_assistant_masks_and_bool_masks():
    examples = [{"input_ids": [5, 6, 7, 8], "assistant_masks": [0, 0, 1, 1]},
                {"input_ids": [9, 10], "assistant_masks": np.array([True, True])}]
    batch = PaddingFreeCollator()(examples)
    assert batch.labels.tolist() == [[-100, -100, 7, 8, -100, 10]]


# ----------------------------------------------------------------------------------------------
# fixed windows
# ----------------------------------------------------------------------------------------------


@given(data=st.data(), window=st.sampled_from([1, 2, 7, 16, 17, 33]), kind=kinds, labels=label_kinds,
       strategy=st.sampled_from(["bfd", "ffd", "shuffle_ff", "next_fit"]))
def test_fixed_window_invariants(data, window, kind, labels, strategy):
    lengths = data.draw(st.lists(st.sampled_from([1, 2, 3, window - 1, window, 5, 11]).filter(
        lambda n: 1 <= n <= window), min_size=1, max_size=10))
    examples = make_examples(lengths, kind=kind, labels=labels)
    batch = FixedWindowCollator(window=window, strategy=strategy, pad_token_id=PAD)(examples)
    check_windows(batch, examples, window)
    check_consistency(batch)
    assert batch.max_seqlen == int(torch.diff(batch.cu_seqlens).max())
    assert batch.input_ids.shape[0] >= -(-sum(lengths) // window)


@given(lengths=st.lists(st.integers(1, 50), min_size=1, max_size=8), window=st.sampled_from([7, 16, 17]),
       overflow=st.sampled_from(["split", "truncate", "drop"]), labels=label_kinds)
@example(lengths=[50, 50], window=7, overflow="drop", labels="labels")  # everything dropped: refused
@example(lengths=[50], window=17, overflow="split", labels="mask")  # 2W + 16: three pieces
@example(lengths=[7, 8, 1], window=7, overflow="truncate", labels="none")
@example(lengths=[16] * 8, window=16, overflow="split", labels="labels")  # all equal to the window
def test_fixed_window_overflow_policies(lengths, window, overflow, labels):
    """Examples up to three times the window: split pieces reassemble, truncate/drop are counted."""
    examples = make_examples(lengths, labels=labels)
    collator = FixedWindowCollator(window=window, overflow=overflow, pad_token_id=PAD)
    if overflow == "drop" and all(n > window for n in lengths):
        with pytest.raises(ValueError, match="dropped all"):  # no empty batch is invented
            collator(examples)
        return
    batch = collator(examples)
    check_windows(batch, examples, window, overflow=overflow)
    check_consistency(batch)
    cut = sum(max(n - window, 0) for n in lengths) if overflow == "truncate" else \
        sum(n for n in lengths if n > window) if overflow == "drop" else 0
    assert collator.cut_tokens == cut


def test_fixed_window_example_over_window_names_it():
    with pytest.raises(ValueError, match=r"example 2 has 9 tokens > window=8.*overflow='split'"):
        FixedWindowCollator(window=8)(make_examples([3, 4, 9]))


@given(batches=st.lists(st.lists(st.integers(1, 16), min_size=1, max_size=6), min_size=2, max_size=5),
       labels=label_kinds)
@settings(max_examples=30)
@example(batches=[[16] * 6, [1]], labels="none")  # every window full, then one token
@example(batches=[[1] * 6, [1] * 6], labels="mask")
def test_static_shapes_are_constant(batches, labels):
    """Invariant: with static_shape, every tensor has one shape and max_seqlen = W, whatever the batch."""
    window, num_windows, max_segments = 16, 6, 40
    collator = FixedWindowCollator(window=window, num_windows=num_windows, static_shape=True,
                                   max_segments=max_segments, pad_token_id=PAD)
    shapes = set()
    for lengths in batches:
        examples = make_examples(lengths, labels=labels)
        batch = collator(examples)
        shapes.add((tuple(batch.input_ids.shape), tuple(batch.labels.shape), tuple(batch.position_ids.shape),
                    tuple(batch.seq_idx.shape), tuple(batch.cu_seqlens.shape), batch.max_seqlen))
        check_windows(batch, examples, window, num_windows=num_windows)
        check_consistency(batch)
        cu = batch.cu_seqlens.tolist()
        real = [b for a, b in zip(cu, cu[1:]) if b > a]
        assert cu[len(real) + 1:] == [cu[-1]] * (len(cu) - len(real) - 1)  # padded by repeating the end
    assert shapes == {((num_windows, window),) * 4 + ((max_segments + 1,), window)}


def test_static_shape_errors_name_the_fix():
    with pytest.raises(ValueError, match="static_shape=True needs num_windows"):
        FixedWindowCollator(window=8, static_shape=True)
    collator = FixedWindowCollator(window=4, num_windows=1)
    with pytest.raises(ValueError, match="needs 2 windows of 4 tokens > num_windows=1"):
        collator(make_examples([3, 3]))
    collator = FixedWindowCollator(window=4, num_windows=2, static_shape=True, max_segments=3)
    with pytest.raises(ValueError, match="5 segments .padding tails included. > max_segments=3"):
        collator(make_examples([1, 1, 1, 1]))


def test_next_fit_rebuilds_at_most_k_windows_in_order():
    """The indices of k windows formed upstream (each <= W), concatenated, give at most k windows."""
    window = 10
    groups = [[6, 4], [9], [3, 3, 3], [10]]
    examples = make_examples([n for g in groups for n in g])
    batch = FixedWindowCollator(window=window, strategy="next_fit", num_windows=len(groups), pad_token_id=PAD)(
        examples)
    check_windows(batch, examples, window, num_windows=len(groups))
    real = [t for t in batch.input_ids.reshape(-1).tolist() if t != PAD]
    assert real == sorted(real)  # the given order is kept


# ----------------------------------------------------------------------------------------------
# packed rows (offline packing)
# ----------------------------------------------------------------------------------------------


@given(data=st.data(), use_positions=st.booleans(), with_labels=st.booleans())
def test_packed_rows_from_offline_packing(data, use_positions, with_labels):
    """Rows built with binpack.pack + packer.pack_arrays (what pack_dataset writes) collate back exactly."""
    from packkit.binpack import pack
    from packkit.packer import pack_arrays

    window = data.draw(st.sampled_from([5, 8, 13]))
    lengths = data.draw(st.lists(st.integers(1, window), min_size=1, max_size=12))
    examples = make_examples(lengths, labels="labels")
    flat_ids = np.concatenate([e["input_ids"] for e in examples]) if examples else np.zeros(0)
    flat_labels = np.concatenate([np.asarray(e["labels"]) for e in examples])
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    plan = pack(lengths, window=window)
    rows_arr = pack_arrays(plan, flat_ids, offsets, flat_labels)
    rows = []
    for r in range(rows_arr.num_rows):
        a, b = rows_arr.row_offsets[r], rows_arr.row_offsets[r + 1]
        seg = rows_arr.seq_lengths[rows_arr.seq_offsets[r]:rows_arr.seq_offsets[r + 1]]
        row = {"input_ids": rows_arr.input_ids[a:b].tolist()}
        if with_labels:
            row["labels"] = rows_arr.labels[a:b].tolist()
        if use_positions:
            row["position_ids"] = [p for n in seg.tolist() for p in range(n)]
        else:
            row["seq_lengths"] = seg.tolist()
        rows.append(row)
    batch = PackedRowsCollator(window=window, pad_token_id=PAD)(rows)
    check_consistency(batch)
    if with_labels:
        check_windows(batch, examples, window)
    ids = batch.input_ids.tolist()
    for r, row in enumerate(rows):
        n = len(row["input_ids"])
        assert ids[r][:n] == row["input_ids"] and set(ids[r][n:]) <= {PAD}
    cu = batch.cu_seqlens.tolist()
    real_lengths = [b - a for a, b in zip(cu, cu[1:]) if batch.input_ids.reshape(-1)[a] != PAD]
    assert real_lengths == rows_arr.seq_lengths.tolist()


def test_packed_rows_docstring_example_and_errors():
    batch = PackedRowsCollator(window=4)([{"input_ids": [5, 6, 7], "seq_lengths": [2, 1]}])
    assert batch.input_ids.tolist() == [[5, 6, 7, 0]] and batch.position_ids.tolist() == [[0, 1, 0, 0]]
    assert batch.cu_seqlens.tolist() == [0, 2, 3, 4] and batch.labels.tolist() == [[-100, 6, -100, -100]]
    collator = PackedRowsCollator(window=4)
    with pytest.raises(ValueError, match="example 1 has seq_lengths summing to 2 for 3"):
        collator([{"input_ids": [1], "seq_lengths": [1]}, {"input_ids": [1, 2, 3], "seq_lengths": [1, 1]}])
    with pytest.raises(ValueError, match="example 1 is a packed row of 5 tokens > window=4"):
        collator([{"input_ids": [1], "seq_lengths": [1]}, {"input_ids": [1] * 5, "seq_lengths": [5]}])
    with pytest.raises(ValueError, match="example 0 has position_ids that neither restart"):
        collator([{"input_ids": [1, 2, 3], "position_ids": [0, 2, 3]}])
    with pytest.raises(ValueError, match="example 0 has no 'seq_lengths' or 'position_ids'; .*remove_unused_columns=False"):
        collator([{"input_ids": [1, 2, 3]}])


# ----------------------------------------------------------------------------------------------
# padded fallback
# ----------------------------------------------------------------------------------------------


@given(lengths=lengths_st, multiple=st.sampled_from([None, 1, 8, 13]), labels=label_kinds, kind=kinds)
@example(lengths=[1], multiple=None, labels="none", kind="list")
@example(lengths=[1, 1], multiple=13, labels="mask", kind="numpy")
@example(lengths=[8] * 3, multiple=8, labels="labels", kind="tensor")  # all equal, a multiple already
def test_padded_matches_reference(lengths, multiple, labels, kind):
    examples = make_examples(lengths, kind=kind, labels=labels)
    batch = PaddedCollator(pad_token_id=PAD, pad_to_multiple_of=multiple)(examples)
    width = max(lengths) if multiple is None else -(-max(lengths) // multiple) * multiple
    assert batch.input_ids.shape == (len(lengths), width)
    for r, ex in enumerate(examples):
        n = len(ex["input_ids"])
        toks = np.asarray(ex["input_ids"]).tolist()
        lab = ref_labels(ex)
        assert batch.input_ids[r].tolist() == toks + [PAD] * (width - n)
        assert batch.labels[r].tolist() == [-100] + lab[1:] + [-100] * (width - n)
        assert batch.attention_mask[r].tolist() == [1] * n + [0] * (width - n)
        assert batch.position_ids[r].tolist() == list(range(n)) + list(range(width - n))
    check_consistency(batch)
    assert "attention_mask" in batch.hf_kwargs() and "cu_seq_lens_q" not in batch.hf_kwargs()


def test_padded_without_mask_is_a_packed_view():
    batch = PaddedCollator(return_attention_mask=False)([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}])
    assert batch.attention_mask is None and batch.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert "attention_mask" not in batch.hf_kwargs() and "cu_seq_lens_q" in batch.hf_kwargs()


# ----------------------------------------------------------------------------------------------
# bad input: errors name the example index and the fix
# ----------------------------------------------------------------------------------------------

ALL = [PaddingFreeCollator(), FixedWindowCollator(window=64), PaddedCollator()]


@pytest.mark.parametrize("collator", ALL, ids=lambda c: type(c).__name__)
@pytest.mark.parametrize("examples, error, match", [
    ([{"input_ids": [1, 2]}, {"input_ids": []}], ValueError, "example 1 is empty"),
    ([{"input_ids": [1, 2]}, {"input_ids": np.zeros(0, np.int64)}], ValueError, "example 1 is empty"),
    ([{"input_ids": [1]}, {"input_ids": [2]}, {"text": "hi"}], ValueError, "example 2 has no 'input_ids'"),
    ([{"input_ids": [1], "labels": [1]}, {"input_ids": [1, 2], "labels": [1]}], ValueError,
     r"example 1 has 1 'labels' for 2 'input_ids'; they must match token for token"),
    ([{"input_ids": [1]}, {"input_ids": [1, 2], "labels": [1]}], ValueError,
     r"example 1 has 1 'labels' for 2 'input_ids'"),
    ([{"input_ids": [1]}, {"input_ids": [1, 2], "completion_mask": [1, 1, 1]}], ValueError,
     r"example 1 has 3 'completion_mask' for 2 'input_ids'"),
    ([{"input_ids": [1]}, {"input_ids": [1.5, 2.0]}], TypeError,
     r"example 1 has 1.5 \(float\) in 'input_ids'; token ids are integers >= 0"),
    ([{"input_ids": [1]}, {"input_ids": [1, 2.5]}], TypeError, r"example 1 has 2.5 \(float\) in 'input_ids'"),
    ([{"input_ids": [1]}, {"input_ids": [1, float("nan")]}], TypeError, r"example 1 has nan \(float\) in 'input_ids'"),
    ([{"input_ids": [1]}, {"input_ids": np.array([1.0])}], TypeError, r"example 1 has 1.0 \(float\) in 'input_ids'"),
    ([{"input_ids": [1]}, {"input_ids": np.array([1.0, np.nan])}], TypeError, r"example 1 has nan \(float\)"),
    ([{"input_ids": [1]}, {"input_ids": torch.tensor([1.0])}], TypeError, r"example 1 has 1.0 \(float\) in 'input_ids'"),
    ([{"input_ids": [1]}, {"input_ids": ["a"]}], TypeError, r"example 1 has 'a' \(str\) in 'input_ids'"),
    ([{"input_ids": [1]}, {"input_ids": [True]}], TypeError, r"example 1 has True \(bool\) in 'input_ids'"),
    ([{"input_ids": [1]}, {"input_ids": np.array([True])}], TypeError, r"example 1 has True \(bool\) in 'input_ids'"),
    ([{"input_ids": [1]}, {"input_ids": [[1, 2]]}], TypeError,
     r"example 1 has a nested list in 'input_ids' \(a list inside a list\); pass one flat list per example"),
    ([{"input_ids": [1]}, {"input_ids": [1, [1, 2]]}], TypeError, r"example 1 has a nested list in 'input_ids'"),
    ([{"input_ids": [1]}, {"input_ids": np.ones((1, 3), np.int64)}], TypeError,
     r"example 1 has a nested list in 'input_ids' \(shape \(1, 3\)\); .*squeeze"),
    ([{"input_ids": [1]}, {"input_ids": [4, -3]}], ValueError,
     "example 1 has token id -3 in 'input_ids'; token ids are integers >= 0"),
    ([{"input_ids": [1], "labels": [1]}, {"input_ids": [4], "labels": [-5]}], ValueError,
     r"example 1 has label -5 in 'labels'; labels are token ids \(>= 0\) or -100 \(no loss\)"),
    ([{"input_ids": [1]}, {"input_ids": [4, 5], "labels": [4, -7]}], ValueError, "example 1 has label -7 in 'labels'"),
    ([{"input_ids": [1]}, {"input_ids": [4], "labels": [1.5]}], TypeError, r"example 1 has 1.5 \(float\) in 'labels'"),
    ([{"input_ids": [1]}, {"input_ids": [4, 5], "assistant_masks": [1, 2]}], ValueError,
     r"example 1 has 2 in the loss mask 'assistant_masks'; a loss mask holds 1 \(loss\) or 0 \(no loss\)"),
    ([{"input_ids": [1]}, [1, 2]], TypeError, "example 1 is a list, not a dict with 'input_ids'"),
    ([{"input_ids": [1]}, {"input_ids": "abc"}], TypeError, "example 1 has a str in 'input_ids'; pass a list"),
    ([], ValueError, "empty list of examples"),
])
def test_bad_input_names_the_example(collator, examples, error, match):
    with pytest.raises(error, match=match):
        collator(examples)


def test_bad_options():
    with pytest.raises(ValueError, match="window must be at least 1"):
        FixedWindowCollator(window=0)
    with pytest.raises(ValueError, match="unknown strategy"):
        FixedWindowCollator(window=8, strategy="best")
    with pytest.raises(ValueError, match="num_windows must be at least 1, got 0"):
        FixedWindowCollator(window=8, num_windows=0)
    with pytest.raises(ValueError, match="pad_token_id must be at least 0, got -1"):
        PaddedCollator(pad_token_id=-1)
    with pytest.raises(ValueError, match="max_segments only applies with static_shape=True"):
        FixedWindowCollator(window=8, max_segments=4)


@pytest.mark.parametrize("make, error, match", [
    (lambda: FixedWindowCollator(window=8, seed="x"), TypeError, "seed must be an integer, got 'x'"),
    (lambda: FixedWindowCollator(window=8, seed=-1), ValueError, "seed must be at least 0, got -1"),
    (lambda: FixedWindowCollator(window=8, seed=True), TypeError, "seed must be an integer"),
    (lambda: FixedWindowCollator(window=8, num_windows=2.5), TypeError, "num_windows must be an integer"),
    (lambda: FixedWindowCollator(window=8, num_windows=True), TypeError, "num_windows must be an integer"),
    (lambda: PaddedCollator(pad_to_multiple_of=2.5), TypeError, "pad_to_multiple_of must be an integer"),
    (lambda: PaddedCollator(pad_to_multiple_of=0), ValueError, "pad_to_multiple_of must be at least 1"),
    (lambda: PaddedCollator(pad_token_id="0"), TypeError, "pad_token_id must be an integer"),
    (lambda: PackedRowsCollator(window=8, num_windows=2, static_shape=True, max_segments=1.0), TypeError,
     "max_segments must be an integer"),
])
def test_options_are_checked_in_init_with_one_contract(make, error, match):
    """Before the fix, a bad seed failed only at the first batch (inside a DataLoader worker), and
    collate's option checks raised ValueError for non-integers where sampler/budget raise TypeError.
    Now: checked in __init__, TypeError for a non-integer or a bool, ValueError for a value out of range."""
    with pytest.raises(error, match=match):
        make()


def test_static_shape_requires_max_segments():
    """Before the fix, the default max_segments was num_windows * window (cu_seqlens B*W+1 long, B*W
    mostly empty kernel programs). static_shape now needs an explicit bound, and the error says how
    to choose it."""
    with pytest.raises(ValueError, match=r"needs num_windows=B and max_segments=S.*window // shortest_example"):
        FixedWindowCollator(window=8, num_windows=2, static_shape=True)
    with pytest.raises(ValueError, match="max_segments"):
        PackedRowsCollator(window=8, num_windows=2, static_shape=True)
    b = FixedWindowCollator(window=8, num_windows=2, static_shape=True, max_segments=4)([{"input_ids": [1, 2, 3]}])
    assert b.cu_seqlens.tolist() == [0, 3, 8, 16, 16] and b.num_real_segments == 3


@pytest.mark.parametrize("examples, match", [
    ([{"input_ids": [1, 2]}, {"input_ids": [3, True, 4]}], r"example 1 has True \(bool\) in 'input_ids'"),
    ([{"input_ids": [1, 2]}, {"input_ids": [3, 4, np.True_]}], r"example 1 has True \(bool\) in 'input_ids'"),
    ([{"input_ids": [5, 6], "labels": [-100, 6]}, {"input_ids": [7, 8], "labels": [-100, False]}],
     r"example 1 has False \(bool\) in 'labels'"),
    ([{"input_ids": np.array([1, 2])}, {"input_ids": [3, True]}], r"example 1 has True \(bool\) in 'input_ids'"),
    ([{"input_ids": np.array([1, 2])}, {"input_ids": [3, 2.5]}], r"example 1 has 2.5 \(float\) in 'input_ids'"),
])
def test_bools_after_the_first_token_are_rejected(examples, match):
    """Before the fix, only the first element of a list was type-checked and struct.pack('q', True) takes a
    bool as 1, so [3, True] collated silently as [3, 1] (and lists mixed with arrays went through
    np.array, which truncates floats). Every list element is now held to the integer rule."""
    with pytest.raises(TypeError, match=match):
        PaddingFreeCollator()(examples)


def test_token_ids_zero_and_one_are_still_fine():
    """The bool check looks at positions holding 0 or 1: real ids 0 and 1 must pass."""
    b = PaddingFreeCollator()([{"input_ids": [0, 1, 0]}, {"input_ids": np.array([1, 0])}, {"input_ids": [1]}])
    assert b.input_ids.tolist() == [[0, 1, 0, 1, 0, 1]]


@pytest.mark.parametrize("key", ["completion_mask", "assistant_masks"])
@pytest.mark.parametrize("bad", [2, -1])
def test_mask_values_other_than_zero_and_one_are_rejected(key, bad):
    """Before the fix, a completion mask of 2 or -1 silently counted as "loss". Now a ValueError naming
    the example and the value; bool masks still work."""
    ok = {"input_ids": [1, 2, 3], key: [0, 1, 1]}
    with pytest.raises(ValueError, match=f"example 1 has {bad} in the loss mask '{key}'; a loss mask holds 1"):
        PaddingFreeCollator()([ok, {"input_ids": [1, 2, 3], key: [0, bad, 1]}])
    with pytest.raises(ValueError, match=f"example 1 has {bad} in the loss mask '{key}'"):
        PaddingFreeCollator()([{"input_ids": np.array([1, 2]), key: np.array([0, 1])},
                               {"input_ids": np.array([1, 2]), key: np.array([bad, 1])}])
    b = PaddingFreeCollator()([{"input_ids": [1, 2, 3], key: [False, True, True]}])
    assert b.labels.tolist() == [[-100, 2, 3]]
