"""Streaming packing: buffered best fit (stream_windows) and pack_stream / IterableDataset."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from packkit.binpack import pack
from packkit.binpack import stream_windows
from packkit.offline import pack_dataset
from packkit.packer import pack_stream
from packkit.segments import IGNORE_INDEX

datasets.disable_progress_bars()


def stream_ref(lengths, window, buffer_size):
    """Obvious reference: a list as the buffer; oldest first, then the longest (oldest of it) that fits."""
    pending = list(enumerate(lengths))
    buf, out = [], []

    def refill():
        while pending and len(buf) < buffer_size:
            buf.append(pending.pop(0))

    refill()
    while buf:
        i, n = buf.pop(0)
        win, room = [i], window - n
        refill()
        while True:
            fits = [(m, -k) for k, (j, m) in enumerate(buf) if m <= room]
            if not fits:
                break
            m, negk = max(fits)
            win.append(buf.pop(-negk)[0])
            room -= m
            refill()
        out.append(win)
    return out


case = st.integers(1, 30).flatmap(
    lambda W: st.tuples(st.just(W), st.lists(st.integers(1, W), max_size=60), st.integers(1, 12)))


@given(case)
@example((1, [], 1))  # no items
@example((1, [1] * 5, 3))  # window 1
@example((30, [30] * 4, 12))  # all equal to the window
def test_stream_windows_matches_reference(c):
    window, lengths, buffer_size = c
    got = list(stream_windows(zip(range(len(lengths)), lengths), window=window, buffer_size=buffer_size))
    ref = stream_ref(lengths, window, buffer_size)
    print(len(got), len(ref))
    assert got == ref
    # nothing lost, capacity
    assert sorted(i for w in got for i in w) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in w) <= window for w in got)


@given(case)
@example((1, [], 1))
@example((7, [7], 1))
def test_buffer_of_one_is_next_fit(c):
    window, lengths, _ = c
    got = list(stream_windows(zip(range(len(lengths)), lengths), window=window, buffer_size=1))
    if lengths:
        assert [w.tolist() for w in pack(lengths, window=window, strategy="next_fit").windows()] == got
    else:
        assert got == []


@settings(max_examples=20)
@given(case)
@example((1, [1] * 5, 1))
def test_buffer_is_bounded(c):
    window, lengths, buffer_size = c
    pulled = [0]

    def items():
        for i, n in enumerate(lengths):
            pulled[0] += 1
            yield i, n

    emitted = 0
    for w in stream_windows(items(), window=window, buffer_size=buffer_size):
        emitted += len(w)
        assert pulled[0] - emitted <= buffer_size


def test_bigger_buffer_fills_better_on_sft_lengths():
    rng = np.random.default_rng(0)
    lengths = np.minimum(np.clip(np.round(rng.lognormal(np.log(250), 1.0, 5000)), 8, 4096), 2048).astype(int)
    counts = {b: sum(1 for _ in stream_windows(zip(range(lengths.size), lengths.tolist()), window=2048,
                                               buffer_size=b)) for b in (1, 10, 100)}
    print(counts)
    assert counts[1] > counts[10] > counts[100] >= pack(lengths, window=2048).num_windows


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_buffer_size(bad):
    with pytest.raises(ValueError, match="buffer_size"):
        list(stream_windows([], window=4, buffer_size=bad))


def test_item_longer_than_window():
    with pytest.raises(ValueError, match="item 1 has length 5"):
        list(stream_windows([("a", 2), ("b", 5)], window=4))


# -- pack_stream ----------------------------------------------------------------------------------


def examples(lengths, seed=0, labels=True):
    rng = np.random.default_rng(seed)
    for n in lengths:
        ids = rng.integers(0, 500, n)
        ex = {"input_ids": ids.tolist()}
        if labels:
            ex["labels"] = (ids + 1).tolist()
        yield ex


@settings(max_examples=30)
@given(st.integers(1, 16).flatmap(lambda W: st.tuples(
    st.just(W), st.lists(st.one_of(st.integers(1, W), st.sampled_from([W + 1, 2 * W + 1])), max_size=25))),
    st.sampled_from(["split", "truncate", "drop"]), st.integers(1, 8))
@example((1, []), "split", 1)  # an empty stream
@example((1, [3, 1]), "split", 1)  # window 1: pieces of one token
@example((4, [9, 9]), "drop", 8)  # everything dropped
def test_pack_stream_nothing_lost(c, overflow, buffer_size):
    window, lengths = c
    src = list(examples(lengths))
    stream = pack_stream(iter(src), window=window, buffer_size=buffer_size, overflow=overflow, example_ids=True)
    rows = list(stream)
    pieces = {}
    for row in rows:
        assert len(row["input_ids"]) <= window and row["seq_lengths"].sum() == len(row["input_ids"])
        assert row["seq_lengths"].dtype == np.int32
        pos = 0
        for ex, n in zip(row["example_ids"].tolist(), row["seq_lengths"].tolist()):
            seg = row["input_ids"][pos: pos + n].tolist()
            lab = row["labels"][pos: pos + n].tolist()
            assert lab == [IGNORE_INDEX] + [t + 1 for t in seg[1:]]
            pieces.setdefault(ex, []).append(seg)
            pos += n
    s = stream.stats
    for i, ex in enumerate(src):
        toks, n = ex["input_ids"], len(ex["input_ids"])
        if n <= window:
            assert pieces[i] == [toks]
        elif overflow == "truncate":
            assert pieces[i] == [toks[:window]]
        elif overflow == "drop":
            assert i not in pieces
        else:  # pieces are W tokens but the last; their order in the stream may change
            assert sorted(pieces[i]) == sorted(toks[k: k + window] for k in range(0, n, window))
    over = [n for n in lengths if n > window]
    assert s.examples == len(lengths) and s.tokens == sum(lengths) and s.windows == len(rows)
    assert s.cut_tokens == {"truncate": sum(n - window for n in over), "drop": sum(over), "split": 0}[overflow]
    assert s.truncated_examples + s.dropped_examples + s.split_examples == len(over)
    assert s.packed_tokens == sum(lengths) - s.cut_tokens


def test_pack_stream_accepts_numpy_and_tensors_and_is_deterministic():
    import torch

    exs = [{"input_ids": np.array([1, 2, 3])}, {"input_ids": torch.tensor([4, 5])}, {"input_ids": [6]}]
    a = [r["input_ids"].tolist() for r in pack_stream(exs, window=4)]
    b = [r["input_ids"].tolist() for r in pack_stream(exs, window=4)]
    assert a == b == [[1, 2, 3, 6], [4, 5]]


@pytest.mark.parametrize("exs, match, exc", [
    ([{"input_ids": [1]}, {"input_ids": []}], r"example 1 is empty \(0 tokens in 'input_ids'\)", ValueError),
    ([{"input_ids": [1, 2, 3, 4, 5]}], "example 0 has 5 tokens > window=4", ValueError),
    ([{"input_ids": [1]}, {"text": "x"}], "example 1 has no 'input_ids'", ValueError),
    ([{"input_ids": [1]}, {"input_ids": [2], "labels": [2]}], "example 1 has 'labels', which this stream's first",
     ValueError),
    ([{"input_ids": [1]}, {"input_ids": [2], "assistant_masks": [1]}], "example 1 has 'assistant_masks'", ValueError),
    ([{"input_ids": [1, 2], "labels": [1]}], "example 0 has 1 'labels' for 2 'input_ids'", ValueError),
    ([{"input_ids": [[1, 2]]}], r"example 0 has a nested list in 'input_ids' \(shape \(1, 2\)\)", TypeError),
    ([{"input_ids": [1.5]}], r"example 0 has 1.5 \(float\) in 'input_ids'", TypeError),
    ([{"input_ids": [3, -1]}], "example 0 has token id -1 in 'input_ids'", ValueError),
    ([{"input_ids": [3], "labels": [-7]}], "example 0 has label -7 in 'labels'", ValueError),
    ([[1, 2]], "example 0 is a list, not a dict", TypeError),
])
def test_pack_stream_bad_input(exs, match, exc):
    with pytest.raises(exc, match=match):
        list(pack_stream(exs, window=4, overflow="error"))


def test_iterable_dataset_streams_the_same_rows():
    src = list(examples([3, 9, 4, 2, 7, 1, 5], labels=True))
    ids = datasets.IterableDataset.from_generator(lambda: iter(src))
    out = pack_dataset(ids, window=10, buffer_size=3, shuffle=False)
    assert isinstance(out, datasets.IterableDataset)
    got = [(r["input_ids"], r["labels"], r["seq_lengths"]) for r in out]
    ref = [(r["input_ids"].tolist(), r["labels"].tolist(), r["seq_lengths"].tolist())
           for r in pack_stream(src, window=10, buffer_size=3)]
    assert got == ref
    with pytest.raises(ValueError, match="strategy must be 'bfd'"):
        pack_dataset(ids, window=10, strategy="next_fit")


# -- regressions ---------------------------------------------------------------------------------


@pytest.mark.parametrize("exs, match", [
    ([{"input_ids": np.array([True, False])}], r"example 0 has True \(bool\) in 'input_ids'"),
    ([{"input_ids": [1, 2]}, {"input_ids": np.array([True])}], r"example 1 has True \(bool\) in 'input_ids'"),
    ([{"input_ids": [1, 2], "labels": np.array([True, True])}], r"example 0 has True \(bool\) in 'labels'"),
])
def test_boolean_token_ids_and_labels_are_rejected(exs, match):
    """Before the fix, PackedStream accepted boolean token ids (dtype kind "b") and packed them as 0/1."""
    with pytest.raises(TypeError, match=match):
        list(pack_stream(exs, window=4))


def test_boolean_loss_mask_is_accepted():
    rows = list(pack_stream([{"input_ids": [5, 6, 7], "completion_mask": np.array([False, True, True])}], window=4))
    assert rows[0]["labels"].tolist() == [-100, 6, 7]


@pytest.mark.parametrize("mask_key", ["completion_mask", "assistant_masks"])
@pytest.mark.parametrize("labels", [False, True])
def test_stream_loss_mask_becomes_labels_as_the_online_collator_does(mask_key, labels):
    """Before the fix, pack_stream dropped a completion_mask / assistant_masks without a word; every
    streamed row must now collate to what the online collator makes of the same examples."""
    collate = pytest.importorskip("packkit.collate")
    W = 16
    rng = np.random.default_rng(3)
    exs = []
    for n in rng.integers(1, 12, 30):
        ids = rng.integers(0, 500, n)
        ex = {"input_ids": ids.tolist(), mask_key: rng.integers(0, 2, n).tolist()}
        if labels:
            ex["labels"] = np.where(rng.random(n) < 0.2, IGNORE_INDEX, ids + 1).tolist()
        exs.append(ex)
    rows = list(pack_stream(exs, window=W, buffer_size=4, example_ids=True))
    online = collate.FixedWindowCollator(window=W, strategy="next_fit")
    for row in rows:
        assert list(row) == ["input_ids", "labels", "seq_lengths", "example_ids", "piece_offsets", "example_loss"]
        want = online([exs[i] for i in row["example_ids"]])
        assert row["labels"].tolist() == want.labels[0, :row["input_ids"].size].tolist()
    out = pack_dataset(datasets.Dataset.from_list(exs).to_iterable_dataset(), window=W, buffer_size=4,
                       shuffle=False)
    assert [r["labels"] for r in out] == [r["labels"].tolist() for r in rows]


def test_stream_label_values_are_checked():
    """A label that is neither a token id nor -100 names its example (before the fix it was packed, and
    failed only when a collator read it)."""
    with pytest.raises(ValueError, match=r"example 1 has label -3 in 'labels'"):
        list(pack_stream([{"input_ids": [1], "labels": [1]}, {"input_ids": [2, 3], "labels": [-100, -3]}],
                         window=4))


def test_stream_overflow_error_is_binpacks_text():
    """Before the fix, the stream's overflow error was a copy of binpack's text; it is binpack's now."""
    from packkit.binpack import overflow_error

    with pytest.raises(ValueError) as got:
        list(pack_stream([{"input_ids": [1]}, {"input_ids": [2]}, {"input_ids": list(range(9))}], window=4,
                         overflow="error"))
    assert str(got.value) == str(overflow_error(np.array([1, 1, 9]), 4))
    assert str(got.value).startswith("example 2 has 9 tokens > window=4")


def test_iterable_dataset_honours_shuffle_seed_progress_and_refuses_num_proc(capsys):
    """Before the fix, on an IterableDataset, pack_dataset silently ignored seed, shuffle, num_proc and progress.
    Now shuffle=True (the default) gives a seeded shuffle of the same rows, progress draws a bar, and
    num_proc (which a stream cannot use) is an error."""
    src = list(examples(np.random.default_rng(0).integers(1, 9, 60).tolist(), labels=True))
    ids = datasets.IterableDataset.from_generator(lambda: iter(src))
    plain = [r["input_ids"] for r in pack_dataset(ids, window=10, shuffle=False)]
    a = [r["input_ids"] for r in pack_dataset(ids, window=10, seed=1)]
    b = [r["input_ids"] for r in pack_dataset(ids, window=10, seed=1)]
    c = [r["input_ids"] for r in pack_dataset(ids, window=10, seed=2)]
    assert a == b and a != plain and a != c
    assert sorted(a) == sorted(plain) == sorted(c)
    assert [r["input_ids"] for r in pack_dataset(ids, window=10, shuffle=False, progress=True)] == plain
    assert "tok" in capsys.readouterr().err
    with pytest.raises(ValueError, match="num_proc=2 copies .*an IterableDataset is packed in one stream"):
        pack_dataset(ids, window=10, num_proc=2)
