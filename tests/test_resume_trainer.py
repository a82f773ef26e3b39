"""transformers.Trainer with packkit's batch sampler, stopped at a random optimiser step and resumed with
``resume_from_checkpoint``: Trainer replays the epoch from the sampler's seed and skips the batches done
(accelerate's ``skip_first_batches``), so every example is trained once.

The examples trained are read where the model sees them (``compute_loss``), not at collate time: Trainer
and accelerate fetch batches ahead of the step that trains them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from testlib import thorough, tiny_causal_lm
from torch.utils.data import DataLoader

transformers = pytest.importorskip("transformers")

from packkit.collate import FixedWindowCollator  # noqa: E402
from packkit.sampler import PackedBatchSampler  # noqa: E402

N, W, K = 32, 64, 2
LENGTHS = np.random.default_rng(0).integers(4, 60, size=N)


def rows():
    rng = np.random.default_rng(1)
    return [{"input_ids": rng.integers(3, 100, int(n)).tolist(), "idx": i} for i, n in enumerate(LENGTHS)]


class Recording:
    """The collator, keeping each batch's example indices in the batch (``example_ids``)."""

    def __init__(self):
        self.inner = FixedWindowCollator(window=W, strategy="next_fit", num_windows=K, loss_mask="none")

    def __call__(self, items):
        batch = self.inner([{"input_ids": x["input_ids"]} for x in items])
        batch["example_ids"] = torch.tensor([x["idx"] for x in items])
        return batch


def make_trainer(out, sampler, seen: list, **args):
    class PackedTrainer(transformers.Trainer):
        def get_train_dataloader(self):
            return self.accelerator.prepare(DataLoader(self.train_dataset, batch_sampler=sampler,
                                                       collate_fn=self.data_collator))

        def compute_loss(self, model, inputs, *a, **kw):
            seen.append(inputs.pop("example_ids").tolist())
            return super().compute_loss(model, inputs, *a, **kw)

    targs = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=1, num_train_epochs=2, gradient_accumulation_steps=2,
        learning_rate=1e-3, save_strategy="no", report_to=[], use_cpu=True, logging_strategy="no",
        disable_tqdm=True, remove_unused_columns=False, seed=0, **args)
    return PackedTrainer(model=tiny_causal_lm(dtype=torch.float32, max_position_embeddings=W), args=targs,
                         train_dataset=rows(), data_collator=Recording())


class StopAt(transformers.TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_save = True
            control.should_training_stop = True


def sampler():
    return PackedBatchSampler(LENGTHS, window=W, windows_per_batch=K, seed=3)


@pytest.mark.slow  # three Trainer runs a stop point
def test_trainer_resume_from_checkpoint_trains_every_example_once(tmp_path):
    full = []
    make_trainer(tmp_path / "full", sampler(), full).train()
    per_epoch = sampler().batches_per_epoch
    assert sorted(i for b in full for i in b) == sorted(list(range(N)) * 2)  # two epochs, each example once
    rng = np.random.default_rng(0)
    steps = -(-per_epoch // 2) * 2  # optimiser steps of 2 micro-batches, over two epochs
    points = 20 if thorough() else 1
    for point in range(points):
        stop = int(rng.integers(1, steps)) if point else per_epoch // 2 + 1  # ci: a stop in the second epoch
        out = tmp_path / f"run{point}"
        head, rest = [], []
        first = make_trainer(out, sampler(), head)
        first.add_callback(StopAt(stop))
        first.train()
        again = make_trainer(out, sampler(), rest)
        again.train(resume_from_checkpoint=str(out / f"checkpoint-{stop}"))
        assert head + rest == full, (stop, len(head), len(rest), len(full))
