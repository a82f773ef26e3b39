"""The packkit command's dispatcher: help, unknown commands, one-line errors and their exit codes,
install hints, PACKKIT_DEBUG, and the options every subcommand shares."""

import argparse
import importlib
import importlib.util

import pytest

from packkit import cli
from packkit.errors import DataError, arg


def test_help_and_version(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "waste" in out and "exit codes:" in out and "3    data" in out
    assert cli.main([]) == 2
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("packkit ")


def test_unknown_command_is_one_line(capsys):
    assert cli.main(["wastes"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'wastes'" in err and err.count("\n") == 1


def test_user_error_is_one_line_and_debug_reraises(capsys, monkeypatch):
    monkeypatch.delenv("PACKKIT_DEBUG", raising=False)
    assert cli.main(["plan", "--synthetic", "0"]) == 2
    err = capsys.readouterr().err
    assert err == "packkit plan: error: --synthetic must be at least 1 example, got 0\n"
    monkeypatch.setenv("PACKKIT_DEBUG", "1")
    with pytest.raises(cli.UsageError):
        cli.main(["plan", "--synthetic", "0"])


@pytest.mark.parametrize("name", sorted(cli.SUBCOMMANDS))
def test_every_option_has_help_and_one_overflow_default(name):
    """Every option has help text; --overflow has one default across commands (before the fix, plan and
    pack defaulted to error, waste to truncate)."""
    parser = importlib.import_module(cli.SUBCOMMANDS[name][0]).parser()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help and action.help.strip(), f"packkit {name}: {action.option_strings or action.dest} has no help"
        if action.dest == "overflow":
            assert action.default == cli.DEFAULT_OVERFLOW == "split"
    assert "exit codes:" in parser.format_help()


@pytest.mark.parametrize("name", sorted(cli.SUBCOMMANDS))
def test_the_input_help_lists_the_door_ins_formats(name, monkeypatch):
    """IN's help names every suffix of the door in (packkit.datafiles.INPUTS), ``.npy`` (lengths) only where the
    command reads lengths: each command wrote its own list (``plan``'s lacked ``.ndjson``, ``.pq``, ``.feather``), so
    a format added to the door in was missed there."""
    import re

    from packkit.datafiles import INPUTS

    monkeypatch.setenv("COLUMNS", "1000")  # IN's help on one line
    text = importlib.import_module(cli.SUBCOMMANDS[name][0]).parser().format_help()
    line = next(line for line in text.splitlines() if line.lstrip().startswith("input "))
    want = {s for s, (kind, _) in INPUTS.items() if name in ("waste", "plan") or kind != "npy"}
    assert set(re.findall(r"(?<![\w.])\.[a-z]+", line)) == want, line


def test_every_help_expands_once_its_argument_is_added(monkeypatch):
    """Python 3.14's argparse expands each help as its argument is added (``ArgumentParser._check_help``: one that
    cannot be expanded is 'badly formed', and the command would not start); IN's help reads the door in's formats
    through ``%(formats)s``, a field the argument has only once added, so its help is set then. 3.14's check, here."""
    real = argparse._ActionsContainer.add_argument

    def checked(self, *args, **kwargs):
        action = real(self, *args, **kwargs)
        if action.help and hasattr(self, "_get_formatter"):
            self._get_formatter()._expand_help(action)
        return action

    monkeypatch.setattr(argparse._ActionsContainer, "add_argument", checked)
    for module, _ in cli.SUBCOMMANDS.values():
        assert "exit codes:" in importlib.import_module(module).parser().format_help()


def test_library_wording_becomes_the_commands_options(capsys, monkeypatch):
    """A library error that names arguments (overflow='split'; before the fix, as the CLI printed it) reads
    in the CLI's syntax, through
    one translation (each command's own flags; aliases where the library's name differs)."""
    from packkit.cli import waste

    def boom(*a, **k):
        raise DataError("pass {fix}, or raise {w}; {other}", fix=arg("overflow", "split"), w=arg("window"),
                        other=arg("not_an_option", 3))

    monkeypatch.setattr(waste, "measure_waste", boom)
    assert cli.main(["waste"]) == 3
    assert capsys.readouterr().err == ("packkit waste: error: pass --overflow split, or raise --window; "
                                       "not_an_option=3\n")
    opts = cli.options_of(importlib.import_module("packkit.cli.pack").parser(), {"column": "columns"})
    assert opts["column"] == ("--columns", True) and opts["overwrite"] == ("--overwrite", False)


def test_missing_extra_says_what_to_install(capsys, monkeypatch):
    """Before the fix, `packkit pack` without datasets said "No module named 'datasets'" and nothing more."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "datasets" else real(n, *a))
    assert cli.main(["pack", "in.jsonl", "out.parquet", "-w", "8"]) == 3  # the input is checked first
    capsys.readouterr()
    assert cli.install_hint(ModuleNotFoundError("No module named 'datasets'", name="datasets")) == (
        "No module named 'datasets': pip install 'packkit[datasets]'")
    assert cli.install_hint(ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")).endswith(
        "pip install 'packkit[plot]'")
    assert cli.install_hint(ModuleNotFoundError("No module named 'zzz'", name="zzz")).endswith("pip install zzz")


def test_missing_extra_exit_code_before_any_work(tmp_path, capsys, monkeypatch):
    src = tmp_path / "in.jsonl"
    src.write_text('{"input_ids": [1, 2]}\n')
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "datasets" else real(n, *a))
    assert cli.main(["pack", str(src), str(tmp_path / "o.parquet"), "-w", "8"]) == 4
    assert capsys.readouterr().err == ("packkit pack: error: No module named 'datasets': "
                                       "pip install 'packkit[datasets]'\n")
    assert not (tmp_path / "o.parquet").exists()


@pytest.mark.parametrize("exc, code, text", [
    (MemoryError("Unable to allocate 8.00 TiB"), 4,
     "out of memory (Unable to allocate 8.00 TiB); free memory, or process a smaller input"),
    (OSError(28, "No space left on device", "/data/out.parquet"), 4, "/data/out.parquet: No space left on device"),
    (OSError("Corrupt snappy compressed data."), 3, "Corrupt snappy compressed data."),
    (KeyError("no column 'x'"), 3, "no column 'x'"),
    (ValueError("bad\nthing"), 3, "bad thing"),
])
def test_exit_codes_of_each_kind(capsys, monkeypatch, exc, code, text):
    from packkit.cli import plan

    def boom(*a, **k):
        raise exc

    monkeypatch.setattr(plan, "plan_budget", boom)
    assert cli.main(["plan", "--synthetic", "10"]) == code
    assert capsys.readouterr().err == f"packkit plan: error: {text}\n"


def test_a_bug_keeps_its_traceback(monkeypatch):
    """A RuntimeError or an ImportError inside packkit is not the user's: it is re-raised (exit 1)."""
    from packkit.cli import plan

    for exc in (RuntimeError("internal"), ImportError("cannot import name 'x' from 'packkit.y'", name="packkit.y")):
        def boom(*a, exc=exc, **k):
            raise exc

        monkeypatch.setattr(plan, "plan_budget", boom)
        with pytest.raises(type(exc)):
            cli.main(["plan", "--synthetic", "10"])


def test_switches_render_as_their_flags():
    opts = cli.options_of(importlib.import_module("packkit.cli.waste").parser())
    assert arg("assistant_only_loss", False).render(opts) == "--no-assistant-only-loss"
    assert arg("assistant_only_loss", True).render(opts) == "--assistant-only-loss"
    assert arg("overwrite", True).render(opts) == "--overwrite"
    assert arg("assistant_only_loss", False).render(None) == "assistant_only_loss=False"


@pytest.mark.slow  # processes
def test_python_dash_m_packkit_is_the_command():
    """Before the fix ``python -m packkit`` failed (no ``packkit/__main__.py``); it is the command now."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "packkit", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("packkit "), out.stderr
