"""Prefix trees inside their real consumer: ``transformers.Trainer`` with its default arguments (a
``datasets.Dataset`` of turn-by-turn samples, ``remove_unused_columns=True``), ``TreeSFTMixin`` and a
``TreeCollator`` in a DataLoader with 2 worker processes, a tiny float64 Qwen3 from a config: the first step's
loss equals the unpacked computation (every sample alone through the model, the mean negative log-probability
of every sample's loss tokens) within 1e-10, with shared histories forwarded once.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from testlib import tiny_causal_lm  # noqa: E402

from packkit.prefixtree import TreeBatch, TreeCollator, TreeSFTMixin  # noqa: E402

pytestmark = pytest.mark.slow  # a real Trainer with DataLoader workers: make test runs it

VOCAB = 64


def turn_samples(seed: int = 0):
    """Samples as multi-turn SFT makes them: each assistant turn with the conversation before it (the loss on the
    turn), so each conversation's samples share their histories; 8 samples, one batch."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(3):
        history = rng.integers(0, VOCAB, 5).tolist()
        for _ in range(int(rng.integers(2, 4))):
            turn = rng.integers(0, VOCAB, int(rng.integers(2, 6))).tolist()
            rows.append({"input_ids": history + turn, "completion_mask": [0] * len(history) + [1] * len(turn)})
            history = history + turn + rng.integers(0, VOCAB, 3).tolist()  # the user's next message
    return rows[:8]


class Recording(TreeSFTMixin, transformers.Trainer):
    """Records every step's batch and loss."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        self.seen.append((inputs, float((loss[0] if return_outputs else loss).detach())))
        return loss


def unpacked_loss(model, rows, *, masked: bool = True) -> float:
    """Every sample alone: ``-mean`` of the log-probabilities of its loss tokens (after the first), all samples'."""
    terms = []
    with torch.no_grad():
        for r in rows:
            x = torch.tensor([r["input_ids"]])
            logp = model(input_ids=x).logits[0, :-1].log_softmax(-1).gather(1, x[0, 1:, None])[:, 0]
            keep = torch.tensor(r["completion_mask"][1:], dtype=torch.bool) if masked else slice(None)
            terms.append(logp[keep])
    return float(-torch.cat(terms).mean())


def test_trainer_with_default_arguments_trains_trees_as_unpacked(tmp_path):
    rows = turn_samples()
    model = tiny_causal_lm("qwen3", vocab_size=VOCAB)
    want = unpacked_loss(model, rows)
    unmasked = unpacked_loss(model, rows, masked=False)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, dataloader_num_workers=2,
                                          report_to="none")
    trainer = Recording(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                        data_collator=TreeCollator())
    trainer.train()
    batch, got = trainer.seen[0]
    assert isinstance(batch, TreeBatch)  # rebuilt by the Trainer and accelerate, still ours
    tokens = sum(len(r["input_ids"]) for r in rows)
    print(f"first step: loss {got:.15f} vs unpacked {want:.15f} (every token scored: {unmasked:.6f}); "
          f"{batch.num_real_tokens} nodes forwarded for {tokens} sample tokens")
    assert batch.num_sample_tokens == tokens and batch.num_real_tokens < tokens  # histories forwarded once
    assert abs(got - want) < 1e-10
    # the loss mask reached the collator (the Trainer's default drops columns its model's forward does not name)
    assert int(batch.score_target.numel()) == sum(sum(r["completion_mask"][1:]) for r in rows)
    assert abs(unmasked - want) > 1e-5


def unpacked_gradient(model, rows) -> dict:
    """The gradient of the unpacked token mean over ``rows`` (every sample alone through the model)."""
    model.zero_grad()
    terms = []
    for r in rows:
        x = torch.tensor([r["input_ids"]])
        logp = model(input_ids=x).logits[0, :-1].log_softmax(-1).gather(1, x[0, 1:, None])[:, 0]
        terms.append(logp[torch.tensor(r["completion_mask"][1:], dtype=torch.bool)])
    (-torch.cat(terms).mean()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def test_accumulated_step_is_the_unpacked_token_mean(tmp_path):
    """Regression: under gradient accumulation the mixin averaged the micro-batches' means (transformers then left
    the sum of two means undivided, or divided it by the steps), so the tokens of a small micro-batch weighed more than
    those of a large one, silently unlike unpacked SFT. Now the step's scored tokens are counted before the first
    forward (``Trainer``'s step count, overridden) and each micro-batch's sum is over that count: one SGD step of
    learning rate 1 moves every parameter by the unpacked token mean's gradient within 1e-10. Fails before."""
    rows = turn_samples(seed=3)
    model = tiny_causal_lm("qwen3", vocab_size=VOCAB)
    want = unpacked_gradient(model, rows)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=3,
                                          gradient_accumulation_steps=3, optim="sgd", learning_rate=1.0,
                                          lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
                                          dataloader_num_workers=2, report_to="none")
    trainer = Recording(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                        data_collator=TreeCollator())
    trainer.train()
    sizes = [int(b.score_target.numel()) for b, _ in trainer.seen]
    assert len(sizes) == 3 and len(set(sizes)) > 1, sizes  # micro-batches of unequal token counts
    err = max(float((before[n] - p.detach() - want[n]).abs().max()) for n, p in model.named_parameters() if n in want)
    print(f"scored tokens per micro-batch {sizes}: |step - unpacked token mean's gradient| {err:.1e}")
    assert err < 1e-10
