"""Text and conversations tokenized a bounded chunk at a time (`packkit pack --tokenizer`, `packkit tokenize`).

Each case runs the command twice on the same file: streamed (chunks of a few KiB instead of 256 KiB-4 MiB, so a
small file crosses many chunk boundaries) and read whole (the path before streaming: the door's ``Input.chunks``
turned off, or its whole-read fallback). The outputs must be equal row for row, nothing may be
left beside OUT (the staging file goes), and errors must name the row of the whole input, not of its chunk.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
datasets = pytest.importorskip("datasets")
pytest.importorskip("transformers")

from packkit.cli import main  # noqa: E402
from test_chat import make_tokenizer, msg, reference_tokens  # noqa: E402
from test_out_of_core import out_of_memory, pack_with_headroom  # noqa: E402

datasets.disable_progress_bars()

WORDS = ["hello", "there", "hi", "friend", "how", "are", "you", "fine", "thanks", "five", "é", "日本"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tiny-chat"
    make_tokenizer(bos=True).save_pretrained(str(path))
    return path


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 4 KiB of text (JSON lines, .txt) and 64 rows (Arrow), so that a small file streams in many."""
    import packkit.datafiles as datafiles
    import packkit.jsonlines as jsonlines

    monkeypatch.setattr(jsonlines, "JSON_BLOCK_BYTES", 4 << 10)
    monkeypatch.setattr(datafiles, "TOKENIZE_BLOCK_BYTES", 4 << 10)
    monkeypatch.setattr(datafiles, "TEXT_BLOCK_CHARS", 4 << 10)
    monkeypatch.setattr(datafiles, "TOKENIZE_ROWS", 64)


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(1, 60)))) for _ in range(n)]


def _conversations(n: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    words = ["hello", "there", "hi", "friend", "how", "are", "you", "fine", "thanks", "five"]
    out = []
    for _ in range(n):
        turns = []
        for _ in range(int(rng.integers(1, 4))):
            turns += [msg("user", " ".join(rng.choice(words, int(rng.integers(1, 12))))),
                      msg("assistant", " ".join(rng.choice(words, int(rng.integers(1, 12)))))]
        out.append(turns)
    return out


def _rows(path):
    path = str(path)
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.endswith(".arrow"):
        return pa.ipc.open_stream(pa.memory_map(path)).read_all().to_pylist()
    return [json.loads(line) for line in open(path)]


def _whole(monkeypatch):
    """The path before streaming: every input read whole, then tokenized."""
    from packkit.datafiles import Input

    monkeypatch.setattr(Input, "chunks", lambda self: None)


@pytest.mark.parametrize("kind", ["txt", "jsonl-text", "parquet-text", "jsonl-messages", "arrow-messages"])
def test_pack_streams_text_and_conversations_same_rows(kind, tok_dir, tmp_path, small_chunks, monkeypatch, capsys):
    """`pack --tokenizer` of .txt lines, JSON lines or parquet of text, JSON lines or Arrow of messages, tokenized
    a chunk at a time across many chunks: the rows (ids, labels from the assistant mask, seq_lengths, example
    ids) equal the whole-read path's; the staging file is gone."""
    if kind == "txt":
        src = tmp_path / "in.txt"
        src.write_text("\ufeff" + "\n\n".join(_texts(600)) + "\n")  # a BOM and blank lines hold no example
        tok = "bytes"
    elif kind == "jsonl-text":
        src = tmp_path / "in.jsonl"
        src.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(600)))
        tok = "bytes"
    elif kind == "parquet-text":
        import pyarrow.parquet as pq

        src = tmp_path / "in.parquet"
        pq.write_table(pa.table({"text": _texts(600), "id": list(range(600))}), src, row_group_size=100)
        tok = "bytes"
    else:
        rows = [{"messages": c} for c in _conversations(400)]
        src = tmp_path / ("in.jsonl" if kind == "jsonl-messages" else "in.arrow")
        if kind == "jsonl-messages":
            src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        else:
            table = pa.Table.from_pylist(rows)
            with pa.OSFile(str(src), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
                w.write_table(table, max_chunksize=50)
        tok = str(tok_dir)
    argv = ["-w", "96", "--tokenizer", tok, "--example-ids", "-q"]
    from packkit.datafiles import Tokenizing

    chunks = []
    encode = Tokenizing.encode
    monkeypatch.setattr(Tokenizing, "encode", lambda self, table, *a, **k: chunks.append(table.num_rows)
                        or encode(self, table, *a, **k))
    assert main(["pack", str(src), str(tmp_path / "s.parquet"), *argv]) == 0
    assert len(chunks) > 5 and max(chunks) < sum(chunks) / 5, chunks  # many chunks, none of them the file
    with monkeypatch.context() as m:
        _whole(m)
        assert main(["pack", str(src), str(tmp_path / "w.parquet"), *argv]) == 0
    streamed, whole = _rows(tmp_path / "s.parquet"), _rows(tmp_path / "w.parquet")
    assert streamed == whole and len(streamed) > 10
    if kind.endswith("messages"):  # against the slow reference, not only the other path
        refs = [reference_tokens(r["messages"])[0] for r in rows]
        for row in streamed:
            starts = np.cumsum([0] + row["seq_lengths"])
            for ex, a, b in zip(row["example_ids"], starts[:-1], starts[1:]):
                assert row["input_ids"][a:b] == refs[ex]
    assert sorted(os.listdir(tmp_path)) == sorted([src.name, "s.parquet", "w.parquet"])
    capsys.readouterr()


@pytest.mark.parametrize("out_name", ["tok.arrow", "tok.jsonl"])
def test_tokenize_streams_and_round_trips(out_name, tok_dir, tmp_path, small_chunks, monkeypatch, capsys):
    """`packkit tokenize` of conversations writes each chunk as it is tokenized: the same table as the whole
    read, with TRL's assistant mask; packkit's own output then goes back through waste, plan and pack, which
    measure and pack exactly what they do on the conversations with the tokenizer."""
    rows = [{"messages": c} for c in _conversations(500, seed=1)]
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, ref = tmp_path / out_name, tmp_path / ("whole-" + out_name)
    assert main(["tokenize", str(src), str(out), "--tokenizer", str(tok_dir), "--json"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["examples"] == 500 and line["columns"] == ["input_ids", "assistant_masks"]
    from packkit.datafiles import Input
    from packkit.jsonlines import JsonLinesChanged

    def whole(self):
        raise JsonLinesChanged("read whole")

    with monkeypatch.context() as m:
        m.setattr(Input, "chunks", whole)
        assert main(["tokenize", str(src), str(ref), "--tokenizer", str(tok_dir), "-q"]) == 0
    assert _rows(out) == _rows(ref)
    assert [r["input_ids"] for r in _rows(out)] == [reference_tokens(r["messages"])[0] for r in rows]
    assert line["tokens"] == sum(len(r["input_ids"]) for r in _rows(out))
    capsys.readouterr()
    for cmd in (["waste", "--json"], ["plan", "--json", "-b", "2", "-a", "1", "-d", "1", "-w", "96"]):
        assert main([cmd[0], str(out), *cmd[1:]]) == 0
        from_tokens = json.loads(capsys.readouterr().out)
        assert main([cmd[0], str(src), *cmd[1:], "--tokenizer", str(tok_dir)]) == 0
        from_text = json.loads(capsys.readouterr().out)
        from_tokens.pop("source", None), from_text.pop("source", None)
        assert from_tokens == from_text
    packed = tmp_path / "packed.parquet"
    assert main(["pack", str(out), str(packed), "-w", "96", "-q"]) == 0
    assert main(["pack", str(src), str(tmp_path / "p2.parquet"), "-w", "96", "-q", "--tokenizer", str(tok_dir)]) == 0
    assert _rows(packed) == _rows(tmp_path / "p2.parquet")
    repacked = tmp_path / "repacked.parquet"  # packed rows back in: read as their documents
    assert main(["pack", str(packed), str(repacked), "-w", "96", "-q", "--no-shuffle"]) == 0
    assert sum(sum(r["seq_lengths"]) for r in _rows(repacked)) == line["tokens"]
    capsys.readouterr()


def test_errors_name_the_row_of_the_whole_input(tok_dir, tmp_path, small_chunks, capsys):
    """A null text, or a conversation that fails, far past the first chunk is named by its row in the file and
    its line, not by its place in the chunk; nothing is left beside OUT."""
    texts = _texts(900)
    src = tmp_path / "t.jsonl"
    lines = [json.dumps({"text": t}) for t in texts]
    lines[700] = json.dumps({"text": None})
    src.write_text("\n".join(lines) + "\n")
    assert main(["pack", str(src), str(tmp_path / "o.parquet"), "-w", "96", "--tokenizer", "bytes", "-q"]) == 3
    err = capsys.readouterr().err
    assert "example 700 (line 701 of" in err and "has no text (null)" in err, err
    chat = tmp_path / "c.jsonl"
    rows = [{"messages": c} for c in _conversations(600, seed=2)]
    rows[555] = {"messages": [msg("user", "hello there")]}  # no assistant token: TRL raises too
    chat.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["tokenize", str(chat), str(tmp_path / "o.arrow"), "--tokenizer", str(tok_dir), "-q"]) == 3
    err = capsys.readouterr().err
    assert "example 555 (line 556 of" in err and "no assistant token" in err, err
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl", "t.jsonl"]


@pytest.mark.parametrize("kind", ["messages", "text"])
def test_waste_and_plan_tokenize_a_chunk_at_a_time(kind, tok_dir, tmp_path, small_chunks, monkeypatch):
    """read_lengths (what `waste` and `plan` measure) tokenizes conversations and text a chunk at a time:
    lengths, loss lengths and loss targets equal the whole read's."""
    import packkit.datafiles as datafiles

    src = tmp_path / "in.jsonl"
    rows = ([{"messages": c} for c in _conversations(400, seed=3)] if kind == "messages"
            else [{"text": t} for t in _texts(400, seed=3)])
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = str(tok_dir) if kind == "messages" else "bytes"
    chunks = []
    encode = datafiles.Tokenizing.encode
    monkeypatch.setattr(datafiles.Tokenizing, "encode", lambda self, table, *a, **k: chunks.append(table.num_rows)
                        or encode(self, table, *a, **k))
    got = datafiles.read_lengths(src, tokenizer=tok)
    assert len(chunks) > 5
    monkeypatch.setattr(datafiles.Input, "_streamed_lengths", lambda self, whole: None)
    whole = datafiles.read_lengths(src, tokenizer=tok)
    assert np.array_equal(got.lengths, whole.lengths) and got.unit == whole.unit and got.source == whole.source
    for field in ("loss_lengths", "targets"):
        a, b = getattr(got, field), getattr(whole, field)
        assert (a is None and b is None) or np.array_equal(a, b)
    assert (got.loss_lengths is not None) == (kind == "messages")


#: Private memory a .txt may take above the warm command while it is tokenized (bytes) and packed: chunks of
#: 256 Ki characters (the default, TEXT_BLOCK_CHARS; it needs 9-16 MiB, measured), and 80 MB of text,
#: 3.3x the headroom (80M byte tokens, 320 MB as int32).
TXT_HEADROOM_MIB = 24
TXT_BYTES = 80 << 20

@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA caps anonymous mappings on Linux only")
def test_pack_of_a_txt_several_times_the_memory_limit(tmp_path):
    """`packkit pack data.txt --tokenizer bytes` with private memory capped at 24 MiB above the warm command
    (RLIMIT_DATA, set in the process after a small pack) packs 80 MB of text lines (3.3x the cap; 80M tokens),
    every token checked against the file's bytes; reading the file whole fails under the same cap."""
    rng = np.random.default_rng(0)
    lengths = np.clip(np.round(rng.lognormal(np.log(1000), 1.0, TXT_BYTES // 800)), 8, 8192).astype(np.int64)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths + 1), TXT_BYTES))]
    body = rng.integers(33, 127, int(lengths.sum()), dtype=np.uint8)  # printable ASCII: one byte, one token
    src, warm, out = tmp_path / "data.txt", tmp_path / "warm.txt", tmp_path / "packed.arrow"
    text = np.insert(body, np.cumsum(lengths), 10).tobytes()  # a newline after every line
    src.write_bytes(text)
    warm.write_bytes(text[: 3 << 20])
    del text
    assert src.stat().st_size > 3 * (TXT_HEADROOM_MIB << 20)
    options = dict(argv=["--tokenizer", "bytes"])
    packed = pack_with_headroom(warm, src, out, TXT_HEADROOM_MIB, **options)
    assert packed.returncode == 0, packed.stderr[-3000:]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    seen = np.zeros(lengths.size, np.int64)
    for batch in pa.ipc.open_stream(pa.memory_map(str(out))):
        ids, seq, ex = (batch.column(c) for c in ("input_ids", "seq_lengths", "example_ids"))
        tokens = ids.values.to_numpy()[ids.offsets[0].as_py(): ids.offsets[-1].as_py()]
        seg_len, seg_ex = seq.values.to_numpy().astype(np.int64), ex.values.to_numpy()
        assert np.array_equal(seg_len, lengths[seg_ex]) and (np.diff(ids.offsets.to_numpy()) <= 8192).all()
        dst = np.concatenate([[0], np.cumsum(seg_len)])
        where = np.repeat(offsets[seg_ex] - dst[:-1], seg_len) + np.arange(int(dst[-1]))
        assert np.array_equal(tokens, body[where])  # every token is its line's byte, in order
        np.add.at(seen, seg_ex, 1)
    assert (seen == 1).all(), "a line is missing or packed twice"
    out.unlink()
    old = pack_with_headroom(warm, src, out, TXT_HEADROOM_MIB, whole=True, **options)
    assert out_of_memory(old), old.stderr[-2000:]
    assert not out.exists()


@pytest.mark.slow  # forks two processes per chunk
def test_tokenize_num_proc_per_chunk_names_the_row_of_the_whole_input(tok_dir, tmp_path, monkeypatch, capsys):
    """`tokenize --num-proc 2` splits each chunk between two processes: the same table as one process, and a
    conversation that fails in a later chunk's second process is named by its row in the file."""
    import packkit.datafiles as datafiles

    monkeypatch.setattr(datafiles, "TOKENIZE_BLOCK_BYTES", 192 << 10)  # chunks of ~700 rows: past a batch (512)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # two processes on any machine (chat.worker_processes)
    rows = [{"messages": c} for c in _conversations(2400, seed=4)]
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["tokenize", str(src), str(tmp_path / "one.arrow"), "--tokenizer", str(tok_dir), "-q"]) == 0
    assert main(["tokenize", str(src), str(tmp_path / "two.arrow"), "--tokenizer", str(tok_dir), "-q",
                 "--num-proc", "2"]) == 0
    assert _rows(tmp_path / "one.arrow") == _rows(tmp_path / "two.arrow")
    rows[1900] = {"messages": [msg("user", "hello there")]}  # no assistant token: 3rd chunk, 2nd process
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["tokenize", str(src), str(tmp_path / "bad.arrow"), "--tokenizer", str(tok_dir), "-q",
                 "--num-proc", "2"]) == 3
    err = capsys.readouterr().err
    assert "example 1900 (line 1,901 of" in err and "no assistant token" in err, err


@pytest.mark.parametrize("lines", [40, 1200])
def test_pack_gives_the_tokenizer_a_bounded_number_of_characters_a_call(lines, tok_dir, tmp_path, monkeypatch, capsys):
    """`pack --tokenizer tokenizer.json` of a .txt: the tokenizer's working set grows with the text of one call
    (about 33 bytes a character for Qwen3's), so every call holds at most TOKENIZE_CALL_CHARS characters, whatever
    the file's size (a longer line alone), and the ids equal one call over every line. Before, a call took 10,000
    lines, a whole chunk of 4 MiB of text here."""
    import packkit.tokenizer as tokenizer

    load, calls = tokenizer.rust_tokenizer, []
    real = load(str(tok_dir / "tokenizer.json"))

    class Spy:  # the real tokenizer, each call's texts counted
        def encode_batch_fast(self, texts):
            calls.append([len(t) for t in texts])
            return real.encode_batch_fast(texts)

        encode_batch = encode_batch_fast  # what marks a loaded tokenizer

    monkeypatch.setattr(tokenizer, "rust_tokenizer", lambda spec, **kw: Spy() if spec == str(tok_dir) else load(spec, **kw))
    monkeypatch.setattr(tokenizer, "TOKENIZE_CALL_CHARS", 300)
    texts = _texts(lines, seed=lines) + ["five " * 100]  # a line of 500 characters
    src = tmp_path / "in.txt"
    src.write_text("\n".join(texts) + "\n")
    assert main(["pack", str(src), str(tmp_path / "out.arrow"), "-w", "4096", "--example-ids", "-q",
                 "--tokenizer", str(tok_dir)]) == 0
    assert sum(map(len, calls)) == len(texts) and len(calls) > lines // 50
    assert all(sum(c) <= 300 or len(c) == 1 for c in calls), max(map(sum, calls))
    assert [500] in calls  # the long line alone
    refs = [e.ids for e in real.encode_batch(texts)]
    for row in _rows(tmp_path / "out.arrow"):
        starts = np.cumsum([0] + row["seq_lengths"])
        for ex, a, b in zip(row["example_ids"], starts[:-1], starts[1:]):
            assert row["input_ids"][a:b] == refs[ex]
    capsys.readouterr()


def test_pack_tokenizes_a_txt_in_chunks_of_bounded_text(tmp_path, monkeypatch, capsys):
    """`pack` of a .txt: every chunk handed to the tokenizer holds at most 256 Ki characters (one line more), whatever
    the file's size. A chunk is made as Python strings (up to 4 bytes a character), then an Arrow array, then its ids,
    and up to four are in flight: with Qwen3's tokenizer the peak over 16 MB of text was 79 MiB with chunks of 4 MiB
    (the file in four chunks), 45 MiB with 256 KiB. Before, a 1.3 MB file was one chunk."""
    import pyarrow.compute as pc
    from packkit.datafiles import Tokenizing

    texts = _texts(12_000, seed=3)  # about 1.3 MB of lines of up to 60 words
    src = tmp_path / "in.txt"
    src.write_text("\n".join(texts) + "\n")
    chunks = []
    encode = Tokenizing.encode
    monkeypatch.setattr(Tokenizing, "encode", lambda self, table, *a, **k: chunks.append(
        pc.sum(pc.utf8_length(table.column("text"))).as_py()) or encode(self, table, *a, **k))
    assert main(["pack", str(src), str(tmp_path / "out.arrow"), "-w", "4096", "-q", "--tokenizer", "bytes"]) == 0
    longest = max(map(len, texts))
    print(f"{len(chunks)} chunks of {min(chunks):,}-{max(chunks):,} characters; the longest line {longest:,}")
    assert sum(chunks) == sum(map(len, texts)) and len(chunks) >= 4
    assert max(chunks) <= (256 << 10) + longest
    capsys.readouterr()


def test_pack_hands_back_what_each_chunk_freed(tok_dir, tmp_path, monkeypatch, capsys):
    """`pack --tokenizer` of a .txt: once a chunk is tokenized, the memory its tokenizing freed goes back to the
    system (glibc's malloc_trim, pyarrow's pool) before the next chunk is read. The allocators keep it otherwise:
    the arenas of the tokenizer's threads and mimalloc's pages grew with the file (Qwen3's tokenizer, 16 MB of text:
    35 MiB over the warm command with it, 53 MiB without, chunks of 256 KiB both)."""
    import packkit.allocators as allocators
    import packkit.datafiles as datafiles
    import packkit.readers as readers

    events = []
    real_release, real_text = allocators.release_freed, datafiles.text_tables

    def text_tables(path, **kw):
        for table in real_text(path, **kw):
            events.append("read")
            yield table

    monkeypatch.setattr(allocators, "release_freed", lambda: events.append("release") or real_release())  # where asked
    monkeypatch.setattr(readers, "text_tables", text_tables)  # the door in reads it from its home, where first asked
    monkeypatch.setattr(datafiles, "TEXT_BLOCK_CHARS", 8 << 10)
    src = tmp_path / "in.txt"
    src.write_text("\n".join(_texts(600, seed=5)) + "\n")
    assert main(["pack", str(src), str(tmp_path / "out.arrow"), "-w", "4096", "-q", "--tokenizer", str(tok_dir)]) == 0
    assert events.count("read") > 5
    assert events == ["read", "release"] * events.count("read"), events  # each chunk's, before the next is read
    if sys.platform.startswith("linux"):
        assert allocators.glibc() is not None  # glibc's trim found, not a no-op
    capsys.readouterr()



_POOL_AFTER_PACK = """
import sys
from packkit.cli import main
assert main(sys.argv[1:]) == 0
import pyarrow as pa
print(pa.default_memory_pool().backend_name)
"""


def _pool_after_pack(tmp_path, tokenizer: str) -> str:
    """pyarrow's default pool once ``packkit pack IN OUT --tokenizer T`` ran in a fresh process."""
    import subprocess

    src = tmp_path / "in.txt"
    src.write_text("\n".join(_texts(400, seed=7)) + "\n")
    out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}.arrow"
    got = subprocess.run([sys.executable, "-c", _POOL_AFTER_PACK, "pack", str(src), str(out), "-w", "4096", "-q",
                          "--tokenizer", tokenizer], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)  # the packkit installed (or on PYTHONPATH), not one in the current folder
    assert got.returncode == 0, got.stderr[-2000:]
    return got.stdout.split()[-1]


def test_pack_with_a_tokenizer_allocates_arrow_from_the_system_pool(tok_dir, tmp_path):
    """`pack --tokenizer T` puts pyarrow's default pool on the system allocator: mimalloc (pyarrow's default) kept the
    pages the text chunks freed after ``release_unused`` (Qwen3's tokenizer, 4 MB of ShareGPT text: 32.5-35.0 MiB
    peak over the warm command at a166061, 27.4-28.9 with the system pool), which ``malloc_trim`` hands back.
    Before: mimalloc (fails). ``bytes`` runs no tokenizer and leaves the process's pool as it is."""
    pool = _pool_after_pack(tmp_path, str(tok_dir))
    default = _pool_after_pack(tmp_path, "bytes")
    print(f"pool after pack --tokenizer: {pool}; after --tokenizer bytes: {default}")
    assert pool == "system"
    assert default != "system" or os.environ.get("ARROW_DEFAULT_MEMORY_POOL") == "system"
