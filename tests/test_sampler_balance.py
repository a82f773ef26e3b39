"""balance="compute": the cost model, the within-step deal, the cost-target packer, and the two figures
(compute imbalance, examples-per-step variation) every sampler, ``packkit waste`` and ``packkit plan``
report. References (an LPT loop, the imbalance counted from the batches each rank yields, a chi-square
test) live here.
"""

from __future__ import annotations

import collections
import math
import os
import sys
import types

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from packkit.balance import (CostModel, compute_imbalance, cost_model, greedy_to_cost, lpt_assign, pack_to_cost, step_figures,
                             steps_to_cost, swap_refine, variation)
from packkit.sampler import LengthGroupedSampler, PackedBatchSampler, TokenBudgetBatchSampler
from packkit.waste import measure_waste

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
import benchlib  # noqa: E402


def heavy_tail(n: int, seed: int, top: int = 1024) -> np.ndarray:
    """Chat-like lengths: lognormal, a few long ones."""
    return np.clip(np.random.default_rng(seed).lognormal(4.5, 1.1, size=n).astype(np.int64), 1, top)


def ref_lpt(cost: list[float], ranks: int) -> list[int]:
    """Equal-count LPT, one item at a time: costliest first, each round of ``ranks`` items to the ranks by
    current load, lightest first (ties: lower rank, then the item met first)."""
    order = sorted(range(len(cost)), key=lambda i: -cost[i])
    load, out = [0.0] * ranks, [0] * len(cost)
    for j in range(0, len(order), ranks):
        by_load = sorted(range(ranks), key=lambda r: load[r])
        for item, r in zip(order[j:j + ranks], by_load):
            out[item] = r
            load[r] += cost[item]
    return out


def imbalance_from_batches(per_rank, lengths, accumulation, model=CostModel(), units=None):
    """The compute imbalance counted from what each rank yields: steps are runs of ``accumulation`` rows
    (the last one shorter), a rank's cost the sum of its documents' costs (with their media ``units``)."""
    rows = len(per_rank[0])
    cost = np.array([[model.costs(lengths[b], None if units is None else units[b]).sum() for b in batches]
                     for batches in per_rank]).T  # (rows, R)
    steps = [cost[i:i + accumulation].sum(axis=0) for i in range(0, rows, accumulation)]
    steps = np.array(steps)
    return steps.max(axis=1).sum() / steps.mean(axis=1).sum()


def chi2_sf(x: float, dof: int) -> float:
    """Upper tail of the chi-square distribution (Wilson-Hilferty's normal approximation)."""
    z = ((x / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def chi2_same(a, b, bins: int = 8) -> float:
    """p-value that samples ``a`` and ``b`` come from one distribution (chi-square test of homogeneity
    over ``bins`` quantile bins of the pooled samples)."""
    edges = np.quantile(np.concatenate((a, b)), np.linspace(0, 1, bins + 1)[1:-1])
    table = np.array([np.bincount(np.searchsorted(edges, x, side="right"), minlength=bins) for x in (a, b)])
    table = table[:, table.sum(axis=0) > 0]
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    return chi2_sf(stat, table.shape[1] - 1)


# ----------------------------------------------------------------------------------------------
# pieces against their references
# ----------------------------------------------------------------------------------------------


@given(cost=st.lists(st.integers(0, 10_000), min_size=1, max_size=24), ranks=st.integers(1, 6))
@example(cost=[5, 1, 4, 2], ranks=2)
@example(cost=[3, 3, 3, 3], ranks=4)  # all ties
def test_lpt_assign_matches_reference(cost, ranks):
    n = len(cost) // ranks * ranks
    if n == 0:
        return
    c = np.array([cost[:n]], np.float64)
    got = lpt_assign(c, ranks, swaps=0)[0].tolist()
    assert got == ref_lpt([float(x) for x in cost[:n]], ranks)
    refined = lpt_assign(c, ranks)[0]  # the swaps keep the counts and never raise the heaviest rank
    assert collections.Counter(refined.tolist()) == {r: n // ranks for r in range(ranks)}
    heaviest = lambda a: max(sum(x for x, r in zip(cost[:n], a) if r == q) for q in range(ranks))  # noqa: E731
    assert heaviest(refined) <= heaviest(got)


def test_cost_model_from_config_cp_and_figures():
    # the attributes a transformers LlamaConfig carries (importing transformers costs seconds here)
    config = types.SimpleNamespace(hidden_size=64, intermediate_size=176, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2)
    m = CostModel.from_config(config, cp_size=2)
    assert m.linear == 2 * 64 + 2 * 32 + 3 * 176 and m.cp_size == 2  # q,o + k,v (2 heads of 16) + gated MLP
    assert CostModel.from_config(hidden_size=4096, intermediate_size=11008).linear == 49408
    assert cost_model(config).linear == m.linear and cost_model(7.0, cp_size=4).costs([4]).tolist() == [32.0]
    assert CostModel(linear=2, cp_size=2).costs([4]).tolist() == [16.0]
    with pytest.raises(ValueError, match="cost"):
        CostModel(linear=0)
    with pytest.raises(ValueError, match="cp_size"):
        cost_model(CostModel(cp_size=2), cp_size=4)
    assert compute_imbalance([[3, 1], [2, 2]]) == 1.25 and compute_imbalance(np.zeros((0, 2))) == 1.0
    assert variation([2, 4]) == pytest.approx(1 / 3)
    assert swap_refine([[4, 3, 2, 1]], [[0, 0, 1, 1]], 2)[0].tolist() == [[1, 0, 0, 1]]
    assert step_figures([3, 1, 2, 2], [1, 1, 2, 2], ranks=2, per_rank=1) == (1.25, pytest.approx(1 / 3))


# ----------------------------------------------------------------------------------------------
# the sampler under balance="compute"
# ----------------------------------------------------------------------------------------------


@settings(max_examples=30)
@given(lengths=st.lists(st.integers(1, 64), min_size=1, max_size=120), world_size=st.integers(1, 5),
       k=st.integers(1, 4), accumulation=st.integers(1, 3), cp=st.integers(1, 2), seed=st.integers(0, 9),
       kind=st.sampled_from(["packed", "grouped", "budget"]))
@example(lengths=[64] * 7, world_size=5, k=1, accumulation=2, cp=1, seed=0, kind="packed")  # windows < a step
@example(lengths=[1], world_size=4, k=2, accumulation=1, cp=2, seed=1, kind="packed")  # one example, four ranks
def test_compute_balance_properties(lengths, world_size, k, accumulation, cp, seed, kind):
    """Each example exactly once (but the counted repeats of a last step with fewer examples than ranks),
    the same number of micro-batches on every rank, the same schedule computed on every rank with no
    collective, and the reported imbalance equal to the one counted from the batches."""
    L = np.array(lengths)

    def make(rank):
        kw = dict(rank=rank, world_size=world_size, step_batches=world_size * accumulation, seed=seed,
                  balance="compute", cp_size=cp)
        if kind == "packed":
            return PackedBatchSampler(L, window=64, windows_per_batch=k, **kw)
        if kind == "grouped":
            return LengthGroupedSampler(L, batch_size=k, **kw)
        return TokenBudgetBatchSampler(L, max_tokens=64 * k, **kw)

    samplers = [make(r) for r in range(world_size)]
    per_rank = [[np.array(b) for b in s] for s in samplers]
    stats = samplers[0].epoch_stats()
    assert {len(b) for b in per_rank} == {stats.steps} and stats.accumulation_steps == accumulation
    first = samplers[0].schedule()
    for r, s in enumerate(samplers):
        sched = s.schedule()
        assert np.array_equal(sched.flat, first.flat) and np.array_equal(sched.ptr, first.ptr)
        assert [b.tolist() for b in sched.batches(r)] == [b.tolist() for b in per_rank[r]]
        assert s.epoch_stats() == stats
    counts = np.bincount(np.concatenate([b for batches in per_rank for b in batches]), minlength=L.size)
    assert (counts >= 1).all() and int((counts - 1).sum()) == stats.repeated
    if kind == "packed":
        for batches in per_rank:
            for b in batches:  # a batch refits into k windows (the collator's contract)
                assert sum(L[b]) <= 64 * k
    model = CostModel(cp_size=cp)
    used = np.minimum(L, 64)
    assert stats.compute_imbalance == pytest.approx(imbalance_from_batches(per_rank, used, accumulation, model))


def test_compute_deal_balances_and_keeps_the_steps():
    """Windows of a step dealt by LPT: the imbalance falls, and each step holds the same examples as
    without balancing (same seed), so the step composition is untouched."""
    L = heavy_tail(6000, 0)
    kw = dict(window=1024, windows_per_batch=8, world_size=4, rank=0, step_batches=4, seed=3)
    plain, balanced = PackedBatchSampler(L, **kw), PackedBatchSampler(L, balance="compute", **kw)
    print("compute imbalance: none", plain.epoch_stats().compute_imbalance, "compute",
          balanced.epoch_stats().compute_imbalance)
    assert balanced.epoch_stats().compute_imbalance - 1 < 0.6 * (plain.epoch_stats().compute_imbalance - 1)

    def steps(s):
        sched = s.schedule()
        return [frozenset(sched.flat[sched.ptr[i * 4]:sched.ptr[(i + 1) * 4]].tolist()) for i in range(sched.rows)]

    assert steps(plain) == steps(balanced)
    assert plain.epoch_stats().examples_per_step_cv == balanced.epoch_stats().examples_per_step_cv


def test_step_composition_chi_square():
    """Examples per step under compute cannot be told from no balancing (chi-square, p > 0.01, other
    seeds so the draws are independent); under sqlen, which sorts steps by cost, they can (p < 1e-6)."""
    L = heavy_tail(3000, 1, top=512)

    def per_step(balance, seed):
        s = PackedBatchSampler(L, window=512, windows_per_batch=4, world_size=4, rank=0, seed=seed,
                               balance=balance)
        out = []
        for epoch in range(8):
            s.set_epoch(epoch)
            sched = s.schedule()
            sizes = np.diff(sched.ptr).reshape(sched.rows, 4).sum(axis=1)
            out.append(sizes[:-1])  # full steps
        return np.concatenate(out)

    none, compute, sqlen = per_step(None, 0), per_step("compute", 100), per_step("sqlen", 200)
    p_compute, p_sqlen = chi2_same(none, compute), chi2_same(none, sqlen)
    print(f"steps {none.size}; p(compute ~ none) = {p_compute:.3f}, p(sqlen ~ none) = {p_sqlen:.2e}; "
          f"cv none {variation(none):.3f} compute {variation(compute):.3f} sqlen {variation(sqlen):.3f}")
    assert p_compute > 0.01 and p_sqlen < 1e-6


def test_cost_target_packer_one_window_per_rank():
    """k = 1: windows built to a cost target, long documents queued until every window of a step gets one;
    every document once, no window over W, at most 6% more windows than the lower bound on these heavy-tailed
    lengths (the benchmark measures real chat lengths), and an imbalance
    well under the random windows'."""
    L = heavy_tail(8000, 2, top=4096)
    kw = dict(window=4096, windows_per_batch=1, world_size=8, rank=0, seed=0, cost=4096.0)
    plain, to_cost = PackedBatchSampler(L, **kw), PackedBatchSampler(L, balance="compute", **kw)
    plan = to_cost.plan()
    assert (plan.window_loads <= 4096).all() and sorted(plan.seg_example.tolist()) == list(range(L.size))
    a, b = plain.epoch_stats(), to_cost.epoch_stats()
    lower = -(-int(L.sum()) // 4096)
    print("none", a.compute_imbalance, "to cost", b.compute_imbalance, "windows", plan.num_windows, "lower", lower,
          "queued", b.queued, "deferred", b.deferred)
    outliers = int((L.astype(float) ** 2 > 0.25 * 4096.0 * 4096).sum())
    assert b.queued == outliers > 0
    assert plan.num_windows <= 1.06 * lower
    assert b.compute_imbalance < 1 + (a.compute_imbalance - 1) / 2
    t = greedy_to_cost([3, 3, 2, 2], [0, 1, 2, 3], window=5, step_windows=2, cost=CostModel(100))
    assert t.seg_example.tolist() == [0, 2, 1, 3] and t.window_ptr.tolist() == [0, 2, 4]
    t = steps_to_cost([4, 3, 2, 1] * 3, range(12), window=10, step_windows=2, cost=CostModel(10))  # its docstring's
    assert [t.seg_example[a:b].tolist() for a, b in zip(t.window_ptr[:-1], t.window_ptr[1:])] == [
        [0, 1, 2], [4, 5, 6], [3, 8], [7, 9, 10], [11]]
    t = pack_to_cost([6, 3, 2, 1] * 4, range(16), window=10, step_windows=2, cost=CostModel(10), chunk=16)  # its
    assert [t.seg_example[a:b].tolist() for a, b in zip(t.window_ptr[:-1], t.window_ptr[1:])] == [  # docstring's
        [0, 2, 3], [4, 6, 7], [8, 1], [12, 5], [9, 14, 15], [10, 11, 13]]


def test_waste_random_batches_figures_match_a_numpy_count():
    """measure_waste(world_size=) reports, for random padded batches (a plain DataLoader's: no packkit sampler
    deals them), the imbalance of the seeded order dealt batch_size rows per rank: recounted here."""
    L = heavy_tail(3000, 3, top=2048)
    r = measure_waste(L, window=2048, batch_size=4, world_size=4, seed=5, strategies=("random",))
    order = np.random.default_rng(5).permutation(L.size)
    longest = np.maximum.reduceat(L[order], np.arange(0, L.size, 4))
    padded = np.repeat(longest, np.diff(np.append(np.arange(0, L.size, 4), L.size)))
    cost = 24576.0 * padded + padded.astype(float) ** 2
    full = L.size // 16 * 16
    per = cost[:full].reshape(-1, 4, 4).sum(axis=2)
    assert r.strategies[0].compute_imbalance == pytest.approx(per.max(axis=1).sum() / per.mean(axis=1).sum())
    assert r.strategies[0].compute_imbalance > 1.0 and r.to_dict()["world_size"] == 4


@pytest.mark.parametrize("balance", [None, "tokens", "sqlen", "compute"])
def test_plan_and_waste_print_the_schedule_the_sampler_deals(tmp_path, capsys, balance):
    """``packkit plan`` and ``packkit waste`` print the steps, compute imbalance and spread of examples per step of
    the epoch a real sampler with the same arguments deals, for every balance policy: before, each command cut
    the epoch into steps its own way, so under balance="compute" they printed the imbalance of a schedule no
    sampler deals (and had no --balance)."""
    import json

    from packkit.cli import main

    L = heavy_tail(3000, 6, top=2048)
    path = tmp_path / "lengths.npy"
    np.save(path, L)
    policy = ["--balance", balance or "none"]
    kw = dict(world_size=4, rank=0, seed=0, balance=balance)
    packed = PackedBatchSampler(L, window=2048, windows_per_batch=2, step_batches=8, **kw)
    grouped = LengthGroupedSampler(L, batch_size=3, step_batches=4, **kw)

    def steps(sampler):
        return sampler.schedule().step_row.size - 1

    assert main(["plan", str(path), "-w", "2048", "-b", "2", "-a", "2", "--ranks", "4", "--json", *policy]) == 0
    got = json.loads(capsys.readouterr().out)
    stats = packed.epoch_stats()
    assert (got["compute_imbalance"], got["examples_per_step_cv"], got["steps_per_epoch"]) == \
        (stats.compute_imbalance, stats.examples_per_step_cv, steps(packed))
    assert main(["waste", str(path), "-w", "2048", "-b", "3", "--windows-per-step", "2", "--world-size", "4",
                 "--strategies", "grouped,bfd", "--json", "-q", *policy]) == 0
    got = {s["name"]: s for s in json.loads(capsys.readouterr().out)["strategies"]}
    bfd = PackedBatchSampler(L, window=2048, windows_per_batch=2, **kw)
    for name, sampler in (("grouped", grouped), ("bfd", bfd)):
        stats = sampler.epoch_stats()
        print(name, balance, "imbalance printed", got[name]["compute_imbalance"], "dealt", stats.compute_imbalance)
        assert got[name]["compute_imbalance"] == pytest.approx(stats.compute_imbalance, abs=1e-6)
        assert got[name]["examples_per_step_cv"] == pytest.approx(stats.examples_per_step_cv, abs=1e-6)
        assert got[name]["steps"] == steps(sampler)
    assert got["bfd"]["rows"] == bfd.plan().num_windows


def test_cli_waste_ranks_and_plan_print_both_figures(tmp_path, capsys):
    """The two commands on a real file: waste --ranks and plan --ranks print both figures."""
    from packkit.cli import main

    path = tmp_path / "lengths.npy"
    np.save(path, heavy_tail(2000, 4, top=2048))
    assert main(["waste", str(path), "--ranks", "4", "-w", "2048", "--strategies", "random,bfd", "-q"]) == 0
    out = capsys.readouterr().out
    assert "on each of 4 ranks" in out and "imbalance" in out and "examples/step cv" in out
    assert main(["plan", str(path), "--ranks", "4", "-w", "2048"]) == 0
    out = capsys.readouterr().out
    assert "compute imbalance" in out and "slowest of 4 devices" in out and "examples per step cv" in out


def gemma3_4b_config():
    pytest.importorskip("transformers")
    return benchlib.gemma3_4b_config()


def vlm_lengths(n: int, window: int):
    """Real ShareGPT text lengths (Qwen3 tokenizer, the file's first ``n``) with Gemma 3's images
    (``benchlib.with_images``). ``(lengths, images)``."""
    return benchlib.with_images(np.load(benchlib.CHAT_LENGTHS)[:n], window)


def test_cost_model_weighs_an_images_encoder_work():
    """A vision-language config gives the text's per-token weight from its text config and one image's
    encoder work (projections and bidirectional attention over its patches, all layers) in units of the
    text's attention pairs: Gemma 3 4B's image is ~3.1e7, three times the text work of its 256 placeholders."""
    model = CostModel.from_config(gemma3_4b_config())
    h, f, p, layers = 1152, 4304, 64 * 64, 27
    assert model.linear == 2 * 2560 + 2 * 4 * 256 + 3 * 10240
    assert model.per_unit == pytest.approx(layers * (2 * (4 * h * h + 2 * h * f) * p + 4 * p * p * h) / (2 * 2560 * 34))
    print(f"per image {model.per_unit:.3e}, 258 placeholder tokens {model.costs([258])[0]:.3e}")
    assert 2.5 < model.per_unit / model.costs([258])[0] < 3.5
    assert model.costs([10, 20], units=[0, 2]).tolist() == (model.costs([10, 20]) + [0, 2 * model.per_unit]).tolist()
    assert cost_model(gemma3_4b_config()) == model  # what a sampler's cost=model.config becomes
    with pytest.raises(ValueError, match=r"per_unit must be a finite number >= 0"):
        CostModel(per_unit=-1.0)


@pytest.mark.parametrize("k", [8, 1])
def test_media_units_balance_what_the_encoder_costs(k):
    """Images in the cost: on VLM-like rows (real ShareGPT text plus 0-4 images) over 8 ranks, a compute-balanced
    deal (k = 8 windows a rank: LPT within the step; k = 1: windows packed to a cost target) that knows each
    example's images leaves a smaller imbalance of the true cost (encoder included), counted from the batches
    each rank yields, than the same deal by text cost alone; and epoch_stats reports that true figure."""
    config = gemma3_4b_config()
    model = CostModel.from_config(config)
    L, images = vlm_lengths(6000, 4096)
    kw = dict(window=4096, windows_per_batch=k, world_size=8, step_batches=8, seed=0, balance="compute", cost=config)
    figures = {}
    for name, units in (("text", None), ("media", images)):
        per_rank = [list(PackedBatchSampler(L, rank=r, media_units=units, **kw)) for r in range(8)]
        figures[name] = imbalance_from_batches(per_rank, L, 1, model, units=images)
        if units is not None:
            stats = PackedBatchSampler(L, rank=0, media_units=units, **kw).epoch_stats()
            assert stats.compute_imbalance == pytest.approx(figures[name])
    print(f"k={k}: true compute imbalance, text cost {figures['text']:.4f}, with images {figures['media']:.4f}")
    assert figures["media"] - 1 < 0.8 * (figures["text"] - 1)


def test_media_units_refused_where_they_would_weigh_nothing():
    L, images = vlm_lengths(200, 4096)
    config = gemma3_4b_config()
    with pytest.raises(ValueError, match=r"^media_units weigh only under balance='compute' with a cost model that "
                                         r"has per_unit \(got balance=None"):
        PackedBatchSampler(L, window=4096, world_size=1, media_units=images)
    with pytest.raises(ValueError, match=r"per_unit=0.0\): pass cost=model.config"):
        PackedBatchSampler(L, window=4096, world_size=1, balance="compute", cost=100.0, media_units=images)
    with pytest.raises(ValueError, match=r"^media_units has 3 entries for \d+ examples: pass one count per example"):
        PackedBatchSampler(L, window=4096, world_size=1, balance="compute", cost=config, media_units=[1, 0, 2])
    with pytest.raises(ValueError, match=r"^media_units\[1\] = -1 is negative: pass counts of 0 or more"):
        PackedBatchSampler(L[:3], window=4096, world_size=1, balance="compute", cost=config, media_units=[1, -1, 2])
