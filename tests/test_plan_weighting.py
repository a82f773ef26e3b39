"""``packkit plan --loss-weighting MODE``: the share of the loss weight by length decile on the user's data
(its own loss tokens), beside the token mean, as a table, in the JSON line and as a plot."""

import json

import numpy as np
import pytest

from packkit import cli
from packkit.weighting import weight_shares


def run_plan(capsys, *argv):
    rc = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def rows(tmp_path):
    """40 examples of 4..400 tokens whose first half is a masked prompt: a JSON-lines file with labels."""
    rng = np.random.default_rng(0)
    path = tmp_path / "data.jsonl"
    with open(path, "w") as f:
        for n in np.linspace(4, 400, 40).astype(int).tolist():
            ids = rng.integers(0, 100, n).tolist()
            f.write(json.dumps({"input_ids": ids, "labels": [-100] * (n // 2) + ids[n // 2:]}) + "\n")
    return path


def test_shares_by_decile(tmp_path, capsys):
    path = rows(tmp_path)
    rc, out, _ = run_plan(capsys, str(path), "--loss-weighting", "sample", "-w", "512", "--json", "-q")
    assert rc == 0
    got = json.loads(out)["loss_weighting"]
    assert got["weighting"] == "sample" and got["examples"] == [4] * 10
    assert got["shares"] == pytest.approx([0.1] * 10)
    # the token mean leans on the longest tenth: its 4 examples hold the most loss tokens (the data's own)
    loss = np.array([n - n // 2 for n in np.linspace(4, 400, 40).astype(int)])
    assert got["token_shares"][-1] == pytest.approx(loss[-4:].sum() / loss.sum())
    assert got["token_shares"][-1] > 0.15 > got["token_shares"][0]


def test_table_and_plot(tmp_path, capsys):
    path, png = rows(tmp_path), tmp_path / "shares.png"
    rc, out, _ = run_plan(capsys, str(path), "--loss-weighting", "sqrt", "--weight-plot", str(png), "-w", "512", "-q")
    assert rc == 0 and "loss weight by length decile under loss_weighting='sqrt'" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, _, err = run_plan(capsys, str(path), "--loss-weighting", "sqrt", "--weight-plot", str(png), "-w", "512", "-q")
    assert rc != 0 and "shares.png" in err  # an existing plot is not replaced unasked


def test_plot_needs_a_weighting(tmp_path, capsys):
    rc, _, err = run_plan(capsys, str(rows(tmp_path)), "--weight-plot", str(tmp_path / "p.png"), "-q")
    assert rc != 0 and "--loss-weighting" in err


def test_weight_shares_sum_to_one():
    rng = np.random.default_rng(1)
    lengths = rng.integers(2, 3000, 1000)
    for mode in ("token", "sample", "sqrt", "seq-mean-token-sum"):
        s = weight_shares(lengths, lengths - 1, mode)
        assert s.shares.sum() == pytest.approx(1.0) and s.examples.sum() == 1000
    assert weight_shares(lengths, lengths - 1, "sqrt").shares[-1] < weight_shares(lengths, lengths - 1, "token").shares[-1]


def test_length_modes_and_refusals_from_the_command_line(tmp_path, capsys):
    """``--loss-weighting dr_grpo:L`` and ``seq-mean-token-sum-norm:L`` (TRL's and verl's constant-length modes):
    every loss token of a step weighs the same under both, so their shares are the token mean's. Without ``:L``,
    or a column of weights (plan reads lengths, not columns), the option is refused in one line naming why.
    Before, the option took only the eight names (argparse's 'invalid choice')."""
    path = rows(tmp_path)
    for spec, name in (("dr_grpo:512", "dr_grpo(512)"), ("seq-mean-token-sum-norm:64", "seq-mean-token-sum-norm(64)")):
        rc, out, _ = run_plan(capsys, str(path), "--loss-weighting", spec, "-w", "512", "--json", "-q")
        got = json.loads(out)["loss_weighting"]
        assert rc == 0 and got["weighting"] == name and got["shares"] == pytest.approx(got["token_shares"])
    for spec, says in (("dr_grpo", "pass dr_grpo:L"), ("dr_grpo:0", "pass dr_grpo:L"),
                       ("column:w", "not read by plan"), ("median", "not a loss weighting")):
        rc, _, err = run_plan(capsys, str(path), "--loss-weighting", spec, "-w", "512", "-q")
        assert rc == 2 and says in err and len(err.strip().splitlines()) <= 2, err
