"""Files read defensively: each class through the public API and the `packkit` command.

- an input truncated while `packkit pack` memory-maps it (a real process, a real truncation): an error naming
  the file, exit 3, nothing beside OUT (it was a SIGBUS: nothing printed, a temporary file left);
- an input open for writing, and one changed where no lease holds it;
- one absurd value that would allocate without bound: a length of 2**40 in a .npy (waste, plan, the library's
  planners), a .npy header claiming 2**40 values; a file that is not .npy, or a pickle, refused by name (numpy's
  advice was to load it with pickle);

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
    """An .arrow IN truncated while `packkit pack` read it through its memory map ended in SIGBUS (exit
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
    os.truncate(src, 100_000)  # here, not in a new interpreter: its start-up let pack read to the end first
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, (proc.returncode, err)
    line = one_line(err)
    assert "'" + str(src) + "'" in line and "was changed while packkit read it" in line, line
    assert not out.exists() and leftovers(tmp_path) == []
    assert src.stat().st_size == 100_000  # the writer went on once packkit let go


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="read leases are Linux's")
def test_a_writer_after_the_last_read_waits_no_longer_and_changes_nothing(tmp_path):
    """Once the reader is done (``hold.release()``, which ``packkit pack`` and ``tokenize`` call after IN's last
    read and before OUT is renamed into place), a writer of IN goes on at once and the block ends without an
    error. Before, a truncation between the last read and the end of the block stopped ``packkit pack`` with
    "nothing was written" while OUT stood complete (seen once in a whole-suite run under load)."""
    src = tmp_path / "shard.arrow"
    arrow_stream(src, 20_000)
    with held_still([src]) as hold:
        hold.release()
        start = time.monotonic()
        os.truncate(src, 100)  # with a lease still held this waits for the SIGIO's stop, then raises at the block
        waited = time.monotonic() - start
    assert src.stat().st_size == 100 and waited < 5, waited
    with pytest.raises(InputChangedError, match=f"^'{src}' was changed while packkit read it"):
        with held_still([src]) as hold:
            subprocess.run([sys.executable, "-c", f"import os; os.truncate({str(src)!r}, 10)"], check=True)
            hold.release()


def test_input_open_for_writing_is_read_and_a_change_named(tmp_path):
    """A file open for writing (here in this process, as a pyarrow writer given a path leaves it) gets no read
    lease: it is read, its size and time compared before the end; a change while it is read is the error."""
    from packkit.datafiles import read_lengths

    src = tmp_path / "shard.arrow"
    arrow_stream(src, 20_000)
    with open(src, "ab") as f:
        code, out, err = cli(["waste", src, "-q"])
        assert code == 0 and err == "", err
        with pytest.raises(InputChangedError, match=f"^'{src}' was changed while packkit read it"):
            with held_still([src]) as hold:
                f.write(b"more")
                f.flush()
                hold.check()
    assert read_lengths(src).lengths.size > 0


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
    assert got and got[0].startswith(f"'{src}' was changed while packkit read it"), got


def test_a_length_of_2_40_is_refused_before_any_allocation_naming_it(tmp_path):
    """A .npy of lengths holding 2**40 made waste and plan split it into 537M pieces (tens of GiB) until
    the machine ran out of memory, naming no example. The pieces are counted first: more than memory can plan is
    the error naming the example, in the command's syntax and in Python's."""
    from packkit.binpack import pack
    from packkit.budget import plan_budget
    from packkit.errors import DataError
    from packkit.waste import measure_waste

    src = tmp_path / "lengths.npy"
    np.save(src, np.array([10, 2**60, 5]))
    for argv in (["waste", src, "-q"], ["plan", src]):
        code, out, err = cli(argv)
        line = one_line(err)
        assert code == 3 and out == "", (argv, code, err)
        assert "example 1 has 1,152,921,504,606,846,976 tokens: --overflow split cuts it into" in line, line
        assert "pieces of --window 2048" in line and "pass --overflow truncate or drop, or raise --window" in line
    lengths = np.array([10, 2**60, 5])
    for call in (lambda: pack(lengths, window=2048, overflow="split"),
                 lambda: measure_waste(lengths, window=2048, batch_size=8, overflow="split", progress=False),
                 lambda: plan_budget(lengths, per_device_batch=1, window=2048, overflow="split")):
        with pytest.raises(DataError, match=r"example 1 has 1,152,921,504,606,846,976 tokens: overflow='split' "
                                            r"cuts it into .* pieces of window=2048.*pass overflow='truncate' or 'drop'"):
            call()
    assert cli(["waste", src, "-q", "--overflow", "truncate"])[0] == 0  # nothing split: nothing to plan
    code, _, err = cli(["plan", "--synthetic", 2**40])  # the same class: numpy asked for 8 TiB (exit 4, no option)
    assert code == 2 and "--synthetic 1,099,511,627,776 examples need about 131,072.0 GiB to draw and plan" \
        in one_line(err), err


@pytest.mark.parametrize("name, make, match", [
    ("notnpy.npy", lambda p: p.write_bytes(b"10\n20\n30\n"),
     "'{p}' is not a .npy file (the magic string is not correct): save the lengths with numpy.save(path, lengths)"),
    ("pickle.npy", lambda p: np.save(p, np.array([1, "a"], dtype=object), allow_pickle=True),
     "'{p}' holds Python objects (a pickle), not integers: packkit never loads a pickle"),
    ("claims.npy", lambda p: p.write_bytes(_npy_header((2**40,)) + bytes(16)),
     "'{p}' is truncated or damaged: its header says (1099511627776,) values of int64 (8,796,093,022,208 bytes), "
     "and it holds 16 bytes after the header"),
    ("cut.npy", lambda p: p.write_bytes(_npy_header((4,)) + bytes(24)),
     "'{p}' is truncated or damaged: its header says (4,) values of int64 (32 bytes), and it holds 24 bytes"),
    ("empty.npy", lambda p: p.write_bytes(b""), "'{p}' is not a .npy file"),
])
def test_a_file_that_is_not_a_npy_of_lengths_is_refused_naming_it(tmp_path, name, make, match):
    """A file that is not .npy (or a pickle) passed on numpy's advice to load it with pickle (which runs
    the file's code); a header claiming 2**40 values asked numpy for 8 TiB before reading a byte. The header is
    read first and checked against the file."""
    from packkit.datafiles import read_lengths
    from packkit.errors import DataError

    path = tmp_path / name
    make(path)
    want = match.format(p=path)
    code, _, err = cli(["waste", path, "-q"])
    assert code == 3 and want in one_line(err), err
    assert "pickle.load" not in err and "allow_pickle" not in err
    with pytest.raises(DataError) as info:
        read_lengths(path)
    assert want in str(info.value)


def test_a_split_the_floor_holds_asks_the_system_nothing(monkeypatch):
    """``pack_stream`` split each long example through the check above, which read ``/proc/meminfo`` every
    time (~50-100 us, a third of the stream's cost an example on chat data). A plan the floor holds asks the
    system nothing; one past it still asks and is refused when memory is short."""
    from packkit import binpack
    from packkit.errors import DataError
    from packkit.packer import pack_stream

    def asked():
        raise AssertionError("memory asked for a plan under the floor")

    monkeypatch.setattr(binpack, "memory_available", asked)
    rows = list(pack_stream([{"input_ids": np.arange(5000)}, {"input_ids": np.arange(7)}], window=2048))
    assert [r["seq_lengths"].tolist() for r in rows] == [[2048], [2048], [904, 7]]
    binpack.check_split_size(np.array([2048 * 1000, 5]), 2048)
    monkeypatch.setattr(binpack, "memory_available", lambda: binpack.SPLIT_CHECK_FLOOR)
    with pytest.raises(DataError, match="example 0 has"):
        binpack.check_split_size(np.array([2048 * (binpack.SPLIT_CHECK_FLOOR // binpack.PLAN_BYTES_PER_ITEM + 1)]),
                                 2048)


def _npy_header(shape) -> bytes:
    from numpy.lib import format as npy

    buf = io.BytesIO()
    npy.write_array_header_1_0(buf, {"descr": "<i8", "fortran_order": False, "shape": shape})
    return buf.getvalue()


def _pairs(path: Path, chosen_lengths) -> Path:
    import json

    with open(path, "w") as f:
        for i, n in enumerate(chosen_lengths):
            f.write(json.dumps({"prompt_ids": [1] * 10, "chosen_ids": [2] * n, "rejected_ids": [3] * 10}) + "\n")
            if i == 0:
                f.write("\n")  # a blank line: rows and lines differ from here on
    return path


def test_waste_preference_honours_overflow_and_names_lines(tmp_path):
    """`waste --preference` ignored --overflow (--overflow error exited 0; a file where every pair is too
    long reported 0 pairs at 100% fill) and named rows but not lines. --overflow error refuses the first pair that
    does not fit whole, by example and line; drop (the default here) leaves pairs out and says how many, but not
    every one; split and truncate cannot apply to a pair and are refused before the file is read."""
    from packkit.errors import ArgumentError, DataError
    from packkit.waste import preference_waste

    some = _pairs(tmp_path / "some.jsonl", [10, 10, 3000, 10])
    code, _, err = cli(["waste", some, "--preference", "-w", "1024", "--overflow", "error"])
    assert code == 3 and (f"example 2 (line 4 of '{some}') has 3,030 tokens as two sequences with their prompt "
                          "(prompt 10 twice, chosen 3,000, rejected 10) > --window 1024; raise --window, or pass "
                          "--overflow drop (left out, counted)") in one_line(err), err
    code, out, _ = cli(["waste", some, "--preference", "-w", "1024"])
    assert code == 0 and "3 pairs, window 1,024" in out and "1 pairs longer than the window left out" in out
    every = _pairs(tmp_path / "every.jsonl", [3000, 3000])
    code, out, err = cli(["waste", every, "--preference", "-w", "1024"])
    assert code == 3 and out == "" and "every pair is longer than the window (2 of them), so none is left to measure: " \
        f"example 0 (line 1 of '{every}') has 3,030 tokens" in one_line(err), err
    for policy in ("split", "truncate"):
        code, _, err = cli(["waste", tmp_path / "missing.jsonl", "--preference", "--overflow", policy])
        assert code == 2 and f"--overflow {policy}: a preference pair is packed whole, never split or truncated" \
            in one_line(err), err
    bad = tmp_path / "bad.jsonl"
    lines = some.read_text().splitlines()
    lines[2] = lines[2].replace('"chosen_ids": [2,', '"chosen_ids": [-2,', 1)
    bad.write_text("\n".join(lines) + "\n")
    code, _, err = cli(["waste", bad, "--preference"])
    assert code == 3 and f"dataset row 1 (line 3 of '{bad}') has token id -2 in 'chosen_ids'" in one_line(err), err
    with pytest.raises(DataError, match=r"^example 1 has 30 tokens .* > window=16; raise window, or pass overflow='drop'"):
        preference_waste([1, 10], [1, 5], [1, 5], window=16, overflow="error")
    with pytest.raises(ArgumentError, match="overflow='split': a preference pair is packed whole"):
        preference_waste([1], [1], [1], window=16, overflow="split")
    assert preference_waste([1, 10], [1, 5], [1, 5], window=16)["dropped"] == 1


def test_waste_preference_names_the_pair_of_a_bad_or_null_count(tmp_path):
    """Regression: counts of a pair below their floor (a prompt of -4, a completion of 0) were refused as "a pair
    needs a prompt of >= 0 tokens and completions of >= 1 token", naming no pair, and a null count the same way
    after numpy's "invalid value encountered in cast" (a null read as NaN, then cast to int64). Now the pair and its
    line are named; a null count in the words of a null list of token ids."""
    import json

    from packkit.errors import DataError
    from packkit.waste import preference_waste

    with pytest.raises(DataError, match=r"^example 1 has a prompt of 2 tokens, chosen 0 and rejected 1: a pair needs"):
        preference_waste([1, 2], [1, 0], [1, 1], window=16)
    counts = tmp_path / "counts.jsonl"
    for row, fault in (({"prompt": -4, "chosen": 2, "rejected": 3}, "example 1 (line 3 of '{}') has a prompt of -4 "
                        "tokens, chosen 2 and rejected 3: a pair needs a prompt of >= 0 tokens"),
                       ({"prompt": None, "chosen": 2, "rejected": 3}, "dataset row 1 (line 3 of '{}') has no "
                        "'prompt' (null); drop the example or fill it")):
        counts.write_text(json.dumps({"prompt": 1, "chosen": 2, "rejected": 3}) + "\n\n" + json.dumps(row) + "\n")
        code, out, err = cli(["waste", counts, "--preference"])
        assert code == 3 and out == "" and fault.format(counts) in one_line(err), err
        assert "invalid value" not in err, err


# ----------------------------------------------------------------------------------------------
# errors that named nothing, or the wrong thing
# ----------------------------------------------------------------------------------------------


def test_an_integral_float_is_blamed_on_its_own_line(tmp_path):
    """One integral ``5.0`` on line 7 made pyarrow read the whole column as floats, and waste, plan and
    pack blamed row 0 / line 1 (value 1.0). Python's reader tells 5.0 from 5: its row and line are named."""
    import json

    from packkit.datafiles import read_lengths
    from packkit.rules import ExampleTypeError

    src = tmp_path / "ids.jsonl"
    rows = [json.dumps({"input_ids": [1, 2, 3]})] * 5 + ["", '{"input_ids": [4, 5.0, 6]}']
    src.write_text("\n".join(rows) + "\n")
    want = (f"dataset row 5 (line 7 of '{src}') has 5.0 (float) in 'input_ids'; token ids are integers >= 0 (a JSON "
            "number written with a decimal point or an exponent")
    for argv in (["waste", src, "-q"], ["plan", src], ["pack", src, tmp_path / "o.parquet", "-q"]):
        code, _, err = cli(argv)
        assert code == 3 and want in one_line(err), (argv, err)
    with pytest.raises(ExampleTypeError, match=r"^dataset row 5 \(line 7 of '[^']+'\) has 5.0 \(float\) in 'input_ids'"):
        read_lengths(src)


def test_a_numeric_role_names_its_line_and_field(tmp_path):
    """A message whose role is a number ended in pyarrow's 'Column(/messages/[]/role) changed from string
    to number', with no line: the line and the field inside the conversation are named (across lines, and inside
    one list)."""
    import json

    src = tmp_path / "chat.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    src.write_text("\n".join([json.dumps(good)] * 3 + [json.dumps({"messages": [{"role": 5, "content": "hi"}]})]) + "\n")
    code, _, err = cli(["waste", src, "-q"])
    assert code == 3 and (f"'{src}' line 4: 'messages[].role' holds a number, but text on line 1; every line must "
                          "give a key the same kind of value") in one_line(err), err
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": 7, "content": "x"}]}) + "\n")
    code, _, err = cli(["waste", src, "-q"])
    assert code == 3 and f"'{src}' line 1: 'messages[].role' mixes text and a number in one list" in one_line(err), err


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    import json

    pytest.importorskip("transformers")
    from test_chat import CONVERSATIONS, TEMPLATE, make_tokenizer

    folder = tmp_path_factory.mktemp("chat")
    make_tokenizer().save_pretrained(str(folder / "tok"))
    (folder / "chat.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    return folder, TEMPLATE


def test_a_template_syntax_error_names_the_template_and_its_line(chat_files, tmp_path):
    """A chat template with a syntax error was blamed on example 0 of the data (exit 3): the template is
    compiled before any example, and its file (or the tokenizer it came with) and line are named (exit 2)."""
    import shutil

    from packkit.chat import tokenize_chat
    from packkit.errors import ArgumentError

    folder, template = chat_files
    bad = tmp_path / "train.jinja"
    bad.write_text(template.replace("{% endfor %}", "{% endfor %}\n\n{% if x %}oops{% endfi %}"))
    want = f"the chat template '{bad}', line 3: Jinja syntax error: Encountered unknown tag 'endfi'"
    for argv in (["waste", folder / "chat.jsonl", "--tokenizer", folder / "tok", "--chat-template", bad, "-q"],
                 ["pack", folder / "chat.jsonl", tmp_path / "o.parquet", "--tokenizer", folder / "tok",
                  "--chat-template", bad, "-q"]):
        code, _, err = cli(argv)
        line = one_line(err)
        assert code == 2 and want in line and "example" not in line, (argv, err)
    own = tmp_path / "tok"
    shutil.copytree(folder / "tok", own)
    (own / "chat_template.jinja").write_text(bad.read_text())
    code, _, err = cli(["waste", folder / "chat.jsonl", "--tokenizer", own, "-q"])
    assert code == 2 and f"the chat template of '{own}', line 3: Jinja syntax error" in one_line(err), err
    pa_table = pa.table({"messages": pa.array([[{"role": "user", "content": "hi"}]])})
    with pytest.raises(ArgumentError, match=r"line 3: Jinja syntax error: .*; fix the template or pass "
                                            r"chat_template=FILE.jinja"):
        tokenize_chat(pa_table, folder / "tok", chat_template=bad)


def test_a_template_that_is_not_utf8_names_its_file_and_line(chat_files, tmp_path):
    """A chat template file that is not UTF-8 ended in a bare codec error ("'utf-8' codec can't decode
    byte 0xe9 in position 412"): the file, its line and the option are named, for --chat-template and for the
    tokenizer folder's own chat_template.jinja."""
    import shutil

    folder, template = chat_files
    latin = tmp_path / "latin.jinja"
    latin.write_bytes(template.encode() + b"\n\n caf\xe9 ")
    code, _, err = cli(["waste", folder / "chat.jsonl", "--tokenizer", folder / "tok", "--chat-template", latin, "-q"])
    assert code == 2 and (f"--chat-template '{latin}' is not UTF-8 text: line 3 holds b'\\xe9' (invalid continuation "
                          "byte); save it as UTF-8") in one_line(err), err
    own = tmp_path / "tok"
    shutil.copytree(folder / "tok", own)
    (own / "chat_template.jinja").write_bytes(b"{{ x }}\ncaf\xe9")
    code, _, err = cli(["waste", folder / "chat.jsonl", "--tokenizer", own, "-q"])
    assert code == 2 and (f"could not load --tokenizer '{own}': '{own}/chat_template.jinja' is not UTF-8 text: line 2 "
                          "holds b'\\xe9'") in one_line(err), err


def test_a_uint64_length_is_shown_as_given(tmp_path):
    """A uint64 length of 2**64 - 1 in a .npy was cast to int64 and shown as -1."""
    src = tmp_path / "u64.npy"
    np.save(src, np.array([10, 2**64 - 1, 5], dtype=np.uint64))
    for argv in (["waste", src, "-q"], ["plan", src]):
        code, _, err = cli(argv)
        line = one_line(err)
        assert code == 3 and "example 1 has length 18446744073709551615 (uint64)" in line and "length -1" not in line, err
        assert f"'{src}'" in line, line


def _break_lease_of(path: Path) -> None:
    """Open ``path`` for writing without waiting (``O_NONBLOCK``): where packkit holds a read lease on it, the
    kernel refuses the open (EAGAIN) and starts the lease break, as another program's write would."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except BlockingIOError:
        pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="read leases are Linux's")
def test_tokenize_stops_naming_an_input_written_while_it_reads_it(tmp_path, monkeypatch):
    """`packkit tokenize` holds IN too (a memory-mapped IN truncated under it was a SIGBUS): a write to IN while its
    chunks are written stops it with the one line naming IN, exit 3, nothing left beside OUT."""
    from packkit.cli import tokenize as tokenize_cmd

    src, out = tmp_path / "t.txt", tmp_path / "o.jsonl"
    src.write_text("hello there\nsecond line\n" * 50)
    real = tokenize_cmd._write

    def write_then_touch(tables, *a, **k):
        def touched():
            for i, t in enumerate(tables):
                if i == 0:
                    _break_lease_of(src)
                    time.sleep(0.2)  # the signal is met at the next bytecode
                yield t
        return real(touched(), *a, **k)

    monkeypatch.setattr(tokenize_cmd, "_write", write_then_touch)
    code, _, err = cli(["tokenize", src, out, "--tokenizer", "bytes"])
    assert code == 3 and f"'{src}' was changed while packkit read it" in one_line(err), err
    assert not out.exists() and leftovers(tmp_path) == []
