"""Fault injection on the `packkit` command.

A real process where the process is the point (SIGKILL, SIGINT / SIGTERM, a broken pipe, an address-space or
file-size limit, a small disk, modules made uninstalled); everywhere else (refusals, damaged input) the
command's own ``packkit.cli.main`` in this process, which is what the ``packkit`` script calls: the same
exit code and stderr, without paying the imports once a case.

- SIGKILL at random moments of `packkit pack` in every output format: the target is absent or
  complete, and a previous target is byte-identical;
- OUT that is IN (the same path, a hard link, a symbolic link), a folder holding IN, an existing OUT,
  an existing plain file where a folder is written, a missing folder;
- input damaged: parquet corrupted in the middle and in the footer, a truncated Arrow stream, a jsonl
  with a bad line deep in a large file (named by its line);
- a window of 2**40 (and 2**31, which the OOM killer used to take), a broken pipe.

Every case asserts the exit code, at most one line on stderr and no traceback, and that every input
is byte-identical afterwards. A line ``fault-injection: N cases tried, N passed`` is printed at the end
(run with ``-s`` to see it).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import json
import os
import random
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

from packkit.cli import main  # noqa: E402
from packkit.fileio import TMP_MARK  # noqa: E402

pytestmark = pytest.mark.slow

EXE = Path(sys.executable).parent / "packkit"
TALLY = {"tried": 0, "passed": 0}


def packkit_argv(*args) -> list[str]:
    return ([str(EXE)] if EXE.exists() else [sys.executable, "-m", "packkit.cli"]) + [str(a) for a in args]


def env() -> dict:
    e = dict(os.environ)
    e.pop("PACKKIT_DEBUG", None)
    e.pop("PACKKIT_MAX_WINDOW", None)
    e["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
    return e


@pytest.fixture(autouse=True)
def same_env_in_process(monkeypatch):
    """The in-process runs see what :func:`env` gives the spawned ones."""
    for name in ("PACKKIT_DEBUG", "PACKKIT_MAX_WINDOW"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


def cli(argv) -> tuple[int, str, str]:
    """``packkit ARGV`` in this process: ``packkit.cli.main`` (what the script calls) -> (exit code, stdout,
    stderr). ``cli(["plan", "--synthetic", "0"])[0] -> 2``."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def digest(path: Path) -> str:
    """A hash of a file, or of a folder's files (names and bytes)."""
    h = hashlib.sha256()
    if path.is_dir():
        for p in sorted(path.rglob("*")):
            if p.is_file():
                h.update(str(p.relative_to(path)).encode() + b"\0" + p.read_bytes())
    else:
        h.update(path.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    print(f"\nfault-injection: {TALLY['tried']} cases tried, {TALLY['passed']} passed")


class Case:
    """Counts a case as tried on entry and as passed when its block ends without an error."""

    def __enter__(self):
        TALLY["tried"] += 1
        return self

    def __exit__(self, kind, *rest):
        if kind is None:
            TALLY["passed"] += 1
        return False


def assert_refused(argv, code: int, match: str, inputs) -> str:
    """Run ``packkit ARGV`` (in this process); assert the exit code, one stderr line containing ``match``
    with no traceback, and inputs unchanged; return stderr."""
    before = {p: digest(p) for p in inputs}
    got, _, err = cli(argv)
    assert got == code, (argv, got, err)
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert match in err, err
    assert {p: digest(p) for p in inputs} == before
    return err


# ----------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A parquet of 20,000 examples (about 2M tokens), its Arrow stream and damaged copies, and jsonl
    files of 160,000 lines with a bad line at 150,001."""
    root = tmp_path_factory.mktemp("faults")
    rng = np.random.default_rng(0)
    lengths = rng.integers(8, 200, 20_000)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    values = pa.array(rng.integers(0, 50_000, int(offsets[-1])).astype(np.int32))
    table = pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), values)})
    paths = {"parquet": root / "in.parquet", "arrow": root / "in.arrow"}
    pq.write_table(table, paths["parquet"], row_group_size=5_000)
    with pa.ipc.new_stream(str(paths["arrow"]), table.schema) as w:
        w.write_table(table, max_chunksize=5_000)
    # parquet damaged in the middle: the page header of the third row group's column chunk overwritten
    raw = bytearray(paths["parquet"].read_bytes())
    at = pq.ParquetFile(paths["parquet"]).metadata.row_group(2).column(0).data_page_offset
    raw[at: at + 64] = b"\xff" * 64
    paths["mid.parquet"] = root / "mid.parquet"
    paths["mid.parquet"].write_bytes(bytes(raw))
    # ... and in the footer (the file metadata before the last 8 bytes)
    raw = paths["parquet"].read_bytes()
    paths["footer.parquet"] = root / "footer.parquet"
    paths["footer.parquet"].write_bytes(raw[:-40] + b"\xff" * 32 + raw[-8:])
    stream = paths["arrow"].read_bytes()
    paths["trunc.arrow"] = root / "trunc.arrow"
    paths["trunc.arrow"].write_bytes(stream[: int(len(stream) * 0.6)])
    lines = [f'{{"input_ids": [{i % 997}, 2, 3, {i % 13}, 5]}}' for i in range(160_000)]
    for name, bad in (("jsonl", '{"input_ids": [1, 2,'),  # line 150,001 cut short
                      ("kind.jsonl", '{"input_ids": "a text where token ids belong"}'),
                      ("neg.jsonl", '{"input_ids": [3, -7, 4]}')):
        lines[150_000] = bad
        paths[name] = root / ("deep.jsonl" if name == "jsonl" else name)
        paths[name].write_text("\n".join(lines) + "\n")
    paths["small"] = root / "small.jsonl"
    paths["small"].write_text("".join(json.dumps({"input_ids": [1, 2, 3][: 1 + i % 3]}) + "\n" for i in range(40)))
    return paths


# ----------------------------------------------------------------------------------------------
# SIGKILL during real writes
# ----------------------------------------------------------------------------------------------

#: Kills per format: the first with no previous output, the last two at any moment of the run, the others
#: while the temporary output is being written.
TRIALS = 6
FORMATS = {"parquet": "out.parquet", "jsonl": "out.jsonl", "arrow": "out.arrow", "feather": "out.feather",
           "folder": "out"}


def read_output(path: Path, fmt: str):
    """The packed rows of a complete output (raises on a partial one)."""
    if fmt == "parquet":
        return pq.read_table(path).column("input_ids").to_pylist()
    if fmt == "jsonl":
        return [json.loads(line)["input_ids"] for line in path.read_text().splitlines()]
    if fmt == "arrow":
        return pa.ipc.open_stream(pa.memory_map(str(path))).read_all().column("input_ids").to_pylist()
    if fmt == "feather":
        return pa.ipc.open_file(pa.memory_map(str(path))).read_all().column("input_ids").to_pylist()
    return datasets.load_from_disk(str(path))["input_ids"]


def temp_beside(target: Path) -> bool:
    return any(TMP_MARK in p.name and p.name.startswith(f".{target.name}") for p in target.parent.iterdir())


#: A fork server: imports `packkit.cli` and what `pack` writes with once, then for each line of stdin (an
#: argv as JSON) forks a child that runs the command (``os._exit(main(argv))``, stdout and stderr to
#: /dev/null), prints the child's pid, waits for it and prints its exit status (-9: SIGKILL). A kill then
#: costs the packing, not the interpreter's start and the imports. The server runs nothing before it forks
#: (no thread of pyarrow's pools exists yet).
FORKER = r"""
import json, os, sys
import datasets, pyarrow.ipc, pyarrow.parquet  # noqa: F401 - imported once, before any fork
import packkit.cli.pack  # noqa: F401
from packkit.cli import main
print("ready", flush=True)
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        os._exit(main(json.loads(line)))
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


class Forker:
    """The test's side of :data:`FORKER`: ``start(argv) -> pid``, ``finished(wait) -> bool``, ``status()``;
    ``server``: another fork server of the same protocol (a JSON line in, the child's pid and exit status out)."""

    def __init__(self, root: Path, server: str = FORKER):
        script = root / "forker.py"
        script.write_text(server)
        self.proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     bufsize=0, env=env())
        self.buf = b""
        assert self._line() == "ready"  # imports done: the runs are timed from here

    def _line(self) -> str:
        while b"\n" not in self.buf:
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            assert chunk, f"the fork server died: {self.proc.wait()}"
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def start(self, argv) -> int:
        self.proc.stdin.write(json.dumps([str(a) for a in argv]).encode() + b"\n")
        return int(self._line())

    def finished(self, wait: float) -> bool:
        """Whether the child's exit status has come (waiting up to ``wait`` seconds for it)."""
        return b"\n" in self.buf or bool(select.select([self.proc.stdout], [], [], wait)[0])

    def kill(self, pid: int) -> int:
        """SIGKILL the child (if it has not ended already) -> its exit status."""
        with contextlib.suppress(ProcessLookupError):  # it ended and the server reaped it
            os.kill(pid, signal.SIGKILL)
        return self.status()

    def status(self) -> int:
        return int(self._line())

    def close(self):
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0


@pytest.fixture(scope="module")
def forker(tmp_path_factory):
    f = Forker(tmp_path_factory.mktemp("forker"))
    yield f
    f.close()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_sigkill_at_random_moments_of_pack(tmp_path, data, forker, fmt):
    """`packkit pack IN OUT --overwrite` killed with SIGKILL at random moments (most during the write,
    timed from the moment its temporary file appears): OUT is the previous complete output byte for
    byte, or the new complete output, or (with no previous output) absent. IN is never touched. Each run
    is forked from a server that imported packkit once (:data:`FORKER`), so the moments fall on the work."""
    src = data["parquet"]
    src_digest = digest(src)
    out = tmp_path / FORMATS[fmt]
    argv = ("pack", src, out, "-w", "2048", "-q", "--overwrite")
    # the new output, from an uninterrupted run, and how long its temporary file lives (the write,
    # fsync and rename)
    t0 = time.monotonic()
    pid = forker.start(argv)
    first = last = None
    while not forker.finished(0.002):
        if temp_beside(out):
            first = first or time.monotonic()
            last = time.monotonic()
    end = time.monotonic()
    assert forker.status() == 0, f"pid {pid}: the uninterrupted {fmt} run failed"
    new_rows = read_output(out, fmt)
    write_time = (last - first) if first else 0.05
    # the previous output: any complete content other than the new one
    old = tmp_path / "previous"
    if fmt == "folder":
        old.mkdir()
        (old / "data-00000-of-00001.arrow").write_bytes(b"previous complete folder")
    else:
        old.write_bytes(b"previous complete " + fmt.encode())
    rng = random.Random(f"{fmt}-{os.getpid()}")
    outcomes = {"absent": 0, "old": 0, "new": 0}
    for trial in range(TRIALS):
        with Case():
            if out.is_dir():
                shutil.rmtree(out)
            elif out.exists():
                out.unlink()
            fresh = trial == 0  # the first kill has no previous output: absent or complete
            if not fresh:
                (shutil.copytree if fmt == "folder" else shutil.copyfile)(old, out)
            old_digest = None if fresh else digest(out)
            pid = forker.start(argv)
            if trial >= TRIALS - 2:  # kills at uniformly random moments of the whole run
                time.sleep(rng.uniform(0, end - t0))
            else:  # a kill while the temporary file is being written
                deadline = time.monotonic() + 300
                while not temp_beside(out) and time.monotonic() < deadline and not forker.finished(0.002):
                    pass
                time.sleep(rng.uniform(0, write_time))
            assert forker.kill(pid) in (0, -signal.SIGKILL)
            if not out.exists():
                assert fresh, f"trial {trial}: the previous {fmt} output is gone"
                outcomes["absent"] += 1
            elif old_digest is not None and digest(out) == old_digest:
                outcomes["old"] += 1
            else:
                assert read_output(out, fmt) == new_rows, f"trial {trial}: {fmt} output is neither old nor new"
                outcomes["new"] += 1
            assert digest(src) == src_digest
    print(f"{fmt}: temporary file for {write_time:.2f} s, run {end - t0:.1f} s, outcomes {outcomes}")


# ----------------------------------------------------------------------------------------------
# refusals: nothing of the user's is destroyed
# ----------------------------------------------------------------------------------------------


def test_output_that_is_the_input_is_refused(tmp_path, data):
    """`ln a.parquet b.parquet; packkit pack a.parquet b.parquet` used to overwrite a.parquet."""
    src = tmp_path / "a.parquet"
    shutil.copyfile(data["parquet"], src)
    hard, soft = tmp_path / "b.parquet", tmp_path / "c.parquet"
    os.link(src, hard)
    soft.symlink_to(src)
    for out in (src, hard, soft):
        with Case():
            assert_refused(("pack", src, out, "-w", "64", "--overwrite"), 2, "is the input", [src])


def test_folder_holding_the_input_is_refused(tmp_path, data):
    """`packkit pack ds/data-00000-of-00001.arrow ds` used to overwrite the source dataset."""
    ds = tmp_path / "ds"
    datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]]}).save_to_disk(str(ds))
    arrow = next(ds.glob("*.arrow"))
    for argv, match in (((arrow, ds, "-w", "128", "--overwrite"), "is a folder that holds the input"),
                        ((ds, ds, "-w", "128", "--overwrite"), "is the input"),
                        ((arrow, ds, "-w", "128"), "is a folder that holds the input")):
        with Case():
            assert_refused(("pack",) + argv, 2, match, [ds])


def test_existing_output_is_refused_without_overwrite(tmp_path, data):
    src = data["small"]
    for name in ("o.parquet", "o.jsonl", "o.arrow", "o.feather", "o"):
        with Case():
            out = tmp_path / name
            if name == "o":
                out.mkdir()
                (out / "state.json").write_text("{}")
            else:
                out.write_bytes(b"an earlier output")
            assert_refused(("pack", src, out, "-w", "8"), 2, "exists; pass --overwrite to replace it", [src, out])
    with Case():  # a plain file where a folder would be written, even with --overwrite
        plain = tmp_path / "plain"
        plain.write_bytes(b"user data")
        assert_refused(("pack", src, plain, "-w", "8", "--overwrite"), 2, "is a file, and the output is a folder",
                    [src, plain])
    with Case():  # --plot too
        png = tmp_path / "w.png"
        png.write_bytes(b"user picture")
        assert_refused(("waste", src, "--plot", png), 2, "exists; pass --overwrite to replace it", [src, png])
    with Case():  # a missing folder is not created
        assert_refused(("pack", src, tmp_path / "nowhere" / "o.parquet", "-w", "8"), 2,
                    "does not exist; create it first (mkdir -p", [src])
        assert not (tmp_path / "nowhere").exists()


# ----------------------------------------------------------------------------------------------
# damaged input, huge windows, a closed pipe
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cmd", ["waste", "pack"])
@pytest.mark.parametrize("name, match", [
    ("mid.parquet", "as Parquet (damaged, truncated, or not Parquet)"),
    ("footer.parquet", "as Parquet (damaged, truncated, or not Parquet)"),
    ("trunc.arrow", "as an Arrow IPC file or stream (damaged, truncated, or not Arrow)"),
    ("jsonl", "line 150,001: not valid JSON"),
    ("kind.jsonl", "line 150,001: 'input_ids' holds text, but a list of numbers on line 1"),
])
def test_damaged_input_is_one_line_naming_it(tmp_path, data, cmd, name, match):
    with Case():
        src = data[name]
        argv = ("waste", src) if cmd == "waste" else ("pack", src, tmp_path / "o.parquet", "-w", "256")
        err = assert_refused(argv, 3, match, [src])
        assert src.name in err
        assert not (tmp_path / "o.parquet").exists() and not list(tmp_path.iterdir())


def test_bad_row_deep_in_a_jsonl_names_its_line(tmp_path, data):
    """A row refused after reading (a negative token id) names the example and the file's line."""
    with Case():
        assert_refused(("pack", data["neg.jsonl"], tmp_path / "o.parquet", "-w", "64"), 3,
                    f"dataset row 150000 (line 150,001 of '{data['neg.jsonl']}') has token id -7",
                    [data["neg.jsonl"]])


def test_window_far_too_large_is_refused_before_any_allocation(tmp_path, data):
    """`-w 1099511627776` tried to allocate 8 TiB and `waste -w 2147483648` was OOM-killed; now a usage
    error with the reason, in a process under a 4 GiB address-space limit to show that nothing large is
    allocated (one process, every command in turn)."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    argvs = [("waste", "-w", 2**40), ("waste", "-w", 2**31), ("plan", "--synthetic", "100", "-w", 2**40),
             ("pack", data["small"], tmp_path / "o.parquet", "-w", 2**40)]
    proc = driver(tmp_path, [{"argv": a} for a in argvs], preexec_fn=limit)
    out, err = proc.communicate(timeout=300)
    results = [json.loads(line) for line in out.splitlines() if '"code"' in line]
    assert proc.returncode == 0 and len(results) == len(argvs) and "Traceback" not in err, err
    for argv, result in zip(argvs, results):
        with Case():
            assert result["code"] == 2, (argv, result)
            assert result["stderr"].count("\n") == 1, (argv, result)
            assert "--window" in result["stderr"], (argv, result)
            assert "is above the largest window packkit accepts, 16,777,216" in result["stderr"], (argv, result)
    assert not (tmp_path / "o.parquet").exists()


def test_broken_pipe_exits_quietly():
    """`packkit waste | head -1` could print a BrokenPipeError traceback. The reader here goes away
    before packkit writes (`| true`): exit 141, as a Unix tool killed by SIGPIPE, and nothing on stderr
    (three real commands, one shell)."""
    argvs = [("waste",), ("waste", "--json"), ("plan", "--synthetic", "1000")]
    line = "; ".join(" ".join(packkit_argv(*a)) + ' | true; echo "rc=${PIPESTATUS[0]}"' for a in argvs)
    proc = subprocess.run(["bash", "-c", line], capture_output=True, text=True, env=env(), timeout=300)
    for _ in argvs:
        TALLY["tried"] += 1
    assert proc.stdout.split() == ["rc=141"] * len(argvs), (proc.stdout, proc.stderr)
    assert proc.stderr == ""
    TALLY["passed"] += len(argvs)


# ----------------------------------------------------------------------------------------------
# hostile moments: stop signals, a full disk, a file-size limit, names the disk refuses
# ----------------------------------------------------------------------------------------------

#: Runs `packkit.cli.main` on many cases in one process (imports paid once): prints {"start": k} before
#: a case and its result after, then waits for a line on stdin when the case says so. Stop signals that
#: land between cases are held (the test sends them at random moments, some after `main` returned).
#: What the commands import lazily is imported first: a signal inside an import leaves a half-imported
#: module behind (asyncio's `base_events` missing, seen here), which a real packkit process, ending there,
#: never meets again, but the driver's next case would.
DRIVER = r"""
import contextlib, importlib, io, json, os, resource, signal, sys
for name in filter(None, os.environ.get("PACKKIT_TEST_BLOCK", "").split(",")):
    sys.modules[name] = None  # as if not installed: importing it raises ModuleNotFoundError
for name in ("pyarrow.compute", "pyarrow.ipc", "pyarrow.json", "pyarrow.parquet", "datasets", "datasets.fingerprint",
             "packkit.cli.pack", "packkit.cli.plan", "packkit.cli.waste"):
    with contextlib.suppress(ImportError):
        importlib.import_module(name)
from packkit.cli import main
late = []
for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, lambda n, f: late.append(n))
for k, case in enumerate(json.loads(sys.argv[1])):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if case.get("fsize"):
        resource.setrlimit(resource.RLIMIT_FSIZE, (case["fsize"], hard))
    print(json.dumps({"start": k}), flush=True)
    err, said = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(said):
        code = main(case["argv"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    listing = {d: sorted(os.listdir(d)) for d in case.get("list", [])}
    print(json.dumps({"k": k, "code": code, "stderr": err.getvalue(), "listing": listing, "late": len(late)}),
          flush=True)
    if case.get("wait"):
        sys.stdin.readline()
"""


def driver(tmp_path, cases, *, prefix=(), stdin=None, block=(), preexec_fn=None):
    """Start the in-process driver on ``cases`` (``prefix``: a command to run it under, e.g. unshare;
    ``block``: modules made uninstalled; ``preexec_fn``: run in the child before it starts, e.g. a limit)."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    argv = [*prefix, sys.executable, str(script), json.dumps([{**c, "argv": [str(a) for a in c["argv"]]}
                                                             for c in cases])]
    return subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**env(), "PACKKIT_TEST_BLOCK": ",".join(block)}, preexec_fn=preexec_fn)


def small_parquet(path: Path, rows: int = 1500, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, 50_000, n).tolist() for n in rng.integers(8, 200, rows)]
    pq.write_table(pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32()))}), path, row_group_size=500)
    return ids


def packed_tokens(path: Path, fmt: str) -> list:
    """Every token of a packed output, in document order within rows, sorted as multiset of documents."""
    rows = read_output(path, fmt)
    return sorted(t for row in rows for t in row)


def test_stop_signals_at_random_moments_leave_nothing(tmp_path):
    """SIGINT / SIGTERM at random moments of `pack` (the scan, staging parquet, the writer thread, the
    rename), 32 tries in four formats: each run returns 130 / 143 with one line (or 0 when the signal came
    after the work), OUT is absent or complete, and no temporary file is left; every temporary name seen
    while running matches TMP_PATTERN. It used to end in SIGSEGV / SIGABRT (the file closed under the writer
    thread) with `.OUT.packkit-tmp-*` left behind; later about one run in five hung for good (the signal's
    exception raised inside the writer queue's lock left it held) or left `.staged.packkit-tmp-*` (a signal
    between the staging file's creation and its registration for removal)."""
    from packkit.fileio import TMP_PATTERN

    src = tmp_path / "in.parquet"
    tokens = sorted(t for ex in small_parquet(src) for t in ex)
    outs = tmp_path / "o"
    outs.mkdir()
    names = ["o.parquet", "o.arrow", "o.jsonl", "ods"]
    tries = 32
    argv = lambda name: ("pack", src, outs / name, "-w", "256", "-q", "--buffer-mb", "4")  # noqa: E731
    cases = [{"argv": argv(names[k % 4]), "wait": True, "list": [str(outs)]} for k in range(2 + tries)]
    proc = driver(tmp_path, cases, stdin=subprocess.PIPE)
    # a driver that hangs (a stop signal's exception inside a lock's acquire once left the lock held: the next
    # acquire waited forever) is killed, so the test fails below with -9 instead of hanging the suite
    watchdog = threading.Timer(300, proc.kill)
    watchdog.daemon = True
    watchdog.start()
    rng = random.Random(19)
    seen, codes, took, writing = set(), [], [], []

    def look() -> bool:
        found = {p.name for p in outs.iterdir() if TMP_MARK in p.name}
        seen.update(found | {p.name for p in tmp_path.iterdir() if TMP_MARK in p.name})
        return bool(found)

    for k in range(2 + tries):
        assert json.loads(proc.stdout.readline()) == {"start": k}
        t0 = time.monotonic()
        if k < 2:  # timed: the whole run, and how long OUT's temporary file lives (the shorter of two: a load
            # spike on this shared machine in one of them would put most moments after the work)
            first = last = None
            while not select.select([proc.stdout], [], [], 0.001)[0]:
                if look():
                    first, last = first or time.monotonic(), time.monotonic()
            writing.append((last - first) if first else 0.0)
        elif k % 2:  # half the moments while OUT's temporary file is written (the writer thread)
            while not look() and not select.select([proc.stdout], [], [], 0.001)[0]:
                pass
            time.sleep(rng.uniform(0, min([w for w in writing if w] or [0.0])))
        else:  # half over the whole run (the scan, staging, the rename)
            deadline = t0 + rng.uniform(0, min(took[:2]))
            while time.monotonic() < deadline:
                look()
                time.sleep(0.001)
        if k >= 2:
            proc.send_signal(rng.choice([signal.SIGINT, signal.SIGTERM]))
        line = proc.stdout.readline()
        assert line, f"try {k}: the process died with {proc.wait()}: {proc.stderr.read()[-2000:]}"
        result = json.loads(line)
        took.append(time.monotonic() - t0)
        name = names[k % 4]
        with Case():
            code, err = result["code"], result["stderr"]
            assert code in (0, 130, 143), result
            if code:
                assert err == "packkit pack: " + ("interrupted\n" if code == 130 else "stopped by SIGTERM\n"), err
            assert not [n for n in result["listing"][str(outs)] if n != name], result  # no temporary left
            assert not [p for p in tmp_path.iterdir() if TMP_MARK in p.name]
            fmt = "folder" if name == "ods" else output_format_of(name)
            if code == 0 or (outs / name).exists():
                assert packed_tokens(outs / name, fmt) == tokens
            codes.append(code)
        (shutil.rmtree if name == "ods" else os.unlink)(outs / name) if (outs / name).exists() else None
        proc.stdin.write("\n")
        proc.stdin.flush()
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    watchdog.cancel()
    stderr = proc.stderr.read()
    assert "Traceback" not in stderr and "terminate called" not in stderr, stderr
    assert seen and all(TMP_PATTERN.fullmatch(n) for n in seen), seen
    print(f"stop signals: {tries} tries, exit codes {sorted(collections.Counter(codes[2:]).items())}, "
          f"a run {min(took[:2]):.2f} s (writing {min([w for w in writing if w] or [0.0]):.2f} s), "
          f"temporary names seen {len(seen)}")
    assert codes[2:].count(0) < tries // 2, "most signals came after the work: the moments are not spread over it"


def output_format_of(name: str) -> str:
    from packkit.outputs import output_format

    return output_format(name).name


def test_sigterm_to_the_packkit_command_removes_its_temporary_file(tmp_path, data):
    """The real command, SIGTERM while OUT's temporary file is written: exit 143, one line, nothing left
    (SIGTERM used to end the process before any cleanup)."""
    with Case():
        out = tmp_path / "o.parquet"
        proc = subprocess.Popen(packkit_argv("pack", data["parquet"], out, "-w", "2048", "-q", "--buffer-mb", "1"),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env())
        while not temp_beside(out) and proc.poll() is None:
            time.sleep(0.002)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode in (143, 0), err
        if proc.returncode == 143:
            assert err == "packkit pack: stopped by SIGTERM\n" and not out.exists()
        assert not [p for p in tmp_path.iterdir() if TMP_MARK in p.name]


def _tmpfs_prefix(mount: Path, size: str) -> tuple | None:
    """`unshare -m sh -c 'mount tmpfs at MOUNT; exec "$@"'`: a small real file system in a private mount
    namespace (gone with the process); None where this machine does not allow it (not root)."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return None
    mount.mkdir(exist_ok=True)
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {mount}"],
                           capture_output=True)
    if probe.returncode != 0:
        return None
    return ("unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size={size} tmpfs {mount} && exec "$@"', "sh")


def test_full_disk_and_file_size_limit_leave_nothing(tmp_path):
    """A disk that fills while parquet input is staged beside OUT, or while OUT is written (a real small
    tmpfs where the machine allows it, else a file-size limit), and a file-size limit (EFBIG): exit 4, one
    line naming OUT or the folder its input is staged in, nothing left on the disk. The staging file used to stay
    (the disk stayed full), EFBIG exited 3 naming no file."""
    src, jsonl, arrow = tmp_path / "in.parquet", tmp_path / "in.jsonl", tmp_path / "in.arrow"
    ids = small_parquet(src, rows=3000)
    jsonl.write_text("".join(json.dumps({"input_ids": x}) + "\n" for x in ids))
    table = pq.read_table(src)
    with pa.ipc.new_stream(str(arrow), table.schema) as w:  # memory-mapped, not staged: OUT fills the disk
        w.write_table(table)
    disk = tmp_path / "disk"
    prefix = _tmpfs_prefix(disk, "256k")
    if prefix is None:
        disk.mkdir(exist_ok=True)
    full = {} if prefix is not None else {"fsize": 256 << 10}
    cases = [{"argv": ("pack", src, disk / "o.parquet", "-w", "256", "-q"), "list": [str(disk)], **full}]
    cases += [{"argv": ("pack", jsonl, disk / "o.arrow", "-w", "256", "-q"), "list": [str(disk)], **full}]
    cases += [{"argv": ("pack", arrow, disk / name, "-w", "256", "-q"), "list": [str(disk)], **full}
              for name in ("o.parquet", "o.arrow", "o.jsonl", "ods")]
    cases += [{"argv": ("pack", arrow, tmp_path / "big.parquet", "-w", "256", "-q"), "list": [str(tmp_path)],
               "fsize": 64 << 10}]
    proc = driver(tmp_path, cases, prefix=prefix or ())
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "Traceback" not in err, err
    results = [json.loads(line) for line in out.splitlines() if '"code"' in line]
    assert len(results) == len(cases)
    why = "No space left on device" if prefix is not None else "File too large"
    for case, result in zip(cases, results):
        with Case():
            assert result["code"] == 4, result
            assert result["stderr"].count("\n") == 1, result
            folder, = result["listing"]
            assert not [n for n in result["listing"][folder] if TMP_MARK in n], result
            target, staged_from = Path(case["argv"][2]), case["argv"][1]
            # parquet and JSON lines input are staged beside OUT (the disk fills there); Arrow is mapped
            named = str(target) if staged_from == arrow else f"{target.parent} (staging '{staged_from}' there)"
            assert f"packkit pack: error: {named}: " in result["stderr"], result
            assert ("File too large" if case.get("fsize") == 64 << 10 else why) in result["stderr"], result
            assert not target.exists()
    print(f"full disk: {'tmpfs' if prefix else 'RLIMIT_FSIZE'}, {len(cases)} cases")


def test_names_the_disk_cannot_take_are_refused_before_any_work(tmp_path, data):
    """A legal 255-byte OUT name is written (its temporary name is cut to fit; it used to fail after all
    the work, 22 bytes too long); a longer one, or one that is not UTF-8, is refused at once, naming it."""
    src = data["small"]
    longest = "a" * (255 - len(".jsonl")) + ".jsonl"
    cases = [{"argv": ("pack", src, tmp_path / longest, "-w", "8", "-q")},
             {"argv": ("pack", src, tmp_path / ("b" + longest), "-w", "8", "-q")},
             {"argv": ("pack", src, tmp_path / "é" / longest, "-w", "8", "-q")},
             {"argv": ("pack", src, os.fsdecode(os.fsencode(str(tmp_path)) + b"/\xff.parquet"), "-w", "8")}]
    (tmp_path / "é").mkdir()
    results = [dict(zip(("code", "stdout", "stderr"), cli(case["argv"]))) for case in cases]
    with Case():
        assert results[0]["code"] == 0 and len(read_output(tmp_path / longest, "jsonl")) > 0, results[0]
    with Case():
        assert results[1]["code"] == 2 and "its name is 256 bytes, longer than the file system takes (255)" in \
            results[1]["stderr"], results[1]
    with Case():
        assert results[2]["code"] == 0, results[2]
    with Case():  # a name that is not UTF-8 (bytes from another locale: Python's argv holds surrogates)
        assert results[3]["code"] == 2 and "is not a UTF-8 path" in results[3]["stderr"], results[3]
        assert results[3]["stderr"].count("\n") == 1
    assert not [p for p in tmp_path.iterdir() if TMP_MARK in p.name]


def test_empty_input_is_one_rule_for_every_format(tmp_path):
    """0 rows is refused with exit 3 by every command for every format (a 0-row parquet used to pack
    into an empty OUT with exit 0, which `waste` then refused)."""
    t = pa.table({"input_ids": pa.array([], pa.list_(pa.int32()))})
    files = {"e.parquet": lambda p: pq.write_table(t, p), "e.jsonl": lambda p: p.write_text("\n"),
             "e.arrow": lambda p: pa.ipc.new_stream(str(p), t.schema).close()}
    cases = []
    for name, make in files.items():
        make(tmp_path / name)
        cases += [{"argv": ("pack", tmp_path / name, tmp_path / "o.parquet", "-w", "8")},
                  {"argv": ("waste", tmp_path / name)}, {"argv": ("plan", tmp_path / name)}]
    results = [dict(zip(("code", "stdout", "stderr"), cli(case["argv"]))) for case in cases]
    for case, result in zip(cases, results):
        with Case():
            assert result["code"] == 3 and "holds no examples" in result["stderr"], (case, result)
            assert result["stderr"].count("\n") == 1
    assert not (tmp_path / "o.parquet").exists()


def test_without_extras_every_command_runs_or_names_the_extra(tmp_path):
    """As after `pip install packkit` alone (pyarrow, datasets, matplotlib missing): the bundled sample, a
    .txt and a .npy are measured; jsonl, parquet, --plot and pack stop in one line naming the extra, exit 4
    (`waste data.jsonl` used to end in a traceback, exit 1). .ci/run checks the same on the real wheel."""
    (tmp_path / "d.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    (tmp_path / "d.txt").write_text("\ufeffa line\n\nanother line\n")
    np.save(tmp_path / "l.npy", np.array([3, 5, 8]))
    runs = [("waste",), ("waste", tmp_path / "d.txt"), ("plan", tmp_path / "d.txt"), ("waste", tmp_path / "l.npy")]
    hints = [(("waste", tmp_path / "d.jsonl"), "datasets"), (("plan", tmp_path / "d.jsonl"), "datasets"),
             (("waste", "--plot", tmp_path / "w.png"), "plot"),
             (("pack", tmp_path / "d.jsonl", tmp_path / "o.parquet", "-w", "8"), "datasets")]
    cases = [{"argv": a} for a in runs] + [{"argv": a} for a, _ in hints]
    proc = driver(tmp_path, cases, block=("pyarrow", "datasets", "matplotlib"))
    out, err = proc.communicate(timeout=300)
    results = [json.loads(line) for line in out.splitlines() if '"code"' in line]
    assert len(results) == len(cases) and "Traceback" not in err, err
    for result in results[:len(runs)]:
        with Case():
            assert result["code"] == 0, result
    for (argv, extra), result in zip(hints, results[len(runs):]):
        with Case():
            assert result["code"] == 4 and result["stderr"].count("\n") == 1, (argv, result)
            assert f"pip install 'packkit[{extra}]'" in result["stderr"], (argv, result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "d.txt", "driver.py", "l.npy"]


def test_hostile_files_are_read_or_refused_by_name(tmp_path):
    """Values past int64 (parquet list<uint64> holding 2**64-1 was written as label -1; a jsonl value past
    int64 on line 2 was reported as row 0, line 1, value 1.0), a jsonl line of 200k tokens (pyarrow's
    "straddling object"), a BOM, a named pipe (hung forever), damaged save_to_disk folders (errors naming
    no file) and one listing no data files (a traceback): each packs, or stops in one line naming the file,
    the row and line, or the value."""
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2, 3], [4, 5, 6]], pa.list_(pa.uint64())),
                             "labels": pa.array([[1, 2, 3], [4, 2**64 - 1, 6]], pa.list_(pa.uint64()))}),
                   tmp_path / "u64.parquet")
    (tmp_path / "big.jsonl").write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [4, 18446744073709551615, 6]}\n')
    huge = list(range(200_000))  # 1.3 MB: past pyarrow's 1 MiB block
    (tmp_path / "huge.jsonl").write_text("\ufeff" + "".join(json.dumps({"input_ids": x}) + "\n"
                                                              for x in ([5, 6], huge, [7])))
    os.mkfifo(tmp_path / "pipe.jsonl")
    ds = tmp_path / "ds"
    datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]] * 3000}).save_to_disk(str(ds))
    cut, trunc, empty = tmp_path / "cut", tmp_path / "trunc", tmp_path / "empty"
    shutil.copytree(ds, cut)
    (cut / "state.json").write_text((ds / "state.json").read_text()[:18])
    shutil.copytree(ds, trunc)
    shard = next(trunc.glob("*.arrow"))
    shard.write_bytes(shard.read_bytes()[:20_000])
    datasets.Dataset.from_dict({"input_ids": [[1]]}).select([]).save_to_disk(str(empty))
    o = tmp_path / "o.parquet"
    refused = [
        (("pack", tmp_path / "u64.parquet", o, "-w", "8"), "dataset row 1 has 18446744073709551615 (int) in 'labels', "
                                                           "beyond int64"),
        (("waste", tmp_path / "big.jsonl"), f"dataset row 1 (line 2 of '{tmp_path / 'big.jsonl'}') has "
                                            "1.8446744073709552e+19 (float) in 'input_ids', beyond int64"),
        (("pack", tmp_path / "pipe.jsonl", o, "-w", "8"), "pipe.jsonl' is a pipe or a device, not a file"),
        (("waste", tmp_path / "pipe.jsonl"), "pipe.jsonl' is a pipe or a device, not a file"),
        (("waste", cut), f"cannot read '{cut / 'state.json'}', part of the datasets folder"),
        (("pack", trunc, o, "-w", "8"), f"cannot read '{shard}', part of the datasets folder"),
        (("plan", empty), "holds no examples"),
        (("pack", empty, o, "-w", "8"), "holds no examples"),
    ]
    cases = [{"argv": a} for a, _ in refused] + [{"argv": ("pack", tmp_path / "huge.jsonl", o, "-w", "4096", "-q")}]
    proc = driver(tmp_path, cases)
    out, err = proc.communicate(timeout=300)
    results = [json.loads(line) for line in out.splitlines() if '"code"' in line]
    assert len(results) == len(cases) and "Traceback" not in err, err
    for (argv, match), result in zip(refused, results):
        with Case():
            assert result["code"] == 3 and match in result["stderr"], (argv, result)
            assert result["stderr"].count("\n") == 1, result
    with Case():  # the 200k-token line packs, every token in place; the BOM is not part of the first line
        assert results[-1]["code"] == 0, results[-1]
        assert packed_tokens(o, "parquet") == sorted([5, 6, 7] + huge)


def test_a_bad_value_past_the_first_chunk_of_a_jsonl_is_named_by_its_row(tmp_path):
    """Before the fix, a jsonl whose bad value (2.5, or 2**64 - 1) came after the first streamed chunk (1 MiB)
    was read whole, where pyarrow makes the whole column float, and waste, plan and pack named row 0, line 1
    and its value 1.0; each now names the culprit's row, line and value, and writes nothing."""
    good = "".join(json.dumps({"input_ids": [1, 2, 3, 4, 5, 6, 7]}) + "\n" for _ in range(60_000))  # 2.2 MB
    files = {"frac.jsonl": ('{"input_ids": [1, 2.5, 3]}', "has 2.5 (float) in 'input_ids'; token ids are"),
             "u64.jsonl": ('{"input_ids": [1, 18446744073709551615]}', "has 1.8446744073709552e+19 (float) in "
                                                                       "'input_ids', beyond int64")}
    for name, (bad, says) in files.items():
        path = tmp_path / name
        path.write_text(good + bad + "\n" + '{"input_ids": [8, 9]}\n')
        for argv in (("waste", path), ("plan", path), ("pack", path, tmp_path / "o.arrow", "-w", "64")):
            with Case():
                err = assert_refused(argv, 3, f"dataset row 60000 (line 60,001 of '{path}') {says}", [path])
                assert {p.name for p in tmp_path.iterdir()} <= set(files), err  # no OUT, no temporary file


def test_a_damaged_parquet_page_is_caught_by_its_checksum(tmp_path):
    """packkit's parquet carries page checksums and packkit's readers verify them: 8 bytes zeroed inside a
    data page read back as other token ids, silently, without them (asserted first, on the same file);
    packkit's read stops naming the file."""
    from packkit.datafiles import read_lengths
    from packkit.outputs import write_batches

    rng = np.random.default_rng(0)
    rows, width = 200, 4096
    values = pa.array(rng.integers(0, 150_000, rows * width).astype(np.int32))
    table = pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(np.arange(0, rows * width + 1, width,
                                                                               dtype=np.int32)), values)})
    out = tmp_path / "o.parquet"
    write_batches(out, table.schema, table.to_batches(max_chunksize=100), background=False)
    col = pq.ParquetFile(out).metadata.row_group(1).column(0)
    raw = bytearray(out.read_bytes())
    at = col.data_page_offset + col.total_compressed_size // 2
    raw[at: at + 8] = bytes(8)
    out.write_bytes(bytes(raw))
    with Case():
        silent = pq.read_table(out, page_checksum_verification=False)  # the premise: no error, other ids
        assert not silent.column("input_ids").combine_chunks().values.equals(values)
        with pytest.raises(ValueError, match=r"o.parquet' as Parquet \(damaged, truncated, or not Parquet\): "
                                             r"could not verify page integrity"):
            read_lengths(out)


@pytest.mark.parametrize("signum, code, said", [(signal.SIGINT, 130, "interrupted"),
                                                (signal.SIGTERM, 143, "stopped by SIGTERM")])
def test_a_stop_signal_outside_the_command_body_is_one_line(monkeypatch, capsys, signum, code, said):
    """A stop signal that lands while main enters or leaves its blocks (the warnings block, the signal
    handlers' restore), outside the command's own handlers, ended packkit with a Python traceback and exit 1
    (found by test_formats' SIGINT at random moments under a random seed); now the same line and code as a
    stop inside the command."""
    import packkit.cli as cli
    from packkit.interrupts import Interrupted

    def stopped(argv, *rest):
        raise Interrupted(signum)

    monkeypatch.setattr(cli, "_run", stopped)  # inside main's signal and warnings blocks, outside _run's handlers
    assert cli.main(["waste"]) == code
    assert capsys.readouterr().err.strip() == f"packkit waste: {said}"


SWALLOWED = """
import signal, sys


class CtrlC:
    '''Ctrl-C while pyarrow imports pandas (lazily, at its first ``Array.to_numpy``): its pandas shim swallows the
    KeyboardInterrupt raised there, as it swallows an ImportError.'''

    def find_spec(self, name, path=None, target=None):
        if name == "pandas":
            sys.meta_path.remove(self)
            open(sys.argv[1], "w").close()
            raised = "nothing raised"
            try:
                signal.raise_signal(signal.SIGINT)
            except BaseException as exc:
                raised = repr(exc)
                raise
            finally:  # where the signal landed, for the test's message
                import threading, traceback
                with open(sys.argv[1], "w") as f:
                    f.write(f"{raised} in thread {threading.current_thread().name}, SIGINT's handler "
                            f"{signal.getsignal(signal.SIGINT)!r}, at:\\n" + "".join(traceback.format_stack()))


# A Ctrl-C at a terminal: a run started in the background (`cmd &` in a script: CI's runner) inherits SIGINT ignored,
# which Python then leaves ignored, as packkit does (the raise above was a no-op: exit 0, 3 of 3 whole-suite runs)
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.meta_path.insert(0, CtrlC())
from packkit.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("cmd", ["pack", "waste"])
def test_a_ctrl_c_pyarrow_swallows_importing_pandas_still_stops_the_command(tmp_path, cmd):
    """Ctrl-C 0.25 to 0.35 s into ``packkit pack big.jsonl OUT`` (``timeout -s INT``) lands in pyarrow's lazy
    ``import pandas``, whose shim swallowed the KeyboardInterrupt: the command went on, wrote OUT and exited 0, the
    Ctrl-C lost without a word. Now the stop is raised again before OUT is renamed into place and when the command
    ends: exit 130, one line, no OUT and no temporary file."""
    src, out, fired = tmp_path / "in.jsonl", tmp_path / "o.parquet", tmp_path / "fired"
    src.write_text("".join(json.dumps({"input_ids": list(range(1, n))}) + "\n" for n in (40, 90, 300, 7)))
    script = tmp_path / "swallowed.py"
    script.write_text(SWALLOWED)
    argv = [cmd, src, *([out] if cmd == "pack" else []), "-w", "128", "-q"]
    root = str(Path(__file__).resolve().parents[1])  # this checkout's packkit, not the one installed
    proc = subprocess.run([sys.executable, str(script), str(fired), *map(str, argv)], capture_output=True, text=True,
                          env={**env(), "PYTHONPATH": root}, timeout=120)
    assert fired.exists(), "pandas was imported before the command ran: the Ctrl-C did not land in pyarrow"
    assert (proc.returncode, proc.stderr) == (130, f"packkit {cmd}: interrupted\n"), (proc.stderr[-2000:],
                                                                                     fired.read_text()[-3000:])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fired", "in.jsonl", "swallowed.py"]


LEASE_BROKEN_IN_PANDAS = """
import subprocess, sys, time


class Writer:
    '''Another program opens IN for writing while pyarrow imports pandas: the read lease's break raises as Ctrl-C does,
    inside pyarrow's lazy import, which swallows it.'''

    def find_spec(self, name, path=None, target=None):
        if name == "pandas":
            sys.meta_path.remove(self)
            open(sys.argv[1], "w").close()
            writer = subprocess.Popen([sys.executable, "-c", f"open({sys.argv[3]!r}, 'a').close()"])  # IN
            deadline = time.monotonic() + 60
            while writer.poll() is None and time.monotonic() < deadline:  # the break lands in this wait
                time.sleep(0.01)


sys.meta_path.insert(0, Writer())
from packkit.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_an_input_changed_under_a_swallowed_lease_break_is_said_once_as_changed(tmp_path):
    """A read lease broken by another program raises as Ctrl-C does; where that landed in pyarrow's lazy ``import
    pandas`` (which swallows it), the run met the change later and said ``error: ... was changed`` (exit 3), and the
    stop a library swallowed was then raised again at the command's end: a second line, ``interrupted``, exit 130;
    elsewhere a change met by the writer's check was said as ``interrupted`` alone. The break is the change, said once:
    exit 3, nothing written."""
    from packkit.fileio import _leases_possible

    if not _leases_possible():
        pytest.skip("no read leases here (not Linux, or leases disabled)")
    src, out, fired = tmp_path / "in.jsonl", tmp_path / "o.parquet", tmp_path / "fired"
    src.write_text("".join(json.dumps({"input_ids": list(range(1, n))}) + "\n" for n in (40, 90, 300, 7)))
    script = tmp_path / "writer.py"
    script.write_text(LEASE_BROKEN_IN_PANDAS)
    root = str(Path(__file__).resolve().parents[1])  # this checkout's packkit, not the one installed
    proc = subprocess.run([sys.executable, str(script), str(fired), "pack", str(src), str(out), "-w", "128", "-q"],
                          capture_output=True, text=True, env={**env(), "PYTHONPATH": root}, timeout=120)
    assert fired.exists(), "pandas was imported before the command ran: the break did not land in pyarrow"
    assert proc.returncode == 3 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith(f"packkit pack: error: {str(src)!r} was changed while packkit read it"), proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fired", "in.jsonl", "writer.py"]
