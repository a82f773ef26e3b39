"""Loss weightings through ``transformers.Trainer`` on 2 real gloo processes (spawned, ``RANK`` / ``WORLD_SIZE`` /
``LOCAL_RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT`` set as a launcher sets them, so accelerate runs a distributed
CPU job and wraps the model in DDP): ``TrainingArguments(use_cpu=True, ddp_backend="gloo")`` with the defaults but
for 2 examples a device, 2 micro-batches a step, 1 DataLoader worker, plain SGD at learning rate 1 for one step
(``max_steps=1``; the default linear schedule is at its full rate on the first step) and no clipping (a clipped
gradient hides a wrong scale). A tiny float64 Llama is stepped once; its parameters on both ranks must equal the
start minus the gradient of the unpacked reference definition (``test_loss_weighting.reference_loss``) over the
global step's examples, computed on one process, within 1e-10.

What Trainer does under DDP (transformers 5.24), which packkit's route has to land on exactly: it draws a step's
micro-batches before the first forward and counts their loss tokens (``_get_num_items_in_batch``, gathered over the
processes with ``average_tokens_across_devices=True``, its default), hands the count to ``compute_loss_func`` as
``num_items_in_batch``, multiplies each loss by the number of processes (DDP then averages the gradients over them)
and, since the loss is normalised by the count, does not divide it by the accumulation steps.

- ``WeightedLossMixin`` + ``compute_loss_func=hf_compute_loss_func``: ``"sample"`` and a ``Column`` over Trainer's
  own sampler (one all-reduce of the step's counts); ``"sample"`` and ``"sqrt"`` over a ``PackedBatchSampler`` of 2
  ranks that plans the steps (no collective: ``sampler.step_facts()``).
- ``compute_loss_func=hf_compute_loss_func`` alone: the token mean is exact (Trainer's own gathered count); a
  weighting is refused on every rank in one line naming the mixin (a micro-batch cannot know the other
  micro-batches' and ranks' part of ``Z``).
- The mixin without ``compute_loss_func``: the model's own loss would ignore the weights; refused in one line.
"""

import os
import sys
import time

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_loss_weighting import IGNORE, reference_loss  # noqa: E402
from test_prefixtree_ddp import float64_norms  # noqa: E402
from testlib import free_port, gloo_rank, rank_results, run_processes, tiny_causal_lm  # noqa: E402

from packkit.weighting import Column  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WORLD = 2
PER_DEVICE = 2
ACCUMULATION = 2
VOCAB = 64
WINDOW = 64
TIMEOUT_S = 300
TOL = 1e-10

#: (name, trainer, mode, planned): the runs, in this order on every rank
CASES = [
    ("func-token", "plain", "token", False),
    ("mixin-sample", "mixin", "sample", False),
    ("mixin-column", "mixin", Column("w"), False),
    ("mixin-sample-planned", "mixin", "sample", True),
    ("mixin-sqrt-planned", "mixin", "sqrt", True),
    ("func-sample", "plain", "sample", False),  # refused: a weighting needs the mixin
    ("mixin-no-func", "mixin-no-func", "sample", False),  # refused: the model's own loss ignores the weights
]


def documents(n: int, seed: int) -> list:
    """``n`` documents of 2-23 tokens with masked prompts (document 1 wholly masked: it weighs 0), a weight ``w``."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        length = int(rng.integers(2, 24))
        ids = rng.integers(0, VOCAB, length).tolist()
        prompt = length if i == 1 else length // 3
        docs.append({"input_ids": ids, "labels": [IGNORE] * prompt + ids[prompt:], "w": float(rng.uniform(0.1, 3))})
    return docs


def planned_sampler(docs, mode, rank: int):
    from packkit.sampler import PackedBatchSampler

    lengths = np.array([len(d["input_ids"]) for d in docs])
    loss = np.array([sum(x != IGNORE for x in d["labels"][1:]) for d in docs])
    return PackedBatchSampler(lengths, window=WINDOW, rank=rank, world_size=WORLD, step_batches=WORLD * ACCUMULATION,
                              seed=3, loss_weighting=mode, loss_lengths=loss)


def first_step_documents(s) -> list:
    """The examples of the first optimiser step of ``s``'s plan, every rank's."""
    sched, R = s.schedule(), s.world_size
    lo, hi = (max(int(x), 0) for x in sched.step_row[:2])
    return sched.flat[sched.ptr[lo * R]:sched.ptr[hi * R]].tolist()


def model():
    return tiny_causal_lm(dtype=torch.float64, vocab_size=VOCAB, max_position_embeddings=128)


class Drawn(transformers.TrainerCallback):
    """The step's gradient just before the optimiser applies it (this rank's, after DDP's average)."""

    grad = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grad = torch.cat([p.grad.flatten().clone() for p in model.parameters() if p.grad is not None])


def train_one(out_dir, rank, case, docs, planned_docs):
    """One Trainer run of ``case`` on this rank: ``(parameters after the step, the step's gradient)``."""
    from torch.utils.data import DataLoader

    from packkit.collate import PaddingFreeCollator
    from packkit.loss import WeightedLossMixin, hf_compute_loss_func

    name, kind, mode, planned = case
    sampler = planned_sampler(planned_docs, mode, rank) if planned else None

    class Mixin(WeightedLossMixin, transformers.Trainer):
        def get_train_dataloader(self):
            if sampler is None:
                return super().get_train_dataloader()
            loader = self.accelerator.prepare(DataLoader(self.train_dataset, batch_sampler=sampler,
                                                         collate_fn=self.data_collator,
                                                         num_workers=self.args.dataloader_num_workers))
            loader.batch_sampler.num_processes, loader.batch_sampler.process_index = 1, 0  # already this rank's
            return loader

    args = transformers.TrainingArguments(
        output_dir=os.path.join(out_dir, name), use_cpu=True, ddp_backend="gloo", max_steps=1, optim="sgd",
        learning_rate=1.0, max_grad_norm=0.0, per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=ACCUMULATION, dataloader_num_workers=1, save_strategy="no", report_to=[],
        disable_tqdm=True)
    assert args.world_size == WORLD and args.average_tokens_across_devices and args.weight_decay == 0
    drawn = Drawn()
    trainer = (transformers.Trainer if kind == "plain" else Mixin)(
        model=model(), args=args, train_dataset=planned_docs if planned else docs, callbacks=[drawn],
        data_collator=PaddingFreeCollator(loss_weighting=mode),
        compute_loss_func=None if kind == "mixin-no-func" else hf_compute_loss_func)
    trainer.train()
    assert type(trainer.model_wrapped).__name__ == "DistributedDataParallel"
    return torch.cat([p.detach().flatten() for p in trainer.model.parameters()]), drawn.grad


def worker(rank, port, out_dir, docs, planned_docs):
    import multiprocessing

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    # a launcher's rank (torchrun) starts its DataLoader workers with the platform's default, fork; a rank spawned
    # here would spawn them too (a fresh interpreter importing torch: about 30 s a run on a loaded 2-core machine)
    multiprocessing.set_start_method("fork", force=True)
    float64_norms()
    import packkit.loss

    planned, real = [], packkit.loss.accumulation_step  # whether each step the mixin counts was read off a plan
    packkit.loss.accumulation_step = lambda mbs, **k: (planned.append(k.get("facts") is not None), real(mbs, **k))[1]
    with gloo_rank(rank, port, WORLD, out_dir, timeout_s=TIMEOUT_S) as results:
        clock = time.process_time()
        for case in CASES:
            try:
                params, grad = train_one(out_dir, rank, case, docs, planned_docs)
                results.append((case[0], params, grad, None, planned))
            except ValueError as exc:
                results.append((case[0], None, None, str(exc), planned))
            planned = []
        print(f"rank {rank}: {len(CASES)} Trainer runs, {time.process_time() - clock:.1f} s CPU", file=sys.stderr)


def reference_step(docs, mode):
    """``(parameters after one SGD step at rate 1, the gradient)`` of the mode's unpacked definition over ``docs``."""
    net = model()
    reference_loss(net_logits(net), docs, mode).backward()
    grad = torch.cat([p.grad.flatten() for p in net.parameters() if p.grad is not None])
    return torch.cat([p.detach().flatten() for p in net.parameters()]) - grad, grad


def net_logits(net):
    return lambda ids: net(input_ids=ids).logits


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case's result on every rank: ``{name: [(params, grad, error) of rank 0, of rank 1]}``; the inputs."""
    out = tmp_path_factory.mktemp("trainer_ddp")
    docs = documents(WORLD * ACCUMULATION * PER_DEVICE, 0)  # one global step: every example in it
    planned_docs = documents(40, 1)
    run_processes(worker, WORLD, (free_port(), str(out), docs, planned_docs), timeout_s=TIMEOUT_S)
    by_case = {}
    for name, params, grad, error, planned in rank_results(out, WORLD):
        by_case.setdefault(name, []).append((params, grad, error, planned))
    return by_case, docs, planned_docs


@pytest.mark.parametrize("case", [c for c in CASES if not c[0].startswith(("func-sample", "mixin-no-func"))],
                         ids=lambda c: c[0])
def test_one_step_equals_the_unpacked_definition(runs, case):
    """Both ranks' parameters after the step equal the unpacked definition's step over the global step's
    examples (Trainer's own sampler: all 8; the planned sampler: its first step's), within 1e-10."""
    by_case, docs, planned_docs = runs
    name, kind, mode, planned = case
    step_docs = [planned_docs[i] for i in first_step_documents(planned_sampler(planned_docs, mode, 0))] \
        if planned else docs
    with pytest.MonkeyPatch.context() as mp:
        float64_norms(mp)
        want_params, want_grad = reference_step(step_docs, "token" if mode == "token" else mode)
    ranks = by_case[name]
    assert len(ranks) == WORLD and all(error is None for _, _, error, _ in ranks), [r[2] for r in ranks]
    for rank, (params, grad, _, steps) in enumerate(ranks):
        # the mixin counts one step, from the sampler's plan (no collective) where it plans them
        assert steps == ([planned] if kind == "mixin" else []), steps
        d_params, d_grad = (float((a - b).abs().max()) for a, b in ((params, want_params), (grad, want_grad)))
        print(f"{name} rank {rank}: {len(step_docs)} examples, max |params - reference| {d_params:.1e}, "
              f"|grad - reference| {d_grad:.1e} (max |grad| {float(want_grad.abs().max()):.1e})")
        assert d_params <= TOL and d_grad <= TOL


def test_a_weighting_without_the_mixin_is_refused_on_every_rank(runs):
    """``compute_loss_func`` alone under DDP with accumulation: the micro-batch holds part of the step's Z and
    cannot learn the rest; every rank refuses in one line naming the mixin, before any step."""
    for params, _, error, _ in runs[0]["func-sample"]:
        assert params is None and error is not None and "WeightedLossMixin" in error and "\n" not in error, error


def test_the_mixin_without_compute_loss_func_is_refused(runs):
    """The mixin hands Z where Trainer hands its count; without ``compute_loss_func`` the model's own loss would
    divide the unweighted sum by it (the weights dropped unsaid): every rank refuses in one line naming the fix."""
    for params, _, error, _ in runs[0]["mixin-no-func"]:
        assert params is None and error is not None and "compute_loss_func" in error and "\n" not in error, error
