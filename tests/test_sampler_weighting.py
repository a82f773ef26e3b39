"""A sampler that knows the loss weighting hands each optimiser step's normaliser to ``accumulation_step``
(``sampler.step_facts()``): every rank knows the whole step plan, so the recipe's loss is exact with no
collective. Through a DataLoader with 2 workers, on real gloo ranks (``torch.distributed.all_reduce`` never
called), after a resume inside a step and onto another world size: float64 loss and gradients equal the
unpacked definition within 1e-12.
"""

import contextlib

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from test_loss_weighting import L_MAX, VOCAB, grads, reference_loss
from testlib import tiny_token_lm
from torch.utils.data import DataLoader

from packkit.collate import PaddingFreeCollator
from packkit.errors import ArgumentError
from packkit.loss import accumulation_step
from packkit.sampler import LengthGroupedSampler, PackedBatchSampler, TokenBudgetBatchSampler
from packkit.weighting import Column, DrGRPO, SeqSumNorm, resolve

IGNORE = -100
MODES = ["sample", "sqrt", "token", "seq-mean-token-sum", DrGRPO(L_MAX), SeqSumNorm(L_MAX)]


def make_examples(n: int = 60, seed: int = 5):
    """Documents of 1-40 tokens with masked prompts (some wholly masked), their lengths and loss tokens as the
    collator counts them (labels other than -100 after the first)."""
    rng = np.random.default_rng(seed)
    examples = []
    for i in range(n):
        length = int(rng.integers(1, 41))
        ids = rng.integers(0, VOCAB, length).tolist()
        prompt = length if i % 9 == 4 else int(rng.integers(0, length))
        examples.append({"input_ids": ids, "labels": [IGNORE] * prompt + ids[prompt:]})
    lengths = np.array([len(e["input_ids"]) for e in examples])
    loss = np.array([sum(x != IGNORE for x in e["labels"][1:]) for e in examples])
    return examples, lengths, loss


def sampler(lengths, loss, mode, rank, world_size, **kw):
    kw.setdefault("step_batches", 4)
    return PackedBatchSampler(lengths, window=64, rank=rank, world_size=world_size, seed=3, loss_weighting=mode,
                              loss_lengths=loss, **kw)


def rank_steps(s, examples, mode, model, *, workers=0, ddp=False):
    """One rank's loop: the step's micro-batches from a DataLoader, ``accumulation_step(..., facts=...)``, each
    micro-batch's loss: ``[(loss of this rank, the step's facts), ...]`` a step. ``ddp``: ``model`` is a DDP
    module; each micro-batch's loss is backpropagated (gradient reduced on the step's last), the gradient of
    each step kept in place of its loss."""
    loader = DataLoader(examples, batch_sampler=s, collate_fn=PaddingFreeCollator(loss_weighting=mode),
                        num_workers=workers)
    out, mbs = [], []
    m = s.accumulation_steps
    for mb in loader:
        mbs.append(mb)
        facts = s.step_facts()
        if len(mbs) < len(facts.micro):
            continue
        step = accumulation_step(mbs, facts=facts)
        if ddp:
            for i, b in enumerate(mbs):
                with model.no_sync() if i < len(mbs) - 1 else contextlib.nullcontext():
                    step.loss(model(b["input_ids"]), b).backward()
            out.append((grads(model.module).clone(), facts))
            model.zero_grad()
        else:
            out.append((sum(step.loss(model(b["input_ids"]), b) for b in mbs), facts))
        mbs = []
    assert not mbs and m >= 1
    return out


def step_documents(s):
    """The examples of every optimiser step of ``s``'s schedule (all ranks), in order."""
    sched, R = s.schedule(), s.world_size
    rows = np.clip(sched.step_row, 0, None)
    return [sched.flat[sched.ptr[lo * R]:sched.ptr[hi * R]].tolist() for lo, hi in zip(rows[:-1], rows[1:]) if hi > lo]


def check_world(examples, lengths, loss, mode, world_size, *, workers=0, state=None):
    """Every rank's loop (DDP averaging: the ranks' losses summed over the ranks, divided by them) against the
    reference of each step: loss and gradient within 1e-12. Returns the steps checked."""
    samplers = [sampler(lengths, loss, mode, r, world_size) for r in range(world_size)]
    if state is not None:
        for s in samplers:
            s.load_state_dict(state)
    docs = step_documents(samplers[0])
    per_rank = []
    for s in samplers:
        model = tiny_token_lm(VOCAB, 4)
        per_rank.append(rank_steps(s, examples, mode, model, workers=workers))
    assert len(per_rank[0]) == len(docs)
    for k, step_docs in enumerate(docs):
        model = tiny_token_lm(VOCAB, 4)
        got = sum(rank[k][0] for rank in per_rank) / world_size
        want = reference_loss(model, [examples[i] for i in step_docs], mode)
        err = abs(float(got.detach()) - float(want.detach()))
        assert err <= 1e-12, (resolve(mode).name, world_size, k, float(got), float(want))
    return len(docs)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: resolve(m).name)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_step_equals_the_unpacked_definition(mode, world_size):
    """Every step of an epoch, 4 micro-batches a step over 1/2/4 ranks, no collective: the loss of each step
    (every rank's summed, DDP's average) equals the mode's formula over the step's documents."""
    examples, lengths, loss = make_examples()
    steps = check_world(examples, lengths, loss, mode, world_size)
    print(f"{resolve(mode).name}: {steps} steps on {world_size} ranks equal the reference")


def test_through_a_dataloader_with_two_workers():
    """The facts come from the sampler in the main process while 2 workers collate ahead of the loop: the step
    they name is the one whose micro-batches the loop holds."""
    examples, lengths, loss = make_examples()
    assert check_world(examples, lengths, loss, "sample", 2, workers=2) >= 3


def test_per_rank_normaliser_is_wrong_and_the_plan_is_not():
    """Regression for normalising per micro-batch or per rank (TRL's 1.25 against 0.65, prime-rl's per-rank
    counts): each rank dividing by its own Z misses the step's loss; the plan's Z gives it exactly."""
    examples, lengths, loss = make_examples()
    model = tiny_token_lm(VOCAB, 4)
    coll = PaddingFreeCollator(loss_weighting="sample")
    samplers = [sampler(lengths, loss, "sample", r, 2) for r in range(2)]
    sched = samplers[0].schedule()
    lo, hi = int(sched.step_row[0]), int(sched.step_row[1])
    local = planned = 0
    for r, s in enumerate(samplers):
        mbs = [coll([examples[i] for i in sched.flat[sched.ptr[b]:sched.ptr[b + 1]]]) for b in range(lo * 2 + r, hi * 2, 2)]
        own = accumulation_step(mbs, all_reduce=False)  # this rank's Z only
        local = local + sum(own.loss(model(b["input_ids"]), b) for b in mbs)
        it = iter(s)
        for _ in mbs:
            next(it)
        step = accumulation_step(mbs, facts=s.step_facts())
        planned = planned + sum(step.loss(model(b["input_ids"]), b) for b in mbs) / 2
    want = reference_loss(model, [examples[i] for i in step_documents(samplers[0])[0]], "sample")
    local, planned, want = float(local.detach()) / 2, float(planned.detach()), float(want.detach())  # DDP's mean
    print(f"per-rank Z: {local:.6f}, the plan's: {planned:.6f}, reference {want:.6f}")
    assert abs(planned - want) <= 1e-12
    assert abs(local - want) > 1e-3


@pytest.mark.parametrize("new_world", [1, 4])
def test_resume_onto_another_world_size(new_world):
    """Saved after one whole step on 2 ranks, resumed on 1 or 4: every step left equals the reference of the
    documents it holds, with no collective."""
    examples, lengths, loss = make_examples()
    first = sampler(lengths, loss, "sqrt", 0, 2)
    state = first.state_dict(batches_consumed=first.accumulation_steps)
    assert check_world(examples, lengths, loss, "sqrt", new_world, state=state) >= 2


def test_resume_inside_a_step_keeps_the_whole_step():
    """Saved after one of a step's two micro-batches (same world size): the step resumed takes the Z of the
    whole step (the row done before the save included), the one the uninterrupted run used."""
    examples, lengths, loss = make_examples()
    whole = sampler(lengths, loss, "sample", 0, 2)
    it = iter(whole)
    next(it), next(it)
    want = whole.step_facts()
    cut = sampler(lengths, loss, "sample", 0, 2)
    cut.load_state_dict(whole.state_dict(batches_consumed=1))
    it = iter(cut)
    next(it)
    got = cut.step_facts()
    assert (got.loss_normalizer, got.loss_tokens, got.examples) == (want.loss_normalizer, want.loss_tokens, want.examples)
    assert got.micro == want.micro[1:]  # this rank holds the step's second micro-batch only


def test_wrong_loss_lengths_refused_in_one_line():
    """loss_lengths that disagree with the labels would give silently wrong weights: refused, naming the
    micro-batch and the fix."""
    examples, lengths, loss = make_examples()
    s = sampler(lengths, loss + (loss < lengths - 1), "sample", 0, 1, step_batches=1)
    loader = DataLoader(examples, batch_sampler=s, collate_fn=PaddingFreeCollator(loss_weighting="sample"))
    mb = next(iter(loader))
    with pytest.raises(ValueError, match=r"micro-batch 0 holds \d+ loss tokens .* the sampler's loss_lengths say") as e:
        accumulation_step([mb], facts=s.step_facts())
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="collated under loss_weighting='token', the sampler plans 'sample'"):
        accumulation_step([PaddingFreeCollator()([examples[i] for i in s.schedule().batches(0)[0]])],
                          facts=s.step_facts())


def test_bad_options_refused_in_one_line():
    examples, lengths, loss = make_examples()
    with pytest.raises(ArgumentError, match="needs loss_lengths"):
        PackedBatchSampler(lengths, window=64, loss_weighting="sample")
    with pytest.raises(ArgumentError, match="read only with loss_weighting"):
        PackedBatchSampler(lengths, window=64, loss_lengths=loss)
    with pytest.raises(ArgumentError, match="which a sampler does not read"):
        PackedBatchSampler(lengths, window=64, loss_weighting=Column("w"), loss_lengths=loss)
    with pytest.raises(ValueError, match="example 0 has loss_lengths="):
        PackedBatchSampler(lengths, window=64, loss_weighting="sample", loss_lengths=lengths)
    with pytest.raises(ArgumentError, match="step_facts needs"):
        PackedBatchSampler(lengths, window=64).step_facts()
    with pytest.raises(ValueError, match="no batch of this pass was drawn yet"):
        sampler(lengths, loss, "sample", 0, 1).step_facts()


# -- real ranks (gloo): no collective for the normaliser ------------------------------------------------------


def gloo_worker(rank, world_size, port, out_dir):
    import datetime
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        examples, lengths, loss = make_examples()
        out = {}
        for mode in ("sample", "sqrt", DrGRPO(L_MAX)):
            model = DDP(tiny_token_lm(VOCAB, 4))
            s = sampler(lengths, loss, mode, rank, world_size)
            out[resolve(mode).name] = [g for g, _ in rank_steps(s, examples, mode, model, ddp=True)]
        out["all_reduce_calls"] = len(calls)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.all_reduce = real
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2])
def test_real_ranks_with_no_collective(tmp_path, world_size):
    """2 gloo ranks under DDP (averaging), the sampler's facts for every step: each step's gradient equals the
    unpacked reference's within 1e-12, and ``torch.distributed.all_reduce`` is never called for a count or Z."""
    from testlib import free_port, run_processes

    run_processes(gloo_worker, world_size, (world_size, free_port(), str(tmp_path)), timeout_s=240)
    examples, lengths, loss = make_examples()
    docs = step_documents(sampler(lengths, loss, "sample", 0, world_size))
    outs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    assert all(o["all_reduce_calls"] == 0 for o in outs)
    for mode in ("sample", "sqrt", DrGRPO(L_MAX)):
        for k, step_docs in enumerate(docs):
            model = tiny_token_lm(VOCAB, 4)
            reference_loss(model, [examples[i] for i in step_docs], mode).backward()
            want = grads(model)
            for o in outs:
                err = float((o[resolve(mode).name][k] - want).abs().max())
                assert err <= 1e-12, (resolve(mode).name, k, err)
        print(f"{resolve(mode).name}: {len(docs)} steps on {world_size} gloo ranks, gradients equal the reference")


# -- every sampler: the plan's Z is the sum of what the collated micro-batches carry --------------------------


@st.composite
def sampler_cases(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(1, 40))
    examples, lengths, loss = make_examples(n, seed=int(rng.integers(1 << 30)))
    world = draw(st.sampled_from([1, 2, 3, 4]))
    options = dict(rank=0, world_size=world, step_batches=world * draw(st.integers(1, 3)), seed=draw(st.integers(0, 9)),
                   drop_last=draw(st.booleans()), loss_weighting=MODES[draw(st.integers(0, len(MODES) - 1))],
                   loss_lengths=loss)
    kind = draw(st.sampled_from(["packed", "grouped", "budget"]))
    if kind == "packed":
        make = lambda r: PackedBatchSampler(lengths, window=64, windows_per_batch=draw_k, **{**options, "rank": r})
        draw_k = draw(st.integers(1, 2))
    elif kind == "grouped":
        bs = draw(st.integers(1, 5))
        make = lambda r: LengthGroupedSampler(lengths, batch_size=bs, **{**options, "rank": r})
    else:
        make = lambda r: TokenBudgetBatchSampler(lengths, max_tokens=80, **{**options, "rank": r})
    return examples, make, world, options["loss_weighting"]


@given(sampler_cases())
def test_every_sampler_plans_the_z_its_batches_carry(case):
    """Length-grouped, token-budget and packed samplers, 1-4 ranks, 1-3 micro-batches a rank, short last steps
    and dropped tails: for every step, the plan's Z and loss tokens are the sums over every rank's collated
    micro-batches, and each rank's micro-batches are the ones it lists (accumulation_step accepts them)."""
    examples, make, world, mode = case
    coll = PaddingFreeCollator(loss_weighting=mode)
    for r in range(world):
        try:
            s = make(r)
        except ValueError as e:  # drop_last with less than one step: refused, as it should be
            assume("pass drop_last=False" not in str(e))
            raise
        sched = s.schedule()
        it, mbs, steps = iter(s), [], 0
        for idx in it:
            mbs.append(coll([examples[i] for i in idx]))
            facts = s.step_facts()
            if len(mbs) < len(facts.micro):
                continue
            step = accumulation_step(mbs, facts=facts)
            lo, hi = int(sched.step_row[steps]), int(sched.step_row[steps + 1])
            every = [coll([examples[i] for i in sched.flat[sched.ptr[b]:sched.ptr[b + 1]]])
                     for b in range(lo * world, hi * world) if sched.ptr[b + 1] > sched.ptr[b]]
            want = accumulation_step(every, all_reduce=False)
            assert step.num_loss_tokens == want.num_loss_tokens
            assert abs(step.loss_normalizer - want.loss_normalizer) <= 1e-9 * max(1.0, want.loss_normalizer)
            mbs, steps = [], steps + 1
        assert not mbs and steps == sched.step_start.size


def test_longalign_weights_stored_for_another_gpu_count_regression():
    """LongAlign (THUDM/LongAlign #8): a target token of sequence i weighs K / (N_i M), K the GPUs and M the
    sequences of the global batch, stored with the packs when they are grouped; asked whether a new GPU count needs
    the packs sorted and grouped again, the answer is yes. Weights stored for 2 ranks and trained on 4 from a
    2-rank state: each step's loss (DDP's mean over 4) leaves the per-sample mean of the documents it holds; the
    sampler's, planned for the world size it runs on, equals it within 1e-12."""
    examples, lengths, loss = make_examples()
    old = sampler(lengths, loss, "sample", 0, 2)
    stored = np.zeros(len(examples))
    for docs in step_documents(old):  # LongAlign's weights, for 2 GPUs
        m = int((loss[docs] > 0).sum())
        for i in docs:
            stored[i] = 2 / (loss[i] * m) if loss[i] > 0 else 0.0
    state = old.state_dict(batches_consumed=old.accumulation_steps)
    new = sampler(lengths, loss, "sample", 0, 4)
    new.load_state_dict(state)
    model = tiny_token_lm(VOCAB, 4)
    worst = 0.0
    for docs in step_documents(new):
        sums = [float(reference_loss(model, [examples[i]], "seq-mean-token-sum")) for i in docs]
        naive = sum(stored[i] * s for i, s in zip(docs, sums)) / 4
        want = float(reference_loss(model, [examples[i] for i in docs], "sample"))
        worst = max(worst, abs(naive - want))
    print(f"weights stored for 2 GPUs, trained on 4: worst step off by {worst:.3f}")
    assert worst > 1e-2
    assert check_world(examples, lengths, loss, "sample", 4, state=state) >= 2
