"""Drop-in: PaddingFreeCollator as ``data_collator`` of a real ``transformers.Trainer`` (CPU, tiny random
model, three steps) gives the losses and weights of the same three steps run by hand."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # a real Trainer run: make test runs it, make test-fast does not

from testlib import tiny_causal_lm  # noqa: E402

from packkit.batch import PackedBatch  # noqa: E402
from packkit.collate import PaddingFreeCollator  # noqa: E402


class Recording(PaddingFreeCollator):
    """The collator, recording every batch it makes (num_workers=0: it runs in this process)."""

    def __init__(self):
        super().__init__()
        self.batches = []

    def __call__(self, examples):
        batch = super().__call__(examples)
        self.batches.append(batch)
        return batch


def test_trainer_matches_steps_by_hand(tmp_path):
    model = tiny_causal_lm(dtype=torch.float32, vocab_size=64)
    start = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    data = []
    for n in torch.randint(3, 20, (12,), generator=g).tolist():
        ids = torch.randint(0, 64, (n,), generator=g).tolist()
        data.append({"input_ids": ids, "labels": [-100] * (n // 2) + ids[n // 2:]})
    collator = Recording()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", max_steps=3,
        per_device_train_batch_size=4, learning_rate=1e-2, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=0.0, logging_steps=1, remove_unused_columns=False,
        dataloader_num_workers=0, seed=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collator)
    trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(collator.batches) == 3 and all(isinstance(b, PackedBatch) for b in collator.batches)

    # the same three steps by hand: AdamW (Trainer's default, same hyper-parameters), mean token loss
    start.train()
    opt = torch.optim.AdamW(start.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    by_hand = []
    for batch in collator.batches:
        loss = start(**batch).loss
        # the model's mean equals the summed token loss over the batch's loss-token count
        by_hand.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    print("trainer", logged, "by hand", by_hand)
    assert len(logged) == 3
    for a, b in zip(logged, by_hand):
        assert abs(a - b) < 1e-5
    diff = max((p - q).abs().max().item() for p, q in zip(trainer.model.parameters(), start.parameters()))
    print(f"weights after 3 steps: max abs diff {diff:.3e}")
    assert diff < 1e-5
