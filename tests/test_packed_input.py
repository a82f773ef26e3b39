"""Packed data is a kind of input: rows carrying ``seq_lengths`` (or restarting ``position_ids``) are read
as their documents by ``pack_dataset``, ``packkit pack``, ``waste`` and ``plan``, never as one example.

Before the fix, ``packkit pack packed.parquet repacked.parquet`` packed every old window as one example
and dropped ``seq_lengths``, so documents that shared a window attended to each other after the repack;
``waste`` and ``plan`` reported one example per window.
"""

from __future__ import annotations

import collections
import json

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from packkit.cli import main
from packkit.offline import pack_dataset
from packkit.segments import IGNORE_INDEX

datasets.disable_progress_bars()


# -- slow, obvious references --------------------------------------------------------------------


def documents(rows):
    """Every document of packed rows as ``(ids, labels)`` tuples, cut by their ``seq_lengths``, in a
    multiset; asserts each row's segments cover it exactly."""
    out = collections.Counter()
    for row in rows:
        ids, labels, seqs = row["input_ids"], row.get("labels") or row["input_ids"], row["seq_lengths"]
        assert sum(seqs) == len(ids) and all(n >= 1 for n in seqs)
        pos = 0
        for n in seqs:
            out[(tuple(ids[pos: pos + n]), tuple(labels[pos: pos + n]))] += 1
            pos += n
    return out


def as_packed(examples, window):
    """The documents one pack of ``examples`` makes (overflow split): every example cut into pieces of at
    most ``window``, each piece's first label -100 (labels are shifted)."""
    out = collections.Counter()
    for ex in examples:
        ids, labels = ex["input_ids"], ex["labels"]
        for lo in range(0, len(ids), window):
            lab = list(labels[lo: lo + window])
            lab[0] = IGNORE_INDEX
            out[(tuple(ids[lo: lo + window]), tuple(lab))] += 1
    return out


def loss_count(docs) -> int:
    """Loss tokens of documents: labels other than -100 past each document's first token."""
    return sum(c * sum(1 for x in lab[1:] if x != IGNORE_INDEX) for (_, lab), c in docs.items())


def rows_of(ds):
    return [dict(zip(ds.column_names, vals)) for vals in zip(*(ds[c] for c in ds.column_names))]


@st.composite
def corpora(draw):
    window = draw(st.integers(2, 12))
    n = draw(st.integers(1, 14))
    examples = []
    for _ in range(n):
        length = draw(st.integers(1, 2 * window + 1))
        ids = draw(st.lists(st.integers(0, 50), min_size=length, max_size=length))
        masked = draw(st.lists(st.booleans(), min_size=length, max_size=length))
        examples.append({"input_ids": ids, "labels": [IGNORE_INDEX if m else t for t, m in zip(ids, masked)]})
    return examples, window


# -- pack_dataset: a packed Dataset repacks as its documents --------------------------------------


@settings(max_examples=10)
@given(corpora(), st.sampled_from(["bfd", "ffd", "next_fit", "shuffle_ff"]), st.integers(0, 3))
@example(([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4], "labels": [4]}], 4), "bfd", 0)
def test_repacking_keeps_every_document_and_label(corpus, strategy, extra):
    """pack_dataset of pack_dataset's output, at the same window and a larger one: the same documents
    with the same labels, none merged, none lost, none doubled; the loss-token count unchanged."""
    examples, window = corpus
    ds = datasets.Dataset.from_list(examples)
    once = pack_dataset(ds, window=window, overflow="split", strategy=strategy, seed=1)
    want = as_packed(examples, window)
    assert documents(rows_of(once)) == want
    for w2 in (window, window + extra + 1):
        twice = pack_dataset(once, window=w2, overflow="error", strategy=strategy, seed=2)
        assert documents(rows_of(twice)) == want
        assert all(len(r) <= w2 for r in twice["input_ids"])
    # a smaller window splits a document (under split) into pieces; by their example ids and offsets (carried
    # through the repack where the first pack split examples) the pieces reassemble every example
    if window > 2:
        small = pack_dataset(once, window=window - 1, overflow="split", shuffle=False, example_ids=True)
        pieces = collections.defaultdict(list)
        for row in rows_of(small):
            pos = 0
            for n, e, o in zip(row["seq_lengths"], row["example_ids"], row["piece_offsets"]):
                pieces[e].append((o, row["input_ids"][pos: pos + n]))
                pos += n
        joined = [tuple(t for _, part in sorted(p) for t in part) for p in pieces.values()]
        assert sorted(joined) == sorted(tuple(ex["input_ids"]) for ex in examples)


def test_position_ids_mark_documents_too():
    """Rows packed by another tool, with restarting position_ids and no seq_lengths."""
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5], [6, 7]],
                                     "position_ids": [[0, 1, 2, 0, 1], [0, 1]]})
    out = pack_dataset(ds, window=8, shuffle=False, strategy="next_fit")
    assert out["seq_lengths"] == [[3, 2, 2]]
    assert out["input_ids"] == [[1, 2, 3, 4, 5, 6, 7]]


@pytest.mark.parametrize("col, bad, message", [
    ("seq_lengths", [[2, 2], [2]], "dataset row 0 has seq_lengths summing to 4 for 3 input_ids"),
    ("seq_lengths", [[3], [0, 2]], "dataset row 1 has a segment of length 0"),
    ("position_ids", [[0, 1, 2], [0, 2]], "dataset row 1 has position_ids that neither restart"),
])
def test_bad_segments_are_named(col, bad, message):
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]], col: bad})
    with pytest.raises(ValueError, match=message):
        pack_dataset(ds, window=8)


# -- the command line: pack, waste and plan on packed files --------------------------------------


def test_cli_round_trip_waste_and_plan_read_documents(tmp_path, capsys):
    """pack of pack's output (same and other window, parquet and JSON lines), waste and plan of the
    packed file: the same documents and labels, and waste/plan count documents and their loss tokens."""
    rng = np.random.default_rng(0)
    examples = []
    for _ in range(60):
        n = int(rng.integers(1, 90))
        ids = rng.integers(0, 500, n).tolist()
        examples.append({"input_ids": ids, "labels": [t if rng.random() < 0.6 else IGNORE_INDEX for t in ids]})
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps(e) + "\n" for e in examples))
    want = as_packed(examples, 32)

    def run(*argv):
        assert main(list(argv)) == 0, capsys.readouterr().err
        return capsys.readouterr().out

    run("pack", str(src), str(tmp_path / "p1.parquet"), "-w", "32", "-q")
    assert documents(pq.read_table(tmp_path / "p1.parquet").to_pylist()) == want
    out = json.loads(run("pack", str(tmp_path / "p1.parquet"), str(tmp_path / "p2.jsonl"), "-w", "32", "--json"))
    assert out["examples"] == sum(want.values()) and out["packed_rows_in"] == len(
        pq.read_table(tmp_path / "p1.parquet"))
    rows = [json.loads(line) for line in (tmp_path / "p2.jsonl").read_text().splitlines()]
    assert documents(rows) == want
    run("pack", str(tmp_path / "p2.jsonl"), str(tmp_path / "p3.parquet"), "-w", "100", "-q")
    assert documents(pq.read_table(tmp_path / "p3.parquet").to_pylist()) == want
    text = run("pack", str(tmp_path / "p3.parquet"), str(tmp_path / "p4.parquet"), "-w", "100")
    assert f"{len(pq.read_table(tmp_path / 'p3.parquet')):,} packed rows read as their {sum(want.values()):,} " \
           "documents" in text

    waste = json.loads(run("waste", str(tmp_path / "p1.parquet"), "-w", "32", "--json", "-q"))
    assert waste["examples"] == sum(want.values())
    assert waste["loss_tokens"] == loss_count(want)
    plan = json.loads(run("plan", str(tmp_path / "p1.parquet"), "-w", "32", "--json"))
    assert plan["num_examples"] == sum(want.values())
    assert plan["steps_per_epoch"] == len(pq.read_table(tmp_path / "p1.parquet"))  # bfd again: as many windows


def test_pack_refuses_nothing_silently_on_a_bad_packed_file(tmp_path, capsys):
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]], "seq_lengths": [[1, 1]]}), bad)
    assert main(["pack", str(bad), str(tmp_path / "o.parquet"), "-w", "8"]) == 3
    assert "dataset row 0 has seq_lengths summing to 2 for 3 input_ids" in capsys.readouterr().err


# -- streams and collators ------------------------------------------------------------------------


def test_stream_packs_documents_of_packed_rows():
    """pack_stream and pack_dataset of an IterableDataset read a packed row as its documents."""
    from packkit.packer import pack_stream

    rows = [{"input_ids": [1, 2, 3, 4], "labels": [-100, 2, -100, 4], "seq_lengths": [3, 1]},
            {"input_ids": [5, 6], "labels": [-100, 6], "seq_lengths": [2]}]
    out = list(pack_stream(rows, window=3, buffer_size=1))
    assert [r["seq_lengths"].tolist() for r in out] == [[3], [1, 2]]
    assert [r["labels"].tolist() for r in out] == [[-100, 2, -100], [-100, -100, 6]]
    ids = datasets.IterableDataset.from_generator(lambda: iter(rows))
    packed = list(pack_dataset(ids, window=3, shuffle=False, buffer_size=1))
    assert [list(r["seq_lengths"]) for r in packed] == [[3], [1, 2]]
    with pytest.raises(ValueError, match="example 1 has seq_lengths summing to 1 for 2 input_ids"):
        list(pack_stream([rows[0], {"input_ids": [5, 6], "seq_lengths": [1]}], window=3))


@pytest.mark.parametrize("name", ["PaddingFreeCollator", "FixedWindowCollator", "PaddedCollator"])
def test_collators_of_examples_refuse_packed_rows(name):
    """A packed row handed to a collator of examples (directly, or through ColumnarDataset) is refused
    with the fix, never collated as one example whose documents attend to each other."""
    from packkit import collate
    from packkit.columnar import ColumnarDataset

    kwargs = {"window": 8} if name == "FixedWindowCollator" else {}
    coll = getattr(collate, name)(**kwargs)
    rows = [{"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [1, 2, 3], "labels": [-100, 2, 3],
                                                    "seq_lengths": [2, 1]}]
    with pytest.raises(ValueError, match="example 1 is a packed row .* PackedRowsCollator"):
        coll(rows)
    cds = ColumnarDataset(pa.table({"input_ids": [[1, 2, 3], [4, 5]], "seq_lengths": [[2, 1], [2]]}))
    with pytest.raises(ValueError, match="dataset row 1 is a packed row"):
        coll(cds.__getitems__([1, 0]))
    batch = collate.PackedRowsCollator(window=4, loss_mask="none")(cds.__getitems__([0]))
    assert batch.position_ids.tolist() == [[0, 1, 0, 0]]


def test_an_error_about_a_document_of_packed_rows_names_no_line(tmp_path, capsys):
    """An example of packed JSON lines is a document, not a line: ``example 2`` is the second row's first document
    here. The command line found ``example N`` in the message text and named line N + 1 (line 3, a row that
    does not exist); the reader now reads the error's row as a number and names a line for a dataset row only."""
    src = tmp_path / "packed.jsonl"
    rows = [{"input_ids": [1, 2, 3, 4], "seq_lengths": [2, 2]}, {"input_ids": [5, 6, 7, 8, 9], "seq_lengths": [5]},
            {"input_ids": [1], "seq_lengths": [1]}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["pack", str(src), str(tmp_path / "o.parquet"), "-w", "4", "--overflow", "error", "-q"]) == 3
    err = capsys.readouterr().err
    assert "example 2 has 5 tokens > --window 4" in err and "(line" not in err, err
    bad = tmp_path / "bad.jsonl"  # a dataset row is a line, packed or not
    bad.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps({"input_ids": [5, -6], "seq_lengths": [2]}) + "\n")
    assert main(["pack", str(bad), str(tmp_path / "o.parquet"), "-w", "4", "-q"]) == 3
    err = capsys.readouterr().err
    assert f"dataset row 1 (line 3 of '{bad}') has token id -6" in err, err


# -- multimodal rows packed, read back ------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:.*(tokens per optimiser step|steps per epoch)")
def test_packed_media_rows_give_the_figures_of_the_rows_before_packing(tmp_path, capsys):
    """Gemma-3-like rows with their images, packed by ``packkit pack --example-ids`` and by ``pack_dataset(...,
    output=, example_ids=True)``: ``packkit waste`` / ``plan`` and ``measure_waste`` / ``plan_budget`` of the packed
    file give every figure of the rows before packing (their documents read in the dataset's order, by their
    example_ids: random batches, length grouping, next fit and the stream depend on it; they read the packed
    order before, 0.379 against 0.384 padding for random batches, 7 against 6 steps for next fit). Without
    example_ids the order-free figures (examples, tokens, loss tokens, best fit) are the same and the source says
    that the documents are read in packed order."""
    from test_media_faults import write_media

    from packkit.budget import plan_budget
    from packkit.datafiles import read_lengths
    from packkit.waste import measure_waste

    src = tmp_path / "rows.parquet"
    write_media(src, 400)
    with_ids, library, without = tmp_path / "ids.parquet", tmp_path / "lib.arrow", tmp_path / "no.parquet"
    assert main(["pack", str(src), str(with_ids), "-w", "256", "-q", "--example-ids"]) == 0
    assert main(["pack", str(src), str(without), "-w", "256", "-q"]) == 0
    pack_dataset(datasets.Dataset.from_parquet(str(src)), window=256, output=library, example_ids=True, progress=False)
    capsys.readouterr()

    def report(command, path):
        assert main([command, str(path), "-w", "256", "--json"]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        return out.pop("source", ""), out

    def figures(path):
        lengths = read_lengths(path)
        waste = measure_waste(lengths, window=256).to_dict()
        budget = plan_budget(lengths, per_device_batch=2, accumulation_steps=2, window=256).as_dict()
        waste.pop("source", None)
        budget.pop("source", None)
        return waste, budget

    want = {c: report(c, src)[1] for c in ("waste", "plan")}
    for packed in (with_ids, library):
        for command in ("waste", "plan"):
            source, got = report(command, packed)
            assert command == "plan" or "read as their 400 documents, in the dataset's order (example_ids)" in source
            assert got == want[command], (packed.name, command)
        assert figures(packed) == figures(src), packed.name
    for command, keys in (("waste", ("examples", "input_tokens", "loss_tokens", "longest_example")),
                          ("plan", ("num_examples", "num_tokens", "steps_per_epoch"))):
        source, got = report(command, without)
        assert command == "plan" or "documents in packed order (no example_ids: pack with example_ids" in source
        assert [got[k] for k in keys] == [want[command][k] for k in keys]


def test_packed_rows_with_split_examples_are_not_said_to_lack_example_ids(tmp_path, capsys):
    """``packkit pack`` writes ``example_ids`` whenever it splits an example; ``packkit waste`` of that output said
    ``in packed order (no example_ids: pack with example_ids ...)`` of a file that holds them (the ids repeat: the
    split examples' pieces cannot be put back in the dataset's order as documents). It now names that reason."""
    src, packed = tmp_path / "d.jsonl", tmp_path / "p.parquet"
    src.write_text("".join(json.dumps({"input_ids": list(range(1, n + 1))}) + "\n" for n in (5, 40, 9, 70, 3)))
    assert main(["pack", str(src), str(packed), "-w", "32", "-q"]) == 0
    assert "example_ids" in pq.read_table(packed).column_names
    capsys.readouterr()
    assert main(["waste", str(packed), "-w", "32", "-q"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "no example_ids" not in first, first
    assert "documents in packed order (pieces of split examples)" in first, first
