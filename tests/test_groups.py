"""Atoms: ``pack(..., groups=)`` keeps a group (a preference pair, a prompt's k completions)
in one window, members adjacent and in example order, through the planner, ``PackedBatchSampler`` across ranks
and ``FixedWindowCollator(group_key=)`` inside a DataLoader with workers.

The reference for "no atom split" is a nested loop over the plan's windows in this file.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from packkit.binpack import STRATEGIES, as_groups, lower_bound, pack
from packkit.collate import FixedWindowCollator
from packkit.errors import ArgumentError, DataError
from packkit.sampler import PackedBatchSampler


def check_atoms(plan, lengths, member_of: dict, *, whole=True):
    """Nested-loop reference: every example exactly once; capacity; each group's members in one window,
    adjacent and in example order (``whole``); ``seg_group`` names each segment's group."""
    seen = []
    where = {}
    for w in range(plan.num_windows):
        ex, start, length = plan.segments(w)
        assert int(length.sum()) <= plan.window
        assert (start == 0).all() and (length == np.asarray(lengths)[ex]).all()
        seen += ex.tolist()
        lo = int(plan.window_ptr[w])
        for k, e in enumerate(ex.tolist()):
            g = int(plan.seg_group[lo + k])
            assert e in member_of[g]
            where.setdefault(g, []).append((w, lo + k, e))
    if whole:
        for g, places in where.items():
            assert len({w for w, _, _ in places}) == 1, f"group {g} split across windows {places}"
            pos = [p for _, p, _ in places]
            assert pos == list(range(pos[0], pos[0] + len(pos))), f"group {g} not adjacent"
            assert [e for _, _, e in places] == sorted(member_of[g])
    return seen


def groups_of(ids):
    member, ptr = as_groups(len(ids), groups=ids)
    return {g: member[ptr[g]:ptr[g + 1]].tolist() for g in range(ptr.size - 1)}


@st.composite
def grouped(draw):
    window = draw(st.sampled_from([1, 2, 7, 16, 97]))
    n = draw(st.integers(0, 40))
    lengths = draw(st.lists(st.integers(1, window), min_size=n, max_size=n))
    ids = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    return lengths, ids, window


@given(grouped(), st.sampled_from(STRATEGIES), st.sampled_from(["error", "split", "drop"]))
@example(([3, 5, 4, 4], [0, 0, 1, 1], 8), "bfd", "error")
@example(([8, 1, 8], [0, 0, 1], 8), "next_fit", "split")
@example(([8, 1, 8], [0, 0, 1], 8), "ffd", "drop")
def test_no_atom_split_tokens_conserved(case, strategy, overflow):
    lengths, ids, window = case
    member_of = groups_of(ids)
    glen = {g: sum(lengths[i] for i in m) for g, m in member_of.items()}
    over = sorted(g for g, n in glen.items() if n > window)
    if over and overflow == "error":
        with pytest.raises(DataError, match=f"group {over[0]} .* > window={window}"):
            pack(lengths, window=window, strategy=strategy, groups=ids)
        return
    plan = pack(lengths, window=window, strategy=strategy, overflow=overflow, groups=ids, seed=3)
    assert plan.num_groups == len(member_of)
    assert plan.overflow_groups.tolist() == over
    seen = check_atoms(plan, lengths, member_of, whole=overflow != "split")
    dropped = sorted(i for g in over for i in member_of[g]) if overflow == "drop" else []
    assert sorted(seen) == sorted(set(range(len(lengths))) - set(dropped))  # each kept example exactly once
    assert plan.dropped_examples.tolist() == dropped
    assert plan.cut_tokens == sum(lengths[i] for i in dropped)
    if overflow == "split":  # only the over-long groups are cut, between examples, in order
        by_group = {}
        for w in range(plan.num_windows):
            lo, hi = plan.window_ptr[w], plan.window_ptr[w + 1]
            for g in set(plan.seg_group[lo:hi].tolist()):
                by_group.setdefault(g, []).append(w)
        for g, ws in by_group.items():
            assert len(ws) == 1 or g in over
    kept = sum(lengths) - plan.cut_tokens
    assert plan.total_tokens == kept
    assert plan.num_windows >= -(-kept // window)
    assert plan.ungrouped_windows >= -(-kept // window)
    assert plan.summary()["group_cost_windows"] == plan.num_windows - plan.ungrouped_windows
    # a shuffled and a selected plan keep seg_group aligned with the segments
    check_atoms(plan.shuffled(1), lengths, member_of, whole=overflow != "split")


def test_group_sizes_and_ids_agree_and_errors_name_the_fix():
    lengths = [3, 4, 2, 2, 5, 1]
    a = pack(lengths, window=8, group_sizes=[2, 2, 2])
    b = pack(lengths, window=8, groups=["x", "x", "y", "y", "z", "z"])
    assert [w.tolist() for w in a.windows()] == [w.tolist() for w in b.windows()]
    assert a.seg_group.tolist() == b.seg_group.tolist()
    with pytest.raises(ArgumentError, match="pass one of groups"):
        pack(lengths, window=8, groups=[0] * 6, group_sizes=[6])
    with pytest.raises(ArgumentError, match="group_sizes sum to 5 examples, but there are 6"):
        pack(lengths, window=8, group_sizes=[2, 3])
    with pytest.raises(ArgumentError, match="groups has 2 ids for 6 examples"):
        pack(lengths, window=8, groups=[0, 1])
    with pytest.raises(TypeError, match="group ids"):
        pack(lengths, window=8, groups=[0.5] * 6)
    with pytest.raises(ArgumentError, match="overflow='truncate' would cut one sequence of a group"):
        pack(lengths, window=8, groups=[0] * 6, overflow="truncate")
    with pytest.raises(DataError, match=r"example 1 \(group 0\) has 9 tokens > window=8: one sequence"):
        pack([1, 9, 2], window=8, groups=[0, 0, 1], overflow="split")
    with pytest.raises(DataError, match=r"group 1 \(examples 2, 3\) has 9 tokens > window=8; pass overflow='split'"):
        pack([1, 1, 4, 5], window=8, group_sizes=[2, 2])


def test_fill_cost_is_reported_against_the_ungrouped_plan():
    """Pairs that cannot share windows without splitting: the plan says what keeping them whole cost."""
    lengths = [5, 5, 3, 3] * 4  # pairs of 10 and 6 tokens; alone, 5+3 fill a window of 8 exactly
    plan = pack(lengths, window=10, group_sizes=[2] * 8)
    assert plan.ungrouped_windows == lower_bound(lengths, window=10) == 7
    assert plan.num_windows == 8 and plan.summary()["group_cost_windows"] == 1
    assert "groups=8, ungrouped_windows=7" in repr(plan)


def test_preference_like_fill_is_near_the_lower_bound():
    """UltraFeedback-like pairs (prompt ~ 160, completions ~ 280 tokens, long tails) in 4,096-token windows:
    best fit over pair atoms lands within 1% of the lower bound."""
    rng = np.random.default_rng(0)
    n = 4000
    prompt = np.minimum(rng.lognormal(4.6, 0.9, n).astype(int) + 8, 1500)
    chosen = np.minimum(rng.lognormal(5.3, 0.8, n).astype(int) + 4, 1500)
    rejected = np.minimum(rng.lognormal(5.3, 0.8, n).astype(int) + 4, 1500)
    lengths = np.stack([prompt + chosen, prompt + rejected], 1).reshape(-1)
    plan = pack(lengths, window=4096, group_sizes=np.full(n, 2))
    assert plan.lower_bound / plan.num_windows >= 0.99, plan.summary()


# ----------------------------------------------------------------------------------------------
# through the sampler (ranks) and the collator (DataLoader with workers)
# ----------------------------------------------------------------------------------------------


def test_sampler_keeps_groups_on_one_rank_and_every_rank_gets_work():
    """TRL PR #7328's rank starvation: a micro-batch with fewer groups than ranks. Here a step gives each rank
    whole windows, each holding at least one whole group, so no rank is left without work (the tail repeats
    the fewest windows, counted), and a group never spans two ranks or steps."""
    rng = np.random.default_rng(1)
    k = 4  # completions per prompt
    n_prompts = 13
    lengths = rng.integers(5, 60, n_prompts * k)
    ids = np.repeat(np.arange(n_prompts), k)
    for R in (1, 3, 8):
        owner = {}
        for r in range(R):
            s = PackedBatchSampler(lengths, window=256, windows_per_batch=1, rank=r, world_size=R, seed=2,
                                   group_sizes=np.full(n_prompts, k))
            batches = list(s)
            assert batches and all(batches), f"rank {r} of {R} got an empty step"
            for step, b in enumerate(batches):
                for g in set(ids[b].tolist()):
                    members = [i for i in b if ids[i] == g]
                    assert members == list(range(g * k, g * k + k))  # whole, adjacent, in order
                    owner.setdefault(g, set()).add((r, step))
        assert set(owner) == set(range(n_prompts))
        multi = [g for g, places in owner.items() if len(places) > 1]
        assert len(multi) * k <= s.epoch_stats().repeated  # a group shows up twice only as a counted repeat


def test_sampler_state_changes_with_groups():
    lengths = [3, 4, 2, 2]
    a = PackedBatchSampler(lengths, window=8, group_sizes=[2, 2], world_size=1, rank=0)
    b = PackedBatchSampler(lengths, window=8, group_sizes=[1, 3], world_size=1, rank=0)
    assert a.state_dict()["fingerprint"] != b.state_dict()["fingerprint"]


def test_collator_group_key_with_sampler_and_workers():
    """PackedBatchSampler(groups) -> DataLoader(num_workers=2) -> FixedWindowCollator(group_key, next_fit): each
    window of each batch holds whole groups, the batch never needs more rows than the sampler's windows."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    n = 40
    lengths = rng.integers(3, 30, n)
    gid = np.repeat(np.arange(n // 2), 2)
    data = [{"input_ids": rng.integers(3, 50, L).tolist(), "pair": int(g)} for L, g in zip(lengths, gid)]
    sampler = PackedBatchSampler(lengths, window=64, windows_per_batch=2, groups=gid, seed=0, world_size=1, rank=0)
    collate = FixedWindowCollator(window=64, strategy="next_fit", num_windows=2, group_key="pair", loss_mask="none")
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, collate_fn=collate, num_workers=2)
    seen = 0
    for batch, idx in zip(loader, iter(sampler)):
        cu = batch.cu_seqlens.tolist()
        starts = set(cu[:-1])
        flat = batch.input_ids.reshape(-1).tolist()
        at = {}
        for i in idx:  # each example is a segment; find it, check its partner sits right after it in the row
            ids = data[i]["input_ids"]
            for s in starts:
                if flat[s: s + len(ids)] == ids and s + len(ids) in set(cu):
                    at[i] = s
                    break
        for g in set(gid[idx].tolist()):
            a, b = [i for i in idx if gid[i] == g]
            assert at[a] + len(data[a]["input_ids"]) == at[b]
            assert at[a] // 64 == (at[b] + len(data[b]["input_ids"]) - 1) // 64  # one row
        seen += len(idx)
    assert seen == n
    with pytest.raises(ValueError, match="example 1 has no group id under 'pair'"):
        collate([{"input_ids": [1], "pair": 0}, {"input_ids": [2]}])


def test_pack_dataset_keeps_groups_whole(tmp_path):
    """Offline packing (a real Arrow file on disk, memory-mapped): the rows of one group share a packed row,
    adjacent and in order; a group longer than the window is named; a stream is refused."""
    datasets = pytest.importorskip("datasets")
    from packkit.offline import pack_dataset

    rng = np.random.default_rng(4)
    n = 60
    gid = np.repeat(np.arange(n // 3), 3)  # a prompt's 3 completions
    rows = [{"input_ids": rng.integers(3, 50, int(rng.integers(2, 20))).tolist(), "prompt": f"p{g}"}
            for g in gid]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    ds = datasets.load_from_disk(str(tmp_path / "ds"))
    out, plan = pack_dataset(ds, window=64, group_column="prompt", example_ids=True, return_report=True)
    assert plan.num_groups == n // 3 and plan.summary()["group_cost_windows"] >= 0
    seen = []
    for row in out:
        ids = row["example_ids"]
        for g in set(gid[ids].tolist()):
            at = [k for k, i in enumerate(ids) if gid[i] == g]
            assert [ids[k] for k in at] == [3 * g, 3 * g + 1, 3 * g + 2] and at == list(range(at[0], at[0] + 3))
        seen += ids
        assert sum(row["seq_lengths"]) == len(row["input_ids"]) <= 64
    assert sorted(seen) == list(range(n))
    short = ds.select(range(3)).map(lambda r: {"input_ids": r["input_ids"][:2]})  # a group of 6 tokens
    with pytest.raises(DataError, match=r"group 0 \(examples 0, 1, 2\) has 6 tokens > window=5"):
        pack_dataset(short, window=5, group_column="prompt", overflow="error")
    with pytest.raises(ArgumentError, match="group_column needs the whole dataset"):
        pack_dataset(ds.to_iterable_dataset(), window=64, group_column="prompt")
