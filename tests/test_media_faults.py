"""Fault injection on the media write path: ``packkit pack`` of multimodal rows and ``pack_dataset(..., output=)``
of them (:mod:`packkit.mediarows`), with the helpers of ``tests/test_cli_faults.py`` (the in-process ``cli``, the
driver that runs many commands in one process, the tally of cases).

- a stop signal right after the rows were written, and SIGINT / SIGTERM at random moments of the command and of
  the library call (real processes): OUT absent or complete, a previous OUT byte-identical, no temporary file;
  every temporary name seen matches ``packkit.fileio.TMP_PATTERN``;
- a FIFO or a folder as OUT, and a damaged or truncated IN: refused in one line, naming it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

from test_cli_faults import (Case, Forker, assert_refused, cli, digest, driver, env, report,  # noqa: E402,F401
                             same_env_in_process)

from packkit.fileio import TMP_MARK, TMP_PATTERN  # noqa: E402

pytestmark = pytest.mark.slow

IMG, BOI, EOI = 120, 121, 122


def media_rows(n: int, *, seed: int = 0, side: int = 8, tokens_per_image: int = 4) -> pa.Table:
    """``n`` Gemma-3-like rows as its processor gives them: text, then 0-2 images each ``[BOI, IMG x
    tokens_per_image, EOI]`` and more text; ``token_type_ids`` 1 on the image tokens; ``pixel_values`` ``(images,
    3, side, side)`` float32 as nested lists (null for a row without images); ``labels`` -100 on the image
    tokens."""
    rng = np.random.default_rng(seed)
    ids, pixels = [], []
    for _ in range(n):
        units = int(rng.integers(0, 3))
        row = rng.integers(1, 100, int(rng.integers(3, 40))).tolist()
        for _ in range(units):
            row += [BOI] + [IMG] * tokens_per_image + [EOI] + rng.integers(1, 100, 3).tolist()
        ids.append(row)
        pixels.append(rng.standard_normal((units, 3, side, side), dtype=np.float32) if units else None)
    flat = pa.array(np.concatenate([p.reshape(-1) for p in pixels if p is not None]))
    for size in (side, side, 3):  # innermost first: a row of pixels, a channel, an image
        flat = pa.ListArray.from_arrays(pa.array(np.arange(0, len(flat) + 1, size, dtype=np.int32)), flat)
    counts = np.array([0 if p is None else len(p) for p in pixels])
    offsets = pa.array(np.concatenate(([0], np.cumsum(counts))).astype(np.int32),
                       mask=np.array([False] + [p is None for p in pixels]))
    return pa.table({"input_ids": pa.array(ids, pa.list_(pa.int64())),
                     "token_type_ids": pa.array([[int(x == IMG) for x in r] for r in ids], pa.list_(pa.int64())),
                     "labels": pa.array([[-100 if x >= IMG else x for x in r] for r in ids], pa.list_(pa.int64())),
                     "pixel_values": pa.ListArray.from_arrays(offsets, flat)})


def write_media(path: Path, n: int = 400, seed: int = 0) -> pa.Table:
    table = media_rows(n, seed=seed)
    pq.write_table(table, path, row_group_size=100)
    return table


def read_back(path: Path) -> pa.Table:
    """A complete packed OUT (parquet, Arrow stream or Arrow file); raises on a partial one."""
    if path.suffix == ".parquet":
        return pq.read_table(path)
    with pa.memory_map(str(path)) as source:
        if path.suffix == ".feather":
            return pa.ipc.open_file(source).read_all()
        return pa.ipc.open_stream(source).read_all()


def documents(table: pa.Table) -> list:
    """Every document of packed rows, ``(tokens, its pixel values)``, sorted: what any complete OUT of the same
    rows holds, whatever its row order or seed."""
    out = []
    for row in table.to_pylist():
        cut = np.concatenate(([0], np.cumsum(row["seq_lengths"])))
        for j, (a, b) in enumerate(zip(cut[:-1], cut[1:])):
            out.append((row["input_ids"][a:b], json.dumps(row["pixel_values"][j])))
    return sorted(out)


def source_documents(table: pa.Table) -> list:
    return sorted((r["input_ids"], json.dumps(r["pixel_values"])) for r in table.to_pylist())


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# ----------------------------------------------------------------------------------------------
# one home for the temporary name
# ----------------------------------------------------------------------------------------------


def test_a_stop_between_the_write_and_the_rename_leaves_the_previous_out(tmp_path, monkeypatch):
    """``packkit pack --overwrite`` of media rows wrote its new file as ``.OUT.packkit-new`` beside OUT and renamed
    it afterwards: a stop between the two left that complete file behind, a name ``TMP_PATTERN`` does not know
    (nothing removes it, nothing recognises it). Now OUT goes through ``packkit.fileio.atomic_output`` as every
    writer: a SIGTERM right after the rows are written leaves the previous OUT byte-identical and nothing beside
    it, and every name seen beside OUT is a temporary name."""
    import packkit.cli.pack as pack_cli
    from packkit.interrupts import Interrupted

    src = tmp_path / "in.parquet"
    write_media(src, 120)
    out = tmp_path / "o.parquet"
    with Case():
        assert cli(("pack", src, out, "-w", "256", "-q"))[0] == 0
        before, seen = digest(out), []
        real = pack_cli.pack_dataset

        def stopped(*args, **kwargs):
            result = real(*args, **kwargs)
            seen.extend(hidden(tmp_path))
            raise Interrupted(signal.SIGTERM)  # the signal lands as pack_dataset returns

        monkeypatch.setattr(pack_cli, "pack_dataset", stopped)
        code, _, err = cli(("pack", src, out, "-w", "256", "-q", "--seed", "5", "--overwrite"))
        print(f"names beside OUT after the write: {seen}")
        assert (code, err) == (143, "packkit pack: stopped by SIGTERM\n")
        assert digest(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["in.parquet", "o.parquet"]
        assert seen and all(TMP_PATTERN.fullmatch(n) for n in seen), seen


def test_a_stop_signal_a_library_swallows_still_stops_the_command(tmp_path, monkeypatch):
    """fsspec's ``exists`` (which ``datasets`` calls to find IN) catches every exception with a bare ``except:``,
    the ``KeyboardInterrupt`` a stop signal raises included, and answers False: a SIGINT or SIGTERM landing in
    its ``stat`` came out as ``error: Unable to find '.../in.parquet'`` (exit 3), IN blamed for the user's
    stop (1 run in 8 to 22 of the random-moment test below). The command now stops with the signal's own
    line and code, and leaves nothing beside OUT."""
    from fsspec.implementations.local import LocalFileSystem

    src = tmp_path / "in.parquet"
    write_media(src, 120)
    out = tmp_path / "o.parquet"
    real, fired = LocalFileSystem.info, []

    def info(self, path, **kwargs):
        if not fired and str(path).endswith("in.parquet"):
            fired.append(path)
            signal.raise_signal(signal.SIGTERM)  # the handler raises here, inside fsspec's try
        return real(self, path, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "info", info)
    code, _, err = cli(("pack", src, out, "-w", "256", "-q"))
    assert fired, "the stat the signal must land in was never made: the test no longer reaches fsspec"
    assert (code, err) == (143, "packkit pack: stopped by SIGTERM\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.parquet"]


def test_a_stop_signal_landing_in_a_finaliser_stops_the_command_with_its_one_line(tmp_path, monkeypatch):
    """A finaliser cannot let an exception out: a SIGTERM landing in one (``datasets.Dataset.__del__``, 2 runs in 7
    of the random-moment test below) was printed by Python as ``Exception ignored in ...`` with its traceback,
    beside the command's one line. The command stops with its line and code alone; ``sys.unraisablehook`` is not
    called for it."""
    from fsspec.implementations.local import LocalFileSystem

    src = tmp_path / "in.parquet"
    write_media(src, 120)
    out = tmp_path / "o.parquet"
    real, fired, reported = LocalFileSystem.info, [], []

    class Finalised:
        def __del__(self):
            if not fired:
                fired.append(True)
                signal.raise_signal(signal.SIGTERM)  # the handler raises here, inside the finaliser

    def info(self, path, **kwargs):
        Finalised()  # freed at once
        return real(self, path, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "info", info)
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    code, _, err = cli(("pack", src, out, "-w", "256", "-q"))
    assert fired, "no finaliser ran where the signal must land: the test no longer reaches fsspec"
    assert (code, err, reported) == (143, "packkit pack: stopped by SIGTERM\n", [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.parquet"]


# ----------------------------------------------------------------------------------------------
# stop signals at random moments, in real processes
# ----------------------------------------------------------------------------------------------


def moments(rng: random.Random, took: float, writing: float, k: int) -> tuple[str, float]:
    """Where the ``k``-th signal lands: half of them a random time after OUT's temporary file appears (the
    writer), half a random time into the whole run (planning, the writer, the rename)."""
    return ("writing", rng.uniform(0, writing)) if k % 2 else ("run", rng.uniform(0, took))


def test_stop_signals_at_random_moments_of_packkit_pack_of_media_rows(tmp_path):
    """SIGINT / SIGTERM at random moments of ``packkit pack`` of media rows (the command's own process: its
    handlers, its cleanup), a fresh OUT or ``--overwrite`` of a previous one, 24 tries: each run returns 130 / 143
    with one line (or 0 when the signal came after the work); a fresh OUT is absent or holds every document with
    its images, a previous OUT is byte-identical or replaced whole (a signal after the rename); nothing but OUT is left; every temporary name
    seen matches TMP_PATTERN."""
    src = tmp_path / "in.parquet"
    want = source_documents(write_media(src, 400))
    outs = tmp_path / "o"
    outs.mkdir()
    fresh, old = outs / "fresh.parquet", outs / "old.arrow"
    assert cli(("pack", src, old, "-w", "256", "-q", "--seed", "1"))[0] == 0
    before = old.read_bytes()
    tries = 24
    argv = [("pack", src, fresh, "-w", "256", "-q", "--buffer-mb", "1") if k % 4 < 2 else
            ("pack", src, old, "-w", "256", "-q", "--buffer-mb", "1", "--seed", "2", "--overwrite")
            for k in range(2 + tries)]
    proc = driver(tmp_path, [{"argv": a, "wait": True, "list": [str(outs)]} for a in argv], stdin=subprocess.PIPE)
    watchdog = threading.Timer(600, proc.kill)
    watchdog.daemon = True
    watchdog.start()
    rng, seen, codes, took, writing = random.Random(23), set(), [], [], []

    def look() -> bool:
        found = {p.name for p in outs.iterdir() if TMP_MARK in p.name}
        seen.update(found)
        return bool(found)

    for k in range(2 + tries):
        assert json.loads(proc.stdout.readline()) == {"start": k}
        t0, first, last = time.monotonic(), None, None
        if k < 2:  # timed, no signal: the whole run and how long OUT's temporary file lives
            while not select.select([proc.stdout], [], [], 0.001)[0]:
                if look():
                    first, last = first or time.monotonic(), time.monotonic()
            writing.append(last - first if first else 0.0)
        else:
            where, wait = moments(rng, min(took), min(writing) or 0.01, k)
            if where == "writing":
                while not look() and not select.select([proc.stdout], [], [], 0.001)[0]:
                    pass
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                look()
                time.sleep(0.001)
            proc.send_signal(rng.choice([signal.SIGINT, signal.SIGTERM]))
        line = proc.stdout.readline()
        assert line, f"try {k}: the process died with {proc.wait()}: {proc.stderr.read()[-2000:]}"
        result = json.loads(line)
        took.append(time.monotonic() - t0)
        out = Path(argv[k][2])
        with Case():
            code, err = result["code"], result["stderr"]
            assert code in (0, 130, 143), result
            if code:
                assert err == "packkit pack: " + ("interrupted\n" if code == 130 else "stopped by SIGTERM\n"), err
            assert set(result["listing"][str(outs)]) <= {fresh.name, old.name}, result  # no temporary left
            if out == fresh and (code == 0 or fresh.exists()):
                assert documents(read_back(fresh)) == want
            if out == old:
                # untouched, or replaced whole (a signal after the rename still stops the command: 130 / 143)
                assert old.read_bytes() == before or documents(read_back(old)) == want
            codes.append(code)
        fresh.unlink(missing_ok=True)
        old.write_bytes(before)
        proc.stdin.write("\n")
        proc.stdin.flush()
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    watchdog.cancel()
    assert "Traceback" not in proc.stderr.read()
    print(f"packkit pack of media rows, stop signals: {tries} tries, exit codes "
          f"{sorted((c, codes[2:].count(c)) for c in set(codes[2:]))}, a run {min(took[:2]):.2f} s (writing "
          f"{min(writing):.2f} s), temporary names seen {len(seen)}")
    assert seen and all(TMP_PATTERN.fullmatch(n) for n in seen), seen
    # a loaded machine makes some runs shorter than the timed ones: a third of the signals may come after the work
    assert codes[2:].count(0) <= tries * 2 // 3, "most signals came after the work: the moments are not spread over it"


#: A fork server (``test_cli_faults.Forker``'s protocol) for the library: each JSON line ``[src, out, seed]``
#: forks a child that runs ``pack_dataset(Dataset.from_file(src), output=out)`` in a plain program (SIGTERM at its
#: default action, SIGINT a KeyboardInterrupt it lets end the child with 130).
LIBRARY = r"""
import json, os, sys
import datasets, pyarrow.ipc, pyarrow.parquet  # noqa: F401 - imported once, before any fork
from packkit.offline import pack_dataset
print("ready", flush=True)
for line in sys.stdin:
    src, out, seed = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:  # a SIGINT anywhere in the child (even before or after the call) is its KeyboardInterrupt: 130
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            pack_dataset(datasets.Dataset.from_file(src), window=256, seed=int(seed), output=out,
                         buffer_bytes=1 << 16, progress=False)
            os._exit(0)
        except KeyboardInterrupt:
            os._exit(130)
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


def test_stop_signals_at_random_moments_of_pack_dataset_output_of_media_rows(tmp_path):
    """SIGINT / SIGTERM at random moments of ``pack_dataset(ds, output=OUT)`` of media rows in a program that
    installs no handler (SIGTERM used to end it at once, its temporary file left beside OUT), 24 tries: the
    program ends by the signal (SIGINT: its KeyboardInterrupt) or completes; OUT is absent or holds every
    document with its images; no temporary file is left."""
    src = tmp_path / "in.arrow"
    table = media_rows(400)
    with pa.ipc.new_stream(str(src), table.schema) as w:
        w.write_table(table, max_chunksize=100)
    want = source_documents(table)
    outs = tmp_path / "o"
    outs.mkdir()
    out = outs / "packed.parquet"
    server = Forker(tmp_path, LIBRARY)
    rng, codes, took, writing, seen = random.Random(29), [], [], [], set()
    tries = 24
    try:
        for k in range(2 + tries):
            pid = server.start([src, out, k])
            t0, first, last = time.monotonic(), None, None
            if k < 2:
                while not server.finished(0.001):
                    found = {p.name for p in outs.iterdir() if TMP_MARK in p.name}
                    seen.update(found)
                    if found:
                        first, last = first or time.monotonic(), time.monotonic()
                writing.append(last - first if first else 0.0)
            else:
                where, wait = moments(rng, min(took), min(writing) or 0.01, k)
                if where == "writing":
                    while not any(TMP_MARK in p.name for p in outs.iterdir()) and not server.finished(0.001):
                        pass
                time.sleep(wait)
                signum = rng.choice([signal.SIGINT, signal.SIGTERM])
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
            code = server.status()
            took.append(time.monotonic() - t0)
            with Case():
                assert code in (0, 130, -signal.SIGTERM), (k, code)
                assert [p.name for p in outs.iterdir()] in ([], [out.name]), list(outs.iterdir())
                if code == 0 or out.exists():
                    assert documents(read_back(out)) == want
                codes.append(code)
            out.unlink(missing_ok=True)
    finally:
        server.close()
    print(f"pack_dataset(output=) of media rows, stop signals: {tries} tries, exit codes "
          f"{sorted((c, codes[2:].count(c)) for c in set(codes[2:]))}, a run {min(took[:2]):.2f} s (writing "
          f"{min(writing):.2f} s)")
    assert seen and all(TMP_PATTERN.fullmatch(n) for n in seen), seen
    # a loaded machine makes some runs shorter than the timed ones: a third of the signals may come after the work
    assert codes[2:].count(0) <= tries * 2 // 3, "most signals came after the work: the moments are not spread over it"


# ----------------------------------------------------------------------------------------------
# what OUT may not be, and damaged input
# ----------------------------------------------------------------------------------------------


def test_a_fifo_or_a_folder_as_out_is_refused_in_one_line(tmp_path):
    """A named pipe as OUT was replaced by a file with --overwrite (the rename puts the file where the pipe was: a
    reader waiting on the pipe gets nothing) and, without it, told to pass --overwrite; a folder as OUT. Both
    refused in one line, with or without --overwrite, by ``packkit pack`` and ``pack_dataset(output=)`` of media
    rows alike; the pipe and the folder are left as they were."""
    import stat

    from packkit.offline import pack_dataset

    src = tmp_path / "in.parquet"
    table = write_media(src, 100)
    fifo, folder = tmp_path / "pipe.parquet", tmp_path / "dir.parquet"
    os.mkfifo(fifo)
    folder.mkdir()
    for out, match in ((fifo, "is a named pipe (FIFO), not a file: packkit writes beside it and renames"),
                       (folder, "is a folder, and the output is a file; remove it or choose another name")):
        for extra in ((), ("--overwrite",)):
            with Case():
                assert_refused(("pack", src, out, "-w", "256", *extra), 2, match, [src])
        with Case(), pytest.raises(ValueError, match=re.escape(match)):
            pack_dataset(datasets.Dataset(table), window=256, output=out, progress=False)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and not any(folder.iterdir())
    assert not hidden(tmp_path)


def test_media_rows_to_an_out_named_without_its_formats_suffix(tmp_path):
    """``packkit pack IN.parquet OUT.bin --output-format arrow`` (or ``feather``) of media rows wrote OUT, then read
    its columns back by its name for the summary: exit 3 and "cannot read 'OUT.bin': unknown format '.bin'" after a
    complete OUT was written. OUT's columns are read by its format (:func:`packkit.mediarows.file_columns`): the
    same rows and summary as an OUT named by its format, exit 0."""
    from packkit.mediarows import kept_media

    src = tmp_path / "in.parquet"
    write_media(src, 100)
    assert kept_media(src, "parquet", "jsonl") == [] and kept_media(src, "parquet", "feather") == ["pixel_values"]
    for fmt, suffix in (("arrow", ".arrow"), ("feather", ".feather"), ("parquet", ".parquet")):
        named, odd = tmp_path / f"named{suffix}", tmp_path / f"{fmt}.bin"
        with Case():
            code, out, err = cli(("pack", src, named, "-w", "256", "--json"))
            assert code == 0, err
            want = json.loads(out)
            code, out, err = cli(("pack", src, odd, "-w", "256", "--json", "--output-format", fmt))
            assert code == 0, err
            got = json.loads(out)
            assert got["media"] == ["pixel_values"] and "pixel_values" in got["columns"]
            assert {**got, "output": str(named)} == want
            assert read_back(odd.rename(odd.with_suffix(suffix))).equals(read_back(named))  # read by its suffix
    assert not hidden(tmp_path)


def test_damaged_or_truncated_media_input_is_one_line_naming_it(tmp_path):
    """A media parquet whose page header is damaged (in the token column, in the pixel column) ended ``packkit
    pack`` with the traceback of ``datasets``' DatasetGenerationError; a damaged footer, a truncated parquet, a
    truncated Arrow stream and Arrow file: each one line naming the file, exit 3, no OUT, nothing beside it."""
    src = tmp_path / "in.parquet"
    table = write_media(src, 400)
    meta = pq.ParquetFile(src).metadata
    raw = src.read_bytes()
    bad = {}
    for column, name in ((0, "ids.parquet"), (meta.num_columns - 1, "pixels.parquet")):
        at = meta.row_group(2).column(column).data_page_offset
        bad[name] = raw[:at] + b"\xff" * 64 + raw[at + 64:]
    bad["footer.parquet"] = raw[:-40] + b"\xff" * 32 + raw[-8:]
    bad["cut.parquet"] = raw[: len(raw) // 2]
    for name, writer in (("stream.arrow", pa.ipc.new_stream), ("file.arrow", pa.ipc.new_file)):
        sink = pa.BufferOutputStream()
        with writer(sink, table.schema) as w:
            w.write_table(table, max_chunksize=100)
        whole = sink.getvalue().to_pybytes()
        bad[name] = whole[: int(len(whole) * 0.6)]
    inputs = tmp_path / "in"
    inputs.mkdir()
    for name, content in bad.items():
        path = inputs / name
        path.write_bytes(content)
        what = "Parquet" if name.endswith(".parquet") else "an Arrow IPC file or stream"
        with Case():
            err = assert_refused(("pack", path, tmp_path / "o.parquet", "-w", "256"), 3,
                                 f"cannot read {str(path)!r} as {what} (damaged, truncated, or not", [path])
            print(err.strip())
            assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "in.parquet"]
