"""Benchmarks that cannot flatter (benchmarks/RESULTS.md, "Benchmarks that cannot flatter", engineer bench34): every
comparison in benchmarks/ runs on real data unless a synthetic distribution is asked for by name, alternates its
providers round by round with garbage collected outside the clock, and prints the median and spread of the pair
ratios. Read from the scripts' source (no benchmark runs here) and from benchlib's helpers with a fake clock."""

import argparse
import gc
import os
import re
import sys

import numpy as np
import pytest

BENCH_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks")
sys.path.insert(0, BENCH_DIR)

import benchlib  # noqa: E402

SCRIPTS = sorted(f for f in os.listdir(BENCH_DIR) if f.startswith("bench_") and f.endswith(".py"))

# Scripts with no timed comparison: what they print is exact (counts, bytes, weights), so there is no pair ratio to
# spread. Their data must still be real by default.
UNTIMED = {
    "bench_piece_bytes.py": "bytes of the document columns of one packing: one measurement, no provider against another",
    "bench_loss.py": "the weights and gradients of two loss rules on the same micro-batches: exact, not timed "
                     "(count_us times packkit's count alone; the baseline counts nothing)",
}
# A best-of figure beside the pair ratios, where it is a decomposition rather than the comparison.
BEST_OF_BESIDE = {
    "bench_weighting.py": "the isolated share (what only the weighting runs, over the whole collate) is a least-time "
                          "decomposition; its A/B (sample against token weighting) is rotated rounds and pair ratios",
}
SYNTHETIC_HELPERS = ("sft_like_lengths(", "uniform_lengths(", "synthetic_sft_lengths(")
ALTERNATES = re.compile(r"r % 2|\[::-1\]|names\[r %|_order\(")


def source(name: str) -> str:
    with open(os.path.join(BENCH_DIR, name)) as f:
        return f.read()


def test_the_lists_name_real_scripts():
    assert len(SCRIPTS) >= 27
    assert set(UNTIMED) | set(BEST_OF_BESIDE) <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_no_comparison_defaults_to_synthetic_lengths(name):
    """A script takes synthetic lengths only through ``benchlib.bench_lengths`` behind ``--lengths sft-like``: it
    calls none of the synthetic generators itself (before: eight scripts called ``sft_like_lengths`` by default)."""
    text = source(name)
    called = [h for h in SYNTHETIC_HELPERS if re.search(r"(?<![\w.])" + re.escape(h), text)
              or re.search(r"\." + re.escape(h), text)]
    assert not called, f"{name} calls {called}: take lengths from benchlib.bench_lengths (chat by default)"
    if "bench_lengths(" in text:
        assert "add_lengths_option(" in text, f"{name} reads --lengths without offering it"


@pytest.mark.parametrize("name", sorted(set(SCRIPTS) - set(UNTIMED)))
def test_every_timed_comparison_prints_the_spread_of_its_pair_ratios(name):
    """Each timed comparison computes its pair ratios with ``benchlib.ratio_spread`` (median, lowest-highest,
    middle half), not a best-of or a ratio of two medians, and gets its rounds from an alternating helper, or
    alternates them itself with the collector off during the clock, or alternates fresh processes."""
    text = source(name)
    assert "ratio_spread(" in text, f"{name}: no pair ratios (benchlib.ratio_spread)"
    alternates = any(h in text for h in ("ab_pairs(", "rotating_rounds(")) or (
        ("gc.disable()" in text or "subprocess" in text) and ALTERNATES.search(text))
    assert alternates, f"{name}: rounds not alternated with the collector outside the clock"
    if name not in BEST_OF_BESIDE:
        assert "best_of(" not in text and "best_interleaved(" not in text, f"{name}: a best-of figure"


def test_the_lengths_option_defaults_to_real_chat():
    parser = argparse.ArgumentParser()
    benchlib.add_lengths_option(parser)
    assert parser.parse_args([]).lengths == "chat"
    real = benchlib.bench_lengths("chat", 500, seed=3)
    assert np.array_equal(real, benchlib.chat_lengths(500, seed=3))
    assert np.isin(real, np.load(benchlib.CHAT_LENGTHS)).all()
    fit = benchlib.bench_lengths("chat", 2000, seed=1, high=4096)
    assert fit.max() <= 4096 and np.isin(fit, np.load(benchlib.CHAT_LENGTHS)).all()  # drawn below, none clipped
    assert parser.parse_args(["--lengths", "sft-like"]).lengths == "sft-like"
    with pytest.raises(ValueError, match="unknown length source"):
        benchlib.bench_lengths("lognormal", 10)


def test_chat_turns_are_real_samples():
    lengths, loss = benchlib.chat_turns(1000, seed=0, high=2048)
    assert lengths.max() <= 2048 and (loss >= 0).all() and (loss <= lengths).all()


class FakeClock:
    """A clock that records, at every reading, whether the collector was on and how many collections ran."""

    def __init__(self, monkeypatch):
        self.t, self.collects, self.readings = 0.0, 0, []
        real = gc.collect

        def collect(*a):
            self.collects += 1
            return real(*a)

        monkeypatch.setattr(gc, "collect", collect)

    def __call__(self):
        self.t += 1.0
        self.readings.append((gc.isenabled(), self.collects))
        return self.t


@pytest.mark.parametrize("helper", ["ab_pairs", "rotating_rounds"])
def test_pair_helpers_collect_outside_the_clock_and_alternate(helper, monkeypatch):
    clock = FakeClock(monkeypatch)
    order = []
    a, b = (lambda: order.append("a")), (lambda: order.append("b"))
    if helper == "ab_pairs":
        ta, tb = benchlib.ab_pairs(a, b, 4, clock=clock)
    else:
        got = benchlib.rotating_rounds({"a": a, "b": b}, 4, clock=clock)
        ta, tb = got["a"], got["b"]
    assert len(ta) == len(tb) == 4
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]  # who goes first alternates
    starts, stops = clock.readings[0::2], clock.readings[1::2]
    assert all(not on for on, _ in clock.readings), "the collector ran while the clock was running"
    assert [n for _, n in starts] == list(range(1, 9)), "one collection before each timed call"
    assert [n for _, n in stops] == [n for _, n in starts], "a collection inside the clock"
    assert gc.isenabled()


def test_ratio_spread_reports_median_and_spread():
    s = benchlib.ratio_spread([2, 3, 4, 10], [1, 1, 2, 2])
    assert s["median"] == 2.5 and s["low"] == 2.0 and s["high"] == 5.0 and s["pairs"] == 4
    assert s["low"] <= s["q1"] <= s["median"] <= s["q3"] <= s["high"]
    text = benchlib.spread_text(s)
    assert text.startswith("2.50x (2.00-5.00, mid ") and text.endswith("4 pairs)")
    two = benchlib.ratio_spread([2.0, 30.0], [1.0, 1.0])  # the middle half of few pairs stays inside their range
    assert 2.0 <= two["q1"] <= two["q3"] <= 30.0, two
    with pytest.raises(ValueError, match="no pairs"):
        benchlib.ratio_spread([], [])
