"""packkit.datafiles: list arrays with 64-bit offsets past int32, for both tokenizers."""

from __future__ import annotations

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
tokenizers = pytest.importorskip("tokenizers")

from packkit import arrow  # noqa: E402
from packkit import datafiles as pio  # noqa: E402


@pytest.fixture
def tokenizer_json(tmp_path):
    """A tiny word-level tokenizer.json built here (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "packing": 1, "is": 2, "fun": 3, "a": 4, "b": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


TEXTS = ["packing is fun", "a b", "fun", "zzz a"]
IDS = [[1, 2, 3], [4, 5], [3], [0, 4]]


def test_list_array_switches_to_large_list_past_the_limit():
    small = arrow.list_array([0, 2, 3], np.array([5, 6, 7]))
    assert pa.types.is_list(small.type) and small.to_pylist() == [[5, 6], [7]]
    big = arrow.list_array([0, 2, 3], np.array([5, 6, 7]), max_tokens=2)
    assert pa.types.is_large_list(big.type) and big.to_pylist() == [[5, 6], [7]]
    exact = arrow.list_array([0, 2, 3], np.array([5, 6, 7]), max_tokens=3)  # 3 offsets fit: no switch
    assert pa.types.is_list(exact.type)


@pytest.mark.parametrize("limit", [None, 7, 6])
def test_tokenize_uses_64_bit_offsets_past_int32(tokenizer_json, monkeypatch, limit):
    """Before the fix, tokenize (a tokenizer.json) built int32 offsets with astype(int32), which wraps past
    2**31 - 1 tokens (byte_tokenize had the large_list branch, tokenize did not). Both now go through
    arrow.list_array; the limit is lowered here to exercise the switch on 8 tokens."""
    if limit is not None:
        monkeypatch.setattr(arrow, "MAX_LIST_VALUES", limit)
    ids = pio.tokenize(TEXTS, str(tokenizer_json))
    byte_ids = pio.tokenize(TEXTS, "bytes")
    assert ids.to_pylist() == IDS
    assert byte_ids.to_pylist() == [list(t.encode()) for t in TEXTS]
    large = limit is not None and limit < 8
    assert pa.types.is_large_list(ids.type) == large
    assert pa.types.is_large_list(byte_ids.type) == (limit is not None)  # 27 bytes > 7
    assert np.diff(ids.offsets.to_numpy()).tolist() == [3, 2, 1, 2]


def test_tokenize_null_text_names_the_example(tokenizer_json):
    with pytest.raises(ValueError, match="example 1 has no text"):
        pio.tokenize(pa.array(["a", None]), str(tokenizer_json))


def test_text_lines_drop_the_bom_and_read_without_pyarrow(tmp_path):
    """A UTF-8 BOM was counted as 3 bytes of the first example; a .txt measured in bytes needs no pyarrow
    (the same lengths as the Arrow path), and bytes that are not UTF-8 name their line."""
    from packkit.datafiles import load_table, read_lengths
    from packkit.readers import text_lines

    path = tmp_path / "t.txt"
    path.write_bytes("\ufeffhé\n\n  \nthere\r\nlast".encode())
    assert list(text_lines(path)) == ["hé", "there", "last"]
    assert read_lengths(path).lengths.tolist() == [3, 5, 4]
    assert load_table(path).column("text").to_pylist() == ["hé", "there", "last"]
    path.write_bytes(b"fine\nbad \xff here\n")
    with pytest.raises(ValueError, match=r"is not UTF-8 text: line 2 holds b'\\xff'"):
        read_lengths(path)


def test_a_line_many_chunks_long_is_read_in_linear_time(tmp_path):
    """A line longer than a chunk grew with ``rest += block`` (a copy of the whole line for each chunk
    read: quadratic; a 128 MiB JSON line took 9-13x the same bytes in 1 MiB lines). At a chunk of 256 bytes, a
    2 MiB line is 8,192 chunks: the old growth copied ~8 GiB (a minute here); joined once, it costs what the
    same bytes in short lines cost. The chunks are whole lines and hold every byte."""
    import time

    from packkit.jsonlines import line_chunks

    body = ",".join("7" * (1 << 20))  # one digit and a comma each: 2 MiB of text
    long_path, short_path = tmp_path / "long.jsonl", tmp_path / "short.jsonl"
    long_path.write_text('{"input_ids": [' + body + "]}\n")
    cut = [body[i: i + 1000].strip(",") for i in range(0, len(body), 1000)]
    short_path.write_text("".join('{"input_ids": [' + c + "]}\n" for c in cut if c))

    def clock(path):
        t = time.perf_counter()
        n = sum(len(c) for c in line_chunks(path, size=256))
        return time.perf_counter() - t, n

    (t_long, n_long), (t_short, n_short) = clock(long_path), clock(short_path)
    assert n_long == long_path.stat().st_size and n_short == short_path.stat().st_size
    assert t_long < 0.25 + 4 * t_short, (t_long, t_short)
    assert [len(c) for c in line_chunks(long_path, size=256)] == [long_path.stat().st_size]


@pytest.mark.parametrize("sep", [",", ", ", " ,\t"])
def test_a_long_line_of_integers_parses_on_threads_as_pyarrow_reads_it(tmp_path, monkeypatch, sep):
    """One long JSON line was parsed by pyarrow on one thread (a line never spans two blocks) while the
    same bytes in short lines took every core. Its long flat lists of integers are parsed apart, as one CSV column
    on pyarrow's threads: the table equals pyarrow's own (other keys, negative ids, any spacing between numbers,
    the first chunk's schema on a later chunk); a list that is not plain integers (5.0, past int64, an empty
    value, nested) goes the usual way, so its error is the usual one, naming its row."""
    import json

    import pyarrow.json as pj

    from packkit import jsonlines, longline

    monkeypatch.setattr(jsonlines, "LONG_LINE_BYTES", 64)
    monkeypatch.setattr(longline, "LONG_LIST_BYTES", 16)
    ids = list(range(-3, 60))
    body = sep.join(map(str, ids))
    line = '{"source": "a [bracket]", "input_ids": [' + body + '], "labels": [' + body + '], "n": 3}\n'
    got = jsonlines._parse_json_chunk(line.encode(), None, tmp_path / "x.jsonl")
    want = pj.read_json(pa.BufferReader(line.encode()))
    assert got is not None and got.equals(want), (got, want)
    assert longline.one_long_line(line.encode(), pj.ParseOptions()) is not None  # the threaded path was taken
    schema = pa.schema([("source", pa.string()), ("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int64())),
                        ("n", pa.int64())])
    later = jsonlines._parse_json_chunk(line.encode(), schema, tmp_path / "x.jsonl")
    assert later.schema == schema and later.column("input_ids").to_pylist() == [ids]
    for bad in ("5.0", str(2**64), "", "[1]"):
        odd = line.replace(", 7,", f", {bad},").replace(",7,", f",{bad},").replace(" ,\t7 ,", f" ,\t{bad} ,")
        assert longline.one_long_line(odd.encode(), pj.ParseOptions()) is None, bad
    path = tmp_path / "ids.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 2]}) + "\n" + line.replace(", 7,", ", 7.5,").replace(",7,", ",7.5,")
                    .replace(" ,\t7 ,", " ,\t7.5 ,"))
    with pytest.raises(ValueError, match=r"dataset row 1 \(line 2 of '[^']+'\) has 7.5 \(float\) in 'input_ids'"):
        pio.read_lengths(path)


@pytest.mark.parametrize("command", ["waste", "plan", "pack"])
def test_without_pyarrow_the_error_names_the_file_and_its_format(tmp_path, command):
    """On the base install (no pyarrow), a JSON lines input is one line naming the file, its format and the
    extra to install, whichever reader meets it first (the chunked JSON reader said "reading Arrow data")."""
    import subprocess
    import sys

    (tmp_path / "data.jsonl").write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [4, 5]}\n')
    argv = [command, "data.jsonl"] + (["out.parquet", "-w", "8"] if command == "pack" else [])
    code = ("import sys; sys.modules['pyarrow'] = None\nfrom packkit.cli import main\n"
            f"sys.exit(main({argv!r}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4, proc.stderr
    assert proc.stderr.strip() == (f"packkit {command}: error: reading JSON lines ('data.jsonl') needs pyarrow: "
                                   "pip install 'packkit[datasets]'")


@pytest.mark.parametrize("lines, want", [
    (['{"k": [null, 1]}', '{"k": "a"}'], "line 2: 'k' holds text, but a list of numbers on line 1"),
    (['{"m": {"tags": [1, "a"]}}'], "line 1: 'm.tags[]' mixes a number and text in one list"),
    (['{"k": {"x": null, "y": 1}}', '{"k": {"x": null, "y": "a"}}'], "line 2: 'k.y' holds text, but a number on line 1"),
    (['{"k": 1}', '[1, true]'], "line 2: a list where a JSON object (one example) was expected"),
    (['[{"input_ids": [1]}]'], "line 1: a list of objects where a JSON object"),
    (['{"k": [[1], [2]]}', '{"k": [true]}'], "line 2: 'k[]' holds true/false, but a list of numbers on line 1"),
    (['{"k": [[true]]}', '{"k": 1}'], "line 2: 'k' holds a number, but a list of lists of true/false values on line 1"),
    (['{"k": [{"a": 1}]}', '{"k": "x"}'], "line 2: 'k' holds text, but a list of objects on line 1"),
])
def test_the_line_to_blame_names_the_value_that_clashes(tmp_path, lines, want):
    """Regression: the JSON lines error path blamed a list that starts with null (``'k[]' mixes null and null``),
    missed a mixed list inside an object (no line named), blamed a field that is null on both lines rather than the
    one that changed (``'k.x' holds null, but null``), called a mixed list line ``mixed``, and said "a list of an
    objects" and "a list of true/falses"."""
    from packkit import jsonblame

    path = tmp_path / "x.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert f"'{path}' {want}" in str(jsonblame.locate_error(path))


def test_a_json_list_after_a_blank_head_is_read_not_skipped(tmp_path):
    """Regression: a JSON list after 64 KiB of blank lines was zero rows to the streamed read (``pack``, ``tokenize``:
    its blank head read as an empty file) and JSON lines to the whole read (``'...' line 40,001: a list of an
    objects where a JSON object (one example) was expected``). Both now find the list, as after a short head."""
    import json

    from packkit import jsonlines
    from packkit.cli import main

    path = tmp_path / "x.json"
    path.write_text(" \n" * 40_000 + json.dumps([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]))
    blank = tmp_path / "blank.json"
    blank.write_text(" \n" * 40_000)
    assert jsonlines.first_byte(path) == b"[" and jsonlines.first_byte(blank) == b""
    assert list(pio.table_chunks(blank)) == []
    assert [t.to_pylist() for t in pio.table_chunks(path)] == [[{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]]
    assert pio.load_table(path).to_pylist() == [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]
    assert main(["pack", str(path), str(tmp_path / "out.parquet"), "-w", "8"]) == 0
    assert pa.parquet.read_table(tmp_path / "out.parquet").column("input_ids").to_pylist() == [[1, 2, 3, 4, 5]]


def test_a_npy_of_format_version_3_is_read(tmp_path):
    """Regression: a .npy of format version 3.0 (numpy writes it for utf-8 field names, or when asked) raised
    AttributeError: its header was read with numpy.lib.format._read_array_header, which numpy 2 no longer has."""
    from numpy.lib import format as npy

    path = tmp_path / "lengths.npy"
    with open(path, "wb") as f:
        npy.write_array(f, np.array([3, 5, 2], np.int64), version=(3, 0))
    assert pio.read_lengths(path).lengths.tolist() == [3, 5, 2]
