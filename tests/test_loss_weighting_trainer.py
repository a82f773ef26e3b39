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


# -- a packkit sampler that plans the steps: WeightedLossMixin divides by its Z, no collective -----------------


class Steps(transformers.TrainerCallback):
    """Every optimiser step's gradient, taken just before the optimiser applies it (learning rate 0: the model
    stays where it started, so each step is compared with the reference at the same weights)."""

    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append(torch.cat([p.grad.flatten().clone() for p in model.parameters() if p.grad is not None]))


class StopAt(transformers.TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = True
            control.should_training_stop = True


def planned(examples, mode):
    import numpy as np

    from packkit.sampler import PackedBatchSampler

    lengths = np.array([len(e["input_ids"]) for e in examples])
    loss = np.array([sum(x != IGNORE for x in e["labels"][1:]) for e in examples])
    return PackedBatchSampler(lengths, window=64, seed=3, step_batches=3, loss_weighting=mode, loss_lengths=loss)


def planned_trainer(out, examples, mode, steps, *, loader=None, **args):
    """``WeightedTrainer`` (default ``TrainingArguments`` but for the loop's length and a learning rate of 0)
    whose training loader draws from a packkit sampler given the weighting and the loss lengths."""
    from torch.utils.data import DataLoader

    s = planned(examples, mode)

    class PlannedTrainer(WeightedTrainer):
        def get_train_dataloader(self):
            make = loader or DataLoader
            if loader is not None:  # accelerate's loader around it stays a StatefulDataLoader
                self.accelerator.dataloader_config.use_stateful_dataloader = True
            return self.accelerator.prepare(make(self.train_dataset, batch_sampler=s, collate_fn=self.data_collator,
                                                 num_workers=self.args.dataloader_num_workers))

    targs = transformers.TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[], learning_rate=0.0,
                                           max_grad_norm=0.0, save_strategy="no", disable_tqdm=True,
                                           gradient_accumulation_steps=s.accumulation_steps, **args)
    trainer = PlannedTrainer(model=tiny_causal_lm(dtype=torch.float64, vocab_size=VOCAB), args=targs,
                             train_dataset=examples, callbacks=[steps], compute_loss_func=hf_compute_loss_func,
                             data_collator=PaddingFreeCollator(loss_weighting=mode))
    return trainer, s


def step_documents(s):
    """The examples of every optimiser step of ``s``'s plan, in order."""
    sched = s.schedule()
    return [sched.flat[sched.ptr[lo]:sched.ptr[hi]].tolist() for lo, hi in zip(sched.step_row[:-1], sched.step_row[1:])]


@pytest.fixture
def no_collective(monkeypatch):
    """``torch.distributed.all_reduce`` fails, and every ``accumulation_step`` the mixin makes is recorded with
    the facts it was given."""
    import torch.distributed as dist

    import packkit.loss

    def refuse(*a, **k):
        raise AssertionError("a collective was made where the sampler's plan knows Z")

    monkeypatch.setattr(dist, "all_reduce", refuse)
    calls, real = [], packkit.loss.accumulation_step
    monkeypatch.setattr(packkit.loss, "accumulation_step",
                        lambda mbs, **k: (calls.append(k.get("facts")), real(mbs, **k))[1])
    return calls


def check_steps(examples, mode, s, grads, first=0):
    want_model = tiny_causal_lm(dtype=torch.float64, vocab_size=VOCAB)
    ref = Logits(want_model)
    docs = step_documents(s)[first:]
    assert len(grads) == len(docs) > 0
    worst = 0.0
    for got, step in zip(grads, docs):
        want_model.zero_grad()
        reference_loss(ref, [examples[i] for i in step], mode).backward()
        want = torch.cat([p.grad.flatten() for p in want_model.parameters() if p.grad is not None])
        worst = max(worst, float((got - want).abs().max()))
    print(f"{mode}: {len(docs)} steps, max |grad - reference| {worst:.1e}")
    assert worst < 1e-12


@pytest.mark.parametrize("workers", [0, 2])
def test_mixin_divides_by_the_samplers_plan_with_no_collective(tmp_path, no_collective, workers):
    """A packkit sampler given the weighting and the loss lengths knows every step's Z: the mixin reads it
    (``sampler.step_facts()``) and makes no collective; every step's gradient equals the unpacked definition's,
    with the batches collated in 0 or 2 DataLoader workers (which fetch ahead of the step). Fails before: the mixin
    ignored the plan (accumulation_step without facts)."""
    examples = documents(40, 2)
    steps = Steps()
    trainer, s = planned_trainer(tmp_path, examples, "sample", steps, dataloader_num_workers=workers,
                                 num_train_epochs=1)
    trainer.train()
    assert no_collective and all(f is not None for f in no_collective), no_collective
    check_steps(examples, "sample", s, steps.grads)


def test_mixin_plan_after_a_resume_at_a_random_step(tmp_path, no_collective):
    """Stopped at a random optimiser step and resumed with ``resume_from_checkpoint`` (Trainer skips the batches
    done through accelerate's ``skip_first_batches``), 2 workers: the steps after the resume still read their own
    Z from the plan. Fails before: the sampler counted the skipped batches' loader as not drawing from it."""
    import numpy as np

    examples = documents(100, 2)
    total = len(step_documents(planned(examples, "sqrt")))
    stop = int(np.random.default_rng().integers(1, total - 1))  # two steps or more left: the workers fetch past one
    first, _ = planned_trainer(tmp_path, examples, "sqrt", Steps(), dataloader_num_workers=2, num_train_epochs=1)
    first.add_callback(StopAt(stop))
    first.train()
    steps = Steps()
    again, s = planned_trainer(tmp_path, examples, "sqrt", steps, dataloader_num_workers=2, num_train_epochs=1)
    again.train(resume_from_checkpoint=str(tmp_path / f"checkpoint-{stop}"))
    assert all(f is not None for f in no_collective)
    print(f"stopped at step {stop} of {total}")
    check_steps(examples, "sqrt", s, steps.grads, first=stop)


def test_mixin_plan_under_a_stateful_dataloader(tmp_path, no_collective):
    """torchdata's ``StatefulDataLoader`` (2 workers) under the mixin: its count of the batches handed to the loop
    names the step (the sampler's own runs ahead with the workers). Fails before: step_facts named a later step
    and the micro-batches were refused against it."""
    tdl = pytest.importorskip("torchdata.stateful_dataloader")
    examples = documents(100, 2)
    steps = Steps()
    trainer, s = planned_trainer(tmp_path, examples, "sample", steps, loader=tdl.StatefulDataLoader,
                                 dataloader_num_workers=2, num_train_epochs=1)
    trainer.train()
    assert isinstance(trainer.callback_handler.train_dataloader, tdl.StatefulDataLoader)
    assert no_collective and all(f is not None for f in no_collective)
    check_steps(examples, "sample", s, steps.grads)
