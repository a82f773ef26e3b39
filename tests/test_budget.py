"""packkit.budget: per-step figures against loop references, advice, the micro-batch search, the CLI."""

import gc
import json
import math
import tracemalloc
import warnings

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from packkit import cli
from packkit.binpack import pack
from packkit.budget import (
    Advice,
    AdviceOptions,
    BudgetWarning,
    effective_batch_size,
    find_max_micro_batch,
    is_out_of_memory,
    plan_budget,
    synthetic_sft_lengths,
)
from packkit.datafiles import Lengths, read_lengths
from packkit.listcolumns import loss_lengths
from packkit.packer import pack_arrays
from packkit.sampler import LengthGroupedSampler, PackedBatchSampler
from packkit.segments import lengths_to_offsets, piece_loss_tokens

IGNORE = -100
QUIET = AdviceOptions(warn=False)


# ----------------------------------------------------------------------------------------------
# references
# ----------------------------------------------------------------------------------------------


def steps_ref(units, group):
    """Per-step (tokens, examples, loss) of consecutive groups of units; full steps only when any."""
    steps = [units[i:i + group] for i in range(0, len(units), group)]
    full = [s for s in steps if len(s) == group]
    use = full if full else steps
    return [tuple(sum(u[k] for u in s) for k in range(3)) for s in use], len(steps), len(full)


def packed_units_ref(plan, lengths, loss):
    """(tokens, examples, loss) of each window, with loss counted on real packed labels."""
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    labels = np.full(offsets[-1], IGNORE, np.int64)
    for i, (n, c) in enumerate(zip(lengths, loss)):
        labels[offsets[i] + n - c: offsets[i] + n] = 7  # the completion: the last c tokens
    rows = pack_arrays(plan, np.zeros(offsets[-1], np.int64), offsets, labels)
    units = []
    for w in range(plan.num_windows):
        ex, start, ln = plan.segments(w)
        lab = rows.labels[rows.row_offsets[w]:rows.row_offsets[w + 1]]
        units.append((int(ln.sum()), int((start == 0).sum()), int((lab != IGNORE).sum())))
    return units


# ----------------------------------------------------------------------------------------------
# small functions
# ----------------------------------------------------------------------------------------------


def test_effective_batch_and_bad_input():
    assert effective_batch_size(per_device_batch=4, accumulation_steps=8, world_size=2) == 64
    with pytest.raises(ValueError, match="world_size must be at least 1, got 0"):
        plan_budget([5, 6], per_device_batch=1, world_size=0)
    with pytest.raises(ValueError, match="accumulation_steps must be at least 1, got 0"):
        plan_budget([5, 6], per_device_batch=1, accumulation_steps=0)
    with pytest.raises(ValueError, match="lengths is empty"):
        plan_budget([], per_device_batch=1)
    with pytest.raises(ValueError, match="example 1 has length 0"):
        plan_budget([5, 0], per_device_batch=1)
    with pytest.raises(TypeError, match="per_device_batch must be an integer"):
        plan_budget([5], per_device_batch=2.5)
    with pytest.raises(ValueError, match="example 1 has loss_lengths=6 with length 6"):
        plan_budget(Lengths(np.array([5, 6]), "t", loss_lengths=np.array([2, 6])), per_device_batch=1)
    with pytest.raises(ValueError, match="lengths \\(or a packed plan\\)"):
        plan_budget(per_device_batch=1)


@settings(max_examples=40)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 39)), min_size=1, max_size=30),
       st.integers(1, 40), st.sampled_from(["truncate", "split"]))
@example([(1, 0)], 1, "truncate")  # a one-token example in a window of 1: no loss token
@example([(40, 39)] * 3, 1, "split")  # all equal, window 1: every piece one token
@example([(40, 39), (3, 0)], 40, "split")
def test_piece_loss_tokens_of_loss_lengths_match_real_packed_labels(examples, window, overflow):
    lengths = np.array([n for n, _ in examples])
    loss = np.array([min(c, n - 1) for n, c in examples])
    plan = pack(lengths, window=window, overflow=overflow)
    got = piece_loss_tokens(plan.seg_example, plan.seg_start, plan.seg_length, offsets=lengths_to_offsets(lengths),
                            loss_lengths=loss)
    want = np.array([u[2] for u in packed_units_ref(plan, lengths, loss)])
    per_window = np.bincount(plan.seg_window, weights=got, minlength=plan.num_windows)
    np.testing.assert_array_equal(per_window, want)


# ----------------------------------------------------------------------------------------------
# the report against loop references
# ----------------------------------------------------------------------------------------------


def dealt_steps_ref(make, world_size, accumulation, full_steps, values):
    """Per optimiser step, the sum of ``values`` over every rank's batches, read in loops from each rank's own
    sampler (``make(rank)``): full steps are ``accumulation`` batches on every rank and come first, the rest is
    one partial step. ``(sums of the full steps, or of the partial one when there is none), steps``."""
    per_rank = [[list(b) for b in make(r)] for r in range(world_size)]
    rows = len(per_rank[0])
    bounds = list(range(0, full_steps * accumulation, accumulation)) + ([full_steps * accumulation]
                                                                       if rows > full_steps * accumulation else [])
    sums = [sum(values[i] for batches in per_rank for b in batches[lo:hi] for i in b)
            for lo, hi in zip(bounds, bounds[1:] + [rows])]
    return (sums[:full_steps] if full_steps else sums), len(sums)


@settings(max_examples=30)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=120), st.integers(1, 4), st.integers(1, 3),
       st.integers(1, 2), st.integers(0, 5), st.booleans(), st.sampled_from([None, "tokens", "sqlen", "compute"]))
@example([300], 4, 3, 2, 0, True, None)  # one window, a step of 24: no full step
@example([300], 4, 3, 2, 0, False, None)
@example([1] * 120, 1, 1, 1, 5, False, None)  # all equal: one window
@example([150] * 4, 1, 1, 2, 1, True, "compute")  # every step alike (std 0)
def test_packed_report_is_the_schedule_the_sampler_deals(lengths, b, a, d, seed, drop_last, balance):
    """The per-step figures are those of the epoch a real PackedBatchSampler (same window, windows per batch,
    ranks, accumulation, seed and balance) deals, read here rank by rank, whatever the balance policy: before,
    plan_budget cut its own order of the windows into steps, not the sampler's."""
    lengths = np.array(lengths)
    loss = lengths // 2
    r = plan_budget(Lengths(lengths, "t", loss_lengths=loss), window=300, per_device_batch=b, accumulation_steps=a,
                    world_size=d, seed=seed, drop_last=drop_last, balance=balance, advice=QUIET)
    probe = PackedBatchSampler(lengths, window=300, windows_per_batch=b, world_size=d, rank=0, step_batches=d * a,
                               seed=seed, balance=balance)
    full = probe.plan().num_windows // (b * a * d)

    def make(rank):
        return PackedBatchSampler(lengths, window=300, windows_per_batch=b, world_size=d, rank=rank,
                                  step_batches=d * a, seed=seed, balance=balance, drop_last=drop_last and full > 0)

    sampler = make(0)
    assert r.mode == "packed" and r.effective_batch == b * a * d and r.full_steps_per_epoch == full
    for values, spread in ((lengths, r.tokens_per_step), (np.ones_like(lengths), r.examples_per_step),
                           (loss, r.loss_tokens_per_step)):
        vals, steps = dealt_steps_ref(make, d, a, full, values)
        assert spread.mean == pytest.approx(np.mean(vals)) and spread.min == min(vals) and spread.max == max(vals)
        assert spread.std == pytest.approx(np.std(vals), abs=1e-9)
    assert r.steps_per_epoch == (full if drop_last else steps)
    assert r.padding_fraction == pytest.approx(1 - lengths.sum() / (sampler.plan().num_windows * 300))
    if full or not drop_last:
        stats = sampler.epoch_stats()
        assert (r.compute_imbalance, r.examples_per_step_cv) == (stats.compute_imbalance, stats.examples_per_step_cv)


@settings(max_examples=30)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=120), st.integers(1, 4), st.integers(1, 3),
       st.integers(0, 5))
@example([1], 4, 3, 0)  # one one-token example: no loss token, one partial step
@example([300] * 12, 4, 3, 1)  # all equal: no padding, one full step
def test_padded_report_is_the_schedule_the_sampler_deals(lengths, b, a, seed):
    """Padded: the length-grouped batches a real LengthGroupedSampler deals, each padded to its longest."""
    lengths = np.array(lengths)
    r = plan_budget(lengths, per_device_batch=b, accumulation_steps=a, seed=seed, advice=QUIET)

    def make(rank):
        return LengthGroupedSampler(lengths, batch_size=b, world_size=1, rank=rank, step_batches=a, seed=seed)

    sampler, full = make(0), len(lengths) // (a * b)
    vals, steps = dealt_steps_ref(make, 1, a, full, lengths)
    assert r.mode == "padded" and r.loss_tokens_assumed
    assert r.steps_per_epoch == steps and r.full_steps_per_epoch == full
    assert r.tokens_per_step.mean == pytest.approx(np.mean(vals))
    assert r.loss_tokens_per_step.mean == pytest.approx(np.mean(dealt_steps_ref(make, 1, a, full, lengths - 1)[0]))
    padded = sum(len(batch) * lengths[batch].max() for batch in sampler)
    assert r.padding_fraction == pytest.approx(1 - lengths.sum() / padded)


def test_next_fit_is_dealt_as_planned_in_order():
    """No sampler plans next fit: plan_budget plans it (in dataset order) and deals those windows."""
    lengths = np.array([300, 200, 100, 250, 50, 120, 80, 290, 10] * 5)
    r = plan_budget(lengths, window=300, strategy="next_fit", per_device_batch=2, advice=QUIET)
    windows = pack(lengths, window=300, strategy="next_fit").num_windows
    assert r.num_units == windows and r.steps_per_epoch == -(-windows // 2)
    assert r.padding_fraction == pytest.approx(1 - lengths.sum() / (windows * 300))


def test_a_plan_given_is_dealt_in_its_order():
    """A Plan as lengths: its windows dealt in the order given (no shuffle), steps of b x a x d windows."""
    lengths = np.array([300, 200, 100, 250, 50, 120, 80, 290, 10] * 5)
    plan = pack(lengths, window=300).shuffled(3)
    r = plan_budget(plan, per_device_batch=2, accumulation_steps=1, world_size=2, advice=QUIET)
    tokens = plan.window_loads
    want = [int(tokens[i:i + 4].sum()) for i in range(0, plan.num_windows // 4 * 4, 4)]
    assert r.steps_per_epoch == -(-plan.num_windows // 4) and r.tokens_per_step.mean == pytest.approx(np.mean(want))
    assert r.tokens_per_step.max == max(want) and r.window == 300


def test_a_plan_given_with_strategy_next_fit_is_dealt_as_made():
    """Regression: ``plan_budget(plan, strategy="next_fit")`` raised ``TypeError: 'Plan' object is not iterable``
    (:func:`packkit.epoch.deal` planned next fit again, from the plan itself); a plan's windows are taken as made,
    whatever ``strategy`` says, as with every other strategy."""
    plan = pack(np.array([300, 200, 100, 250, 50, 120, 80, 290, 10] * 5), window=300).shuffled(3)
    r = plan_budget(plan, strategy="next_fit", per_device_batch=2, world_size=2, advice=QUIET)
    assert r.as_dict() == plan_budget(plan, per_device_batch=2, world_size=2, advice=QUIET).as_dict()
    assert r.num_units == plan.num_windows


# ----------------------------------------------------------------------------------------------
# advice
# ----------------------------------------------------------------------------------------------


def codes(report):
    return [a.code for a in report.advice]


def test_few_steps_per_epoch_800_examples_at_64_is_twelve_steps():
    with pytest.warns(BudgetWarning, match="few_steps_per_epoch") as rec:
        r = plan_budget([500] * 800, per_device_batch=8, accumulation_steps=4, world_size=2)
    assert r.effective_batch == 64 and r.full_steps_per_epoch == 12 and r.steps_per_epoch == 13
    assert codes(r) == ["few_steps_per_epoch"]
    w = [x.message for x in rec if isinstance(x.message, BudgetWarning)][0]
    assert w.advice is r.advice[0] and w.code == "few_steps_per_epoch"
    assert r.advice[0].values["full_steps_per_epoch"] == 12
    assert "only 12 full optimiser steps" in r.advice[0].message
    assert r.advice[0].values["suggested_examples_per_step"] == 800 // 50


def test_a_budget_warning_rebuilt_from_its_text():
    """pytest-xdist sends a warning a test left uncaught to the controller as its class and args and rebuilds it as
    ``cls(*args)``, and pickle does the same: ``BudgetWarning(str)`` raised AttributeError there, which took down
    the whole xdist worker (INTERNALERROR, every later test of the run unrun). Rebuilt, it keeps its text and code."""
    import pickle

    with pytest.warns(BudgetWarning) as rec:
        plan_budget([500] * 800, per_device_batch=8, accumulation_steps=4, world_size=2)
    w = [x.message for x in rec if isinstance(x.message, BudgetWarning)][0]
    for again in (type(w)(*w.args), pickle.loads(pickle.dumps(w))):
        assert str(again) == str(w) and again.code == w.code == "few_steps_per_epoch"


def test_the_names_that_left_budget_are_lent_at_their_old_address():
    """The advice went to :mod:`packkit.advice` and ``plan --synthetic``'s lengths to :mod:`packkit.sample`, rooms of
    their own: ``from packkit.budget import advise`` (and every name of its ``__all__``) gives the same object."""
    from packkit import advice, budget, microbatch, sample

    homes = {**{n: advice for n in advice.__all__ if n != "for_target"}, "synthetic_sft_lengths": sample,
             **{n: microbatch for n in microbatch.__all__}}
    assert set(homes) <= set(budget.__all__)
    assert [n for n, home in homes.items() if getattr(budget, n) is not getattr(home, n)] == []
    assert [n for n in budget.__all__ if not hasattr(budget, n)] == []


def test_low_tokens_per_step_suggests_accumulation_that_reaches_the_threshold():
    r = plan_budget([100] * 10_000, per_device_batch=4, accumulation_steps=2, advice=QUIET)  # 800 tokens/step
    (adv,) = [a for a in r.advice if a.code == "low_tokens_per_step"]
    assert adv.values["tokens_per_step"] == 800
    assert adv.values["suggested_accumulation_steps"] == 10  # 10 x 400 = 4,000
    assert "rather than raising the learning rate" in adv.message
    r2 = plan_budget([100] * 10_000, per_device_batch=4, accumulation_steps=10, advice=QUIET)
    assert "low_tokens_per_step" not in codes(r2)


def test_lora_large_batch_and_target_accumulation():
    lengths = [200] * 20_000
    r = plan_budget(lengths, per_device_batch=16, accumulation_steps=4, advice=AdviceOptions(lora=True, warn=False))
    assert "lora_large_batch" in codes(r)
    assert "lora_large_batch" not in codes(plan_budget(lengths, per_device_batch=16, accumulation_steps=2,
                                                       advice=AdviceOptions(lora=True, warn=False)))
    assert "lora_large_batch" not in codes(plan_budget(lengths, per_device_batch=16, accumulation_steps=4,
                                                       advice=QUIET))
    # packed: 2 windows of 2,000 tokens per accumulation step (x 2 devices): 8,000 tokens; target 50,000
    r = plan_budget([1000] * 4000, window=2000, per_device_batch=2, world_size=2, accumulation_steps=1,
                    advice=AdviceOptions(target_tokens_per_step=50_000, warn=False))
    assert r.accumulation_for_target == math.ceil(50_000 / 8000) == 7
    (adv,) = [a for a in r.advice if a.code == "accumulation_for_target"]
    assert adv.values["suggested_accumulation_steps"] == 7
    r = plan_budget([1000] * 4000, window=2000, per_device_batch=2, world_size=2, accumulation_steps=7,
                    advice=AdviceOptions(target_tokens_per_step=50_000, warn=False))
    assert "accumulation_for_target" not in codes(r) and r.accumulation_for_target == 7


def test_a_healthy_run_gets_no_advice_and_warn_false_is_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = plan_budget([1000] * 100_000, window=4096, per_device_batch=4, accumulation_steps=2)
        assert r.advice == ()
        plan_budget([10] * 10, per_device_batch=1, advice=QUIET)  # would advise, but silently
    assert isinstance(Advice("x", "y", {}).as_dict(), dict)


def test_report_table_and_dict():
    lengths, loss = synthetic_sft_lengths(3000, seed=1)
    assert lengths.max() <= 2048 and (loss <= lengths - 1).all() and (loss >= 1).all()
    r = plan_budget(Lengths(lengths, "t", loss_lengths=loss), window=2048, per_device_batch=2, accumulation_steps=2,
                    advice=QUIET)
    text = r.table()
    assert "tokens per step" in text and "steps per epoch" in text
    d = json.loads(json.dumps(r.as_dict()))
    assert d["steps_per_epoch"] == r.steps_per_epoch and d["tokens_per_step"]["mean"] == r.tokens_per_step.mean


# ----------------------------------------------------------------------------------------------
# the largest micro-batch
# ----------------------------------------------------------------------------------------------

MIB = 1 << 20


def memory_step(limit_bytes, per_item_bytes, calls):
    """A step that allocates ``per_item_bytes`` per example for real and raises OOM above ``limit``.

    The allocations sit in a reference cycle, so after a failed attempt only ``gc.collect()`` gives
    them back: a search that does not free memory between attempts sees the previous attempt's
    memory still live and under-reports the limit.
    """
    base = tracemalloc.get_traced_memory()[0]

    def step(batch_size):
        calls.append(batch_size)
        holder = []
        holder.append(holder)  # the cycle
        for _ in range(batch_size):
            holder.append(np.ones(per_item_bytes // 8))  # touched pages, traced by tracemalloc
            if tracemalloc.get_traced_memory()[0] - base > limit_bytes:
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {per_item_bytes} bytes")
    return step


@pytest.mark.parametrize("high,limit_items", [(200, 37), (64, 64), (1000, 1)])
def test_bisection_finds_the_limit_with_real_allocations(high, limit_items):
    calls = []
    gc_was = gc.isenabled()
    gc.disable()  # only the search's own gc.collect() may free the failed attempts' cycles
    tracemalloc.start()
    try:
        step = memory_step(int((limit_items + 0.5) * MIB), MIB, calls)
        res = find_max_micro_batch(step, high=high)
        leftover = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
        if gc_was:
            gc.enable()
    print(res)
    assert res.batch_size == limit_items
    assert res.attempts == len(calls) <= math.ceil(math.log2(high + 1))
    assert [s for s, _ in res.trials] == calls
    assert all(ok == (s <= limit_items) for s, ok in res.trials)
    assert leftover < 8 * MIB  # every attempt's memory was given back


def test_bisection_nothing_fits_other_errors_and_multiples():
    def too_big(b):
        raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB")

    with pytest.raises(ValueError, match="even micro-batch size 1 runs out of memory"):
        find_max_micro_batch(too_big, high=16)

    def broken(b):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        find_max_micro_batch(broken, high=16)

    seen = []

    def step(b):
        seen.append(b)
        if b > 50:
            raise torch.OutOfMemoryError("out of memory")

    res = find_max_micro_batch(step, low=8, high=128, multiple_of=8)
    assert res.batch_size == 48 and all(s % 8 == 0 for s in seen)
    assert is_out_of_memory(torch.OutOfMemoryError("x")) and not is_out_of_memory(ValueError("out of memory"))
    with pytest.raises(ValueError, match="no multiple of 64"):
        find_max_micro_batch(step, low=1, high=32, multiple_of=64)


# ----------------------------------------------------------------------------------------------
# packkit plan
# ----------------------------------------------------------------------------------------------


def run_cli(capsys, *argv):
    rc = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_inputs_agree(tmp_path, capsys):
    """``packkit plan`` reads every format ``packkit waste`` reads (one reader, packkit.datafiles: before the
    fix budget had its own), and
    the loss tokens agree whichever way the file carries them (labels, a JSON list, Parquet, Arrow,
    save_to_disk, a completion mask)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    lengths, loss = synthetic_sft_lengths(400, seed=3)
    np.save(tmp_path / "l.npy", lengths)
    rows = [{"input_ids": [1] * int(n), "labels": [IGNORE] * int(n - c) + [1] * int(c)} for n, c in zip(lengths, loss)]
    with open(tmp_path / "d.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "d.json").write_text(json.dumps(rows))
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "d.parquet")
    with pa.ipc.new_file(str(tmp_path / "d.arrow"), table.schema) as w:
        w.write_table(table)
    masked = [{"input_ids": r["input_ids"], "completion_mask": [int(x != IGNORE) for x in r["labels"]]} for r in rows]
    datasets.Dataset.from_list(masked).save_to_disk(str(tmp_path / "saved"))
    results = []
    for name in ("l.npy", "d.jsonl", "d.json", "d.parquet", "d.arrow", "saved"):
        rc, out, err = run_cli(capsys, str(tmp_path / name), "-b", "2", "-a", "3", "-w", "2048", "--json")
        assert rc == 0, (name, err)
        results.append(json.loads(out))
    assert len({r["tokens_per_step"]["mean"] for r in results}) == 1
    assert results[0]["loss_tokens_assumed"] and not any(r["loss_tokens_assumed"] for r in results[1:])
    want = plan_budget(Lengths(lengths, "t", loss_lengths=loss), window=2048, per_device_batch=2, accumulation_steps=3,
                       advice=QUIET)
    for r in results[1:]:
        assert r["loss_tokens_per_step"]["mean"] == pytest.approx(want.loss_tokens_per_step.mean)

    rc, out, err = run_cli(capsys, "--synthetic", "800", "--padded", "-b", "8", "-a", "8", "--lora")
    assert rc == 0 and "steps per epoch" in out and "[few_steps_per_epoch]" in out and "[lora_large_batch]" in out


@pytest.mark.parametrize("argv,code,message", [
    ((), 2, "give a lengths FILE or --synthetic N"),
    (("--synthetic", "10", "-d", "0"), 2, "--world-size must be at least 1"),
    (("--synthetic", "10", "-a", "0"), 2, "--accumulation-steps must be at least 1"),
    (("missing.npy",), 3, "does not exist"),
])
def test_cli_errors_are_one_line(capsys, argv, code, message):
    rc, out, err = run_cli(capsys, *argv)
    assert rc == code and message in err and len(err.strip().splitlines()) == 1


def test_cli_txt_means_text_as_in_packkit_waste(tmp_path, capsys):
    """Before the fix, budget read a .txt as one length per line while packkit.datafiles (packkit waste) reads one
    text example per line, so the two commands disagreed on the same file. Both read text now."""
    (tmp_path / "t.txt").write_text("12\n7\nhello world\n")
    assert read_lengths(str(tmp_path / "t.txt")).lengths.tolist() == [2, 1, 11]
    assert read_lengths(tmp_path / "t.txt").lengths.tolist() == [2, 1, 11]
    rc, out, err = run_cli(capsys, str(tmp_path / "t.txt"), "--json")
    assert rc == 0 and json.loads(out)["num_tokens"] == 14
    (tmp_path / "e.txt").write_text("")
    rc, out, err = run_cli(capsys, str(tmp_path / "e.txt"))
    assert rc == 3 and "holds no examples" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("rows, error, match", [
    ([{"input_ids": [1, 2, 3], "labels": [IGNORE, 2, 3]}, {"input_ids": [1, 2], "labels": [IGNORE]}],
     ValueError, r"dataset row 1 \(line 2 of '[^']+'\) has 1 'labels' for 2 'input_ids'"),
    ([{"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]}, {"input_ids": [1, 2], "completion_mask": [0, 2]}],
     ValueError, r"dataset row 1 \(line 2 of '[^']+'\) has 2 in the loss mask 'completion_mask'"),
    ([{"input_ids": [1, 2, 3], "completion_mask": [0, 1]}], ValueError, r"dataset row 0 \(line 1 of '[^']+'\) has 2 'completion_mask' for 3 'input_ids'"),
    ([{"input_ids": [1, 2, 3], "labels": [IGNORE, 2, 3]}, {"input_ids": [1, 2], "labels": [IGNORE, -7]}],
     ValueError, r"dataset row 1 \(line 2 of '[^']+'\) has label -7 in 'labels'"),
])
def test_loss_columns_are_checked(tmp_path, rows, error, match):
    """Before the fix, the jsonl reader did not check that labels are as long as input_ids (and counted any
    non-zero mask value as loss). The reader names the row and its line."""
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(error, match=match):
        read_lengths(str(path))


def test_loss_lengths_matches_a_loop():
    """Loss tokens from labels and a mask together, against a per-example loop (first token never counts)."""
    import pyarrow as pa

    rng = np.random.default_rng(0)
    rows = []
    for n in rng.integers(1, 9, 50).tolist():
        labels = [int(x) if rng.random() < 0.6 else IGNORE for x in rng.integers(0, 9, n)]
        rows.append({"input_ids": [1] * n, "labels": labels, "completion_mask": rng.integers(0, 2, n).tolist()})
    table = pa.Table.from_pylist(rows)
    want = [sum(1 for t in range(1, len(r["labels"])) if r["labels"][t] != IGNORE and r["completion_mask"][t] == 1)
            for r in rows]
    got = loss_lengths(table, np.array([len(r["input_ids"]) for r in rows]))
    assert got.tolist() == want
    assert loss_lengths(pa.table({"input_ids": [[1, 2]]}), np.array([2])) is None
