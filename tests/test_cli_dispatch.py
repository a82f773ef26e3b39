"""The packkit command's dispatcher: help, unknown commands, one-line errors, PACKKIT_DEBUG."""

import pytest

from packkit import cli


def test_help_and_version(capsys):
    assert cli.main(["--help"]) == 0
    assert "waste" in capsys.readouterr().out
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
    assert err.startswith("packkit plan: error:") and "Traceback" not in err
    monkeypatch.setenv("PACKKIT_DEBUG", "1")
    with pytest.raises(ValueError):
        cli.main(["plan", "--synthetic", "0"])
