"""packkit.fileio: atomic, non-destructive output. Killed at any moment, a target holds its previous
complete content or does not exist; inputs are never written; an existing target needs ``overwrite``."""

import dataclasses
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pyarrow as pa
import pytest

from packkit import atomic, fileio
from packkit.fileio import OutputExistsError, atomic_output, check_output


def write_file(path, data: bytes):
    with open(path, "wb") as f:
        f.write(data)


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if fileio.TMP_MARK in p.name)


def test_file_is_renamed_into_place(tmp_path):
    out = tmp_path / "out.bin"
    with atomic_output(out) as tmp:
        assert tmp.parent == tmp_path and not tmp.exists() and tmp.name.startswith(".out.bin")
        write_file(tmp, b"complete")
        assert not out.exists()  # nothing under the target's name until the writer is done
    assert out.read_bytes() == b"complete"
    assert leftovers(tmp_path) == []


def test_existing_target_refused_unless_overwrite(tmp_path):
    out = tmp_path / "out.bin"
    write_file(out, b"old")
    with pytest.raises(OutputExistsError, match=r"exists; pass --overwrite to replace it"):
        with atomic_output(out, overwrite_hint="--overwrite") as tmp:
            write_file(tmp, b"new")
    assert out.read_bytes() == b"old"
    with atomic_output(out, overwrite=True) as tmp:
        write_file(tmp, b"new")
    assert out.read_bytes() == b"new"
    assert leftovers(tmp_path) == []


def test_target_appearing_during_the_write_is_not_clobbered(tmp_path):
    out = tmp_path / "out.bin"
    with pytest.raises(OutputExistsError):
        with atomic_output(out) as tmp:
            write_file(tmp, b"ours")
            write_file(out, b"someone else's")
    assert out.read_bytes() == b"someone else's"
    assert leftovers(tmp_path) == []


def test_error_in_the_writer_leaves_the_old_target(tmp_path):
    out = tmp_path / "out.bin"
    write_file(out, b"old")
    with pytest.raises(RuntimeError):
        with atomic_output(out, overwrite=True) as tmp:
            write_file(tmp, b"half")
            raise RuntimeError("writer failed")
    assert out.read_bytes() == b"old"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "portable"])
def test_folder_replaced_whole(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(atomic, "_renameat2", lambda *a: False)
    out = tmp_path / "ds"
    out.mkdir()
    write_file(out / "old.arrow", b"old")
    with atomic_output(out, kind="dir", overwrite=True) as tmp:
        tmp.mkdir()
        write_file(tmp / "new.arrow", b"new")
    assert sorted(p.name for p in out.iterdir()) == ["new.arrow"]
    assert leftovers(tmp_path) == []
    with pytest.raises(OutputExistsError):
        with atomic_output(out, kind="dir") as tmp:
            tmp.mkdir()
    assert sorted(p.name for p in out.iterdir()) == ["new.arrow"]


def test_hard_link_and_symlink_to_the_input_are_refused(tmp_path):
    src = tmp_path / "a.parquet"
    write_file(src, b"input")
    hard = tmp_path / "b.parquet"
    os.link(src, hard)
    soft = tmp_path / "c.parquet"
    soft.symlink_to(src)
    for out in (src, hard, soft):
        with pytest.raises(ValueError, match="is the input"):
            check_output(out, inputs=[src], overwrite=True)
    assert src.read_bytes() == b"input"


def test_folder_holding_the_input_is_refused(tmp_path):
    ds = tmp_path / "ds"
    ds.mkdir()
    src = ds / "data-00000-of-00001.arrow"
    write_file(src, b"input")
    with pytest.raises(ValueError, match="holds the input"):
        check_output(ds, kind="dir", inputs=[src], overwrite=True)
    with pytest.raises(ValueError, match="is the input"):
        check_output(ds, kind="dir", inputs=[ds], overwrite=True)


def test_kind_mismatch_and_missing_parent(tmp_path):
    (tmp_path / "folder").mkdir()
    write_file(tmp_path / "file", b"x")
    with pytest.raises(ValueError, match="is a folder, and the output is a file"):
        check_output(tmp_path / "folder", overwrite=True)
    with pytest.raises(ValueError, match="is a file, and the output is a folder"):
        check_output(tmp_path / "file", kind="dir", overwrite=True)
    with pytest.raises(FileNotFoundError, match="does not exist; create it first"):
        check_output(tmp_path / "missing" / "out.bin")
    assert check_output(tmp_path / "made" / "out.bin", parents=True).parent.is_dir()


WRITER = textwrap.dedent("""
    import sys, time
    from packkit.fileio import atomic_output
    target, kind = sys.argv[1], sys.argv[2]
    chunk = b"x" * 65536
    with atomic_output(target, kind=kind, overwrite=True) as tmp:
        if kind == "dir":
            tmp.mkdir()
            path = tmp / "data.bin"
        else:
            path = tmp
        print("writing", flush=True)
        with open(path, "wb") as f:
            for i in range(64):
                f.write(chunk)
                f.flush()
                time.sleep(0.002)
    print("done", flush=True)
""")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["file", "dir"])
def test_sigkill_at_random_moments(tmp_path, kind):
    """A writer killed with SIGKILL at random moments: the target is the previous complete content,
    or the new complete content, never a part."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    target = tmp_path / ("out" if kind == "dir" else "out.bin")
    old = b"previous complete content"
    if kind == "dir":
        target.mkdir()
        write_file(target / "data.bin", old)
    else:
        write_file(target, old)
    new = b"x" * 65536 * 64
    rng = random.Random(0)
    outcomes = {"old": 0, "new": 0}
    for trial in range(10):
        proc = subprocess.Popen([sys.executable, str(script), str(target), kind], stdout=subprocess.PIPE)
        assert proc.stdout.readline() == b"writing\n"
        time.sleep(rng.uniform(0.0, 0.25))  # the write takes about 0.15 s, then fsync and rename
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        data = (target / "data.bin").read_bytes() if kind == "dir" else target.read_bytes()
        assert data in (old, new), f"trial {trial}: the target holds {len(data)} bytes, a partial write"
        outcomes["old" if data == old else "new"] += 1
        if kind == "dir":
            assert sorted(p.name for p in target.iterdir()) == ["data.bin"]
        if data == new:  # start again from the old content, so later kills test a replacement
            if kind == "dir":
                write_file(target / "data.bin", old)
            else:
                write_file(target, old)
    print("outcomes", outcomes)


# ----------------------------------------------------------------------------------------------
# hostile moments and names
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def sigint_raises():
    """SIGINT as Python sets it up (``KeyboardInterrupt``) for the test, whatever the suite was started with: a
    background job of a non-interactive shell starts with SIGINT ignored, which Python then leaves ignored (and
    packkit too: an ignored signal stays ignored), so that these tests saw no ``KeyboardInterrupt`` there."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_interrupt_while_waiting_for_the_writer_thread_never_closes_under_it(tmp_path, monkeypatch, sigint_raises):
    """Ctrl-C while the main thread waits for the writer thread used to close the file under the write
    (SIGSEGV / SIGABRT in pyarrow): the wait now ends with the write, then the interrupt is raised, the
    file closed once and the temporary file removed."""
    import threading

    from packkit import outputs

    events = []
    sent = threading.Event()

    class SlowSink:
        def __init__(self, path, schema, **options):
            path.write_bytes(b"partial")

        def write(self, batch):  # the write lasts until the signal was sent, however late a loaded machine sends it
            events.append("write")
            sent.wait(30)
            time.sleep(0.2)
            events.append("written")

        def close(self):
            events.append("close")

    monkeypatch.setitem(outputs.FORMATS, "parquet", dataclasses.replace(outputs.FORMATS["parquet"], sink=SlowSink))
    main = threading.main_thread().ident  # a real SIGINT to the main thread: it cuts a blocking wait short
    timer = threading.Timer(0.1, lambda: (signal.pthread_kill(main, signal.SIGINT), sent.set()))
    schema = pa.schema([("input_ids", pa.list_(pa.int32()))])
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            outputs.write_batches(tmp_path / "o.parquet", schema, iter([object()]))
    finally:  # a write that failed before the timer fired must not leave a SIGINT for whatever runs next
        timer.cancel()
        timer.join()
    assert events == ["write", "written", "close"]
    assert sorted(os.listdir(tmp_path)) == []


def test_deferred_holds_a_signal_until_the_block_ends(sigint_raises):
    from packkit.interrupts import deferred

    done = []
    with pytest.raises(KeyboardInterrupt):
        with deferred():
            signal.raise_signal(signal.SIGINT)
            done.append("cleanup finished")
    assert done == ["cleanup finished"]


def test_temporary_names_fit_the_file_system(tmp_path):
    """`.NAME.packkit-tmp-XXXXXXXX` is 22 bytes longer than NAME: a 255-byte name's temporary name is cut
    (at a character boundary) to 255 bytes, and every name matches TMP_PATTERN."""
    for name in ("out.parquet", "a" * 240 + ".parquet", "é" * 127 + ".jsonl"):
        tmp = fileio.temp_sibling(tmp_path / name)
        raw = os.fsencode(tmp.name)
        assert len(raw) <= 255 and raw.decode("utf-8") and fileio.TMP_PATTERN.fullmatch(tmp.name), tmp.name
    with pytest.raises(ValueError, match="its name is 256 bytes, longer than the file system takes"):
        check_output(tmp_path / ("b" * 248 + ".parquet"))


def test_os_errors_without_a_file_name_the_target(tmp_path):
    """pyarrow's "[errno 27] File too large" names no file; atomic_output raises it naming the target."""
    with pytest.raises(OSError) as info:
        with atomic_output(tmp_path / "o.bin") as tmp:
            write_file(tmp, b"x")
            raise OSError("Error writing bytes to file. Detail: [errno 27] File too large")
    assert info.value.errno == 27 and info.value.filename == str(tmp_path / "o.bin")
    assert leftovers(tmp_path) == []
