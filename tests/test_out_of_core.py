"""Out-of-core offline packing: tokens read from memory-mapped Arrow, never held whole.

The main test packs a dataset whose token data is larger than the memory the packing process may
allocate: the process runs with ``RLIMIT_DATA`` (on Linux >= 4.7 it caps private writable memory,
anonymous mappings included, but not the pages of a file mapped read-only), and every token of the
output is then checked against its source. The same limit makes the old path (every token copied into
one array, as ``pack_dataset`` did before) fail, so the limit is known to bite.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
datasets = pytest.importorskip("datasets")

from packkit.segments import lengths_to_offsets  # noqa: E402

datasets.disable_progress_bars()

#: The limit on the packing process's private writable memory, and the token data (int64 ids).
LIMIT_MIB = 400
TOKENS = 80_000_000  # 640 MB of int64 token ids: 1.6x the limit


def _lengths(total: int, seed: int = 0) -> np.ndarray:
    """SFT-like lengths summing to exactly ``total``."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(250), 1.0, total // 200)), 8, 4096).astype(np.int64)
    csum = np.cumsum(lengths)
    lengths = lengths[: int(np.searchsorted(csum, total))]
    return np.append(lengths, total - int(lengths.sum()))


def _write_arrow(path, lengths: np.ndarray, *, batch_rows: int = 1000, id_base: int = 0) -> None:
    """An Arrow IPC stream (a ``datasets`` cache file) whose token ids are their global positions (plus
    ``id_base``)."""
    offsets = lengths_to_offsets(lengths)
    schema = pa.schema([("input_ids", pa.list_(pa.int64()))])
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, schema) as w:
        for a in range(0, lengths.size, batch_rows):
            b = min(a + batch_rows, lengths.size)
            off = offsets[a: b + 1]
            col = pa.ListArray.from_arrays(pa.array((off - off[0]).astype(np.int32)),
                                           pa.array(np.arange(off[0], off[-1], dtype=np.int64) + id_base))
            w.write_batch(pa.record_batch([col], schema=schema))


def _run_limited(code: str, limit_mib: int) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter whose private writable memory is capped at ``limit_mib``.

    pyarrow's default allocator reserves 1 GiB of address space up front, which RLIMIT_DATA counts
    although it is never touched: the child uses the system allocator (ARROW_DEFAULT_MEMORY_POOL).
    """
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_DATA, (limit_mib << 20, limit_mib << 20))

    env = dict(os.environ, ARROW_DEFAULT_MEMORY_POOL="system", MALLOC_ARENA_MAX="2", OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          preexec_fn=limit, env=env, timeout=600)


def _check_every_token(out_path, lengths: np.ndarray, *, id_base: int = 0) -> None:
    """Every example appears once, whole, its tokens in order (ids are global positions plus ``id_base``),
    rows <= W."""
    offsets = lengths_to_offsets(lengths)
    seen = np.zeros(lengths.size, np.int64)
    reader = pa.ipc.open_stream(pa.memory_map(str(out_path)))
    for batch in reader:
        ids = batch.column("input_ids")
        seq = batch.column("seq_lengths")
        ex = batch.column("example_ids")
        tokens = ids.values.to_numpy()[ids.offsets[0].as_py(): ids.offsets[-1].as_py()]
        seg_len = seq.values.to_numpy().astype(np.int64)
        seg_ex = ex.values.to_numpy()
        assert np.array_equal(np.diff(seq.offsets.to_numpy()), np.diff(ex.offsets.to_numpy()))
        assert (np.diff(ids.offsets.to_numpy()) <= 8192).all()
        assert np.array_equal(seg_len, lengths[seg_ex])
        dst = lengths_to_offsets(seg_len)
        expect = np.repeat(offsets[seg_ex] - dst[:-1], seg_len) + np.arange(int(dst[-1]), dtype=np.int64) + id_base
        assert np.array_equal(tokens, expect)
        np.add.at(seen, seg_ex, 1)
    assert (seen == 1).all(), "an example is missing or packed twice"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA caps anonymous mappings on Linux only")
def test_pack_dataset_under_a_memory_limit_below_its_token_data(tmp_path):
    """pack_dataset on a memory-mapped dataset of 640 MB of tokens, in a process limited to 400 MiB of
    private memory (imports included), writes every token; the old path fails under the same limit."""
    lengths = _lengths(TOKENS)
    src = tmp_path / "data.arrow"
    _write_arrow(src, lengths)
    out = tmp_path / "packed.arrow"
    packed = _run_limited(f"""
        import json, datasets
        from packkit.offline import pack_dataset
        ds = datasets.Dataset.from_file({str(src)!r})
        got, plan = pack_dataset(ds, window=8192, example_ids=True, buffer_bytes=32 << 20, return_report=True,
                                 cache_file_name={str(out)!r})
        status = dict(line.split(":", 1) for line in open("/proc/self/status"))
        print(json.dumps({{"rows": len(got), "windows": plan.num_windows, "hwm": status["VmHWM"].strip()}}))
    """, LIMIT_MIB)
    assert packed.returncode == 0, packed.stderr[-3000:]
    result = json.loads(packed.stdout.strip().splitlines()[-1])
    print("packed under the limit:", result)
    assert result["rows"] == result["windows"]
    _check_every_token(out, lengths)

    # the limit bites: the old path (every token of the column concatenated into one array) fails
    old = _run_limited(f"""
        import numpy as np, datasets
        ds = datasets.Dataset.from_file({str(src)!r})
        values = np.concatenate([c.values.to_numpy() for c in ds.data.column("input_ids").chunks])
        print(values.size)
    """, LIMIT_MIB)
    print("old path:", old.returncode, old.stderr.strip().splitlines()[-1:])
    assert old.returncode != 0 and "MemoryError" in old.stderr


# ----------------------------------------------------------------------------------------------
# the scan: views where the data stays valid, staging where it does not
# ----------------------------------------------------------------------------------------------


def _examples(n, *, seed=0, mask=False, labels=False, bool_mask=False):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 60, n)
    cols = {"input_ids": [rng.integers(0, 1000, k).tolist() for k in lengths]}
    if labels:
        cols["labels"] = [[t if rng.random() < 0.7 else -100 for t in x] for x in cols["input_ids"]]
    if mask:
        m = [rng.integers(0, 2, k).tolist() for k in lengths]
        cols["completion_mask"] = [[bool(v) for v in x] for x in m] if bool_mask else m
    return cols


def _in_memory_reference(cols, **kw):
    """pack_dataset on the same rows as one in-memory table with an int mask (the plain path)."""
    from packkit.offline import pack_dataset

    cols = dict(cols)
    if "completion_mask" in cols:
        cols["completion_mask"] = [[int(v) for v in x] for x in cols["completion_mask"]]
    return pack_dataset(datasets.Dataset.from_dict(cols), keep_in_memory=True, **kw)


def test_scan_views_memory_mapped_batches_as_one_region(tmp_path):
    """Every record batch of a memory-mapped file is a view into one region: no copy, no staging."""
    from packkit.sources import ArrowSource, scan

    t = pa.table(_examples(3000))
    for i, part in enumerate((t.slice(0, 1700), t.slice(1700))):  # two files of 100-row record batches
        with pa.OSFile(str(tmp_path / f"{i}.arrow"), "wb") as f, pa.ipc.new_stream(f, t.schema) as w:
            w.write_table(part, max_chunksize=100)
    ds = datasets.concatenate_datasets([datasets.Dataset.from_file(str(tmp_path / f"{i}.arrow")) for i in (0, 1)])
    shards = len(ds.cache_files)
    assert shards == 2 and ds.data.column("input_ids").num_chunks == 30
    found = scan(ArrowSource.from_dataset(ds, batch_rows=700), ["input_ids"])
    col = found.columns["input_ids"]
    assert found.staged_rows == 0 and len(col.regions) == shards  # one region per shard file
    flat = [col.regions[0 if col.region is None else col.region[i]][s: s + n].tolist()
            for i, (s, n) in enumerate(zip(col.starts, found.lengths))]
    assert flat == ds["input_ids"]


@pytest.mark.parametrize("view", ["shuffle", "select", "filter"])
def test_selections_are_staged_and_removed(tmp_path, view):
    """Rows seen through an indices mapping are copies: staged to a memory-mapped file that is gone
    once the scan ends; the packed rows equal the in-memory path's."""
    from packkit.offline import pack_dataset

    cols = _examples(2000, labels=True)
    datasets.Dataset.from_dict(cols).save_to_disk(str(tmp_path / "ds"))
    ds = datasets.load_from_disk(str(tmp_path / "ds"))
    ds = {"shuffle": lambda d: d.shuffle(seed=1), "select": lambda d: d.select(range(1999, 0, -3)),
          "filter": lambda d: d.filter(lambda x: len(x["input_ids"]) % 3 != 0)}[view](ds)
    before = set(os.listdir(tmp_path / "ds"))
    got = pack_dataset(ds, window=128, example_ids=True)
    ref = _in_memory_reference(ds.to_dict(), window=128, example_ids=True)
    assert got[:] == ref[:]
    left = set(os.listdir(tmp_path / "ds")) - before
    assert all(name.startswith("cache-packkit-") for name in left), left  # the result, no staging file


def test_boolean_mask_is_staged_as_uint8(tmp_path):
    """Arrow packs booleans in bits (no numpy view): such a mask is staged, and becomes the same labels."""
    from packkit.offline import pack_dataset

    cols = _examples(500, mask=True, bool_mask=True, labels=True)
    t = pa.table({"input_ids": cols["input_ids"], "labels": cols["labels"],
                  "completion_mask": pa.array(cols["completion_mask"], pa.list_(pa.bool_()))})
    datasets.Dataset(t).save_to_disk(str(tmp_path / "ds"))
    got = pack_dataset(datasets.load_from_disk(str(tmp_path / "ds")), window=96)
    assert got[:] == _in_memory_reference(cols, window=96)[:]
    kept = pack_dataset(datasets.load_from_disk(str(tmp_path / "ds")), window=96,
                        columns=["input_ids", "labels", "completion_mask"])
    assert kept.features["completion_mask"].feature.dtype == "bool"  # written back as booleans


def test_errors_name_the_dataset_row_across_batches(tmp_path):
    """A bad value deep in the data is named by its row in the dataset, not in its batch."""
    from packkit.offline import pack_dataset

    cols = _examples(9000)
    cols["input_ids"][8765][3] = -4
    datasets.Dataset.from_dict(cols).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(ValueError, match="dataset row 8765 has token id -4 in 'input_ids'"):
        pack_dataset(datasets.load_from_disk(str(tmp_path / "ds")), window=64)
    cols = _examples(9000, labels=True)
    cols["labels"][5001][0] = -7
    with pytest.raises(ValueError, match="dataset row 5001 has label -7"):
        pack_dataset(datasets.Dataset.from_dict(cols), window=64)
    cols = _examples(9000, labels=True)
    cols["labels"][6000] = cols["labels"][6000][:-1]
    with pytest.raises(ValueError, match="dataset row 6000 has \\d+ 'labels' for \\d+ 'input_ids'"):
        pack_dataset(datasets.Dataset.from_dict(cols), window=64)


def test_on_disk_input_gives_a_cache_backed_dataset(tmp_path):
    from packkit.offline import pack_dataset

    cols = _examples(300)
    mem = datasets.Dataset.from_dict(cols)
    assert pack_dataset(mem, window=64).cache_files == []  # in-memory input stays in memory
    mem.save_to_disk(str(tmp_path / "ds"))
    disk = pack_dataset(datasets.load_from_disk(str(tmp_path / "ds")), window=64)
    (cache,) = disk.cache_files
    assert os.path.dirname(cache["filename"]) == str(tmp_path / "ds")
    assert disk[:] == pack_dataset(mem, window=64)[:]
    assert pack_dataset(mem, window=64, cache_file_name=str(tmp_path / "mine.arrow")).cache_files == [
        {"filename": str(tmp_path / "mine.arrow")}]
    with pytest.raises(FileExistsError, match="exists"):  # a cache file is never overwritten
        pack_dataset(mem, window=64, cache_file_name=str(tmp_path / "mine.arrow"))


# ----------------------------------------------------------------------------------------------
# packkit pack: each input format to each output format, written as it goes, atomically
# ----------------------------------------------------------------------------------------------


def _read_rows(path):
    import pyarrow.parquet as pq

    path = str(path)
    if os.path.isdir(path):
        return datasets.load_from_disk(path).with_format("arrow")[:].to_pylist()
    if path.endswith(".parquet"):
        return pq.read_table(path).to_pylist()
    if path.endswith(".arrow"):
        return datasets.Dataset.from_file(path).with_format("arrow")[:].to_pylist()
    if path.endswith(".feather"):
        return pa.ipc.open_file(path).read_all().to_pylist()
    return [json.loads(line) for line in open(path)]


@pytest.fixture
def inputs(tmp_path):
    import pyarrow.parquet as pq

    cols = _examples(1500, labels=True, mask=True)
    t = pa.table(cols)
    paths = {"folder": tmp_path / "in_ds", "arrow": tmp_path / "in.arrow", "parquet": tmp_path / "in.parquet"}
    datasets.Dataset(t).save_to_disk(str(paths["folder"]), max_shard_size="50KB")
    with pa.OSFile(str(paths["arrow"]), "wb") as f, pa.ipc.new_stream(f, t.schema) as w:
        w.write_table(t, max_chunksize=100)
    pq.write_table(t, paths["parquet"], row_group_size=200)
    return cols, paths


@pytest.mark.slow
@pytest.mark.parametrize("out_name", ["o.parquet", "o.arrow", "o.feather", "o.jsonl", "o_folder"])
def test_pack_command_every_format_same_rows(inputs, tmp_path, out_name, capsys):
    from packkit.cli import main

    cols, paths = inputs
    ref = _in_memory_reference(cols, window=200).with_format("arrow")[:].to_pylist()
    for kind, src in paths.items():
        out = tmp_path / f"{kind}_{out_name}"
        assert main(["pack", str(src), str(out), "-w", "200", "-q", "--buffer-mb", "1"]) == 0
        assert _read_rows(out) == ref, kind
        assert not [p for p in os.listdir(tmp_path) if ".packkit-tmp-" in p]  # no temporary left
    capsys.readouterr()


def test_a_dataset_folder_rolls_shards(inputs, tmp_path):
    from packkit.offline import plan_source
    from packkit.sources import ArrowSource
    from packkit.outputs import write_batches

    cols, paths = inputs
    packed = plan_source(ArrowSource.from_table(pa.table(cols)), window=200)
    out = tmp_path / "sharded"
    write_batches(out, packed.schema, packed.record_batches(max_tokens=2000), max_shard_bytes=20_000)
    back = datasets.load_from_disk(str(out))
    assert len(back.cache_files) > 3
    assert back.with_format("arrow")[:].to_pylist() == _read_rows(_write_ref(tmp_path, packed))


def _write_ref(tmp_path, packed):
    from packkit.outputs import write_batches

    path = tmp_path / "ref.feather"
    write_batches(path, packed.schema, packed.record_batches(max_tokens=10**9))
    return path


def test_existing_out_is_refused_unless_overwrite(inputs, tmp_path, capsys):
    from packkit.cli import main

    _, paths = inputs
    out = tmp_path / "o.parquet"
    out.write_bytes(b"precious")
    assert main(["pack", str(paths["arrow"]), str(out), "-w", "200", "-q"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert out.read_bytes() == b"precious"
    assert main(["pack", str(paths["arrow"]), str(out), "-w", "200", "-q", "--overwrite"]) == 0
    assert out.read_bytes()[:4] == b"PAR1"
    capsys.readouterr()


@pytest.mark.parametrize("out_name", ["o.parquet", "o.arrow", "o.jsonl", "o_folder"])
def test_a_failure_while_writing_leaves_nothing(inputs, tmp_path, out_name, monkeypatch, capsys):
    """The rows stop half way (a full disk): one line, exit 4, no OUT, no temporary file."""
    from packkit.offline import PackedTable
    from packkit.cli import main

    _, paths = inputs
    real = PackedTable.record_batches

    def failing(self, **kw):
        for i, batch in enumerate(real(self, **kw)):
            if i == 1:  # the first batch is written, the second never comes
                raise OSError(errno.ENOSPC, "No space left on device")
            yield batch

    monkeypatch.setattr(PackedTable, "record_batches", failing)
    code = main(["pack", str(paths["arrow"]), str(tmp_path / out_name), "-w", "200", "-q", "--buffer-mb", "1"])
    err = capsys.readouterr().err
    assert code == 4 and err.count("\n") == 1 and "No space left on device" in err
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in paths.values())


@pytest.mark.parametrize("where", ["memory", "disk", "shuffled"])
def test_missing_keys_and_both_masks_per_example(tmp_path, where):
    """A null labels row reads the example's token ids, a null mask row is loss everywhere, and with
    both masks the loss is where both are 1 (packkit.examples' rules), read as views or staged alike;
    checked against labels built example by example in Python."""
    from packkit.offline import pack_dataset
    from packkit.segments import IGNORE_INDEX

    rng = np.random.default_rng(4)
    rows = []
    for i in range(400):
        n = int(rng.integers(1, 30))
        row = {"input_ids": rng.integers(0, 900, n).tolist(),
               "labels": None if i % 3 == 0 else [int(t) if rng.random() < 0.8 else -100 for t in rng.integers(0, 900, n)],
               "completion_mask": None if i % 4 == 0 else rng.integers(0, 2, n).tolist(),
               "assistant_masks": None if i % 5 == 0 else rng.integers(0, 2, n).tolist()}
        rows.append(row)
    ds = datasets.Dataset.from_list(rows)
    if where != "memory":
        ds.save_to_disk(str(tmp_path / "ds"))
        ds = datasets.load_from_disk(str(tmp_path / "ds"))
        if where == "shuffled":
            ds = ds.shuffle(seed=2)
    got = pack_dataset(ds, window=64, example_ids=True)
    want = {}  # example -> its labels before the first label of its segment is masked
    for i, row in enumerate(ds):
        lab = list(row["labels"] if row["labels"] is not None else row["input_ids"])
        for key in ("completion_mask", "assistant_masks"):
            if row[key] is not None:
                lab = [x if m else IGNORE_INDEX for x, m in zip(lab, row[key])]
        want[i] = lab
    for ids, labels, seqs, exs in zip(got["input_ids"], got["labels"], got["seq_lengths"], got["example_ids"]):
        pos = 0
        for n, e in zip(seqs, exs):
            assert ids[pos: pos + n] == ds[e]["input_ids"]
            assert labels[pos: pos + n] == [IGNORE_INDEX] + want[e][1:]
            pos += n


def test_parquet_is_read_in_order_a_batch_at_a_time(tmp_path):
    import pyarrow.parquet as pq

    import packkit.datafiles as pio

    t = pa.table(_examples(3000, labels=True))
    pq.write_table(t, tmp_path / "in.parquet", row_group_size=257)
    batches = list(pio.parquet_batches(tmp_path / "in.parquet", batch_rows=100))
    assert max(b.num_rows for b in batches) <= 100 and pa.Table.from_batches(batches).equals(t)


def test_prefetch_keeps_order_errors_and_stops():
    from packkit.sources import prefetch

    assert list(prefetch(iter(range(50)), depth=2)) == list(range(50))

    def broken():
        yield 1
        yield 2
        raise OSError("damaged page")

    got = []
    with pytest.raises(OSError, match="damaged page"):
        for x in prefetch(broken()):
            got.append(x)
    assert got == [1, 2]
    it = prefetch(iter(range(10**9)), depth=2)  # an early stop ends the producer thread
    assert next(it) == 0
    it.close()


# ----------------------------------------------------------------------------------------------
# JSON lines streamed a block at a time: a file larger than one read is parsed whole and in order
# ----------------------------------------------------------------------------------------------


def _small_blocks(monkeypatch, size: int = 64 << 10):
    """Blocks of ``size`` bytes instead of 8 MiB, so that a small file streams in many blocks."""
    import packkit.jsonlines as jsonlines

    monkeypatch.setattr(jsonlines, "JSON_BLOCK_BYTES", size)


def test_json_lines_stream_a_block_at_a_time_same_rows(tmp_path, monkeypatch, capsys):
    """`pack data.jsonl` parses one block at a time (staged beside OUT like parquet): the rows equal the
    in-memory reference's, with labels and a loss mask, over many blocks; nothing is left beside OUT."""
    from packkit.cli import main
    from packkit.jsonlines import json_batches

    cols = _examples(1500, labels=True, mask=True)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({k: cols[k][i] for k in cols}) + "\n" for i in range(1500)))
    _small_blocks(monkeypatch, 32 << 10)
    assert len(list(json_batches(src, block_size=32 << 10))) > 5  # many blocks
    out = tmp_path / "o.parquet"
    assert main(["pack", str(src), str(out), "-w", "200", "-q", "--buffer-mb", "1"]) == 0
    assert _read_rows(out) == _in_memory_reference(cols, window=200).with_format("arrow")[:].to_pylist()
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "o.parquet"]
    capsys.readouterr()


def test_json_lines_whose_types_change_after_the_first_block_are_read_whole(tmp_path, monkeypatch, capsys):
    """A key that first appears in a later block, or a float where the first block held integers, cannot
    stream (pyarrow fixes the types from the first block): the file is read whole, as before, so labels
    are kept and a float is named by its row and line."""
    from packkit.cli import main

    cols = _examples(3000, labels=True)
    src = tmp_path / "late.jsonl"
    src.write_text("".join(json.dumps({"input_ids": cols["input_ids"][i]} | ({"labels": cols["labels"][i]}
                                                                             if i >= 2000 else {})) + "\n"
                           for i in range(3000)))
    _small_blocks(monkeypatch)
    out = tmp_path / "o.parquet"
    assert main(["pack", str(src), str(out), "-w", "200", "-q"]) == 0
    ref = dict(cols)
    ref["labels"] = [x if i >= 2000 else list(cols["input_ids"][i]) for i, x in enumerate(cols["labels"])]
    assert _read_rows(out) == _in_memory_reference(ref, window=200).with_format("arrow")[:].to_pylist()
    bad = tmp_path / "float.jsonl"
    lines = [json.dumps({"input_ids": x}) for x in cols["input_ids"]]
    lines[2500] = '{"input_ids": [3, 1.5, 4]}'
    bad.write_text("\n".join(lines) + "\n")
    assert main(["pack", str(bad), str(tmp_path / "o2.parquet"), "-w", "200", "-q"]) == 3
    err = capsys.readouterr().err
    assert f"dataset row 2500 (line 2,501 of '{bad}') has 1.5 (float) in 'input_ids'" in err, err
    assert sorted(os.listdir(tmp_path)) == ["float.jsonl", "late.jsonl", "o.parquet"]


#: Private memory the packing of a JSON lines file may take above the command once warm (imports, pyarrow's
#: thread pools and allocator, the reader's and writer's threads; it needs 21-24 MiB, measured), and the
#: tokens: 12M, 132 MB of JSON text (ids of 10 digits), 3.1x the headroom (48 MB as int32, 1.1x).
JSONL_HEADROOM_MIB = 40
JSONL_ID_BASE = 10**9
JSONL_TOKENS = 12_000_000

_HEADROOM_CHILD = """
import json, resource, sys
import pyarrow as pa
from packkit.cli import main
job = json.loads(sys.argv[1])
pa.set_cpu_count(2)  # thread stacks count against RLIMIT_DATA: as many threads as the warm-up starts
pa.set_io_thread_count(2)
if job["whole"]:  # the path before streaming: the file read whole (parsed, tokenized), then packed
    from packkit.datafiles import Input
    Input.chunks = lambda self: None
exec(job["setup"])
def status():
    return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in open("/proc/self/status")) if "kB" in v}
argv = ["-w", "8192", "-q", *job["argv"]]
assert main(["pack", job["warm"], job["out"] + ".warm.arrow", *argv, "--overwrite"]) == 0  # imports, threads, allocator
before = status()["VmData"]
limit = (before << 10) + (job["headroom_mib"] << 20)
resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
code = main(["pack", job["src"], job["out"], *argv, "--example-ids"])
print(code, before, status()["VmData"], status()["VmHWM"])
sys.exit(code)
"""


def pack_with_headroom(warm, src, out, headroom_mib: int, *, argv=(), setup: str = "",
                       whole: bool = False) -> subprocess.CompletedProcess:
    """`packkit pack src out --example-ids` in a fresh interpreter whose private writable memory is capped
    (RLIMIT_DATA) at ``headroom_mib`` above what it holds after packing ``warm`` (imports, pyarrow's thread
    pools and allocator, the reader's and writer's threads); ``whole``: the path before streaming (the file
    read whole). Prints the exit code, VmData before and after (kB) and VmHWM."""
    job = dict(warm=str(warm), src=str(src), out=str(out), headroom_mib=headroom_mib, argv=list(argv), setup=setup,
               whole=whole)
    env = dict(os.environ, ARROW_DEFAULT_MEMORY_POOL="system", MALLOC_ARENA_MAX="2", OMP_NUM_THREADS="1",
               HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    done = subprocess.run([sys.executable, "-c", _HEADROOM_CHILD, json.dumps(job)], capture_output=True, text=True,
                          env=env, timeout=300)
    print("read whole:" if whole else "streamed:", done.returncode, "(code, VmData kB before and after, VmHWM kB)",
          done.stdout.strip().splitlines()[-1:], done.stderr.strip().splitlines()[-1:])
    return done


def out_of_memory(done: subprocess.CompletedProcess) -> bool:
    """The command stopped for lack of memory (the cap bit), in one line."""
    return done.returncode != 0 and ("out of memory" in done.stderr or "MemoryError" in done.stderr)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA caps anonymous mappings on Linux only")
def test_pack_json_lines_several_times_the_memory_limit(tmp_path):
    """`packkit pack data.jsonl` with private memory capped at 40 MiB above the warm command (RLIMIT_DATA, set
    in the process after a small pack has loaded everything) packs a JSON lines file 3.1x that size, the
    buffer sized to the data, every token checked; the path that parses the file whole fails under the same
    cap, so the cap is known to bite."""
    from packkit.outputs import write_batches

    lengths = _lengths(JSONL_TOKENS, seed=1)
    src, arrow, warm = tmp_path / "data.jsonl", tmp_path / "data.arrow", tmp_path / "warm.jsonl"
    _write_arrow(arrow, lengths, batch_rows=5000, id_base=JSONL_ID_BASE)
    reader = pa.ipc.open_stream(pa.memory_map(str(arrow)))
    write_batches(src, reader.schema, reader, format="jsonl", background=False)
    arrow.unlink()
    warm.write_text("".join(json.dumps({"input_ids": list(range(k))}) + "\n" for k in range(1, 1400)))  # 5 MiB
    assert src.stat().st_size > 3 * (JSONL_HEADROOM_MIB << 20)
    out = tmp_path / "packed.arrow"
    packed = pack_with_headroom(warm, src, out, JSONL_HEADROOM_MIB)
    assert packed.returncode == 0, packed.stderr[-3000:]
    _check_every_token(out, lengths, id_base=JSONL_ID_BASE)
    out.unlink()
    old = pack_with_headroom(warm, src, out, JSONL_HEADROOM_MIB, whole=True)
    assert out_of_memory(old), old.stderr[-2000:]
    assert not out.exists()


def test_waste_and_plan_read_json_lines_a_block_at_a_time(tmp_path, monkeypatch):
    """read_lengths (what `waste` and `plan` measure) streams JSON lines of token ids: lengths, loss lengths
    and loss targets equal the whole-file read's over many blocks; packed rows are read whole (as their
    documents)."""
    import packkit.datafiles as datafiles
    import packkit.jsonlines as jsonlines

    cols = _examples(1500, labels=True)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({k: cols[k][i] for k in cols}) + "\n" for i in range(1500)))
    monkeypatch.setattr(jsonlines, "JSON_BLOCK_BYTES", 32 << 10)
    streamed = datafiles.Input(src)._streamed_lengths(whole=False)
    assert streamed is not None
    got = datafiles.read_lengths(src)
    monkeypatch.setattr(datafiles.Input, "_streamed_lengths", lambda self, whole: None)
    whole = datafiles.read_lengths(src)
    assert np.array_equal(got.lengths, whole.lengths) and np.array_equal(got.loss_lengths, whole.loss_lengths)
    assert np.array_equal(got.targets, whole.targets) and got.lengths.tolist() == [len(x) for x in cols["input_ids"]]
