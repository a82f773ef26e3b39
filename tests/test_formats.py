"""The door out (packkit.outputs): every packed format read back by its own reader equals the rows
pack_dataset makes, token for token, boundary for boundary, loss mask for loss mask; writes are atomic;
an index-only plan re-plans from lengths and its rows, read lazily, are those packing writes.

Readers: megatron-core's IndexedDataset (0.16, the last release for Python 3.11), Megatron-Bridge's
packed parquet read with pyarrow under Bridge's column semantics (GPTSFTPackedDataset.collate_fn: document
[s, e) trains tokens[s:e-1] on labels input_ids[s+1:e] where loss_mask[s:e-1]), mosaicml-streaming's
StreamingDataset over an MDS folder. Bridge's own reader (GPTSFTPackedParquetDataset) cannot run here: it
ships from megatron-bridge 0.6 on, which requires Python 3.12 and a megatron-core past 0.16 (its import fails
on 0.16.1), and 0.3.1, the last release for Python 3.11, has no packed parquet reader.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import time
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

datasets = pytest.importorskip("datasets")

from packkit import outputs  # noqa: E402
from packkit.errors import ArgumentError, DataError  # noqa: E402
from packkit.offline import pack_dataset  # noqa: E402
from packkit.planindex import PlanIndex  # noqa: E402
from packkit.planned import PlannedDataset  # noqa: E402


def megatron_indexed():
    """megatron-core's IndexedDataset class (imports on CPU with torch alone: installed with --no-deps)."""
    mod = pytest.importorskip("megatron.core.datasets.indexed_dataset",
                              reason="megatron-core is not installed (pip install megatron-core==0.16.1)")
    return mod.IndexedDataset


@functools.cache
def streaming_dataset():
    """mosaicml-streaming's StreamingDataset. Its package __init__ imports streaming.vision, which needs
    torchvision; the MDS reader does not, so without torchvision the package is entered below its __init__."""
    if importlib.util.find_spec("streaming") is None:
        pytest.skip("mosaicml-streaming is not installed: make setup-test installs it without its dependencies "
                    "(cloud SDKs, torchvision; see MDS_READER in the Makefile)")
    try:
        from streaming.base import StreamingDataset
    except ModuleNotFoundError as exc:
        if exc.name != "torchvision":
            raise
        spec = importlib.util.find_spec("streaming")
        for name in [m for m in sys.modules if m == "streaming" or m.startswith("streaming.")]:
            del sys.modules[name]
        pkg = types.ModuleType("streaming")
        pkg.__path__, pkg.__spec__ = list(spec.submodule_search_locations), spec
        sys.modules["streaming"] = pkg
        from streaming.base import StreamingDataset
    return StreamingDataset


def make_dataset(lengths, seed: int, *, labels: bool = True):
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, 50_000, n).tolist() for n in lengths]
    cols = {"input_ids": ids}
    if labels:
        cols["labels"] = [[t if rng.random() < 0.6 else -100 for t in e] for e in ids]
    return datasets.Dataset.from_dict(cols)


def reference_rows(ds, **kw):
    """What pack_dataset makes in memory: per row (tokens, document lengths, trained-on mask)."""
    rows = pack_dataset(ds, **kw).with_format("numpy")
    return [as_row(r) for r in rows]


def as_row(r) -> tuple:
    """A packed row (a dict of input_ids, seq_lengths, maybe labels) as ``(tokens, document lengths, trained-on
    mask)``: labels other than -100, or without labels every token but each document's first."""
    ids, seg = np.asarray(r["input_ids"], np.int64), np.asarray(r["seq_lengths"], np.int64)
    if "labels" in r:
        return ids, seg, np.asarray(r["labels"]) != -100
    target = np.ones(ids.size, bool)
    target[np.concatenate([[0], np.cumsum(seg)[:-1]])] = False
    return ids, seg, target


def assert_rows_equal(got, want):
    assert len(got) == len(want)
    for r, ((gi, gs, gt), (wi, ws, wt)) in enumerate(zip(got, want)):
        assert np.array_equal(gi, wi), f"row {r}: tokens"
        assert np.array_equal(gs, ws), f"row {r}: document lengths"
        assert np.array_equal(gt, wt), f"row {r}: loss mask"


def read_megatron(folder):
    IndexedDataset = megatron_indexed()
    tokens, mask = IndexedDataset(str(folder / "tokens")), IndexedDataset(str(folder / "loss_mask"))
    docs = tokens.document_indices
    assert np.array_equal(docs, mask.document_indices)
    assert np.array_equal(tokens.sequence_lengths, mask.sequence_lengths)
    rows = []
    for r in range(len(docs) - 1):
        seqs = range(int(docs[r]), int(docs[r + 1]))
        ids = np.concatenate([tokens[i] for i in seqs]).astype(np.int64)
        target = np.concatenate([mask[i] for i in seqs]).astype(bool)
        rows.append((ids, tokens.sequence_lengths[docs[r]:docs[r + 1]].astype(np.int64), target))
    return rows


def read_bridge(path):
    """Bridge's parquet through pyarrow, turned back into packkit's view with Bridge's semantics: within a
    document [s, e) label input_ids[p + 1] is trained where loss_mask[p] (p in [s, e - 1))."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    assert table.schema.names == ["input_ids", "loss_mask", "seq_start_id"]
    assert [str(f.type) for f in table.schema] == ["list<element: int32>", "list<element: int8>",
                                                   "list<element: int32>"]
    rows = []
    for ids, mask, starts in zip(*(table.column(c).to_pylist() for c in table.schema.names)):
        bounds = starts + [len(ids)]
        assert starts[0] == 0 and all(a < b for a, b in zip(bounds, bounds[1:]))
        target = np.zeros(len(ids), bool)
        for s, e in zip(bounds, bounds[1:]):
            target[s + 1:e] = np.asarray(mask[s:e - 1], bool)  # Bridge's loss_mask[s:e-1] goes with labels ids[s+1:e]
            assert mask[e - 1] == 0
        rows.append((np.asarray(ids, np.int64), np.diff(bounds), target))
    return rows


def mds_samples(folder):
    """Every sample of an MDS folder through streaming's shard reader (``MDSReader.from_json`` on each shard
    of ``index.json``, as StreamingDataset opens them), in order."""
    streaming_dataset()
    from streaming.base.format.mds import MDSReader

    index = json.loads((folder / "index.json").read_text())
    assert index["version"] == 2
    for shard in index["shards"]:
        reader = MDSReader.from_json(str(folder), None, shard)
        for i in range(reader.samples):
            yield reader.get_item(i)


def read_mds(folder, has_labels: bool):
    rows = [as_row(sample) for sample in mds_samples(folder)]
    assert all(len(r[0]) for r in rows) and has_labels == ("labels" in next(mds_samples(folder)))
    return rows


READERS = {"megatron": ("out.megatron", lambda p, labels: read_megatron(p)),
           "bridge": ("out.idx.parquet", lambda p, labels: read_bridge(p)),
           "mds": ("out.mds", read_mds)}

packings = st.fixed_dictionaries({
    "lengths": st.lists(st.integers(1, 40), min_size=1, max_size=30),
    "window": st.sampled_from([3, 5, 8, 16, 17]),
    "strategy": st.sampled_from(["bfd", "ffd", "next_fit", "shuffle_ff"]),
    "overflow": st.sampled_from(["split", "truncate", "drop"]),
    "seed": st.integers(0, 3),
    "shuffle": st.booleans(),
    "labels": st.booleans(),
})


@pytest.mark.parametrize("fmt", [pytest.param("megatron", marks=pytest.mark.slow), "bridge",
                                 pytest.param("mds", marks=pytest.mark.slow)])
@settings(max_examples=12)
@given(p=packings)
def test_round_trip_through_the_formats_own_reader(tmp_path_factory, fmt, p):
    """Hypothesis-drawn packings (lengths 1..40 against windows 3..17: exactly the window, just above, several
    times above; split, truncate and drop; with and without labels) read back by each format's own reader."""
    if fmt in ("megatron",):
        megatron_indexed()
    if fmt == "mds":
        streaming_dataset()
    if p["overflow"] == "drop" and all(n > p["window"] for n in p["lengths"]):
        p["lengths"].append(1)
    ds = make_dataset(p["lengths"], p["seed"], labels=p["labels"])
    kw = dict(window=p["window"], strategy=p["strategy"], overflow=p["overflow"], seed=p["seed"], shuffle=p["shuffle"])
    want = reference_rows(ds, **kw)
    name, read = READERS[fmt]
    out = tmp_path_factory.mktemp(fmt) / name
    assert pack_dataset(ds, output=out, **kw) == out
    assert_rows_equal(read(out, p["labels"]), want)


@pytest.mark.slow  # megatron.core imports its model zoo on the way to IndexedDataset (5-20 s)
def test_megatron_keeps_the_token_type_and_names_its_prefixes(tmp_path):
    IndexedDataset = megatron_indexed()
    ds = make_dataset([3, 4, 5], 0).cast_column("input_ids", datasets.Sequence(datasets.Value("uint16")))
    pack_dataset(ds, window=8, output=tmp_path / "o", output_format="megatron")
    tokens = IndexedDataset(str(tmp_path / "o" / "tokens"))
    assert tokens[0].dtype == np.uint16 and int(tokens.sequence_lengths.sum()) == 12
    pack_dataset(make_dataset([3, 4], 0), window=8, output=tmp_path / "w.megatron")  # int64 ids: written as int32
    assert IndexedDataset(str(tmp_path / "w.megatron" / "tokens"))[0].dtype == np.int32
    big = datasets.Dataset.from_dict({"input_ids": [[5, 2**31]]})
    with pytest.raises(DataError, match="a token id of 2,147,483,648 .* does not fit the int32 ids of the megatron"):
        pack_dataset(big, window=8, output=tmp_path / "big.megatron")
    assert sorted(os.listdir(tmp_path / "o")) == ["loss_mask.bin", "loss_mask.idx", "packkit.json", "tokens.bin",
                                                  "tokens.idx"]


def test_shifted_labels_are_refused_by_the_loss_mask_formats(tmp_path):
    """Megatron and Bridge store token ids and a loss mask: labels that are neither would be trained on as
    something else, so the row is named instead."""
    ds = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7]], "labels": [[6, 7, -100]]})
    for name in ("a.megatron", "a.idx.parquet"):
        with pytest.raises(DataError, match=r"packed row 0: label 7 at token 2 is not its token id 7|label 6 at "
                                            r"token 0|label 7 at token 1 is not its token id 6"):
            pack_dataset(ds, window=4, output=tmp_path / name, mask_first_label=False)
        assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", ["o.parquet", "o.megatron", "o.idx.parquet", "o.mds", "o.packplan", "o"])
def test_an_interrupted_write_leaves_nothing_behind(tmp_path, monkeypatch, name):
    """A Ctrl-C in the middle of the rows (the second record batch) leaves no output and no temporary file,
    for every format; an existing output is kept as it was."""
    from packkit.offline import PackedTable

    ds = make_dataset([5] * 40, 1)
    real = PackedTable.record_batches

    def interrupted(self, **kw):
        for i, batch in enumerate(real(self, **kw)):
            if i == 1:
                raise KeyboardInterrupt
            yield batch

    stats = PackedTable.example_stats

    def interrupted_stats(self, **kw):
        stats(self, **kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(PackedTable, "record_batches", interrupted)
    monkeypatch.setattr(PackedTable, "example_stats", interrupted_stats)
    with pytest.raises(KeyboardInterrupt):
        pack_dataset(ds, window=8, output=tmp_path / name, buffer_bytes=1)
    assert os.listdir(tmp_path) == []


def test_output_format_by_name_and_by_suffix():
    f = outputs.output_format
    assert [f(n).name for n in ("a.parquet", "a.idx.parquet", "a.IDX.PQ", "a.pq", "a.mds", "a.megatron", "a.packplan",
                                "a.jsonl", "a")] == ["parquet", "bridge", "bridge", "parquet", "mds", "megatron", "plan",
                                                     "jsonl", "folder"]
    assert f("anything.bin", "megatron").name == "megatron"
    with pytest.raises(ArgumentError, match="unknown output format 'nope'; choose one of parquet, arrow"):
        f("a", "nope")
    with pytest.raises(ArgumentError, match=r"unknown output format '\.bin'.*\.megatron.*\.idx\.parquet"):
        f("a.bin")


def test_each_format_says_how_the_door_in_reads_it_and_whether_it_holds_media(tmp_path):
    """``Format.input_format`` is what the door in (:func:`packkit.datafiles.input_format`) makes of a file of that
    format by every one of its suffixes, so that ``packkit pack`` reads OUT back by its format whatever OUT's name
    ends with (it asked ``fmt.name == "parquet"``); ``Format.media`` is what pack_dataset decides by, and
    packkit.mediarows' names of those formats (for its messages, a floor below the door out) are held to it."""
    from packkit.datafiles import input_format
    from packkit.mediarows import MEDIA_FORMATS, MEDIA_INPUTS, MEDIA_SUFFIXES

    for f in outputs.FORMATS.values():
        if f.kind == "file":
            assert {input_format(tmp_path / f"out{s}") for s in f.suffixes} == {f.input_format}, f.name
    assert [f.name for f in outputs.FORMATS.values() if f.kind == "dir" and f.input_format] == ["folder"]
    assert input_format(tmp_path) == outputs.FORMATS["folder"].input_format
    media = [f for f in outputs.FORMATS.values() if f.media]  # packkit.mediarows, a floor below, names them itself
    assert MEDIA_FORMATS == tuple(f.name for f in media) == ("parquet", "arrow", "feather")
    assert MEDIA_INPUTS == tuple(dict.fromkeys(f.input_format for f in media)) == ("parquet", "arrow")
    assert MEDIA_SUFFIXES == ", ".join(f.suffixes[0] for f in media) == ".parquet, .arrow, .feather"


@pytest.mark.slow  # streaming imports its cloud clients (about 8 s loaded)
def test_mds_reads_through_streaming_dataset_across_shards(tmp_path):
    """streaming.StreamingDataset over a folder of several shards (size_limit small) gives every row."""
    StreamingDataset = streaming_dataset()
    ds = make_dataset(np.random.default_rng(2).integers(1, 40, 200).tolist(), 2)
    want = pack_dataset(ds, window=64).with_format("numpy")
    batches = pack_dataset(ds, window=64).data.to_batches()
    outputs.write_batches(tmp_path / "o.mds", batches[0].schema, batches, size_limit=1 << 12)
    assert len(list((tmp_path / "o.mds").glob("shard.*.mds"))) > 2
    sd = StreamingDataset(local=str(tmp_path / "o.mds"), shuffle=False, batch_size=1)
    assert len(sd) == len(want)
    for i in range(len(sd)):
        for key in ("input_ids", "labels", "seq_lengths"):
            assert np.array_equal(sd[i][key], want[i][key]), (i, key)


def test_cli_output_format(tmp_path, capsys):
    from packkit.cli import main

    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"input_ids": {list(range(1, n + 1))}}}\n' for n in (3, 5, 2, 7)))
    assert main(["pack", str(src), str(tmp_path / "o"), "-w", "8", "--output-format", "mds", "-q"]) == 0
    assert "as a MosaicML MDS folder" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "o")) == ["index.json", "shard.00000.mds"]
    assert main(["pack", str(src), str(tmp_path / "p.packplan"), "-w", "8", "-q", "--json"]) == 0
    assert '"format": "plan"' in capsys.readouterr().out
    assert PlanIndex.load(tmp_path / "p.packplan").plan.total_tokens == 17
    capsys.readouterr()
    assert main(["tokenize", str(src), str(tmp_path / "t.megatron"), "--tokenizer", "nowhere"]) == 2
    assert "holds packed rows; tokenize writes examples: name OUT .parquet, .arrow" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# the index-only plan
# ----------------------------------------------------------------------------------------------


@settings(max_examples=10)
@given(p=packings, new_window=st.sampled_from([4, 9, 32]), new_seed=st.integers(0, 5))
def test_plan_rows_equal_the_written_rows_and_replan_equals_a_new_pack(tmp_path_factory, p, new_window, new_seed):
    """The rows a PlannedDataset reads from a plan file are those pack_dataset writes; a re-plan at another
    window and seed gives the rows pack_dataset writes with them, and no token is written."""
    if p["overflow"] == "drop" and all(n > min(p["window"], new_window) for n in p["lengths"]):
        p["lengths"].append(1)
    ds = make_dataset(p["lengths"], p["seed"], labels=p["labels"])
    kw = dict(strategy=p["strategy"], overflow=p["overflow"], shuffle=p["shuffle"])
    path = tmp_path_factory.mktemp("plan") / "p.packplan"
    pack_dataset(ds, window=p["window"], seed=p["seed"], output=path, **kw)
    rows = PlannedDataset(path, ds)

    assert_rows_equal([as_row(r) for r in rows.__getitems__(range(len(rows)))],
                      reference_rows(ds, window=p["window"], seed=p["seed"], **kw))
    again = rows.replan(window=new_window, seed=new_seed)
    assert_rows_equal([as_row(again[i]) for i in range(len(again))],
                      reference_rows(ds, window=new_window, seed=new_seed, **kw))


def test_plan_file_loss_counts_and_fingerprint(tmp_path):
    ds = make_dataset([4, 9, 2, 30], 3)
    pack_dataset(ds, window=8, overflow="split", output=tmp_path / "p.packplan")
    index = PlanIndex.load(tmp_path / "p.packplan")
    labels = ds["labels"]
    want = [sum(x != -100 for x in lab[1:]) for lab in labels]  # whole examples, first token masked
    assert index.loss.tolist() == want
    assert index.columns == ("input_ids", "labels") and index.options["overflow"] == "split"
    changed = datasets.Dataset.from_dict({"input_ids": [list(reversed(e)) for e in ds["input_ids"]],
                                          "labels": labels})
    with pytest.raises(DataError, match="tokens or labels are not those planned"):
        PlannedDataset(tmp_path / "p.packplan", changed)
    shorter = ds.select([0, 1, 2])
    with pytest.raises(DataError, match="the source is not the one planned .it has 3 examples, the plan 4"):
        PlannedDataset(tmp_path / "p.packplan", shorter)


def test_plan_file_fields_are_checked(tmp_path):
    ds = make_dataset([4, 9, 2], 3)
    pack_dataset(ds, window=8, overflow="split", output=tmp_path / "p.packplan")
    with np.load(tmp_path / "p.packplan") as z:
        data = {k: z[k] for k in z.files}
    data["piece_row"] = data["piece_row"] + 7
    with open(tmp_path / "bad.packplan", "wb") as f:
        np.savez(f, **data)
    with pytest.raises(DataError, match="array 'piece_row': names an example outside the 3 of the source"):
        PlanIndex.load(tmp_path / "bad.packplan")


def test_plan_feeds_the_packed_rows_collator_in_a_dataloader_with_workers(tmp_path):
    """The collators read a PlannedDataset as they read rows packed offline (DataLoader, two workers)."""
    from torch.utils.data import DataLoader

    from packkit.collate import PackedRowsCollator

    ds = make_dataset(np.random.default_rng(0).integers(1, 30, 60).tolist(), 0)
    pack_dataset(ds, window=32, output=tmp_path / "p.packplan")
    written = pack_dataset(ds, window=32)
    rows = PlannedDataset(tmp_path / "p.packplan", ds)
    collate = PackedRowsCollator(window=32)
    got = list(DataLoader(rows, batch_size=4, collate_fn=collate, num_workers=2))
    want = list(DataLoader(written, batch_size=4, collate_fn=collate))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        for key in ("input_ids", "labels", "position_ids", "cu_seq_lens_q"):
            assert np.array_equal(np.asarray(a[key]), np.asarray(b[key])), key
        assert a.num_loss_tokens == b.num_loss_tokens


def test_plan_costs_at_most_16_bytes_an_example_and_replans_a_million_quickly():
    """On a million ShareGPT chat lengths (Qwen3 tokens, benchmarks/data), split at W=4096: the plan's arrays
    cost at most 16 bytes an example; the re-plan at W=8192 is timed and printed (the 1 s goal is
    benchmarks/bench_planindex.py's to measure, on a quiet machine)."""
    from packkit.binpack import pack

    here = os.path.dirname(__file__)
    lengths = np.load(os.path.join(here, "..", "benchmarks", "data", "sharegpt_qwen3_lengths.npy"))
    lengths = np.random.default_rng(0).choice(lengths, 1_000_000)
    plan = pack(lengths, window=4096, overflow="split").shuffled(0)
    index = PlanIndex(plan=plan, loss=lengths - 1, fingerprint="0" * 32, columns=("input_ids",),
                      mask_first_label=True, options={"strategy": "bfd", "overflow": "split", "seed": 0,
                                                      "shuffle": True, "cp_size": 1, "cp_layout": "hybrid"})
    per_example = index.nbytes() / lengths.size
    t = time.perf_counter()
    again = index.replan(window=8192, seed=1)
    seconds = time.perf_counter() - t
    print(f"\nplan: {per_example:.2f} bytes an example; re-plan of 1,000,000 examples at W=8192: {seconds:.2f} s")
    assert per_example <= 16
    assert again.plan.total_tokens == int(lengths.sum()) and again.window == 8192


def test_offline_formats_snippet_runs_as_pasted(tmp_path, monkeypatch):
    """The offline page's output-formats block (it writes train.packplan) runs as written, on a small
    dataset."""
    from test_readme import doc_code

    monkeypatch.chdir(tmp_path)
    scope = {"ds": make_dataset(np.random.default_rng(5).integers(1, 3000, 40).tolist(), 5)}
    code = doc_code("docs/offline.md", "## Other stacks, and index-only plans", "python")
    exec(compile(code, "docs/offline.md output formats", "exec"), scope)
    assert scope["rows"].window == 4096 and len(scope["rows"]) > 0
    assert sorted(os.listdir(tmp_path)) == ["train.idx.parquet", "train.mds", "train.megatron", "train.packplan"]


def _complete_tokens(out) -> int:
    """Tokens an output holds, read back whole (a partial one fails to read)."""
    import pyarrow.parquet as pq

    if out.name.endswith(".megatron"):
        about = json.loads((out / "packkit.json").read_text())
        assert (out / "tokens.bin").stat().st_size == about["tokens"] * np.dtype(about["token_dtype"]).itemsize
        return about["tokens"]
    if out.name.endswith(".mds"):
        return sum(len(s["input_ids"]) for s in mds_samples(out))
    if out.name.endswith(".packplan"):
        return PlanIndex.load(out).plan.total_tokens
    return sum(len(x) for x in pq.read_table(out, columns=["input_ids"]).column(0).to_pylist())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["o.megatron", "o.idx.parquet", "o.mds", "o.packplan"])
def test_sigint_at_random_moments_of_the_command_leaves_nothing(tmp_path, name):
    """`packkit pack` in a real process, SIGINT at random moments of its run from its first temporary file on
    (staging, planning, the writer thread, the rename): exit 130 with one line, or 0 (or killed by the signal
    on its way out) when it came after the work with OUT complete; OUT absent or complete; no temporary file
    left beside it."""
    import random
    import shutil
    import signal
    import subprocess

    import pyarrow as pa
    import pyarrow.parquet as pq

    from packkit.fileio import TMP_MARK

    if name == "o.mds":
        streaming_dataset()
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 600, 6000)
    total = int(lengths.sum())
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, 30000, total).astype(np.int32)))
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"input_ids": ids}), src)
    outs = tmp_path / "o"
    outs.mkdir()
    out = outs / name
    argv = [sys.executable, "-m", "packkit.cli", "pack", str(src), str(out), "-w", "1024", "-q", "--buffer-mb", "1"]
    t0 = time.monotonic()
    subprocess.run(argv, check=True, capture_output=True, timeout=120)
    took = time.monotonic() - t0
    assert _complete_tokens(out) == total
    rand = random.Random(3)
    codes = []
    for _ in range(3):
        if out.exists():
            (shutil.rmtree if out.is_dir() else os.unlink)(out)
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # from the first temporary file on (the staged input, then OUT's): the command's handlers are in place
        # (a signal during Python's own start-up is Python's KeyboardInterrupt, not packkit's)
        while proc.poll() is None and not any(TMP_MARK in p.name for d in (tmp_path, outs) for p in d.iterdir()):
            time.sleep(0.001)
        time.sleep(rand.uniform(0, took / 4))
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        codes.append(proc.returncode)
        # -2: the signal came after the work, once the command had given its handlers back (on its way out)
        assert proc.returncode in (0, 130, -signal.SIGINT), err
        assert proc.returncode != -signal.SIGINT or out.exists(), err
        if proc.returncode == 130:
            assert err == "packkit pack: interrupted\n", err
        assert [p.name for p in outs.iterdir() if TMP_MARK in p.name] == []
        assert [p.name for p in tmp_path.iterdir() if TMP_MARK in p.name] == []
        if out.exists():
            assert _complete_tokens(out) == total
        else:
            assert proc.returncode == 130
    print(f"{name}: a run {took:.2f} s, exit codes {codes}")


def test_a_plan_from_the_command_reads_the_rows_the_command_writes(tmp_path, capsys):
    """`packkit pack IN OUT.packplan`, then PlannedDataset over IN loaded with datasets: the rows (and the loss
    tokens the command counts) are those of `packkit pack IN OUT.parquet`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from packkit.cli import main

    rng = np.random.default_rng(0)
    ex = [rng.integers(0, 1000, rng.integers(1, 50)).tolist() for _ in range(300)]
    pq.write_table(pa.table({"input_ids": ex, "labels": [[t if rng.random() < .5 else -100 for t in e] for e in ex]}),
                   tmp_path / "in.parquet")
    outs = []
    for name in ("p.packplan", "r.parquet"):
        assert main(["pack", str(tmp_path / "in.parquet"), str(tmp_path / name), "-w", "64", "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0]["loss_tokens"] == outs[1]["loss_tokens"] and outs[0]["rows"] == outs[1]["rows"]
    rows = PlannedDataset(tmp_path / "p.packplan",
                          datasets.load_dataset("parquet", data_files=str(tmp_path / "in.parquet"))["train"])
    written = pq.read_table(tmp_path / "r.parquet").to_pylist()
    assert len(rows) == len(written)
    for i, want in enumerate(written):
        for key in ("input_ids", "labels", "seq_lengths"):
            assert rows[i][key].tolist() == want[key], (i, key)
