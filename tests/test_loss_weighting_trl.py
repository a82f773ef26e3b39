"""TRL's GRPO loss normalisations, run by TRL's own code, against packkit's weights over the optimiser step.

TRL's ``GRPOTrainer._compute_loss`` is called as it stands (a stand-in trainer carries the attributes it reads)
on every micro-batch of every rank of one step, completions with an empty mask (``mask_truncated_completions``)
among them. With the old log-probs equal to the new and every advantage -1 (one per token), each token's loss is
its importance ratio, 1, and the gradient of the step's loss (each rank's micro-batches summed, the ranks
averaged as DDP does) with respect to a token's log-prob is exactly the weight TRL gives that token. packkit's
weight is ``a_c / Z`` (``batch.loss_weight / step.loss_normalizer``) of the same completions collated as documents; the two
must agree within 1e-12 for every token (float64: the factors behind the float32 ``loss_weight``), empty completions included.
"""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from packkit.batch import loss_factors
from packkit.collate import PaddingFreeCollator
from packkit.loss import accumulation_step
from packkit.weighting import DrGRPO

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.skipif(
    not trl.__version__.startswith("1.16."),
    reason=f"the stand-in trainer carries what TRL 1.16's GRPOTrainer._compute_loss reads; TRL {trl.__version__} "
           "may read more: check trl/trainer/grpo_trainer.py and extend the stand-in")

IGNORE = -100
T = 6  # max_completion_length: every completion row is padded to it, as TRL pads its completions


def stand_in(loss_type, *, accumulation, ranks):
    """What ``_compute_loss`` reads of its trainer, nothing else: no model call (the log-probs come in), no KL, no
    entropy bonus, no vLLM correction; ``steps_per_generation`` = the accumulation (a generation batch is a step)."""
    acc = SimpleNamespace(num_processes=ranks, gather=lambda x: x, gather_for_metrics=lambda x: x,
                          reduce=lambda x, reduction="sum": x, sync_gradients=True)
    return SimpleNamespace(
        loss_type=loss_type, max_completion_length=T, current_gradient_accumulation_steps=accumulation,
        accelerator=acc, model=SimpleNamespace(training=True), top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, importance_sampling_level="token", beta=0.0, epsilon_low=0.2,
        epsilon_high=0.2, use_vllm=False, aux_loss_enabled=False, _entropy_bonus_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        args=SimpleNamespace(delta=None, steps_per_generation=accumulation))


def micro_batch(lengths, logps, step_loss_tokens):
    """TRL's inputs for completions of ``lengths`` loss tokens (0: an empty mask) and their log-probs."""
    mask = torch.tensor([[1] * n + [0] * (T - n) for n in lengths])
    return {"prompt_ids": torch.zeros(len(lengths), 1, dtype=torch.long),
            "prompt_mask": torch.ones(len(lengths), 1, dtype=torch.long),
            "completion_ids": torch.ones(len(lengths), T, dtype=torch.long), "completion_mask": mask,
            "advantages": -torch.ones(len(lengths), T, dtype=torch.float64),
            "num_items_in_batch": torch.tensor(float(step_loss_tokens))}, logps


def trl_weights(loss_type, step, *, ranks):
    """``step[r][g]``: the completions' loss-token counts of rank r's micro-batch g. TRL's weight of every loss
    token of the step, in order (rank, micro-batch, completion, token), and the step's loss."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    accumulation = len(step[0])
    tokens = sum(sum(map(sum, rank)) for rank in step)
    trainer = stand_in(loss_type, accumulation=accumulation, ranks=ranks)
    logps, total = [], 0
    for rank in step:
        for lengths in rank:
            leaf = torch.zeros(len(lengths), T, dtype=torch.float64, requires_grad=True)
            inputs, _ = micro_batch(lengths, leaf, tokens)
            trainer._get_per_token_logps_and_entropies = lambda *a, _x=leaf, **k: (_x, torch.zeros_like(_x), None)
            total = total + GRPOTrainer._compute_loss(trainer, None, inputs) / ranks  # DDP averages the ranks
            logps.append((leaf, inputs["completion_mask"].bool()))
    total.backward()
    return torch.cat([leaf.grad[mask] for leaf, mask in logps]), float(total.detach())


def packkit_weights(mode, step):
    """The same completions as documents (a one-token prompt, then the completion's loss tokens; an empty mask
    leaves the completion's tokens -100), each micro-batch of each rank collated, one accumulation_step over all
    of them: ``loss_weight / Z`` of every loss token, in the same order."""
    coll = PaddingFreeCollator(loss_weighting=mode)
    mbs = []
    for rank in step:
        for lengths in rank:
            mbs.append(coll([{"input_ids": [7] * (1 + max(n, 1)), "labels": [IGNORE] + ([5] * n or [IGNORE])}
                             for n in lengths]))
    z = accumulation_step(mbs, all_reduce=False).loss_normalizer
    factors = [loss_factors(mb["labels"]) for mb in mbs]  # float64 a_c; None under the token mean (a_c = 1)
    return torch.cat([(mb.labels.ne(IGNORE).double() if f is None else f[0])[mb.labels != IGNORE] / z
                      for mb, f in zip(mbs, factors)])


#: 2 ranks x 2 micro-batches of 3 completions each (TRL's micro-batches are equal), empty masks among them
STEP = [[[3, 0, 5], [1, 6, 0]], [[0, 0, 2], [4, 2, 6]]]


@pytest.mark.parametrize("loss_type, mode", [("grpo", "grpo"), ("dr_grpo", DrGRPO(T)), ("dapo", "dapo")])
def test_trl_loss_types_equal_packkit_over_the_step(loss_type, mode):
    """Every token of 12 completions (4 with an empty mask) on 2 ranks x 2 micro-batches: TRL's weight equals
    packkit's within 1e-12. Before, packkit left the empty completions out of |B| under "grpo" and DrGRPO:
    8 completions against TRL's 12, each weight 12/8 = 1.5 times TRL's."""
    want, _ = trl_weights(loss_type, STEP, ranks=2)
    got = packkit_weights(mode, STEP)
    err = float((got - want).abs().max())
    print(f"{loss_type}: {want.numel()} tokens, TRL sum of weights {float(want.sum()):.6f}, packkit "
          f"{float(got.sum()):.6f}, max |d| {err:.1e}")
    assert got.shape == want.shape and torch.isfinite(got).all() and err <= 1e-12


def test_a_step_of_empty_completions_weighs_nothing_and_no_nan():
    """Every completion of the step masked (all truncated): TRL's loss is 0; packkit's weights are all 0, Z is
    the count of completions (TRL's size(0)), and nothing is NaN."""
    step = [[[0, 0]], [[0, 0]]]
    for mode in ("grpo", DrGRPO(T)):
        mbs = [PaddingFreeCollator(loss_weighting=mode)([{"input_ids": [7, 7], "labels": [IGNORE, IGNORE]}] * 2)
               for _ in range(2)]
        s = accumulation_step(mbs, all_reduce=False)
        assert s.loss_normalizer == 4 * (1 if mode == "grpo" else T)
        assert all(float(mb.loss_weight.abs().sum()) == 0 and torch.isfinite(mb.loss_weight).all() for mb in mbs)
    for loss_type in ("grpo", "dr_grpo"):
        weights, loss = trl_weights(loss_type, step, ranks=2)
        assert weights.numel() == 0 and loss == 0.0


def test_an_example_the_collator_drops_is_no_completion():
    """``overflow="drop"`` leaves an example out of the batch: it is no completion of the step, so it is not in
    TRL's ``|B|`` (the empty completion beside it is). Z = 2 (the kept one and the empty one), not 3."""
    from packkit.collate import FixedWindowCollator

    docs = [{"input_ids": [1] * 9, "labels": [1] * 9}, {"input_ids": [2, 3], "labels": [2, 3]},
            {"input_ids": [4, 5], "labels": [IGNORE, IGNORE]}]
    for mode, z in (("grpo", 2.0), (DrGRPO(T), 2.0 * T)):
        batch = FixedWindowCollator(window=4, overflow="drop", loss_weighting=mode)(docs)
        assert batch.loss_norm == z and float(batch.loss_weight.sum()) == 1.0
