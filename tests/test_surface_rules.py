"""Issue 28: the rules of :mod:`packkit.rules` on the surfaces added after the SFT paths: lengths (``pack``,
``waste``, ``shard_groups``), cost models, CP ``restore``, preference pairs and RL groups. One fault a test,
each failing on the code before the fix (the old behaviour is in the docstring), through the public API and,
where one exists, its real consumer (the command line, a DataLoader with workers, TRL's DPOTrainer); every test
reads the message, which names the example (or group, part, option) and the fix, in one line.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from packkit.balance import CostModel, compute_imbalance, cost_model
from packkit.binpack import pack
from packkit.collate import PaddingFreeCollator
from packkit.cp import restore, shard
from packkit.errors import ArgumentError
from packkit.preference import shard_groups
from packkit.sampler import PackedBatchSampler
from packkit.waste import measure_waste


def one_line(exc) -> str:
    msg = str(exc.value if hasattr(exc, "value") else exc)
    assert "\n" not in msg, msg
    return msg


# ----------------------------------------------------------------------------------------------
# lengths: values past int64, NaN, fractions
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lengths, shown", [
    (np.array([3, 2**64 - 1, 5], np.uint64), "18446744073709551615 (uint64)"),
    ([3, 2**64 - 1, 5], "18446744073709551615 (int)"),
    ([3, 2**70, 5], "1180591620717411303424 (int)"),
    (np.array([3.0, 1e20, 5.0]), "1e+20 (float64)"),
])
def test_a_length_past_int64_is_named_as_given_not_as_minus_one(lengths, shown):
    """Before: ``example 1 has length -1`` (uint64 cast to int64), or a large negative for 1e20."""
    for call in (lambda: pack(lengths, window=8), lambda: measure_waste(lengths, window=8)):
        with pytest.raises(ValueError) as info:
            call()
        assert one_line(info).startswith(f"example 1 has length {shown} in lengths, beyond int64"), str(info.value)


def test_a_uint64_length_file_through_the_command_line(tmp_path, capsys):
    from packkit.cli import main

    path = tmp_path / "lengths.npy"
    np.save(path, np.array([3, 2**64 - 1, 5], np.uint64))
    for command in (["waste", str(path)], ["plan", str(path), "-w", "8"]):
        assert main(command) == 3
        err = capsys.readouterr().err.strip()
        assert f"example 1 has length 18446744073709551615 (uint64) in lengths in {path.name}, beyond int64" in err
        assert "-1" not in err.replace("2**63 - 1", "") and len(err.splitlines()) == 1


@pytest.mark.parametrize("tokens, words", [
    ([3, float("nan")], "group_tokens[1] = nan is not a whole number of tokens; pass integer token counts"),
    ([3, float("inf")], "group_tokens[1] = inf is not a whole number of tokens"),
    ([3, 2.5], "group_tokens[1] = 2.5 is not a whole number of tokens"),
    ([3, 0], "group 1 has length 0: every group needs at least 1 token"),
    (np.array([3, 2**64 - 1], np.uint64), "group 1 has length 18446744073709551615 (uint64) in group_tokens, beyond"),
])
def test_shard_groups_reads_group_tokens_by_the_length_rule(tokens, words):
    """Before: NaN and inf raised numpy's 'cannot convert float NaN to integer' (naming no group), 2.5 became 2."""
    with pytest.raises(ValueError) as info:
        shard_groups(tokens, world_size=1, max_tokens=8)
    assert words in one_line(info)
    assert [m.tolist() for m in shard_groups([3.0, 2.0], world_size=1, max_tokens=8)[0]] == [[0, 1]]


# ----------------------------------------------------------------------------------------------
# cost models
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("linear", [float("inf"), float("-inf"), float("nan"), 0.0, -1])
def test_cost_must_be_a_finite_positive_weight(linear):
    """Before: cost=inf was accepted, and a balanced sampler then reported its imbalance as 1.0 (perfect)."""
    want = f"cost must be a finite positive number (the per-token weight), got {linear!r}"
    for call in (lambda: CostModel(linear=linear), lambda: cost_model(linear),
                 lambda: PackedBatchSampler([5, 3, 4, 2] * 8, window=8, world_size=2, rank=0, balance="compute",
                                            cost=linear)):
        with pytest.raises(ArgumentError) as info:
            call()
        assert one_line(info) == want


def test_compute_imbalance_refuses_a_cost_that_is_not_finite():
    """Before: ``[[nan, 1]]`` gave 1.0 (NaN compares False), ``[[inf, inf]]`` NaN."""
    for bad, at in (([[1.0, 2.0], [np.nan, 1.0]], "rank_cost[1, 0] = nan"), ([[np.inf, np.inf]], "rank_cost[0, 0] = inf"),
                    ([[1.0, -2.0]], "rank_cost[0, 1] = -2.0")):
        with pytest.raises(ValueError) as info:
            compute_imbalance(bad)
        assert one_line(info).startswith(at + ": a rank's cost is a finite number >= 0")
    assert compute_imbalance([[3, 1], [2, 2]]) == 1.25


# ----------------------------------------------------------------------------------------------
# CP restore: any array of the ranks' outputs
# ----------------------------------------------------------------------------------------------


def test_restore_takes_numpy_arrays_and_lists_and_names_a_bad_part():
    """Before: numpy arrays and lists raised ``AttributeError: 'numpy.ndarray' object has no attribute 'dim'``."""
    batch = PaddingFreeCollator(loss_mask="none")([{"input_ids": [1, 2, 3, 4, 5]}, {"input_ids": [6, 7, 8]}])
    shards = [shard(batch, cp_size=2, rank=r, layout="zigzag") for r in range(2)]
    plan = shards[0].plan
    want = batch.input_ids.reshape(-1)
    for parts in ([s.input_ids.numpy() for s in shards], [s.input_ids.tolist() for s in shards],
                  [s.input_ids[0].tolist() for s in shards], np.stack([s.input_ids[0].numpy() for s in shards]),
                  tuple(s.input_ids for s in shards)):
        assert torch.equal(restore(parts, plan=plan), want)
    ids = [s.input_ids for s in shards]
    n = plan.local_len
    for parts, words in (
            ([ids[0], ids[1][:, :-1]], f"restore: part 1 (rank 1) has shape (1, {n - 1}); every part holds the rank's "
                                       f"local_len={n} tokens"),
            ([ids[0].numpy(), [["a"] * n]], "restore: part 1 (rank 1) is a list of <U1 values, not numbers"),
            ([ids[0], [[1, 2], [3]]], "restore: part 1 (rank 1) is a list of object values, not numbers"),
            ([ids[0], ids[1].float()], f"restore: part 1 (rank 1) is ({n},) torch.float32 and part 0 ({n},) torch.int64"),
            (3, "restore takes a list of 2 parts (one per rank, in rank order), got int"),
            ([ids[0]], "restore needs one part per rank (2), got 1")):
        with pytest.raises((TypeError, ValueError)) as info:
            restore(parts, plan=plan)
        assert one_line(info).startswith(words), str(info.value)
