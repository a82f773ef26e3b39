"""Issue 28, files read defensively: each class through the public API and the `packkit` command.

- an input truncated while `packkit pack` memory-maps it (a real process, a real truncation): an error naming
  the file, exit 3, nothing beside OUT (it was a SIGBUS: nothing printed, a temporary file left);
- an input open for writing elsewhere, and one changed where no lease holds it;

Every refusal is one line on stderr naming the file, row, line, field or option to blame, read here.
In-process through ``packkit.cli.main`` (what the script calls) except where a process is the point.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")

from packkit.cli import main  # noqa: E402
from packkit.fileio import TMP_MARK, InputChangedError, held_still  # noqa: E402


def cli(argv) -> tuple[int, str, str]:
    """``packkit ARGV`` in this process -> (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def arrow_stream(path: Path, tokens: int, *, seed: int = 0) -> None:
    """An Arrow IPC stream of ``input_ids`` (int32), batches of 1,000 rows, as ``datasets`` writes its cache."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(50, 1500, tokens // 700 + 1)
    lengths = lengths[np.cumsum(lengths) <= tokens]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = rng.integers(0, 32000, int(offsets[-1])).astype(np.int32)
    table = pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))})
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        for batch in table.to_batches(max_chunksize=1000):
            w.write_batch(batch)


def leftovers(folder: Path) -> list:
    return [p.name for p in folder.iterdir() if TMP_MARK in p.name]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="read leases are Linux's")
def test_input_truncated_while_pack_maps_it_is_an_error_naming_it(tmp_path):
    """Issue 28: an .arrow IN truncated while `packkit pack` read it through its memory map ended in SIGBUS (exit
    -7 / 135, nothing printed, ``.out.parquet.packkit-tmp-*`` left). The truncation here comes from another
    process once OUT's temporary file exists (mid-pack); packkit holds IN with a read lease, so the truncation
    waits while packkit stops: exit 3, one line naming IN, nothing beside OUT, and the truncation then done."""
    src, out = tmp_path / "shard.arrow", tmp_path / "out.parquet"
    arrow_stream(src, 3_000_000)
    proc = subprocess.Popen([sys.executable, "-m", "packkit.cli", "pack", str(src), str(out), "-w", "4096", "-q",
                             "--buffer-mb", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PACKKIT_DEBUG": ""})
    deadline = time.monotonic() + 120
    while not leftovers(tmp_path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert proc.poll() is None, ("pack ended before it began writing", proc.communicate())
    truncater = subprocess.Popen([sys.executable, "-c", f"import os; os.truncate({str(src)!r}, 100_000)"])
    _, err = proc.communicate(timeout=120)
    truncater.wait(timeout=120)
    assert proc.returncode == 3, (proc.returncode, err)
    line = one_line(err)
    assert "'" + str(src) + "'" in line and "changed by another process while packkit read it" in line, line
    assert not out.exists() and leftovers(tmp_path) == []
    assert src.stat().st_size == 100_000  # the writer went on once packkit let go


def test_input_open_for_writing_elsewhere_is_refused_naming_it(tmp_path):
    """A file still being written (open for writing by another program) gets no read lease: reading it now would
    read half of it, and it could shrink under the map. Refused before reading, naming the file."""
    src = tmp_path / "shard.arrow"
    arrow_stream(src, 20_000)
    with open(src, "ab"):
        code, _, err = cli(["waste", src, "-q"])
        with pytest.raises(InputChangedError, match="is open for writing"):
            from packkit.datafiles import read_lengths

            read_lengths(src)
    if sys.platform.startswith("linux"):
        assert code == 3 and f"'{src}' is open for writing" in one_line(err), err
    assert cli(["waste", src, "-q"])[0] == 0  # closed: read


def test_input_changed_without_a_lease_is_named_at_the_next_check(tmp_path):
    """Off the main thread no lease can be held (signals are the main thread's): the file's size and time are
    compared at each check instead, and a change is the same error naming the file."""
    src = tmp_path / "data.jsonl"
    src.write_text('{"input_ids": [1, 2]}\n')
    got = []

    def reader():
        try:
            with held_still([src]) as hold:
                hold.check()
                src.write_text('{"input_ids": [1, 2, 3]}\n')
                hold.check()
        except InputChangedError as exc:
            got.append(str(exc))

    t = threading.Thread(target=reader)
    t.start()
    t.join()
    assert got and got[0].startswith(f"'{src}' was changed by another process while packkit read it"), got
