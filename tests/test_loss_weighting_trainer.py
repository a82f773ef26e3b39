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


# -- a Trainer that trains its model's own loss, and repeats under the token mean -------------------------------


@pytest.mark.parametrize("trainer_cls", ["Trainer", "SFTTrainer"])
def test_a_weighting_under_the_models_own_loss_is_refused(tmp_path, trainer_cls):
    """A ``Trainer`` (or TRL's ``SFTTrainer``) without ``compute_loss_func`` trains its model's own loss, the token
    mean, whatever weights the labels carry: refused in one line naming ``compute_loss_func``, at the first step.
    Before, it trained the token mean unsaid (its gradient differed from the per-sample mean's)."""
    model = tiny_causal_lm(dtype=torch.float64, vocab_size=VOCAB)
    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1, save_strategy="no",
                  disable_tqdm=True)
    if trainer_cls == "SFTTrainer":
        trl = pytest.importorskip("trl")
        cls, targs = trl.SFTTrainer, trl.SFTConfig(**common, dataset_kwargs={"skip_prepare_dataset": True},
                                                   remove_unused_columns=False)
    else:
        cls, targs = transformers.Trainer, transformers.TrainingArguments(**common)
    docs = documents(8, 0)
    if trainer_cls == "SFTTrainer":
        docs = pytest.importorskip("datasets").Dataset.from_list(docs)
    more = {}
    if trainer_cls == "SFTTrainer":
        from test_chat import make_tokenizer

        more = {"processing_class": make_tokenizer()}
    trainer = cls(model=model, args=targs, train_dataset=docs, data_collator=PaddingFreeCollator(loss_weighting="sample"),
                  **more)
    with pytest.raises(ValueError, match="compute_loss_func=packkit.loss.hf_compute_loss_func") as err:
        trainer.train()
    assert "\n" not in str(err.value) and "'sample'" in str(err.value) and cls.__name__ in str(err.value)


def test_a_trainer_with_its_own_compute_loss_is_trusted(tmp_path):
    """A ``compute_loss`` of the user's own reads the labels as it likes: not refused (it sees the weights)."""
    seen = []

    class Own(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen.append(inputs["labels"])
            return hf_compute_loss_func(model(**{k: v for k, v in inputs.items() if k != "labels"}),
                                        inputs["labels"], num_items_in_batch=num_items_in_batch)

    targs = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1,
                                           save_strategy="no", disable_tqdm=True)
    Own(model=tiny_causal_lm(dtype=torch.float64, vocab_size=VOCAB), args=targs, train_dataset=documents(8, 0),
        data_collator=PaddingFreeCollator(loss_weighting="sample")).train()
    assert len(seen) == 1  # trained its one step


def test_the_mixin_weighs_a_repeat_0_under_the_token_mean(tmp_path):
    """The token mean through ``WeightedLossMixin`` over a packkit sampler of 4 ranks whose last step has 3
    examples: rank 3's micro-batch repeats one of them (so that DDP runs every rank). Trainer's own count took its
    tokens again and trained it twice (its example's gradient doubled in the step); now it weighs 0 and leaves the
    step's count. This process plays rank 3 and rank 0 (one process: the count is the rank's own)."""
    import warnings

    import numpy as np
    from torch.utils.data import DataLoader

    from packkit.sampler import PackedBatchSampler, RepeatWarning

    docs = documents(7, 4)
    lengths = np.array([60] * 5 + [20, 25])  # 5 windows of one example, then one of two: the last step has 3
    docs = [{"input_ids": (d["input_ids"] * 8)[:n], "labels": ([IGNORE] + (d["input_ids"] * 8)[1:n])}
            for d, n in zip(docs, lengths.tolist())]

    def steps_of(rank):
        s = PackedBatchSampler(lengths, window=64, rank=rank, world_size=4, step_batches=4, seed=0)

        class Ranked(WeightedTrainer):
            def get_train_dataloader(self):
                return self.accelerator.prepare(DataLoader(self.train_dataset, batch_sampler=s,
                                                           collate_fn=self.data_collator))

        targs = transformers.TrainingArguments(output_dir=str(tmp_path / str(rank)), use_cpu=True, report_to=[],
                                               learning_rate=0.0, max_grad_norm=0.0, save_strategy="no",
                                               disable_tqdm=True, num_train_epochs=1)
        steps = Steps()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RepeatWarning)
            Ranked(model=tiny_causal_lm(dtype=torch.float64, vocab_size=VOCAB), args=targs, train_dataset=docs,
                   callbacks=[steps], compute_loss_func=hf_compute_loss_func,
                   data_collator=PaddingFreeCollator()).train()
        return [list(b) for b in s], s.schedule().repeats.tolist(), steps.grads

    batches, repeats, grads = steps_of(3)
    assert repeats[-1] and not any(repeats[:-1]) and len(grads) == 2 == len(batches)
    assert float(grads[1].abs().max()) == 0.0 and float(grads[0].abs().max()) > 0  # the repeat weighs 0
    batches, _, grads = steps_of(0)  # rank 0 of the same steps repeats nothing: its count is Trainer's own
    assert len(grads) == 2 and all(float(g.abs().max()) > 0 for g in grads)
