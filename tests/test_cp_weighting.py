"""Every loss weighting under context parallelism, on real gloo processes: a CP shard of a weighted batch carries
its rank's per-token weights (sliced like its ``shift_labels``) and the batch's part of ``Z``, so that
``accumulation_step(shards)`` and ``step.loss(logits, shard)`` give, summed over the ranks, the float64 loss and
gradients of the unpacked reference definition (``tests/test_loss_weighting.py``) within 1e-12: every mode, every
layout, CP 2 and 4, two micro-batches a rank, documents cut across CP ranks and split across windows, and the two
groups the step's counts may be reduced over under DP 2 x CP 2 (the data-parallel group; the world, which holds
whole CP groups and counts each batch once all the same).

The model is per-token (embedding, tanh, linear: ``testlib.tiny_token_lm``), so a rank's logits are those of
its own tokens and the test is about the weights and the normaliser; CP attention is
``tests/test_cp_distributed.py``'s. Four processes are spawned once for every case.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from testlib import free_port, gloo_rank, rank_results, run_processes, tiny_token_lm

from packkit.collate import FixedWindowCollator, PaddingFreeCollator
from packkit.loss import accumulation_step
from packkit.weighting import resolve

pytestmark = pytest.mark.distributed

WORLD = 4
LAYOUTS = ("zigzag", "contiguous", "ulysses", "hybrid")
TOL = 1e-12
TIMEOUT_S = 240
WIDTH = 4


def _reference(mode, kind, dp: int, docs):
    """The unpacked reference loss and gradient of ``mode`` over the step's documents (``kind='split'``: the
    first labels of a split document's later pieces are not targets, as the collator packs them)."""
    from test_loss_weighting import reference_loss

    dropped = {}
    if kind == "split":
        for part in _parts(dp, docs):
            _, plan = _collator(kind, mode)._pack([docs[i] for i in part])
            for ex, start in zip(plan.seg_example.tolist(), plan.seg_start.tolist()):
                if start > 0:
                    dropped.setdefault(part[ex], set()).add(start)
    model = tiny_token_lm(_vocab(), WIDTH)
    loss = reference_loss(model, docs, mode, dropped)
    loss.backward()
    return float(loss.detach()), torch.cat([p.grad.flatten() for p in model.parameters()])


def _vocab():
    from test_loss_weighting import VOCAB

    return VOCAB


def _collator(kind, mode):
    if kind == "free":
        return PaddingFreeCollator(loss_weighting=mode)
    return FixedWindowCollator(window=16, overflow="split", strategy="next_fit", loss_weighting=mode)


def _parts(dp: int, docs) -> list:
    """Every data-parallel rank's two micro-batches: documents dealt round-robin to ``2 * dp`` slots."""
    slots = 2 * dp
    return [[i for i in range(len(docs)) if i % slots == s] for s in range(slots)]


def _run_step(model, mbs, cp, cp_rank, layout, step_kwargs):
    """This rank's shards of its micro-batches, one ``accumulation_step`` over them, each loss backward;
    ``(this rank's summed loss, the step)``."""
    from packkit.cp import shard

    shards = [shard(mb, cp_size=cp, rank=cp_rank, cp_layout=layout) for mb in mbs]
    step = accumulation_step(shards, **step_kwargs)
    total = torch.zeros((), dtype=torch.float64)
    for s in shards:
        loss = step.loss(model(s.input_ids), s)
        loss.backward()
        total = total + loss.detach()
    return total, step


def _setups(rank: int, groups: dict) -> list:
    """``(name, cp, cp rank, dp, dp rank, step kwargs, gradient reduction)`` of the runs this rank takes part in.
    The gradient reduction is what DDP / FSDP (or a hand-written loop) does to the replicated parameters."""
    import torch.distributed as dist

    def average_over_world(g):  # DDP / FSDP over the whole DP x CP mesh (torchtitan's dp_shard_cp)
        dist.all_reduce(g)
        g /= WORLD

    def sum_over(group):
        return lambda g: dist.all_reduce(g, group=group)

    def sum_cp_average_dp(g):  # a hand-written CP sum, then DDP's average over the DP group
        dist.all_reduce(g, group=groups["cp2"][rank // 2])
        dist.all_reduce(g, group=groups["dp2"][rank % 2])
        g /= 2

    return [
        # CP 4 over the world: the counts reduced over it (one whole CP group), DDP-style average
        ("cp4-world", 4, rank, 1, 0, {}, average_over_world),
        # CP 4 without a collective: every rank holds the batch's Z; the gradients summed over the CP group
        ("cp4-local", 4, rank, 1, 0, {"all_reduce": False}, sum_over(None)),
        # DP 2 x CP 2, the counts over the world (whole CP groups: each batch counted once, not twice)
        ("dp2xcp2-world", 2, rank % 2, 2, rank // 2, {}, average_over_world),
        # DP 2 x CP 2, the counts over the data-parallel group (one rank of each CP group)
        ("dp2xcp2-dpgroup", 2, rank % 2, 2, rank // 2, {"group": groups["dp2"][rank % 2]}, sum_cp_average_dp),
    ]


def _prime_rl_gap(rank, docs, layout):
    """prime-rl #2032: the per-sample mean (``"sample"``) with each CP rank counting a document's loss tokens
    from its own tokens, ``|O_c|`` replaced by the rank's share of it, against the per-sample counts summed over
    the CP group (the fix) and packkit's (no collective: the shard's weights). ``(bug, fixed, packkit)``
    losses summed over the CP group of 4, before any gradient."""
    import torch.distributed as dist

    from packkit.cp import shard

    batch = PaddingFreeCollator(loss_weighting="sample")(docs)
    s = shard(batch, cp_size=WORLD, rank=rank, cp_layout=layout)
    model = tiny_token_lm(_vocab(), WIDTH)
    with torch.no_grad():
        ce = F.cross_entropy(model(s.input_ids)[0], s.shift_labels[0], ignore_index=-100, reduction="none")
        target = s.shift_labels[0] != -100
        seg = s.seq_idx[0].long()
        segments = int(batch.cu_seqlens.numel()) - 1
        local = torch.bincount(seg[target], minlength=segments).double()  # the rank's share of each |O_c|
        whole = local.clone()
        dist.all_reduce(whole)  # prime-rl's fix: the per-sample counts all-reduced across the CP group
        samples = int((whole > 0).sum())  # |B|, the same for both: the bug is in the counts
        per_seg = torch.bincount(seg[target], weights=ce[target], minlength=segments)
        bug = (per_seg / local.clamp_min(1)).sum() / samples
        fixed = (per_seg / whole.clamp_min(1)).sum() / samples
        step = accumulation_step([s], all_reduce=False)
        ours = step.loss(model(s.input_ids), s)
        out = torch.stack([bug, fixed, ours])
        dist.all_reduce(out)  # the ranks' parts summed: the loss of the row
    return out.tolist()


#: the weightings of the planned steps: a per-document factor, a root, and a normaliser with a step constant
PLANNED_MODES = ("sample", "sqrt", "dr_grpo")
PLANNED_WINDOW = 32


def _planned_sampler(docs, mode, dp_rank: int):
    """The sampler of data-parallel rank ``dp_rank`` of 2, two micro-batches a rank, planning ``mode``'s steps."""
    from packkit.sampler import PackedBatchSampler

    lengths = np.array([len(d["input_ids"]) for d in docs])
    loss = np.array([sum(x != -100 for x in d["labels"][1:]) for d in docs])
    return PackedBatchSampler(lengths, window=PLANNED_WINDOW, rank=dp_rank, world_size=2, step_batches=4, seed=5,
                              loss_weighting=_planned_mode(mode), loss_lengths=loss)


def _planned_mode(mode):
    from test_loss_weighting import L_MAX

    from packkit.weighting import DrGRPO

    return DrGRPO(L_MAX) if mode == "dr_grpo" else mode


def _planned_steps(s) -> list:
    """The examples of every optimiser step of ``s``'s plan, every data-parallel rank's."""
    sched, R = s.schedule(), s.world_size
    rows = np.clip(sched.step_row, 0, None)
    return [sched.flat[sched.ptr[lo * R]:sched.ptr[hi * R]].tolist() for lo, hi in zip(rows[:-1], rows[1:]) if hi > lo]


def _planned_runs(rank, groups, docs, results) -> None:
    """DP 2 x CP 2, every step of a ``PackedBatchSampler``'s epoch (the data-parallel rank's sampler; both CP ranks
    of it draw the same windows): each CP rank's shards of the step's micro-batches,
    ``accumulation_step(shards, facts=sampler.step_facts(), group=...)`` with the group the gradients are averaged
    over (the world, or the data-parallel group after a sum over the CP group), no collective made by packkit.
    Every step's loss (summed over the ranks) and gradient against the unpacked reference."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from packkit.cp import shard
    from test_loss_weighting import reference_loss

    model = tiny_token_lm(_vocab(), WIDTH)
    for name, cp, cp_rank, dp, dp_rank, step_kwargs, reduce_grads in _setups(rank, groups):
        if not name.startswith("dp2xcp2"):
            continue
        cases, grads, totals = [], [], []
        for mode in PLANNED_MODES:
            for layout in LAYOUTS:
                s, mbs = _planned_sampler(docs, mode, dp_rank), []
                for k, mb in enumerate(DataLoader(docs, batch_sampler=s,
                                                  collate_fn=PaddingFreeCollator(loss_weighting=_planned_mode(mode)))):
                    mbs.append(mb)
                    facts = s.step_facts()
                    if len(mbs) < len(facts.micro):
                        continue
                    shards = [shard(m, cp_size=cp, rank=cp_rank, cp_layout=layout) for m in mbs]
                    step = accumulation_step(shards, facts=facts, group=step_kwargs.get("group"))
                    model.zero_grad(set_to_none=True)
                    total = torch.zeros((), dtype=torch.float64)
                    for sh in shards:
                        loss = step.loss(model(sh.input_ids), sh)
                        loss.backward()
                        total = total + loss.detach()
                    cases.append((mode, layout))
                    grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
                    totals.append(total / step.grad_multiplier)
                    mbs = []
        grads, totals = torch.stack(grads), torch.stack(totals)
        reduce_grads(grads)
        dist.all_reduce(totals)
        steps = {mode: _planned_steps(_planned_sampler(docs, mode, 0)) for mode in PLANNED_MODES}
        done = {}
        for (mode, layout), grad, loss in zip(cases, grads, totals.tolist()):
            k = done[(mode, layout)] = done.get((mode, layout), -1) + 1
            ref = tiny_token_lm(_vocab(), WIDTH)
            want = reference_loss(ref, [docs[i] for i in steps[mode][k]], _planned_mode(mode))
            want.backward()
            want_grad = torch.cat([p.grad.flatten() for p in ref.parameters()])
            results.append(("planned", name, layout, mode, k, len(steps[mode]), abs(loss - float(want.detach())),
                            float((grad - want_grad).abs().max())))
    trio = dist.new_group([0, 1, 2])  # (collective over the world: every rank makes it)
    if rank < 3:  # 3 ranks: neither the 2 data-parallel ranks nor whole CP groups of them
        try:
            accumulation_step(shards, facts=facts, group=trio)
            results.append(("planned_group", "no error"))
        except ValueError as exc:
            results.append(("planned_group", str(exc)))


def worker(rank, port, out_dir, docs):
    import torch.distributed as dist

    from packkit.weighting import resolve as resolve_mode
    from test_loss_weighting import MODES

    with gloo_rank(rank, port, WORLD, out_dir, timeout_s=TIMEOUT_S) as results:
        # new_group is collective over the world: every rank makes every group, in the same order
        groups = {"cp2": [dist.new_group([0, 1]), dist.new_group([2, 3])],
                  "dp2": [dist.new_group([0, 2]), dist.new_group([1, 3])]}
        references, model = {}, tiny_token_lm(_vocab(), WIDTH)  # the reference's weights; never stepped
        for name, cp, cp_rank, dp, dp_rank, step_kwargs, reduce_grads in _setups(rank, groups):
            parts = _parts(dp, docs)[2 * dp_rank:2 * dp_rank + 2]
            cases, grads, totals = [], [], []
            for kind in ("free", "split") if name.endswith("world") else ("free",):
                for mode in MODES:
                    mbs = [_collator(kind, mode)([docs[i] for i in part]) for part in parts]
                    key = (resolve_mode(mode).name, kind, dp)
                    if key not in references:
                        references[key] = _reference(mode, kind, dp, docs)
                    for layout in LAYOUTS:
                        model.zero_grad(set_to_none=True)
                        total, step = _run_step(model, mbs, cp, cp_rank, layout, step_kwargs)
                        cases.append((layout, kind, key))
                        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
                        totals.append(total / step.grad_multiplier)  # the rank's part of the step's loss
            # the reductions of every case at once (linear: one collective instead of one a case)
            grads, totals = torch.stack(grads), torch.stack(totals)
            reduce_grads(grads)
            dist.all_reduce(totals)  # every rank's part: the step's loss
            for (layout, kind, key), grad, loss in zip(cases, grads, totals.tolist()):
                want_loss, want_grad = references[key]
                results.append((name, layout, kind, key[0], abs(loss - want_loss),
                                float((grad - want_grad).abs().max())))
        # the counts reduced over half a CP group of 4 (ranks {0, 1}, {2, 3}): refused on every rank, not counted
        try:
            _run_step(model, [_collator("free", "sample")(docs)], 4, rank, "hybrid",
                      {"group": groups["cp2"][rank // 2]})
            results.append(("half_group", "no error"))
        except ValueError as exc:
            results.append(("half_group", str(exc)))
        for layout in ("contiguous", "hybrid"):
            results.append(("prime_rl_2032", layout, *_prime_rl_gap(rank, docs, layout),
                            references[("sample", "free", 1)][0]))
        _planned_runs(rank, groups, docs, results)


def documents():
    """24 documents of 1-30 tokens, masked prompts (some wholly masked), a per-example weight ``w``
    (``tests/test_loss_weighting.py``'s, so the reference reads the same ones)."""
    from test_loss_weighting import ddp_documents

    return ddp_documents()


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    """Every rank's results, the four processes run once for the tests below."""
    out = tmp_path_factory.mktemp("cp_weighting")
    run_processes(worker, WORLD, (free_port(), str(out), documents()), timeout_s=TIMEOUT_S)
    return rank_results(out, WORLD)


def test_every_weighting_under_cp_equals_the_unpacked_reference(cp_results):
    """CP 4 and DP 2 x CP 2, every layout, every weighting mode, two micro-batches a rank, documents cut across
    CP ranks and split across windows: the loss summed over the ranks and every rank's reduced gradient equal the
    unpacked reference within 1e-12, whether the counts are reduced over the world, the data-parallel group or
    not at all. Before the fix a shard carried no weights: ``accumulation_step([shard])`` raised."""
    from test_loss_weighting import MODES

    worst = {}
    for row in cp_results:
        if row[0] in ("prime_rl_2032", "half_group", "planned", "planned_group"):
            continue
        name, layout, kind, mode, loss_err, grad_err = row
        key = (name, layout, kind, mode)
        worst[key] = max(worst.get(key, 0.0), loss_err, grad_err)
    names = {"cp4-world", "cp4-local", "dp2xcp2-world", "dp2xcp2-dpgroup"}
    modes = {resolve(m).name for m in MODES}
    assert set(worst) == {(n, lay, k, m) for n in names for lay in LAYOUTS for m in modes
                          for k in (("free", "split") if n.endswith("world") else ("free",))}
    for name in sorted(names):
        print(f"{name}: max |d loss|, |d grad| over every layout and mode {max(e for k, e in worst.items() if k[0] == name):.1e}")
    bad = {k: e for k, e in worst.items() if not e <= TOL}
    assert not bad, bad


def test_a_planned_step_of_cp_shards_equals_the_unpacked_reference(cp_results):
    """DP 2 x CP 2, a ``PackedBatchSampler`` planning every step (``accumulation_step(shards,
    facts=sampler.step_facts(), group=...)``, no collective), every layout, three weightings: the loss summed over
    the ranks and every rank's reduced gradient equal the unpacked reference within 1e-12 on every step, whether the
    gradients are averaged over the world (``group=None``) or summed over the CP group and averaged over the
    data-parallel group (``group=`` it). Fails before: the planned step multiplied the loss by the sampler's world
    size (the data-parallel ranks) whatever the group, so the world's average halved the gradient."""
    rows = [r for r in cp_results if r[0] == "planned"]
    worst = {}
    for _, name, layout, mode, k, n, loss_err, grad_err in rows:
        worst[(name, mode)] = max(worst.get((name, mode), 0.0), loss_err, grad_err)
        assert n >= 2
    assert set(worst) == {(n, m) for n in ("dp2xcp2-world", "dp2xcp2-dpgroup") for m in PLANNED_MODES}
    steps = sum(len(_planned_steps(_planned_sampler(documents(), m, 0))) for m in PLANNED_MODES)
    assert len(rows) == WORLD * 2 * len(LAYOUTS) * steps  # every step of every mode, layout and setup, on every rank
    for key, err in sorted(worst.items()):
        print(f"planned {key[0]} {key[1]}: max |d loss|, |d grad| over every step and layout {err:.1e}")
    bad = {k: e for k, e in worst.items() if not e <= TOL}
    assert not bad, bad


def test_a_planned_step_over_another_group_refused(cp_results):
    """A planned step of CP shards whose gradients' group is neither the sampler's data-parallel ranks nor whole CP
    groups of them (3 of DP 2 x CP 2) has no loss multiplier that makes its average the step's gradient: refused in
    one line naming the groups to pass."""
    rows = [r for r in cp_results if r[0] == "planned_group"]
    assert len(rows) == 3
    for _, message in rows:
        print(message)
        assert "pass group= a data-parallel group (2 ranks) or one of whole CP groups (4)" in message


def test_prime_rl_2032_per_rank_sample_counts_regression(cp_results):
    """Regression (prime-rl PR #2032): under CP the per-sample mean needs each sample's whole loss-token count;
    a CP rank that divides by its own share of it weighs a document cut across ranks as several. On a real CP
    group of 4 (contiguous and hybrid layouts) the per-rank counts move the loss, the counts all-reduced over the
    group give the reference, and so do packkit's shards with no collective."""
    rows = [r for r in cp_results if r[0] == "prime_rl_2032"]
    assert len(rows) == 2 * WORLD
    for _, layout, bug, fixed, ours, want in rows:
        print(f"{layout}: per-rank counts {bug:.6f}, all-reduced {fixed:.6f}, packkit {ours:.6f}, reference {want:.6f}")
        assert abs(bug - want) > 1e-3
        assert abs(fixed - want) <= TOL and abs(ours - want) <= TOL


def test_counts_over_part_of_a_cp_group_refused(cp_results):
    """A step's counts reduced over a group that holds some ranks of a CP group and not others would count each
    batch a wrong number of times: every rank refuses it in one line naming the groups to pass."""
    rows = [r for r in cp_results if r[0] == "half_group"]
    assert len(rows) == WORLD
    for _, message in rows:
        print(message)
        assert "some ranks of a CP group and not others" in message and "group=" in message


def test_shard_without_its_weights_says_what_to_pass():
    """Regression: ``step.loss`` on labels that lost their weights (a copy of a weighted shard's ``shift_labels``)
    said the micro-batch was "collated under loss_weighting='token'"; it now says the labels carry no weights and
    what to pass. The shard itself, and its ``hf_kwargs()`` (``shift_labels`` as they are), carry them."""
    from packkit.cp import shard
    from test_loss_weighting import VOCAB

    docs = documents()[:6]
    batch = PaddingFreeCollator(loss_weighting="sample")(docs)
    s = shard(batch, cp_size=2, rank=1, cp_layout="zigzag")
    step = accumulation_step([s], all_reduce=False)
    model = tiny_token_lm(VOCAB, WIDTH)
    logits = model(s.input_ids)
    assert s.loss_weighting == "sample" and s.loss_norm == batch.loss_norm
    assert float(step.loss(logits, s.hf_kwargs()).detach()) == float(step.loss(logits, s).detach())
    with pytest.raises(ValueError, match="labels carry no loss weights .* a copy or slice leaves the weights behind"):
        step.loss(logits, s.shift_labels.clone())


def test_a_step_mixing_shards_and_batches_refused():
    """Every micro-batch of a step is a shard of one CP group, or none: the counts of a shard are its batch's."""
    from packkit.cp import shard

    batch = PaddingFreeCollator(loss_weighting="sqrt")(documents()[:6])
    with pytest.raises(ValueError, match="micro-batch 1 is not a CP shard, micro-batch 0 a shard of a CP group of 2"):
        accumulation_step([shard(batch, cp_size=2, rank=0), batch], all_reduce=False)
