"""pack_dataset end to end through Arrow: nothing lost, capacity, determinism, formats, bad input."""

from __future__ import annotations

import logging

import datasets
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from packkit.offline import pack_dataset
from packkit.packer import gather_segments
from packkit.segments import IGNORE_INDEX

datasets.disable_progress_bars()


# -- slow, obvious references --------------------------------------------------------------------


def gather_ref(values, starts, lengths):
    out = []
    for s, n in zip(starts, lengths):
        out.extend(values[s: s + n].tolist())
    return out


def reassemble(packed, plan, column="input_ids"):
    """Tokens of every source example, put back together from the packed rows, piece by piece."""
    pieces = {}
    rows = packed[column]
    seg = 0
    for r, (row, seqs) in enumerate(zip(rows, packed["seq_lengths"])):
        assert sum(seqs) == len(row)
        pos = 0
        for n in seqs:
            ex, start = int(plan.seg_example[seg]), int(plan.seg_start[seg])
            pieces.setdefault(ex, []).append((start, row[pos: pos + n]))
            pos += n
            seg += 1
    assert seg == plan.num_segments
    return {ex: [t for _, p in sorted(ps, key=lambda x: x[0]) for t in p] for ex, ps in pieces.items()}


def make_ds(lengths, *, seed=0, labels=True, dtype=np.int64):
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, 1000, n).astype(dtype).tolist() for n in lengths]
    cols = {"input_ids": ids}
    if labels:
        cols["labels"] = [[t + 1 for t in x] for x in ids]
    return datasets.Dataset.from_dict(cols)


# -- gather ---------------------------------------------------------------------------------------


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 40)), max_size=40), st.integers(1, 3))
@example([], 1)  # nothing to gather
@example([(99, 40)], 3)  # the last value only
def test_gather_segments_matches_reference(segs, threads):
    values = np.arange(100, dtype=np.int32) * 3
    segs = [(s, min(n, 100 - s)) for s, n in segs if s < 100]
    starts = [s for s, _ in segs]
    lengths = [n for _, n in segs]
    out = gather_segments(values, starts, lengths, num_threads=threads)
    ref = gather_ref(values, starts, lengths)
    print("tokens", len(ref))
    assert out.dtype == values.dtype
    assert out.tolist() == ref


def test_gather_segments_splits_large_groups(monkeypatch):
    """A length group bigger than GROUP_TOKENS is copied in several calls, with the same result."""
    import packkit.packer as packer

    monkeypatch.setattr(packer, "GROUP_TOKENS", 7)
    rng = np.random.default_rng(1)
    values = rng.integers(0, 50, 500)
    lengths = rng.integers(1, 6, 60)
    starts = rng.integers(0, 490, 60)
    assert gather_segments(values, starts, lengths).tolist() == gather_ref(values, starts, lengths)


def test_gather_segments_rejects_out_of_range():
    with pytest.raises(ValueError, match="inside values"):
        gather_segments(np.arange(5), [3], [4])


# -- end to end properties ----------------------------------------------------------------------

lengths_st = st.integers(1, 24).flatmap(
    lambda W: st.tuples(
        st.just(W),
        st.lists(st.one_of(st.integers(1, W), st.sampled_from([1, W, W + 1, 2 * W + 1])), min_size=1, max_size=30),
    )
)


@settings(max_examples=40)
@given(lengths_st, st.sampled_from(["bfd", "ffd", "shuffle_ff", "next_fit"]),
       st.sampled_from(["split", "truncate", "drop"]), st.booleans())
@example((1, [1]), "bfd", "split", False)  # window 1, a single one-token example
@example((1, [3, 3]), "next_fit", "split", True)  # window 1, every piece one token
@example((5, [11, 11]), "ffd", "drop", False)  # every example dropped (the test adds a kept one)
@example((24, [24] * 30), "shuffle_ff", "truncate", True)  # all equal to the window
def test_pack_dataset_nothing_lost_and_capacity(case, strategy, overflow, shuffle):
    window, lengths = case
    if overflow == "drop" and all(n > window for n in lengths):
        lengths = lengths + [1]
    ds = make_ds(lengths)
    packed, plan = pack_dataset(ds, window=window, strategy=strategy, overflow=overflow, shuffle=shuffle,
                                return_report=True, example_ids=True)
    assert packed.column_names == ["input_ids", "labels", "seq_lengths", "example_ids", "piece_offsets", "example_loss"]
    assert len(packed) == plan.num_windows
    src = ds["input_ids"]
    # capacity
    assert all(len(r) <= window for r in packed["input_ids"])
    # example ids and piece offsets agree with the plan, window after window: each document is its example's
    # tokens from its offset on
    assert [e for row in packed["example_ids"] for e in row] == plan.seg_example.tolist()
    assert [o for row in packed["piece_offsets"] for o in row] == plan.seg_start.tolist()
    for row, seqs, ids, offs in zip(packed["input_ids"], packed["seq_lengths"], packed["example_ids"],
                                    packed["piece_offsets"]):
        starts = np.cumsum([0] + seqs[:-1])
        assert all(row[s:s + n] == src[e][o:o + n] for s, n, e, o in zip(starts, seqs, ids, offs))
    got = reassemble(packed, plan)
    for i, toks in enumerate(src):
        if len(toks) <= window or overflow == "split":
            assert got[i] == toks, i
        elif overflow == "truncate":
            assert got[i] == toks[:window], i
        else:
            assert i not in got
    cut = sum(max(0, n - window) for n in lengths) if overflow == "truncate" else (
        sum(n for n in lengths if n > window) if overflow == "drop" else 0)
    assert plan.cut_tokens == cut
    # labels: the source labels, with -100 on the first token of every segment
    lab = reassemble(packed, plan, "labels")
    for row_l, row_i, seqs in zip(packed["labels"], packed["input_ids"], packed["seq_lengths"]):
        starts = np.cumsum([0] + seqs[:-1])
        expect = [t + 1 for t in row_i]
        for s in starts:
            expect[s] = IGNORE_INDEX
        assert row_l == expect
    assert set(lab) == set(got)


def test_default_rows_are_shuffled_and_deterministic(tmp_path):
    make_ds(np.random.default_rng(3).integers(1, 30, 300).tolist()).save_to_disk(str(tmp_path / "ds"))
    ds = datasets.load_from_disk(str(tmp_path / "ds"))
    a = pack_dataset(ds, window=32)
    b = pack_dataset(ds, window=32)
    c = pack_dataset(ds, window=32, seed=1)
    unshuffled, plan = pack_dataset(ds, window=32, shuffle=False, return_report=True)
    assert a["input_ids"] == b["input_ids"] and a["seq_lengths"] == b["seq_lengths"]
    # on-disk input: the fingerprint names the input and the arguments (datasets' caching works)
    assert a._fingerprint == b._fingerprint != c._fingerprint
    assert a.cache_files != b.cache_files  # two cache files beside the dataset's, never one overwritten
    assert a["input_ids"] != c["input_ids"]
    assert sorted(map(tuple, a["input_ids"])) == sorted(map(tuple, unshuffled["input_ids"]))
    # BFD's own order opens windows for the longest examples first; the default order does not
    first = plan.seg_length[plan.window_ptr[:-1]]
    assert first[0] == first.max()


def test_rows_match_plan_and_lower_bound():
    lengths = np.random.default_rng(4).integers(1, 100, 2000)
    ds = make_ds(lengths.tolist(), labels=False)
    packed, plan = pack_dataset(ds, window=128, return_report=True)
    assert packed.column_names == ["input_ids", "seq_lengths"]
    assert len(packed) <= plan.lower_bound + 2
    assert [len(r) for r in packed["input_ids"]] == plan.window_loads.tolist()


def test_selection_multichunk_and_int32_columns():
    """A shuffled/selected view (indices mapping) and a table of several chunks read the right rows."""
    parts = [make_ds([3, 5, 2, 7], seed=s, dtype=np.int32) for s in range(3)]
    full = datasets.concatenate_datasets(parts)
    assert full.data.table.column("input_ids").num_chunks == 3
    view = full.shuffle(seed=0).select(range(2, 11))
    assert view._indices is not None
    packed, plan = pack_dataset(view, window=9, return_report=True)
    got = reassemble(packed, plan)
    assert got == {i: toks for i, toks in enumerate(view["input_ids"])}
    assert packed.features["input_ids"].feature.dtype == "int32"


def test_save_to_disk_and_parquet_round_trip(tmp_path):
    ds = make_ds(np.random.default_rng(5).integers(1, 20, 200).tolist())
    packed = pack_dataset(ds, window=24)
    packed.save_to_disk(str(tmp_path / "packed"))
    back = datasets.load_from_disk(str(tmp_path / "packed"))
    assert back[:] == packed[:]
    packed.to_parquet(str(tmp_path / "packed.parquet"))
    pq = datasets.Dataset.from_parquet(str(tmp_path / "packed.parquet"))
    assert pq[:] == packed[:]


def test_rows_feed_the_packed_rows_collator():
    """The rows carry what the fixed-window collator needs: it rebuilds cu_seqlens from seq_lengths."""
    collate = pytest.importorskip("packkit.collate")
    ds = make_ds([3, 5, 2, 7, 1])
    packed = pack_dataset(ds, window=8, shuffle=False)
    batch = collate.PackedRowsCollator(window=8)([packed[i] for i in range(len(packed))])
    expect = []  # each row's segments, then its padding tail as a segment of its own
    for seqs in packed["seq_lengths"]:
        expect += seqs + ([8 - sum(seqs)] if sum(seqs) < 8 else [])
    cu = np.asarray(batch.cu_seqlens).tolist()
    print("cu_seqlens", cu, "expected lengths", expect)
    assert np.diff(cu).tolist() == expect
    segs = [n for row in packed["seq_lengths"] for n in row]
    assert batch.num_loss_tokens == sum(n - 1 for n in segs)


def test_truncation_is_logged_with_counts(caplog):
    ds = make_ds([5, 12, 3])
    with caplog.at_level(logging.WARNING, logger="packkit"):
        _, plan = pack_dataset(ds, window=8, overflow="truncate", return_report=True)
    assert plan.cut_tokens == 4
    assert "truncated 1 of 3" in caplog.text and "cutting 4 of 20 tokens" in caplog.text


def test_extra_columns_and_unsigned_labels():
    ds = datasets.Dataset.from_dict({
        "input_ids": [[1, 2], [3]], "completion_mask": [[0, 1], [1]], "text": ["a", "b"],
    }).cast_column("completion_mask", datasets.Sequence(datasets.Value("int8")))
    packed = pack_dataset(ds, window=4, columns=["input_ids", "completion_mask"], shuffle=False)
    # A named loss mask is written as asked, and turned into labels too (-100 where it is 0).
    assert packed.column_names == ["input_ids", "labels", "completion_mask", "seq_lengths"]
    assert packed["completion_mask"] == [[0, 1, 1]]
    assert packed["labels"] == [[-100, 2, -100]]
    u = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]], "labels": [[1, 2], [3]]}).cast_column(
        "labels", datasets.Sequence(datasets.Value("uint32")))
    assert pack_dataset(u, window=4, shuffle=False)["labels"] == [[-100, 2, -100]]


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cols, kwargs, exc, match", [
    ({"input_ids": [[1], [], [2]]}, {}, ValueError, r"dataset row 1 is empty \(0 tokens in 'input_ids'\)"),
    ({"input_ids": [[1], [2, 3, 4, 5, 6]]}, {"overflow": "error"}, ValueError, "example 1 has 5 tokens > window=4"),
    ({"input_ids": [[1, 2], [3]], "labels": [[1, 2], [3, 4]]}, {}, ValueError,
     "dataset row 1 has 2 'labels' for 1 'input_ids'; they must match token for token"),
    ({"input_ids": [[1, 2], [3, -4]]}, {}, ValueError, "dataset row 1 has token id -4 in 'input_ids'"),
    ({"tokens": [[1]]}, {}, KeyError, "no 'input_ids' column"),
    ({"input_ids": [[1]]}, {"columns": ["input_ids", "labels"]}, KeyError, "'labels' is not in the dataset"),
    ({"input_ids": [[1.5]]}, {}, TypeError, r"dataset row 0 has 1.5 \(float\) in 'input_ids'"),
    ({"input_ids": [[], [[2, 3]]]}, {}, TypeError, r"dataset row 1 has a nested list in 'input_ids'"),
    ({"input_ids": [1, 2]}, {}, TypeError, "not lists of token ids"),
    ({"input_ids": [[1], None]}, {}, ValueError, r"dataset row 1 has no 'input_ids' \(null\)"),
    ({"input_ids": [[1]]}, {"window": 0}, ValueError, "window must be at least 1"),
    ({"input_ids": [[1]]}, {"strategy": "best"}, ValueError, "unknown strategy"),
    ({"input_ids": [[1]]}, {"overflow": "wrap"}, ValueError, "unknown overflow"),
    ({"input_ids": [[1]]}, {"num_proc": 0}, ValueError, "num_proc"),
])
def test_bad_input_names_the_example(cols, kwargs, exc, match):
    ds = datasets.Dataset.from_dict(cols)
    kwargs = {"window": 4, **kwargs}
    with pytest.raises(exc, match=match):
        pack_dataset(ds, **kwargs)


def test_not_a_dataset():
    with pytest.raises(TypeError, match="pack_stream"):
        pack_dataset([{"input_ids": [1]}], window=4)


def test_negative_id_outside_a_selection_is_ignored():
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [-1], [3]]}).select([0, 2])
    assert sorted(pack_dataset(ds, window=8)["input_ids"][0]) == [1, 2, 3]


def test_output_past_int32_offsets_is_many_record_batches(monkeypatch):
    """A record batch never passes arrow.MAX_LIST_VALUES (int32 list offsets), so an output of more tokens
    is several batches of ``list`` columns (no large_list needed); the rows are the same."""
    import packkit.arrow as pio

    ds = make_ds([3, 4, 5], labels=False)
    small = pack_dataset(ds, window=6, shuffle=False)
    monkeypatch.setattr(pio, "MAX_LIST_VALUES", 5)
    big = pack_dataset(ds, window=6, shuffle=False)
    col = big.with_format("arrow")[:]["input_ids"]
    assert pa.types.is_list(col.type) and col.num_chunks == 3
    assert big["input_ids"] == small["input_ids"]


@pytest.mark.parametrize("buffer_bytes", [1, 64, 10**9])
def test_any_buffer_size_gives_the_same_rows(tmp_path, buffer_bytes):
    """The chunked gather (windows a buffer at a time, a window alone when it is bigger) writes the
    rows of one whole gather, in memory and through the cache file."""
    lengths = np.random.default_rng(8).integers(1, 40, 300).tolist()
    ds = make_ds(lengths)
    ref, plan = pack_dataset(ds, window=48, return_report=True, buffer_bytes=10**9)
    ds.save_to_disk(str(tmp_path / "ds"))
    disk = datasets.load_from_disk(str(tmp_path / "ds"))
    for source in (ds, disk):
        got = pack_dataset(source, window=48, buffer_bytes=buffer_bytes)
        assert got[:] == ref[:]
    assert got.cache_files and got.cache_files[0]["filename"].startswith(str(tmp_path / "ds"))
    assert reassemble(ref, plan) == {i: t for i, t in enumerate(ds["input_ids"])}


# -- regressions ---------------------------------------------------------------------------------


def masked_examples(lengths, mask_key, *, labels, seed=0):
    """Examples with a random 0/1 loss mask (and labels with some -100) as a user's SFT data has."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(0, 500, n)
        ex = {"input_ids": ids.tolist(), mask_key: rng.integers(0, 2, n).tolist()}
        if labels:
            ex["labels"] = np.where(rng.random(n) < 0.2, IGNORE_INDEX, ids + 1).tolist()
        out.append(ex)
    return out


@pytest.mark.parametrize("mask_key", ["completion_mask", "assistant_masks"])
@pytest.mark.parametrize("labels", [False, True])
@pytest.mark.parametrize("select", [False, True])
def test_loss_mask_becomes_labels_as_the_online_collator_does(mask_key, labels, select):
    """Before the fix, offline packing kept only input_ids (+ labels) and dropped a completion_mask /
    assistant_masks column without a word, so PackedRowsCollator then trained on the prompt tokens
    (labels [[-100, 2, 3, 4, -100, 6, 7]], 5 loss tokens, where the online collator gives
    [[-100, -100, 3, 4, -100, 6, 7]], 4). Every offline row must now collate to exactly what the
    online collator makes of the same examples in the same window."""
    collate = pytest.importorskip("packkit.collate")
    W = 16
    exs = masked_examples(np.random.default_rng(1).integers(1, 12, 30), mask_key, labels=labels)
    ds = datasets.Dataset.from_list(exs)
    if select:
        keep = np.random.default_rng(2).permutation(30)[:20]
        ds, exs = ds.select(keep), [exs[i] for i in keep]
    packed = pack_dataset(ds, window=W, example_ids=True)
    assert packed.column_names == ["input_ids", "labels", "seq_lengths", "example_ids", "piece_offsets", "example_loss"]
    online = collate.FixedWindowCollator(window=W, strategy="next_fit")
    offline = collate.PackedRowsCollator(window=W)
    for row in packed:
        want = online([exs[i] for i in row["example_ids"]])
        got = offline([{k: row[k] for k in ("input_ids", "labels", "seq_lengths")}])
        assert want.labels.shape == got.labels.shape == (1, W)
        assert got.labels.tolist() == want.labels.tolist()
        assert got.num_loss_tokens == want.num_loss_tokens
        assert row["labels"] == want.labels[0, :len(row["input_ids"])].tolist()


def test_two_masked_examples_in_a_window_of_8():
    """The reported repro of the dropped mask (the test above): two examples with completion_mask, window 8."""
    collate = pytest.importorskip("packkit.collate")
    exs = [{"input_ids": [1, 2, 3, 4], "completion_mask": [0, 0, 1, 1]},
           {"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1]}]
    packed = pack_dataset(datasets.Dataset.from_list(exs), window=8, shuffle=False)
    assert packed["labels"] == [[-100, -100, 3, 4, -100, 6, 7]]
    batch = collate.PackedRowsCollator(window=8)([packed[0]])
    assert batch.num_loss_tokens == 4


@pytest.mark.parametrize("select", [False, True])
def test_label_values_are_checked_when_packing(select):
    """Before the fix, a label such as -5 (neither a token id nor -100) was packed without a word and failed
    only at collate time inside a DataLoader worker; it now fails at pack time, naming the example
    (its index in the selection when the dataset is a selection; rows left out are not checked)."""
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3], [4, 5, 6], [7]],
                                     "labels": [[1, -100], [-7], [4, -5, 6], [7]]})
    if select:
        assert pack_dataset(ds.select([0, 3]), window=8)["seq_lengths"]  # -7 and -5 are outside
        with pytest.raises(ValueError, match=r"dataset row 1 has label -5 in 'labels'"):
            pack_dataset(ds.select([3, 2, 0]), window=8)
    else:
        with pytest.raises(ValueError, match=r"dataset row 1 has label -7 in 'labels'.*or -100"):
            pack_dataset(ds, window=8)


def test_option_errors_are_binpacks_own():
    """Before the fix, the strategy/overflow checks and the overflow error were copied (text and all) into
    the offline module; they
    are binpack's now, so the wording cannot drift."""
    from packkit.binpack import check_overflow, check_strategy, overflow_error

    ds = datasets.Dataset.from_dict({"input_ids": [[1], [2, 3, 4, 5, 6]]})
    for call, ref in [(lambda: pack_dataset(ds, window=4, strategy="best"), lambda: check_strategy("best")),
                      (lambda: pack_dataset(ds, window=4, overflow="wrap"), lambda: check_overflow("wrap"))]:
        with pytest.raises(ValueError) as want:
            ref()
        with pytest.raises(ValueError) as got:
            call()
        assert str(got.value) == str(want.value)
    with pytest.raises(ValueError) as got:
        pack_dataset(ds, window=4, overflow="error")
    assert str(got.value) == str(overflow_error(np.array([1, 5]), 4))


def test_loss_mask_values_other_than_0_and_1_are_rejected_offline():
    """Before the fix, offline packing treated a mask value of 2 as "loss" while the collators
    reject it; both now refuse it and name the example."""
    import datasets

    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]], "completion_mask": [[0, 1, 1], [1, 2]]})
    with pytest.raises(ValueError, match="dataset row 1 has 2 in the loss mask 'completion_mask'"):
        pack_dataset(ds, window=8)
    from packkit.packer import pack_stream

    with pytest.raises(ValueError, match="example 1 has -1 in the loss mask 'completion_mask'"):
        list(pack_stream([{"input_ids": [1, 2], "completion_mask": [0, 1]},
                          {"input_ids": [3, 4], "completion_mask": [1, -1]}], window=8))


# -- multimodal rows written to a file in bounded memory ------------------------------------------

MEDIA_POOL = r"""
import json, sys
import datasets, pyarrow as pa
from packkit.offline import pack_dataset
datasets.disable_progress_bars()
ds = datasets.Dataset.from_file(sys.argv[1])
pack_dataset(ds, window=256, output=sys.argv[2], buffer_bytes=1 << 22, progress=False)
print(json.dumps({"pool_max": pa.default_memory_pool().max_memory()}))
"""


def test_media_rows_are_written_in_bounded_memory(tmp_path):
    """pack_dataset(..., output=) of rows with images (an Arrow file of 1,200 rows in chunks of 100, 32 MiB of pixel
    values) within buffer_bytes=4 MiB: the Arrow memory pool's peak stays under half the images' bytes (9.9 MiB). It
    was three times all of them (101.8 MiB): pyarrow's ChunkedArray.take concatenated the whole memory-mapped pixel
    column for every record batch, and a batch was sized by its tokens alone (a batch of 341 windows held 160 MB of images in the
    benchmark of RESULTS.md). mediarows.take_rows gathers chunk by chunk, equal to ChunkedArray.take."""
    import json
    import subprocess
    import sys

    from test_media_faults import media_rows

    from packkit.mediarows import take_rows

    table = media_rows(1200, side=48, tokens_per_image=4)
    src = tmp_path / "rows.arrow"
    with pa.ipc.new_stream(str(src), table.schema) as w:
        w.write_table(table, max_chunksize=100)
    images = table.column("pixel_values").nbytes
    run = subprocess.run([sys.executable, "-c", MEDIA_POOL, str(src), str(tmp_path / "out.parquet")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    peak = json.loads(run.stdout.strip().splitlines()[-1])["pool_max"]
    print(f"images {images / 2**20:.1f} MiB, Arrow pool peak {peak / 2**20:.1f} MiB")
    assert peak < images / 2
    col = pa.ipc.open_stream(pa.memory_map(str(src))).read_all().column("pixel_values")
    rng = np.random.default_rng(0)
    for rows in (rng.permutation(len(col))[:300], np.array([5, 5, 1199, 0]), np.zeros(0, np.int64)):
        assert take_rows(col, rows).equals(col.take(pa.array(rows, pa.int64())).combine_chunks())
