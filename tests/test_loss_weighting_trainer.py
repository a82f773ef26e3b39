"""Loss weightings through their real consumers: ``transformers.Trainer`` with ``compute_loss_func`` (default
arguments: one micro-batch a step), and ``WeightedLossMixin`` over three accumulated micro-batches collated
in DataLoader workers. The step's gradient equals the unpacked reference definition's (float64)."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # real Trainer runs

from testlib import tiny_causal_lm  # noqa: E402
from test_loss_weighting import IGNORE, L_MAX, reference_loss  # noqa: E402

from packkit.collate import PaddingFreeCollator  # noqa: E402
from packkit.loss import WeightedLossMixin, hf_compute_loss_func  # noqa: E402
from packkit.weighting import DrGRPO  # noqa: E402

VOCAB = 64


class Logits(torch.nn.Module):
    """The HF model as ``ids -> logits`` for the reference (one unpacked document at a time)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


class Grads(transformers.TrainerCallback):
    """The gradient of the one optimiser step, taken just before the optimiser applies it."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grad = torch.cat([p.grad.flatten().clone() for p in model.parameters() if p.grad is not None])


class WeightedTrainer(WeightedLossMixin, transformers.Trainer):
    pass


def documents(n, seed):
    g = torch.Generator().manual_seed(seed)
    docs = []
    for i, length in enumerate(torch.randint(2, 24, (n,), generator=g).tolist()):
        ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        prompt = length if i == 1 else length // 3  # document 1 has no loss token
        docs.append({"input_ids": ids, "labels": [IGNORE] * prompt + ids[prompt:]})
    return docs


def run(tmp_path, trainer_cls, docs, mode, **args):
    model = tiny_causal_lm(dtype=torch.float64, vocab_size=VOCAB)
    start = copy.deepcopy(model)
    grads = Grads()
    targs = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1,
                                           max_grad_norm=0.0, save_strategy="no", disable_tqdm=True, **args)
    trainer = trainer_cls(model=model, args=targs, train_dataset=docs, callbacks=[grads],
                          data_collator=PaddingFreeCollator(loss_weighting=mode), compute_loss_func=hf_compute_loss_func)
    trainer.train()
    ref = Logits(start)
    reference_loss(ref, docs, mode).backward()
    want = torch.cat([p.grad.flatten() for p in start.parameters() if p.grad is not None])
    err = float((grads.grad - want).abs().max())
    print(f"{mode}: max |grad - reference| {err:.1e} (max |grad| {float(want.abs().max()):.1e})")
    return err


def test_default_trainer_with_compute_loss_func(tmp_path):
    """Default TrainingArguments (8 examples a device, no accumulation; no clipping so the gradient is read
    unchanged): the per-sample mean over the step's 8 documents, not the token mean."""
    docs = documents(8, 0)
    assert run(tmp_path, transformers.Trainer, docs, "sample") < 1e-12


def test_mixin_accumulates_over_dataloader_workers(tmp_path):
    """Three micro-batches of two documents, collated in 2 DataLoader workers (the weights cross processes
    on the labels), Dr. GRPO's normaliser counted once over the step by WeightedLossMixin."""
    docs = documents(6, 1)
    err = run(tmp_path, WeightedTrainer, docs, DrGRPO(L_MAX), per_device_train_batch_size=2,
              gradient_accumulation_steps=3, dataloader_num_workers=2)
    assert err < 1e-12


def test_plain_trainer_refuses_a_weighting_over_accumulation(tmp_path):
    """Without the mixin, a step of several micro-batches cannot know Z: one line says so, naming the mixin."""
    with pytest.raises(ValueError, match="WeightedLossMixin"):
        run(tmp_path, transformers.Trainer, documents(6, 1), "sample", per_device_train_batch_size=2,
            gradient_accumulation_steps=3)
