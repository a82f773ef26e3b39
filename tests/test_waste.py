"""packkit.waste: every figure against a slow reference over explicit batches and windows."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from packkit.binpack import apply_overflow, pack
from packkit.datafiles import Lengths
from packkit.sampler import LengthGroupedSampler, PackedBatchSampler
from packkit.waste import WASTE_STRATEGIES, _percentiles, format_table, measure_waste, padded_rows, plot_waste


def overflow_ref(lengths, window, overflow):
    out, cut = [], 0
    for n in lengths:
        if n <= window:
            out.append(n)
        elif overflow == "truncate":
            out.append(window)
            cut += n - window
        elif overflow == "drop":
            cut += n
        else:
            while n > 0:
                out.append(min(n, window))
                n -= window
    return out, cut


@given(st.lists(st.integers(1, 40), min_size=1, max_size=30), st.integers(1, 12),
       st.sampled_from(["truncate", "split", "drop"]))
@example([1], 1, "split")  # window 1
@example([40] * 3, 1, "split")  # all equal, every token its own piece
@example([12, 12], 12, "drop")  # exactly the window: kept
def test_apply_overflow(lengths, window, overflow):
    """The pieces every waste strategy packs or pads: the one overflow policy, pieces of an example in order."""
    p = apply_overflow(np.array(lengths), window=window, overflow=overflow, in_order=True)
    ref, ref_cut = overflow_ref(lengths, window, overflow)
    assert p.length.tolist() == ref and p.cut_tokens == ref_cut
    assert p.overflow_examples.size == sum(n > window for n in lengths)


def test_apply_overflow_error_names_example():
    with pytest.raises(ValueError, match="example 1 has 9 tokens > window=4"):
        measure_waste([3, 9], window=4, overflow="error")


def padded_ref(lengths, batches):
    """(real, slots, attention) of padded batches, one loop per row."""
    real = slots = att = 0
    for b in batches:
        longest = max(lengths[i] for i in b)
        for i in b:
            real += lengths[i]
            slots += longest
            att += longest ** 2
    return real, slots, att


def packed_ref(windows_lengths, window):
    real = sum(sum(w) for w in windows_lengths)
    att = sum(sum(n * n for n in w) + (window - sum(w)) ** 2 for w in windows_lengths)
    return real, len(windows_lengths) * window, att


@settings(max_examples=30)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=80), st.integers(1, 9), st.integers(20, 64),
       st.integers(1, 5))
@example([8, 6, 6, 8, 6, 6], 1, 20, 1)  # next fit in order (2 windows) beats best fit decreasing (3)
@example([1], 1, 20, 1)  # a single one-token example
@example([50] * 7, 3, 20, 2)  # all equal, every one over the window (truncated)
def test_measure_waste_matches_reference(lengths, batch_size, window, k):
    r = measure_waste(lengths, window=window, batch_size=batch_size, windows_per_step=k, buffer_size=4, seed=3,
                      overflow="truncate")
    L = np.minimum(np.asarray(lengths), window)
    by = {s.name: s for s in r.strategies}
    assert tuple(by) == WASTE_STRATEGIES
    n = L.size
    longest = int(L.max())
    base = n * longest ** 2
    # pad to the longest
    s = by["pad_longest"]
    assert (s.real_tokens, s.slot_tokens, s.rows, s.steps) == (int(L.sum()), n * longest, n, math.ceil(n / batch_size))
    assert r.attention_vs_padded(s) == pytest.approx(1.0)
    # random batches: the seeded permutation cut every batch_size
    perm = np.random.default_rng(3).permutation(n)
    batches = [perm[i: i + batch_size].tolist() for i in range(0, n, batch_size)]
    real, slots, att = padded_ref(L.tolist(), batches)
    s = by["random"]
    assert (s.real_tokens, s.slot_tokens) == (real, slots) and s.attention == pytest.approx(att)
    assert s.padding_fraction == pytest.approx(1 - real / slots)
    # grouped batches: never more padding than random batches of the same size, on average over rows
    g = by["grouped"]
    sampler = LengthGroupedSampler(L, batch_size=batch_size, seed=3, rank=0, world_size=1)  # one epoch's batches
    batches = [np.asarray(b, np.int64).tolist() for b in sampler]
    assert sorted(i for b in batches for i in b) == list(range(n))
    real, slots, att = padded_ref(L.tolist(), batches)
    assert (g.real_tokens, g.slot_tokens, g.steps) == (real, slots, len(batches)) and g.attention == pytest.approx(att)
    # packed strategies: against the plan, one window at a time; first fit in a random order is the plan
    # the sampler that deals it makes (its own seed for the epoch)
    for name in ("bfd", "shuffle_ff", "next_fit"):
        plan = pack(L, window=window, strategy=name, seed=3)
        if name == "shuffle_ff":
            plan = PackedBatchSampler(L, window=window, windows_per_batch=k, strategy=name, seed=3, rank=0,
                                      world_size=1).plan()
        wl = [plan.segments(i)[2].tolist() for i in range(plan.num_windows)]
        real, slots, att = packed_ref(wl, window)
        s = by[name]
        assert (s.real_tokens, s.slot_tokens, s.rows) == (real, slots, plan.num_windows)
        assert s.steps == math.ceil(plan.num_windows / k)
        assert s.attention == pytest.approx(att)
        assert r.attention_vs_padded(s) == pytest.approx(att / base)
        assert s.tokens_per_step == pytest.approx(real / s.steps)
    assert by["stream"].real_tokens == int(L.sum())
    # every packing strategy needs at least ceil(tokens / W) windows. Not "bfd never needs more windows
    # than next_fit" (what this check said before the fix): the data's own order can beat longest-first
    # (lengths [8, 6, 6, 8, 6, 6] at W=20 take 2 windows in order, 8+6+6 twice, and 3 by best fit decreasing)
    for name in ("bfd", "shuffle_ff", "next_fit", "stream"):
        assert by[name].rows >= -(-int(L.sum()) // window)


def test_padded_rows():
    padded, order = padded_rows(np.array([3, 1, 4, 1, 5]), np.array([4, 0, 1, 2, 3]), 2)
    assert padded.tolist() == [5, 5, 4, 4, 1] and order.tolist() == [4, 0, 1, 2, 3]


@pytest.mark.slow
def test_report_json_table_and_plot(tmp_path):
    lengths = np.random.default_rng(0).integers(1, 300, 500)
    r = measure_waste(Lengths(lengths, "test data"), window=256, batch_size=4, overflow="truncate")
    d = json.loads(json.dumps(r.to_dict()))
    assert [s["name"] for s in d["strategies"]] == list(WASTE_STRATEGIES)
    assert d["overflow_examples"] == int((lengths > 256).sum()) and d["cut_tokens"] == int(np.maximum(lengths - 256, 0).sum())
    table = format_table(r)
    for s in r.strategies:
        assert s.label in table and f"{s.padding_fraction:.1%}" in table
    assert "attention vs padded" in table and "sum(L_i^2)" in table
    path = tmp_path / "w.png"
    plot_waste(r, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000


@pytest.mark.slow
def test_waste_plot_of_data_with_labels(tmp_path):
    """Regression: `packkit waste data.jsonl --plot w.png` on data with labels (or a loss mask) crashed
    with NameError ('lines' is not defined): plot_waste held a copy of format_table's loss-token line."""
    from packkit.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"input_ids": list(range(n)), "labels": [-100] * (n // 2) + list(range(n // 2, n))})
                              for n in (3, 9, 5, 12, 7)) + "\n")
    png = tmp_path / "w.png"
    assert main(["waste", str(data), "-w", "16", "-b", "2", "--plot", str(png), "-q"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = measure_waste(Lengths(np.array([3, 9, 5, 12, 7]), "t", loss_lengths=np.array([1, 4, 2, 6, 3])), window=16,
                      batch_size=2)
    plot_waste(r, tmp_path / "v.png")
    assert (tmp_path / "v.png").stat().st_size > 20_000


@pytest.mark.parametrize("kwargs, match", [
    ({"lengths": []}, "empty"),
    ({"lengths": [1, 0]}, "example 1 has length 0"),
    ({"lengths": [1], "batch_size": 0}, "batch_size"),
    ({"lengths": [1], "windows_per_step": 0}, "windows_per_step"),
    ({"lengths": [1], "strategies": ["best"]}, "unknown strategies"),
    ({"lengths": [9], "window": 4, "overflow": "drop"}, "dropped them all"),
])
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        measure_waste(**kwargs)



@given(values=st.lists(st.integers(0, 2**40), min_size=1, max_size=300) | st.lists(st.integers(0, 9), min_size=1),
       q=st.lists(st.floats(0, 100), min_size=1, max_size=5) | st.just([50, 90, 99]),
       dtype=st.sampled_from([np.int64, np.float64]))
@example(values=[1, 2], q=[50, 90, 99], dtype=np.int64)
def test_percentiles_are_numpys_without_numpy_ma(values, q, dtype):
    """waste's median, p90 and p99 (``packkit waste`` prints them) by numpy's own float operations, without the
    ``np.unique`` of ``np.percentile``, which imports numpy.ma at start: the same floats, bit for bit, and so
    the same integers printed (tests/test_cli_startup.py checks that the command imports no numpy.ma)."""
    a = np.asarray(values, dtype)
    got, want = _percentiles(a, q), np.percentile(a, q)
    assert got.dtype == want.dtype and np.array_equal(got, want), (got, want)
