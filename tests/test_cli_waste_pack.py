"""End-to-end CLI: `packkit waste` and `packkit pack` on small files of each format, and bad input."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from packkit.cli import main
from packkit.arrow import byte_tokenize
from packkit.listcolumns import list_chunks
from packkit.datafiles import read_lengths

datasets.disable_progress_bars()

IDS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11], [12, 13, 14, 15]]
TEXTS = ["héllo", "a b", "packing is fun", "x"]


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def files(tmp_path):
    t = pa.table({"input_ids": IDS, "labels": IDS})
    paths = {}
    paths["jsonl"] = tmp_path / "d.jsonl"
    paths["jsonl"].write_text("\n".join(json.dumps({"input_ids": x, "labels": x}) for x in IDS) + "\n")
    paths["json"] = tmp_path / "d.json"
    paths["json"].write_text(json.dumps([{"input_ids": x} for x in IDS]))
    paths["parquet"] = tmp_path / "d.parquet"
    pq.write_table(t, paths["parquet"])
    paths["arrow"] = tmp_path / "d.arrow"
    with ipc.new_file(str(paths["arrow"]), t.schema) as w:
        w.write_table(t)
    paths["stream.arrow"] = tmp_path / "s.arrow"
    with ipc.new_stream(str(paths["stream.arrow"]), t.schema) as w:
        w.write_table(t)
    paths["folder"] = tmp_path / "saved"
    datasets.Dataset(t).save_to_disk(str(paths["folder"]))
    paths["dict"] = tmp_path / "saved_dict"
    datasets.DatasetDict({"train": datasets.Dataset(t), "test": datasets.Dataset(t.slice(0, 2))}).save_to_disk(
        str(paths["dict"]))
    paths["npy"] = tmp_path / "l.npy"
    np.save(paths["npy"], np.array([len(x) for x in IDS]))
    paths["text.jsonl"] = tmp_path / "t.jsonl"
    paths["text.jsonl"].write_text("\n".join(json.dumps({"text": s}) for s in TEXTS) + "\n")
    paths["txt"] = tmp_path / "t.txt"
    paths["txt"].write_text("\n".join(TEXTS) + "\n\n")
    return paths


# -- io ------------------------------------------------------------------------------------------


@pytest.mark.slow
@given(st.lists(st.text(max_size=12), max_size=10))
@example([""])  # an empty text: an empty row
@example(["é", "\U0001f600 x"])  # two- and four-byte characters
def test_byte_tokenize_is_utf8(texts):
    assert byte_tokenize(texts).to_pylist() == [list(s.encode()) for s in texts]


@settings(max_examples=30)
@given(st.lists(st.lists(st.integers(0, 9), max_size=6), max_size=12), st.integers(0, 4), st.integers(0, 4))
@example([], 0, 0)
@example([[], [1]], 1, 1)  # an empty row; a slice that leaves one row in the second chunk
def test_list_chunks_of_sliced_chunked_columns(rows, lo, split):
    arr = pa.array(rows, pa.list_(pa.int64()))
    lo = min(lo, len(rows))
    sl = arr.slice(lo)
    split = min(split, len(sl))
    chunked = pa.chunked_array([sl.slice(0, split), sl.slice(split)], type=sl.type)
    lengths = [np.diff(offsets) for _, offsets, _, _ in list_chunks(chunked)]
    assert np.concatenate(lengths or [np.zeros(0, int)]).tolist() == [len(r) for r in rows[lo:]]


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "arrow", "stream.arrow", "folder", "dict", "npy"])
def test_read_lengths_every_format(files, kind):
    got = read_lengths(files[kind])
    assert got.lengths.tolist() == [len(x) for x in IDS] and got.unit == "tokens"


@pytest.mark.parametrize("kind", ["text.jsonl", "txt"])
def test_text_is_byte_tokenized_by_default(files, kind):
    got = read_lengths(files[kind])
    assert got.lengths.tolist() == [len(s.encode()) for s in TEXTS] and got.unit == "bytes"


def test_tokenizer_json(files, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "a": 1, "b": 2, "packing": 3, "is": 4, "fun": 5}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    got = read_lengths(files["text.jsonl"], tokenizer=str(path))
    assert got.lengths.tolist() == [1, 2, 3, 1] and got.unit == "tokens"


# -- packkit waste ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_waste_bundled_sample_table_json_and_plot(tmp_path, capsys):
    png = tmp_path / "waste.png"
    code, out, err = run(["waste", "--plot", str(png)], capsys)
    assert code == 0, err
    for label in ("pad to dataset's longest", "length-grouped batches", "packed: best fit decreasing",
                  "packed: streaming best fit"):
        assert label in out
    assert "bundled sample" in out and "attention vs padded" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "it/s" not in err  # no progress bar on the small sample
    code, out, _ = run(["waste", "--json", "--window", "512", "-b", "4"], capsys)
    d = json.loads(out)
    assert code == 0 and out.count("\n") == 1
    assert d["window"] == 512 and d["examples"] == read_lengths().lengths.size
    by = {s["name"]: s for s in d["strategies"]}
    assert by["bfd"]["padding_fraction"] < by["random"]["padding_fraction"] < by["pad_longest"]["padding_fraction"]


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "arrow", "folder", "dict", "npy", "text.jsonl", "txt"])
def test_waste_every_format(files, kind, capsys):
    code, out, err = run(["waste", str(files[kind]), "--json", "--window", "8", "-b", "2"], capsys)
    assert code == 0, err
    d = json.loads(out)
    assert d["examples"] == (len(TEXTS) if kind in ("text.jsonl", "txt") else len(IDS))


# -- packkit pack ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "arrow", "folder"])
@pytest.mark.parametrize("out_name", ["out.parquet", "outdir", "out.jsonl"])
def test_pack_command(files, kind, out_name, tmp_path, capsys):
    out = tmp_path / out_name
    code, stdout, err = run(["pack", str(files[kind]), str(out), "--window", "6"], capsys)
    assert code == 0, err
    if out_name.endswith(".parquet"):
        ds = datasets.Dataset.from_parquet(str(out))
    elif out_name.endswith(".jsonl"):
        ds = datasets.Dataset.from_json(str(out))
    else:
        ds = datasets.load_from_disk(str(out))
    assert set(ds.column_names) == {"input_ids", "labels", "seq_lengths"}
    assert sorted(t for r in ds["input_ids"] for t in r) == sorted(t for x in IDS for t in x)
    assert all(len(r) <= 6 for r in ds["input_ids"]) and len(ds) == 3
    assert "packed 5 examples" in stdout and "lower bound 3" in stdout


def test_pack_text_with_tokenizer_and_overflow_counts(files, tmp_path, capsys):
    out = tmp_path / "o.parquet"
    code, stdout, err = run(["pack", str(files["text.jsonl"]), str(out), "-w", "4", "--tokenizer", "bytes",
                             "--overflow", "truncate"], capsys)
    assert code == 0, err
    ds = datasets.Dataset.from_parquet(str(out))
    assert sum(len(r) for r in ds["input_ids"]) == sum(min(len(s.encode()), 4) for s in TEXTS)
    assert "--overflow truncate: 2 of 4 examples longer than the window truncated; 12 of 24 tokens cut (50.00%)" in stdout


@pytest.mark.parametrize("argv, code, match", [
    (["waste", "{tmp}/missing.jsonl"], 3, "does not exist"),
    (["waste", "{tmp}/x.csv"], 3, "unknown format"),
    (["waste", "{tmp}/bad.parquet"], 3, "cannot read"),
    (["waste", "{tmp}/empty.jsonl"], 3, "no examples"),
    (["waste", "{tmp}/d.jsonl", "--column", "ids", "--text-column", "body"], 3,
     "no column 'ids' (token ids) or 'body' (text); the columns are ['input_ids', 'labels']: pass --column NAME "
     "or --text-column NAME"),
    (["waste", "{tmp}/d.jsonl", "--window", "0"], 2, "--window must be at least 1"),
    (["waste", "{tmp}/zero.npy"], 3, "example 1 has length 0"),
    (["waste", "{tmp}/t.jsonl", "--tokenizer", "{tmp}/nope.json"], 2, "--tokenizer"),
    (["waste", "--plot", "{tmp}/w.jpg"], 2, "--plot writes a PNG"),
    (["waste", "{tmp}"], 3, "not a dataset saved with save_to_disk"),
    (["waste", "--strategies", "bfd,best"], 2, "unknown strategies ['best']; choose from --strategies"),
    (["waste", "--window", "x"], 2, "argument -w/--window: invalid int value: 'x' (see packkit waste --help)"),
    (["waste", "--balance", "bogus"], 2, "--balance: invalid choice: 'bogus' (choose from none, tokens, sqlen, compute)"),
    (["plan", "--synthetic", "9", "--ranks", "0"], 2, "--world-size must be at least 1, got 0"),
    (["pack", "{tmp}/t.jsonl", "{tmp}/o.parquet", "-w", "8"], 3, "pass --tokenizer tokenizer.json (or --tokenizer bytes)"),
    (["pack", "{tmp}/l.npy", "{tmp}/o.parquet", "-w", "8"], 3, "lengths only"),
    (["pack", "{tmp}/d.jsonl", "{tmp}/o.parquet", "-w", "2", "--overflow", "error"], 3,
     "example 0 (line 1 of '{tmp}/d.jsonl') has 3 tokens > --window 2 (and 2 more); pass --overflow split, "
     "truncate or drop, or raise --window"),
    (["pack", "{tmp}/d.jsonl", "{tmp}/o.csv", "-w", "8"], 2, "cannot write"),
    (["pack", "{tmp}/d.jsonl", "{tmp}/o.parquet", "-w", "8", "--columns", "input_ids,mask"], 3, "'mask' is not in"),
    (["pack", "{tmp}/d.jsonl", "{tmp}/o.parquet", "-w", "8", "--columns", "ids"], 3, "pass --columns NAME or "
                                                                                   "--text-column NAME"),
    (["pack", "{tmp}/saved_dict", "{tmp}/o.parquet", "-w", "8", "--split", "dev"], 3, "no split 'dev'"),
    (["pack", "{tmp}/saved", "{tmp}/o.parquet", "-w", "8", "--split", "dev"], 3, "not a DatasetDict: drop --split"),
    (["pack", "{tmp}/d.jsonl", "{tmp}/o.parquet", "-w", "8", "--seed", "-1"], 2, "--seed must be at least 0"),
    (["pack", "{tmp}/d.jsonl", "{tmp}/o.parquet", "-w", "8", "--num-proc", "0"], 2, "--num-proc must be at least 1"),
    (["pack", "{tmp}/d.jsonl", "{tmp}/o.parquet", "-w", str(2**40)], 2, "is above the largest window"),
    (["pack", "{tmp}/d.jsonl", "{tmp}/d.jsonl", "-w", "8", "--overwrite"], 2, "is the input"),
    (["pack", "{tmp}/d.jsonl", "{tmp}/no/such/o.parquet", "-w", "8"], 2, "does not exist; create it first"),
    (["pack", "{tmp}/d.jsonl", "{tmp}/saved", "-w", "8"], 2, "exists; pass --overwrite to replace it"),
    (["pack", "{tmp}/d.jsonl", "{tmp}/d.parquet", "-w", "8"], 2, "exists; pass --overwrite to replace it"),
    (["pack", "{tmp}/d.jsonl", "{tmp}/saved.parquet", "-w", "8"], 2, "is a folder, and the output is a file"),
    (["pack", "{tmp}/d.jsonl", "-w", "8"], 2, "the following arguments are required: output"),
    (["plan", "--synthetic", "100", "-a", "0"], 2, "--accumulation-steps must be at least 1, got 0: "
                                                  "--accumulation-steps 1 means no accumulation"),
    (["plan", "--synthetic", "100", "-w", "8", "--padded"], 2, "not allowed with argument"),
    (["plan"], 2, "give a lengths FILE or --synthetic N"),
])
def test_bad_input_is_one_line_with_its_exit_code(files, tmp_path, capsys, argv, code, match):
    """One line naming the option in the CLI's syntax, exit 2 for the command line, 3 for the input (before
    the fix: tracebacks, library argument names, and one exit code for both)."""
    (tmp_path / "x.csv").write_text("a,b\n")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "saved.parquet").mkdir()
    np.save(tmp_path / "zero.npy", np.array([3, 0, 2]))
    before = {p: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    got, out, err = run([a.format(tmp=tmp_path) for a in argv], capsys)
    print(err)
    assert got == code
    assert err.count("\n") == 1 and "Traceback" not in err and match.format(tmp=tmp_path) in err
    assert {p: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before  # nothing written or changed


def test_pack_command_turns_a_loss_mask_into_labels(tmp_path, capsys):
    """Before the fix, `packkit pack` on SFT data with a completion_mask wrote input_ids and seq_lengths
    only, dropping the mask, so training on the output learned the prompts. The mask now becomes
    labels (-100 where it is 0, and on every segment's first token)."""
    src = tmp_path / "sft.jsonl"
    rows = [{"input_ids": [1, 2, 3, 4], "completion_mask": [0, 0, 1, 1]},
            {"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1]}]
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "packed.parquet"
    code, stdout, err = run(["pack", str(src), str(out), "-w", "8", "--no-shuffle"], capsys)
    assert code == 0, err
    table = pq.read_table(out)
    assert table.column_names == ["input_ids", "labels", "seq_lengths"]
    assert table.column("labels").to_pylist() == [[-100, -100, 3, 4, -100, 6, 7]]
    assert "columns ['input_ids', 'labels', 'seq_lengths']" in stdout


def test_pack_command_rejects_bad_label_values(tmp_path, capsys):
    """A label of -5 is an error at pack time that names the example and its line, one line, exit 3
    (data); before the fix it was packed and failed only when a collator read it."""
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(json.dumps({"input_ids": x, "labels": y})
                             for x, y in [([1, 2], [1, 2]), ([3, 4], [-100, -5])]) + "\n")
    code, out, err = run(["pack", str(src), str(tmp_path / "o.parquet"), "-w", "8"], capsys)
    assert code == 3 and err.count("\n") == 1 and "dataset row 1 (line 2 of" in err and "has label -5" in err


def test_disk_full_while_writing_leaves_the_old_output(files, tmp_path, capsys, monkeypatch):
    """An OSError while OUT is written (here ENOSPC after half the file) is one line, exit 4 (system);
    the temporary file is removed and the previous OUT is untouched."""
    import errno

    from packkit import outputs

    out = tmp_path / "out.parquet"
    out.write_bytes(b"the previous complete output")

    def full_disk(self, batch):  # the first record batch finds the disk full
        raise OSError(errno.ENOSPC, "No space left on device", "out.parquet")

    monkeypatch.setattr(outputs._ParquetSink, "write", full_disk)
    code, _, err = run(["pack", str(files["jsonl"]), str(out), "-w", "6", "--overwrite"], capsys)
    assert code == 4 and err.count("\n") == 1 and "No space left on device" in err
    assert out.read_bytes() == b"the previous complete output"
    assert sorted(p.name for p in tmp_path.iterdir() if "packkit-tmp" in p.name) == []


def test_pack_puts_the_packkit_log_level_back(files, tmp_path, capsys):
    """packkit pack quiets the packkit logger while it prints its own notes; run in a program's own process
    (packkit.cli.main), it left the level at ERROR, so every later packkit warning of that process was lost
    (a pack_dataset run after it logged no loss-free windows)."""
    import logging

    logger = logging.getLogger("packkit")
    before = logger.level
    logger.setLevel(logging.INFO)
    try:
        code, _, err = run(["pack", str(files["jsonl"]), str(tmp_path / "o.parquet"), "--window", "6"], capsys)
        assert code == 0, err
        assert logger.level == logging.INFO
        code, _, _ = run(["pack", str(files["jsonl"]), str(tmp_path / "o.parquet"), "--window", "0"], capsys)
        assert code != 0 and logger.level == logging.INFO
    finally:
        logger.setLevel(before)


def test_an_out_with_no_example_left_blames_what_left_none(tmp_path, capsys):
    """Regression: ``packkit pack --overflow drop`` with every example longer than the window blamed
    ``--drop-loss-free``, not passed ("no piece ... holds a loss token, and --drop-loss-free left every one out");
    the refusal names the window now, and ``--drop-loss-free`` is blamed where it left every piece out."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"input_ids": [1, 2, 3, 4, 5, 6]}\n{"input_ids": [1, 2, 3, 4, 5, 6, 7]}\n')
    code, _, err = run(["pack", str(src), str(tmp_path / "a.parquet"), "-w", "4", "--overflow", "drop", "-q"], capsys)
    assert code == 3 and "--drop-loss-free" not in err, err
    assert f"no example of {str(src)!r} is left to write (drop and 4 tokens a window); raise --window" in err
    src.write_text('{"input_ids": [1, 2, 3], "labels": [-100, -100, -100]}\n')
    code, _, err = run(["pack", str(src), str(tmp_path / "b.parquet"), "--drop-loss-free", "-q"], capsys)
    assert code == 3 and not (tmp_path / "b.parquet").exists()
    assert f"no piece of {str(src)!r} holds a loss token, and --drop-loss-free left every one out" in err, err
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]], "labels": [[-100, -100, -100]]})
    from packkit.offline import pack_dataset
    with pytest.raises(ValueError, match="no piece holds a loss token, and drop_loss_free=True left every one out"):
        pack_dataset(ds, window=8, drop_loss_free=True)


@pytest.mark.parametrize("overflow, said", [("drop", "packed 2 of 3 examples (5 of 15 tokens)"),
                                            ("truncate", "packed 3 examples (13 of 15 tokens)"),
                                            ("split", "packed 3 examples (15 tokens)")])
def test_the_summary_counts_the_examples_packed_not_those_read(tmp_path, capsys, overflow, said):
    """Regression: ``--overflow drop`` said ``packed 3 examples`` of a file whose longest example it dropped (the line
    after said so): the summary counts the examples in a window, of those read; the JSON line keeps both counts."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}\n{"input_ids": [4, 5]}\n')
    code, stdout, err = run(["pack", str(src), str(tmp_path / "o.parquet"), "-w", "8", "--overflow", overflow], capsys)
    assert code == 0, err
    assert stdout.splitlines()[0].startswith(said + " into "), stdout
    code, stdout, err = run(["pack", str(src), str(tmp_path / "j.parquet"), "-w", "8", "--overflow", overflow,
                             "--json"], capsys)
    got = json.loads(stdout)
    assert code == 0 and (got["examples"], got["overflow_examples"]) == (3, 1), got


def test_the_summary_leaves_out_the_examples_drop_loss_free_left_out(tmp_path, capsys):
    """The review's case: ``--drop-loss-free`` left one example of three out, and the summary said ``packed 3``."""
    src = tmp_path / "lf.jsonl"
    src.write_text('{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}\n{"input_ids": [4, 5, 6], "labels": [-100, -100, -100]}\n'
                   '{"input_ids": [7, 8], "labels": [7, 8]}\n')
    code, stdout, err = run(["pack", str(src), str(tmp_path / "o.parquet"), "-w", "4", "--drop-loss-free"], capsys)
    assert code == 0, err
    assert stdout.splitlines()[0].startswith("packed 2 of 3 examples (5 of 8 tokens) into "), stdout

