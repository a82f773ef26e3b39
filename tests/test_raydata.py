"""Offline packing on Ray Data (packkit.raydata): a local Ray instance, a few thousand examples, 8 blocks.

Every token id in the generated data is unique (token id = its index in the whole dataset), so a
slow, obvious reference can say where each packed token came from: nothing lost, nothing duplicated,
segments are consecutive pieces of one example, positions restart at every segment.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

pa = pytest.importorskip("pyarrow")
ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow  # a local Ray cluster: make test runs it, make test-fast does not

from packkit import raydata  # noqa: E402
from packkit.binpack import pack  # noqa: E402
from packkit.packer import pack_arrays  # noqa: E402
from packkit.segments import IGNORE_INDEX, lengths_to_position_ids  # noqa: E402

W = 256
N = 6000
BLOCKS = 8


# ----------------------------------------------------------------------------------------------
# data and references
# ----------------------------------------------------------------------------------------------


def make_lengths(n=N, seed=0, median=60, hi=4 * W):
    """SFT-like lengths: lognormal, clipped to [1, hi] (some above W, some twice above it)."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(median), 1.0, n)), 1, hi).astype(np.int64)


def make_table(lengths, *, labels=True):
    """input_ids = global token index (unique), labels = input_ids + 1."""
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    ids = np.arange(offsets[-1], dtype=np.int32)
    cols = {"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))}
    if labels:
        cols["labels"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids.astype(np.int64) + 1))
    return pa.table(cols)


def make_ds(lengths, blocks=BLOCKS, labels=True):
    table = make_table(lengths, labels=labels)
    cuts = np.linspace(0, len(lengths), blocks + 1).astype(int)
    return ray.data.from_arrow([table.slice(a, b - a) for a, b in zip(cuts[:-1], cuts[1:])])


def collect(ds):
    """The packed rows as Python lists, in block order."""
    table = pa.concat_tables(ray.get(ds.to_arrow_refs()))
    return table.to_pydict()


def check_rows(rows, lengths, *, window, overflow):
    """The reference check, one token at a time: returns the set of examples seen (whole or in pieces).

    Nothing lost: every kept token appears exactly once. Capacity: rows <= window. Segments are
    consecutive runs of one example, starting at 0 (or at a multiple of window for split pieces),
    positions restart at 0 per segment, and the first label of every segment is -100.
    """
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    example_of = np.repeat(np.arange(len(lengths)), lengths)
    seen = np.zeros(offsets[-1], np.int64)
    for r, ids in enumerate(rows["input_ids"]):
        segs = rows["seq_lengths"][r]
        assert len(ids) <= window, f"row {r} holds {len(ids)} tokens > {window}"
        assert sum(segs) == len(ids) and all(s >= 1 for s in segs), f"row {r}: seq_lengths {segs}"
        pos = lengths_to_position_ids(segs)
        at = 0
        for s in segs:
            piece = ids[at:at + s]
            e = example_of[piece[0]]
            start = piece[0] - offsets[e]
            assert piece == list(range(piece[0], piece[0] + s)), f"row {r}: segment is not one run"
            assert example_of[piece[-1]] == e, f"row {r}: segment crosses an example boundary"
            assert pos[at] == 0 and pos[at + s - 1] == s - 1
            if overflow == "split":
                assert start % window == 0, f"row {r}: a piece starts at {start}, not a multiple of W"
            else:
                assert start == 0
            if "labels" in rows:
                lab = rows["labels"][r][at:at + s]
                assert lab[0] == IGNORE_INDEX
                assert lab[1:] == [t + 1 for t in piece[1:]], f"row {r}: labels misaligned"
            seen[piece] += 1
            at += s
    assert seen.max(initial=0) <= 1, "a token was packed twice"
    expected = np.ones(offsets[-1], np.int64)
    if overflow == "truncate":
        expected = (np.arange(offsets[-1]) - offsets[example_of] < window).astype(np.int64)
    if overflow == "drop":
        expected = (lengths[example_of] <= window).astype(np.int64)
    missing = np.flatnonzero(seen != expected)
    assert missing.size == 0, f"{missing.size} tokens lost or extra, first {missing[:5]}"


# ----------------------------------------------------------------------------------------------
# pure pieces, no Ray
# ----------------------------------------------------------------------------------------------


def test_tail_windows_docstring_example():
    assert raydata.tail_windows([8, 5, 8, 3], window=8, tokens=24, slack=0.0).tolist() == [1, 3]
    assert raydata.tail_windows([8, 5, 8, 3], window=8, tokens=24, slack=0.2).tolist() == [3]
    assert raydata.tail_windows([8, 8], window=8, tokens=16, slack=0.0).tolist() == []


@settings(max_examples=60)
@given(st.lists(st.integers(1, 97), min_size=0, max_size=40), st.floats(0, 0.5))
@example([], 0.0)  # no windows
@example([97], 0.0)  # one full window
@example([1], 0.5)  # one nearly empty window
@example([50] * 4, 0.5)  # all equal
def test_tail_windows_keeps_fullest_within_budget(loads, slack):
    loads = np.asarray(loads, np.int64)
    tokens = int(loads.sum())
    tail = raydata.tail_windows(loads, window=97, tokens=tokens, slack=slack)
    kept = np.setdiff1d(np.arange(loads.size), tail)
    waste = 97 - loads
    assert waste[kept].sum() <= slack * tokens + 1e-9
    if tail.size and kept.size:  # the emptiest go first
        assert waste[tail].min() >= waste[kept].max()
    if tail.size:  # and no more than needed: keeping the fullest handed window breaks the budget
        best = tail[np.argmin(waste[tail])]
        assert waste[kept].sum() + waste[best] > slack * tokens


def test_list_column_sliced_and_chunked():
    table = make_table(np.array([2, 3, 1, 4]))
    values, offsets, nulls = raydata._list_column(table.slice(1, 2), "input_ids")
    assert values.tolist() == [2, 3, 4, 5] and offsets.tolist() == [0, 3, 4] and nulls is None
    chunked = pa.concat_tables([table.slice(0, 1), table.slice(1, 3)])
    values, offsets, _ = raydata._list_column(chunked, "input_ids")
    assert values.tolist() == list(range(10)) and offsets.tolist() == [0, 2, 5, 6, 10]


def test_block_lengths_reports_local_index_of_bad_examples():
    t = pa.table({"input_ids": [[1, 2], [3, -4], [5]]})
    assert raydata._block_lengths(t, "input_ids", "labels")["error"][1] == 1
    t = pa.table({"input_ids": [[1, 2], [3], [5]], "labels": [[1, 2], [3], [5, 6]]})
    info = raydata._block_lengths(t, "input_ids", "labels")
    assert info["has_labels"] and info["error"][1] == 2
    t = pa.table({"input_ids": [1, 2]})
    assert "not lists of token ids" in raydata._block_lengths(t, "input_ids", None)["error"][2]


# ----------------------------------------------------------------------------------------------
# on a local Ray instance
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2,
             log_to_driver=False, configure_logging=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def data(local_ray):
    lengths = make_lengths()
    return lengths, make_ds(lengths)


@pytest.mark.parametrize("mode", ["local", "global"])
@pytest.mark.parametrize("overflow", ["split", "truncate", "drop"])
def test_conservation_capacity_positions(data, mode, overflow):
    lengths, ds = data
    out, report = raydata.pack_dataset(ds, window=W, mode=mode, overflow=overflow, return_report=True)
    rows = collect(out)
    print(report.summary())
    check_rows(rows, lengths, window=W, overflow=overflow)
    plan = pack(lengths, window=W, overflow=overflow)
    assert report.windows == len(rows["input_ids"]) and report.blocks == BLOCKS
    assert report.tokens == sum(map(len, rows["input_ids"])) == plan.total_tokens
    assert (report.overflow_examples, report.dropped_examples, report.cut_tokens) == (
        plan.overflow_examples.size, plan.dropped_examples.size, plan.cut_tokens)
    assert report.overflow_examples > 0  # the data does exercise the policy


@pytest.mark.parametrize("blocks", [BLOCKS, 48])
def test_local_fill_within_0_1_percent_of_lower_bound(local_ray, blocks):
    lengths = make_lengths(seed=1, hi=W)
    ds = make_ds(lengths, blocks=blocks)
    _, report = raydata.pack_dataset(ds, window=W, mode="local", return_report=True)
    # without pass 2 (every block keeps all its windows) the blocks' tails add up
    _, no_pass2 = raydata.pack_dataset(ds, window=W, mode="local", tail_slack=0.99, return_report=True)
    lb = -(-int(lengths.sum()) // W)
    print(f"blocks={blocks} lower bound {lb}: with pass 2 {report.windows} "
          f"(handed {report.handed_windows} -> {report.pass2_windows}), without {no_pass2.windows}")
    assert report.lower_bound == lb and no_pass2.handed_windows == 0
    assert report.windows <= lb * 1.001, report.summary()
    assert no_pass2.windows > report.windows


def test_global_mode_gives_the_single_machine_windows(data):
    """Global mode: exactly the rows of binpack.pack + packer.pack_arrays on the gathered rows."""
    lengths, ds = data
    out, report = raydata.pack_dataset(ds, window=W, mode="global", overflow="split", seed=7, return_report=True)
    got = collect(out)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    plan = pack(lengths, window=W, overflow="split", seed=7).shuffled(7)
    want = pack_arrays(plan, np.arange(offsets[-1], dtype=np.int32), offsets,
                       np.arange(offsets[-1], dtype=np.int64) + 1)
    assert report.windows == plan.num_windows
    flat = np.concatenate([np.asarray(r) for r in got["input_ids"]])
    np.testing.assert_array_equal(flat, want.input_ids)
    np.testing.assert_array_equal(np.concatenate([np.asarray(r) for r in got["labels"]]), want.labels)
    np.testing.assert_array_equal(np.cumsum([0] + [len(r) for r in got["input_ids"]]), want.row_offsets)
    np.testing.assert_array_equal(np.concatenate([np.asarray(r) for r in got["seq_lengths"]]), want.seq_lengths)


def test_deterministic_for_a_block_layout_and_seed(data):
    _, ds = data
    a = collect(raydata.pack_dataset(ds, window=W, mode="local", overflow="split", seed=3))
    b = collect(raydata.pack_dataset(ds, window=W, mode="local", overflow="split", seed=3))
    c = collect(raydata.pack_dataset(ds, window=W, mode="local", overflow="split", seed=4))
    assert a == b
    assert a != c and sorted(map(tuple, a["input_ids"])) == sorted(map(tuple, c["input_ids"]))


def test_no_labels_in_no_labels_out_and_parquet_roundtrip(local_ray, tmp_path):
    lengths = make_lengths(n=500, seed=2, hi=W)
    ds = make_ds(lengths, blocks=4, labels=False)
    out = raydata.pack_dataset(ds, window=W)
    rows = collect(out)
    assert set(rows) == {"input_ids", "seq_lengths"}
    check_rows(rows, lengths, window=W, overflow="error")
    out.write_parquet(str(tmp_path))
    import pyarrow.parquet as pq

    back = pq.read_table(str(tmp_path)).to_pydict()
    assert sorted(map(tuple, back["input_ids"])) == sorted(map(tuple, rows["input_ids"]))
    assert sorted(map(tuple, back["seq_lengths"])) == sorted(map(tuple, rows["seq_lengths"]))


def test_errors_name_the_example_index_in_the_whole_dataset(local_ray):
    lengths = make_lengths(n=800, seed=3, hi=W)
    lengths[613] = W + 5  # in block 6 of 8
    with pytest.raises(ValueError, match=r"example 613 has 261 tokens > window=256.*overflow='split'"):
        raydata.pack_dataset(make_ds(lengths), window=W, overflow="error")
    table = make_table(lengths)
    ids = table.column("input_ids").to_pylist()
    ids[450] = []
    with pytest.raises(ValueError, match=r"dataset row 450 is empty \(0 tokens in 'input_ids'\)"):
        raydata.pack_dataset(ray.data.from_arrow([pa.table({"input_ids": ids[:400]}),
                                                  pa.table({"input_ids": ids[400:]})]), window=4 * W)
    labs = table.column("labels").to_pylist()
    labs[701] = labs[701][:-1]
    bad = pa.table({"input_ids": table.column("input_ids"), "labels": labs})
    with pytest.raises(ValueError, match="dataset row 701 has .* 'labels'"):
        raydata.pack_dataset(ray.data.from_arrow([bad.slice(0, 500), bad.slice(500)]), window=4 * W)
    with pytest.raises(KeyError, match="no column 'tokens'"):
        raydata.pack_dataset(make_ds(lengths), window=4 * W, columns=["tokens"])
    with pytest.raises(ValueError, match="unknown mode"):
        raydata.pack_dataset(make_ds(lengths), window=W, mode="cluster")
    with pytest.raises(TypeError, match="ray.data.Dataset"):
        raydata.pack_dataset([[1, 2]], window=W)


def test_packed_rows_collator_reads_ray_rows(data):
    """The same fixed-window collator reads the Ray rows: segments and positions as packed."""
    from packkit.collate import PackedRowsCollator

    _, ds = data
    out = raydata.pack_dataset(ds, window=W, mode="local", overflow="split")
    got = collect(out)
    rows = [{k: got[k][r] for k in got} for r in range(8)]
    batch = PackedRowsCollator(window=W)(rows)
    assert tuple(batch.input_ids.shape) == (8, W)
    for r, row in enumerate(rows):
        n = len(row["input_ids"])
        assert batch.input_ids[r, :n].tolist() == row["input_ids"]
        assert batch.labels[r, :n].tolist() == row["labels"]
        assert batch.position_ids[r, :n].tolist() == lengths_to_position_ids(row["seq_lengths"]).tolist()
    want = [s for row in rows for s in row["seq_lengths"] + ([W - len(row["input_ids"])] if len(row["input_ids"]) < W else [])]
    cu = batch.cu_seqlens.tolist()
    assert [b - a for a, b in zip(cu[:-1], cu[1:])] == want  # a padding tail is its own segment


def test_global_mode_equals_hf_pack_dataset(data, caplog):
    """Ray's global mode and the single-machine ``packkit.offline.pack_dataset`` give the same rows, in order."""
    hf = pytest.importorskip("packkit.offline")
    datasets = pytest.importorskip("datasets")
    from datasets.table import InMemoryTable

    lengths, ds = data
    want = hf.pack_dataset(datasets.Dataset(InMemoryTable(make_table(lengths))), window=W, overflow="split",
                           seed=5).data.table
    with caplog.at_level("WARNING", logger="packkit"):
        got = pa.concat_tables(ray.get(raydata.pack_dataset(ds, window=W, mode="global", overflow="split",
                                                            seed=5).to_arrow_refs()))
    assert raydata.PIECES_UNRECORDED in caplog.text and "\n" not in raydata.PIECES_UNRECORDED
    # the single machine also records each piece's example (it splits some here); Ray's rows do not, and say so
    assert got.column_names == ["input_ids", "labels", "seq_lengths"]
    assert want.column_names == got.column_names + ["example_ids", "piece_offsets", "example_loss"]
    want = want.select(got.column_names)
    assert got.schema.equals(want.schema), (got.schema, want.schema)
    assert got.equals(want.combine_chunks())


# ----------------------------------------------------------------------------------------------
# regressions
# ----------------------------------------------------------------------------------------------


def masked_table(lengths, mask_key, *, labels, seed=0):
    """Token ids unique per position, a random 0/1 loss mask, labels (ids + 1, some -100) if asked."""
    rng = np.random.default_rng(seed)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    ids = np.arange(offsets[-1], dtype=np.int32)
    offs = pa.array(offsets)
    cols = {"input_ids": pa.ListArray.from_arrays(offs, pa.array(ids)),
            mask_key: pa.ListArray.from_arrays(offs, pa.array(rng.integers(0, 2, ids.size).astype(np.int8)))}
    if labels:
        lab = np.where(rng.random(ids.size) < 0.2, IGNORE_INDEX, ids.astype(np.int64) + 1)
        cols["labels"] = pa.ListArray.from_arrays(offs, pa.array(lab))
    return pa.table(cols)


def blocks_of(table, blocks):
    cuts = np.linspace(0, table.num_rows, blocks + 1).astype(int)
    return [table.slice(a, b - a) for a, b in zip(cuts[:-1], cuts[1:])]


@pytest.mark.parametrize("mask_key", ["completion_mask", "assistant_masks"])
@pytest.mark.parametrize("labels", [False, True])
def test_loss_mask_becomes_labels(local_ray, mask_key, labels):
    """Before the fix, pack_dataset knew only label_key and dropped a completion_mask / assistant_masks
    column without a word, so the prompt tokens were trained on. Global mode must now give exactly the
    rows of packkit.offline.pack_dataset (which follows the collators' rule), and local mode the same labels
    for every token (the packed token ids are unique, so each label can be checked where it lands)."""
    hf = pytest.importorskip("packkit.offline")
    datasets = pytest.importorskip("datasets")
    from datasets.table import InMemoryTable

    lengths = make_lengths(n=600, seed=4, hi=W)
    table = masked_table(lengths, mask_key, labels=labels)
    ds = ray.data.from_arrow(blocks_of(table, 4))
    want = hf.pack_dataset(datasets.Dataset(InMemoryTable(table)), window=W, seed=2).data.table
    got = pa.concat_tables(ray.get(raydata.pack_dataset(ds, window=W, mode="global", seed=2).to_arrow_refs()))
    assert got.column_names == ["input_ids", "labels", "seq_lengths"]
    assert got.equals(want.combine_chunks())
    # local mode: the label of every token id is the masked label (or -100 at a segment start)
    ids = table.column("input_ids").combine_chunks().flatten().to_numpy()
    mask = table.column(mask_key).combine_chunks().flatten().to_numpy()
    base = table.column("labels").combine_chunks().flatten().to_numpy() if labels else ids.astype(np.int64)
    expect = np.where(mask != 0, base, IGNORE_INDEX)
    rows = collect(raydata.pack_dataset(ds, window=W, mode="local", tail_slack=0.0))
    for row_ids, row_labels, seqs in zip(rows["input_ids"], rows["labels"], rows["seq_lengths"]):
        want_labels = expect[np.asarray(row_ids)]
        want_labels[np.cumsum(seqs) - seqs] = IGNORE_INDEX
        assert row_labels == want_labels.tolist()


def test_label_values_are_checked_with_the_global_index(local_ray):
    """Before the fix, labels other than token ids and -100 were packed and failed only at collate time;
    pass 0 now names the example's index in the whole dataset."""
    lengths = make_lengths(n=400, seed=5, hi=W)
    table = make_table(lengths)
    labs = table.column("labels").to_pylist()
    labs[333][0] = -7
    bad = pa.table({"input_ids": table.column("input_ids"), "labels": labs})
    with pytest.raises(ValueError, match=r"dataset row 333 has label -7 in 'labels'"):
        raydata.pack_dataset(ray.data.from_arrow(blocks_of(bad, 4)), window=4 * W)


def test_loss_mask_values_are_checked_with_the_global_index(local_ray):
    """Before the fix, a loss mask of 2 or -1 was taken as "loss" offline while the collators
    reject it; pass 0 now names the example's index in the whole dataset."""
    lengths = make_lengths(n=400, seed=5, hi=W)
    ids = make_table(lengths).column("input_ids")
    mask = [[1] * int(n) for n in lengths]
    mask[250][-1] = 2
    bad = pa.table({"input_ids": ids, "completion_mask": mask})
    with pytest.raises(ValueError, match=r"dataset row 250 has 2 in the loss mask 'completion_mask'"):
        raydata.pack_dataset(ray.data.from_arrow(blocks_of(bad, 4)), window=4 * W)


def test_pass2_windows_are_spread_after_each_block(local_ray):
    """Before the fix, local mode put every pass-2 window into one last output block, so they were all
    trained last. The output is now block 0's windows, then pass-2 piece 0, block 1's windows, piece 1,
    ... (near-equal contiguous pieces, empty ones left out), deterministically."""
    lengths = make_lengths(n=1200, seed=6, hi=W)
    blocks = blocks_of(make_table(lengths), 4)
    ds = ray.data.from_arrow(blocks)
    out, report = raydata.pack_dataset(ds, window=W, mode="local", overflow="split", tail_slack=0.0,
                                       return_report=True)
    assert report.pass2_windows >= 4  # every block hands windows over: a piece after each block
    opts = dict(window=W, strategy="bfd", overflow="split", seed=0, shuffle=True, tail_slack=0.0,
                input_key="input_ids", label_key="labels", has_labels=True, label_type=pa.int64(),
                mask_first_label=True)
    full = [raydata._pass1_block(b, i, opts)[0] for i, b in enumerate(blocks)]
    pieces = [len(a) for a in np.array_split(np.arange(report.pass2_windows), len(blocks))]
    got = ray.get(out.to_arrow_refs())
    print("rows per output block", [t.num_rows for t in got], "pieces", pieces)
    assert [t.num_rows for t in got] == [n for f, p in zip(full, pieces) for n in (f.num_rows, p) if n]
    for b, f in enumerate(full):
        assert got[2 * b].equals(f)  # the blocks' own windows, in block order
    assert sum(t.num_rows for t in got[1::2]) == report.pass2_windows


def test_scatter_block_matches_a_per_token_reference():
    """Before the fix, the global map side built an int64 index of every token and fancy-indexed; it now copies
    with packer.gather_segments. The pieces must be what the per-token index gave."""
    lengths = np.array([5, 3, 7, 1, 4])
    table = make_table(lengths)
    values = np.arange(int(lengths.sum()))
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    seg_local, seg_start, seg_length = np.array([2, 0, 4, 2, 1]), np.array([3, 0, 0, 0, 1]), np.array([4, 5, 4, 3, 2])
    chunk_ptr = np.array([0, 2, 2, 5])
    opts = {"input_key": "input_ids", "label_key": "labels", "has_labels": True}
    pieces = raydata._scatter_block(table, opts, seg_local, seg_start, seg_length, chunk_ptr)
    ref = [values[offsets[e] + s + k] for e, s, n in zip(seg_local, seg_start, seg_length) for k in range(n)]
    tok_ptr = np.concatenate(([0], np.cumsum(seg_length)))[chunk_ptr]
    for c, (v, lab) in enumerate(pieces):
        assert v.tolist() == ref[tok_ptr[c]:tok_ptr[c + 1]]
        assert lab.tolist() == [t + 1 for t in v.tolist()]


def test_option_errors_are_binpacks_own(local_ray):
    """Before the fix, raydata had its own copies of the strategy/overflow checks and the overflow error text."""
    from packkit.binpack import check_overflow, check_strategy, overflow_error

    lengths = np.array([3, W + 2, 4, W + 9])
    ds = make_ds(lengths, blocks=2)
    for kwargs, ref in [({"strategy": "best"}, lambda: check_strategy("best")),
                        ({"overflow": "wrap"}, lambda: check_overflow("wrap"))]:
        with pytest.raises(ValueError) as want:
            ref()
        with pytest.raises(ValueError) as got:
            raydata.pack_dataset(ds, window=W, **kwargs)
        assert str(got.value) == str(want.value)
    with pytest.raises(ValueError) as got:
        raydata.pack_dataset(ds, window=W, overflow="error")
    assert str(got.value) == str(overflow_error(lengths, W))


def test_negative_seed_is_refused_before_any_task(local_ray):
    """Bug: raydata's inline seed check took seed=-1, and in local mode _block_seed(-1, b) then raised inside
    a Ray task (SeedSequence refuses negative entropy). The seed is now binpack.check_seed's: refused up
    front with its error; a seed that is not an integer is still a TypeError."""
    from packkit.binpack import check_seed
    from packkit.errors import ArgumentError

    ds = make_ds(np.array([3, 5, 4, 7]), blocks=2)
    for mode in raydata.MODES:
        with pytest.raises(ArgumentError) as want:
            check_seed(-1)
        with pytest.raises(ArgumentError) as got:
            raydata.pack_dataset(ds, window=W, mode=mode, seed=-1)
        assert str(got.value) == str(want.value)
    with pytest.raises(TypeError, match="seed must be"):
        raydata.pack_dataset(ds, window=W, seed=1.5)
    assert raydata.pack_dataset(ds, window=W, seed=None).count() == 1


def test_block_errors_keep_their_type_and_text(local_ray):
    """Bug: _raise_block_error rebuilt examples.relocate by hand and turned ExampleValueError /
    ExampleTypeError (DataErrors) into plain ValueError / TypeError, so ``except DataError`` missed a bad
    example found on a Ray block. The block's exception now travels and is relocated on the driver: same
    type, same text ("dataset row ..." in the whole dataset); an error about no one example keeps its
    type and its "block b:" prefix."""
    from packkit.errors import DataError
    from packkit.rules import ExampleTypeError, ExampleValueError

    ids = [[1, 2], [3], [4, 5, 6], [7, -8], [9]]
    ds = ray.data.from_arrow([pa.table({"input_ids": ids[:3]}), pa.table({"input_ids": ids[3:]})])
    with pytest.raises(DataError) as got:
        raydata.pack_dataset(ds, window=8)
    assert type(got.value) is ExampleValueError and got.value.index == 0
    assert str(got.value) == "dataset row 3 has token id -8 in 'input_ids'; token ids are integers >= 0"
    floats = pa.table({"input_ids": pa.array([[1.0], [2.5]], pa.list_(pa.float64()))})
    ds = ray.data.from_arrow([pa.table({"input_ids": [[1], [2]]}), floats])
    with pytest.raises(DataError) as got:
        raydata.pack_dataset(ds, window=8)
    assert isinstance(got.value, TypeError) and type(got.value) is ExampleTypeError
    assert str(got.value) == "dataset row 3 has 2.5 (float) in 'input_ids'; token ids are integers >= 0"
    flat = ray.data.from_arrow([pa.table({"input_ids": [[1]]}), pa.table({"input_ids": [1, 2]})])
    with pytest.raises(TypeError, match=r"^block 1: column 'input_ids' holds int64, not lists of token ids") as got:
        raydata.pack_dataset(flat, window=8)
    assert not isinstance(got.value, DataError)


def test_handed_segments_past_int32_offsets_are_large_list(monkeypatch):
    """Bug: _segments_table built its list arrays with int32 offsets by hand (no large_list fallback), so a
    block handing over more than 2**31 - 1 tokens would wrap. It now goes through arrow.list_array, and pass 2
    joins a large_list block's segments with the others'. The limit is lowered to exercise the switch."""
    import packkit.arrow as pio

    values = np.arange(10, dtype=np.int32)
    tables = []
    for limit in (None, 4):
        with monkeypatch.context() as m:
            if limit is not None:
                m.setattr(pio, "MAX_LIST_VALUES", limit)
            tables.append(raydata._segments_table(values, values + 1, [0, 3, 4, 8, 10]))
    assert pa.types.is_list(tables[0].schema.field("input_ids").type)
    assert pa.types.is_large_list(tables[1].schema.field("input_ids").type)
    assert tables[1].to_pydict() == tables[0].to_pydict()
    opts = dict(window=8, strategy="bfd", seed=0, shuffle=False, has_labels=True, mask_first_label=True,
                label_type=pa.int64())
    got, stats = raydata._pass2_tail(opts, pa.int32(), 0, *tables)
    want, _ = raydata._pass2_tail(opts, pa.int32(), 0, tables[0], tables[0])
    assert got.equals(want) and stats["tokens"] == 20


@pytest.mark.parametrize("mode", ["local", "global"])
def test_packed_rows_repack_as_their_documents(data, mode):
    """Ray's pack of its own output reads each row's documents (``seq_lengths``): the same documents and
    labels, none merged. Before the fix every packed row was one example, its documents merged."""
    _, ds = data
    once = collect(raydata.pack_dataset(ds, window=W, overflow="split"))

    def documents(rows):
        out = []
        for ids, labels, segs in zip(rows["input_ids"], rows["labels"], rows["seq_lengths"]):
            pos = 0
            for n in segs:
                out.append((tuple(ids[pos: pos + n]), tuple(labels[pos: pos + n])))
                pos += n
        return sorted(out)

    table = pa.table(once)
    cuts = np.linspace(0, table.num_rows, 4).astype(int)
    packed_ds = ray.data.from_arrow([table.slice(a, b - a) for a, b in zip(cuts[:-1], cuts[1:])])
    twice = collect(raydata.pack_dataset(packed_ds, window=W, mode=mode, overflow="error"))
    assert documents(twice) == documents(once)
