"""Loss weightings (packkit.weighting) over the optimiser step: float64 loss and gradients of packed,
accumulated batches equal the unpacked reference definition of every mode within 1e-12.

The reference lives here and reads each mode's formula directly (per-document means, square roots,
column weights, verl's and TRL's normalisers) over unpacked documents; the packed side collates random
partitions of the documents into micro-batches with each collator and sums ``accumulation_step``'s losses.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from testlib import gloo_group, tiny_token_lm

from packkit.collate import FixedWindowCollator, PackedRowsCollator, PaddedCollator, PaddingFreeCollator
from packkit.errors import ArgumentError
from packkit.loss import accumulation_step, hf_compute_loss_func, token_normalized_loss
from packkit.weighting import Column, ColumnWeighting, DrGRPO, SeqSumNorm, Weights, resolve

IGNORE = -100
VOCAB = 13
L_MAX = 16
MODES = ["token", "sample", "sqrt", "seq-mean-token-sum", "grpo", "dapo", SeqSumNorm(L_MAX), DrGRPO(L_MAX),
         Column("w"), Weights(np.log1p)]


def reference_loss(model, docs, mode, dropped=None, pieces=None):
    """The mode's loss over unpacked documents, read off its formula: ``ce[c]`` the cross entropies of
    document ``c``'s loss tokens (labels ``!= -100`` after position 0, minus ``dropped[c]``, the first
    labels of a split document's later pieces). TRL's ``grpo`` and ``dr_grpo`` count every document in
    ``|B|``, those without loss tokens too, once however many rows it was split into offline (``pieces``: unused
    since; it counted them once a piece, as packkit did)."""
    ce, w = [], []
    for c, doc in enumerate(docs):
        ids = torch.tensor(doc["input_ids"])
        logits = model(ids[None])[0]
        targets = [t for t in range(1, len(ids)) if doc["labels"][t] != IGNORE and t not in (dropped or {}).get(c, ())]
        ce.append(F.cross_entropy(logits[[t - 1 for t in targets]], torch.tensor(doc["labels"])[targets],
                                  reduction="none") if targets else logits.sum() * 0)
        w.append(doc.get("w", 1.0))
    n = [int(x.numel()) if x.dim() else 0 for x in ce]
    kept = [c for c in range(len(docs)) if n[c] > 0]
    every = len(docs)  # TRL's size(0): every completion once
    zero = sum(model(torch.tensor([[0]])).sum() * 0 for _ in (0,))
    if not kept:
        return zero
    total = sum(ce[c].sum() for c in kept)
    name = mode if isinstance(mode, str) else resolve(mode).name
    if name in ("token", "dapo"):
        return total / sum(n)
    if name == "sample":
        return sum(ce[c].mean() for c in kept) / len(kept)
    if name == "grpo":
        return sum(ce[c].mean() for c in kept) / every
    if name == "sqrt":
        return sum(ce[c].sum() / math.sqrt(n[c]) for c in kept) / sum(math.sqrt(n[c]) for c in kept)
    if name == "seq-mean-token-sum":
        return total / len(kept)
    if name.startswith("seq-mean-token-sum-norm"):
        return total / L_MAX
    if name.startswith("dr_grpo"):
        return total / (every * L_MAX)
    weights = [w[c] if isinstance(mode, ColumnWeighting) else float(np.log1p(n[c])) for c in range(len(docs))]
    den = sum(weights[c] * n[c] for c in kept)
    return sum(weights[c] * ce[c].sum() for c in kept) / den if den else zero


def collator(kind, mode):
    if kind == "free":
        return PaddingFreeCollator(loss_weighting=mode)
    if kind == "padded":
        return PaddedCollator(loss_weighting=mode)
    if kind == "rows":
        return PackedRowsCollator(window=5, loss_weighting=mode)
    return FixedWindowCollator(window=5, overflow="split", strategy="next_fit", loss_weighting=mode)


def packed_rows(examples):
    """``examples`` packed offline into rows of 5 tokens (``pack_dataset``, split, each piece's example
    recorded), and each example's ``(piece starts, pieces)``."""
    datasets = pytest.importorskip("datasets")
    from packkit.offline import pack_dataset

    ds = datasets.Dataset.from_list([{"input_ids": ex["input_ids"], "labels": ex["labels"]} for ex in examples])
    out, plan = pack_dataset(ds, window=5, overflow="split", shuffle=False, example_ids=True, return_report=True)
    return list(out), plan


def packed_loss(model, docs, mode, parts, kind):
    """The step's loss: ``parts`` (lists of document indices) collated as micro-batches, one
    ``accumulation_step``, every micro-batch's loss summed. Also the pieces' dropped first labels, and the
    rows each document's pieces took (packed offline: ``kind="rows"``)."""
    coll = collator(kind, mode)
    mbs, dropped, pieces = [], {}, {}
    for part in parts:
        examples = [docs[i] for i in part]
        if kind == "rows":
            rows, plan = packed_rows(examples)
            for ex, start in zip(plan.seg_example.tolist(), plan.seg_start.tolist()):
                pieces[part[ex]] = pieces.get(part[ex], 0) + 1
                if start > 0:
                    dropped.setdefault(part[ex], set()).add(start)
            batch = coll(rows)
        elif kind == "split":
            batch, plan = coll._pack(examples)
            for ex, start in zip(plan.seg_example.tolist(), plan.seg_start.tolist()):
                if start > 0:
                    dropped.setdefault(part[ex], set()).add(start)
        else:
            batch = coll(examples)
        mbs.append(batch)
    step = accumulation_step(mbs, all_reduce=False)
    return sum(step.loss(model(mb["input_ids"]), mb) for mb in mbs), dropped, pieces


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def check_equal(docs, mode, parts, kind):
    model = tiny_token_lm(VOCAB, 4)
    got, dropped, pieces = packed_loss(model, docs, mode, parts, kind)
    got.backward()
    g_got = grads(model)
    ref_model = tiny_token_lm(VOCAB, 4)
    want = reference_loss(ref_model, docs, mode, dropped, pieces)
    want.backward()
    g_want = grads(ref_model)
    err, gerr = abs(float(got.detach()) - float(want.detach())), float((g_got - g_want).abs().max())
    print(f"{getattr(mode, 'name', mode):>28} {kind:>6}: loss {float(got.detach()):.6f} vs {float(want.detach()):.6f} (|d| {err:.1e}), max |d grad| {gerr:.1e}")
    assert err <= 1e-12 and gerr <= 1e-12


@st.composite
def step_of_documents(draw):
    n = draw(st.integers(1, 10))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    docs = []
    for _ in range(n):
        length = draw(st.sampled_from([1, 2, 3, 5, 7, 12]))
        ids = rng.integers(0, VOCAB, length).tolist()
        masked = rng.random(length) < draw(st.sampled_from([0.0, 0.3, 1.0]))
        docs.append({"input_ids": ids, "labels": [IGNORE if m else x for x, m in zip(ids, masked)],
                     "w": float(rng.uniform(0.1, 3.0))})
    k = draw(st.integers(1, min(8, n)))  # micro-batches of the step (every rank's, summed)
    order = rng.permutation(n)
    cuts = np.sort(rng.choice(np.arange(1, n), k - 1, replace=False)) if k > 1 else []
    parts = [p.tolist() for p in np.split(order, cuts)]
    return docs, parts


@pytest.mark.parametrize("kind", ["free", "padded", "split", "rows"])
@pytest.mark.parametrize("m", range(len(MODES)), ids=[getattr(m, "name", m) for m in MODES])
@settings(deadline=None, max_examples=3)
@given(case=step_of_documents())
def test_every_mode_equals_its_unpacked_definition(m, kind, case):
    """Every mode with every collator, on every profile (hypothesis draws the packings): 1-8 micro-batches,
    documents without loss tokens, split documents (by FixedWindowCollator, whose pieces keep one |O_c|, and
    offline by pack_dataset into rows that PackedRowsCollator reads with each piece's example): loss and
    gradients equal the reference within 1e-12. Column weights are refused on packed rows, in one line."""
    docs, parts = case
    if kind == "rows" and isinstance(MODES[m], ColumnWeighting):
        with pytest.raises(ValueError, match=r"loss_weighting=Column\('w'\) weighs .*example"):
            packed_loss(tiny_token_lm(VOCAB, 4), docs, MODES[m], parts, kind)
        return
    check_equal(docs, MODES[m], parts, kind)


@pytest.mark.parametrize("mode", [Column("w"), Weights(np.log1p)], ids=["column", "callable"])
def test_a_step_whose_weights_sum_below_one_divides_by_them(mode):
    """One document weighing 0.148 with one loss token: Z = 0.148, and the loss is that token's cross entropy.
    The division floored Z at 1, as for a token count, and gave 0.148 of it under a column of weights (found
    by a random seed)."""
    docs = [{"input_ids": [11, 8], "labels": [11, 8], "w": 0.14793014303273438}]
    for kind in ("free", "padded", "split"):
        check_equal(docs, mode, [[0]], kind)


def test_split_document_keeps_one_count():
    """A 12-token document split into windows of 5 is one document: under "sample" its pieces share
    1/|O_c| (per piece, the two 2-token documents of the step would weigh as much as the long one)."""
    docs = [{"input_ids": list(range(1, 13)), "labels": list(range(1, 13))},
            {"input_ids": [3, 4], "labels": [3, 4]}]
    batch = collator("split", "sample")(docs)
    weights = batch.loss_weight[batch.labels != IGNORE]
    assert sorted(set(weights.tolist())) == pytest.approx([1 / 9, 1.0])  # 12 tokens - 3 first labels
    assert batch.loss_norm == 2.0
    check_equal(docs, "sample", [[0, 1]], "split")


@pytest.mark.parametrize("mode", ["grpo", DrGRPO(L_MAX)], ids=["grpo", "dr_grpo"])
def test_an_empty_completion_split_offline_counts_once(mode):
    """A completion without loss tokens, 12 tokens split offline into 3 rows of 5, is one completion of TRL's
    ``|B|``: 2 for this step, not 4 (each piece counted, as the rows' example_loss alone cannot tell the first
    piece; the collator now reads piece_offsets). The loss was half the reference's."""
    docs = [{"input_ids": list(range(1, 13)), "labels": [IGNORE] * 12}, {"input_ids": [3, 4, 5], "labels": [3, 4, 5]}]
    rows, plan = packed_rows(docs)
    assert (plan.seg_example == 0).sum() == 3  # split into three pieces, each in a row of its own
    batch = collator("rows", mode)(rows)
    assert accumulation_step([batch], all_reduce=False).loss_normalizer == pytest.approx(
        2.0 if mode == "grpo" else 2.0 * L_MAX)
    check_equal(docs, mode, [[0, 1]], "rows")
    for row in rows:
        del row["piece_offsets"]
    with pytest.raises(ValueError, match=r"^example 0 has no 'piece_offsets'; packed rows whose example_loss has a 0 "
                                         r"record piece_offsets too"):
        collator("rows", mode)(rows)


def test_document_without_loss_tokens_weighs_zero():
    docs = [{"input_ids": [1, 2, 3], "labels": [IGNORE] * 3, "w": 1.0}, {"input_ids": [4], "labels": [4], "w": 2.0}]
    for mode in MODES:
        batch = PaddingFreeCollator(loss_weighting=mode)(docs)
        assert torch.isfinite(batch.loss_weight).all() and float(batch.loss_weight.abs().sum()) == 0
        model = tiny_token_lm(VOCAB, 4)
        step = accumulation_step([batch], all_reduce=False)
        loss = step.loss(model(batch["input_ids"]), batch)
        loss.backward()
        assert float(loss.detach()) == 0 and torch.isfinite(grads(model)).all()


def _logits_with_ce(values):
    """(T, 2) float64 logits whose cross entropy against target 1 is ``values[t]``."""
    v = torch.tensor(values, dtype=torch.float64)
    return torch.stack([torch.zeros_like(v), -torch.log(torch.expm1(v))], -1)


def test_per_micro_batch_sample_mean_regression():
    """The per-micro-batch bug (TRL #7206's two micro-batches, GRPO's per-sequence mean): micro-batch 0 holds
    one sequence whose tokens lose 2.0 each, micro-batch 1 nine sequences whose tokens lose 0.5. Each
    micro-batch's own mean, averaged over micro-batches, gives 1.25; the mean over the step's ten sequences
    is (2.0 + 9 * 0.5) / 10 = 0.65, which accumulation_step gives."""
    mb0 = PaddingFreeCollator(loss_weighting="grpo")([{"input_ids": [1, 1, 1], "labels": [1, 1, 1]}])
    mb1 = PaddingFreeCollator(loss_weighting="grpo")([{"input_ids": [1, 1], "labels": [1, 1]}] * 9)
    ce = {id(mb0): [2.0, 2.0, 2.0], id(mb1): [0.5] * 18}
    naive = sum(token_normalized_loss(_logits_with_ce(ce[id(mb)])[None], torch.ones_like(mb["labels"]) * 0 +
                                      mb["labels"], loss_weight=mb.loss_weight, num_loss_tokens=mb.loss_norm)
                for mb in (mb0, mb1)) / 2
    step = accumulation_step([mb0, mb1], all_reduce=False)
    exact = sum(step.loss(_logits_with_ce(ce[id(mb)])[None], mb) for mb in (mb0, mb1))
    print(f"per micro-batch {float(naive):.4f}, over the step {float(exact):.4f}")
    assert float(naive) == pytest.approx(1.25, abs=1e-12)
    assert float(exact) == pytest.approx(0.65, abs=1e-12)
    assert step.loss_normalizer == 10.0 and step.loss_weighting == "grpo"  # TRL's: "sample", empty ones counted


def test_mixed_weightings_in_one_step_refused():
    a = PaddingFreeCollator(loss_weighting="sample")([{"input_ids": [1, 2]}])
    b = PaddingFreeCollator()([{"input_ids": [1, 2]}])
    with pytest.raises(ValueError, match="micro-batch 1 was collated under loss_weighting='token'"):
        accumulation_step([a, b], all_reduce=False)


def test_bad_weightings_refused_in_one_line():
    with pytest.raises(ArgumentError, match="one of"):
        resolve("median")
    with pytest.raises(ArgumentError, match="SeqSumNorm"):
        resolve("seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="no example carries one.*remove_unused_columns=False"):
        PaddingFreeCollator(loss_weighting=Column("w"))([{"input_ids": [1, 2]}])
    with pytest.raises(ValueError, match="example 1 has w=-1.0 < 0"):
        PaddingFreeCollator(loss_weighting=Column("w"))([{"input_ids": [1, 2], "w": 1}, {"input_ids": [1], "w": -1}])
    with pytest.raises(ArgumentError, match="callable gave"):
        PaddingFreeCollator(loss_weighting=lambda n: -n)([{"input_ids": [1, 2]}])


def test_weights_survive_moves_and_pickling():
    """The weights ride on the labels (their note): ``.to()``, a copy, a pickle (a DataLoader worker's
    queue) and a popped label tensor (``Trainer`` with ``compute_loss_func``) keep them."""
    import pickle

    batch = PaddingFreeCollator(loss_weighting="sample")([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    want = batch.loss_weight.clone()
    for other in (batch.to("cpu"), batch.copy(), pickle.loads(pickle.dumps(batch)), type(batch)(dict(batch))):
        torch.testing.assert_close(other.loss_weight, want)
        assert other.loss_norm == 2.0 and other.loss_weighting == "sample"
    assert batch.loss_weight.dtype == torch.float32 and batch.loss_weight.shape == batch.labels.shape
    labels = batch.pop("labels")
    model = tiny_token_lm(VOCAB, 4)
    out = {"logits": model(batch["input_ids"])}
    got = hf_compute_loss_func(out, labels, num_items_in_batch=3)
    ref = reference_loss(tiny_token_lm(VOCAB, 4), [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]},
                                                   {"input_ids": [4, 5], "labels": [4, 5]}], "sample")
    assert abs(float(got) - float(ref)) < 1e-12
    with pytest.raises(ValueError, match="WeightedLossMixin"):
        hf_compute_loss_func(out, labels, num_items_in_batch=7)  # the step holds more than this micro-batch


# -- real ranks (gloo): the step's Z rides in accumulation_step's one collective --------------------------

DDP_MODES = ["sample", "sqrt", Column("w"), DrGRPO(L_MAX), SeqSumNorm(L_MAX)]


def ddp_documents():
    """24 documents of 1-30 tokens, masked prompts (some wholly masked), dealt to ranks below."""
    rng = np.random.default_rng(7)
    docs = []
    for i in range(24):
        length = int(rng.integers(1, 31))
        ids = rng.integers(0, VOCAB, length).tolist()
        prompt = length if i % 7 == 3 else int(rng.integers(0, length))
        docs.append({"input_ids": ids, "labels": [IGNORE] * prompt + ids[prompt:], "w": float(rng.uniform(0.1, 3))})
    return docs


def rank_parts(rank, world_size, accumulation):
    """Rank ``rank``'s micro-batches: documents dealt round-robin to ``world_size * accumulation`` slots."""
    slots = world_size * accumulation
    return [[i for i in range(24) if i % slots == rank * accumulation + j] for j in range(accumulation)]


def ddp_worker(rank, world_size, accumulation, port, out_dir):
    import os

    from torch.nn.parallel import DistributedDataParallel as DDP

    with gloo_group(rank, world_size, port=port, timeout_s=60):
        docs, out = ddp_documents(), {}
        for mode in DDP_MODES:
            model = DDP(tiny_token_lm(VOCAB, 4))
            coll = PaddingFreeCollator(loss_weighting=mode)
            mbs = [coll([docs[i] for i in part]) for part in rank_parts(rank, world_size, accumulation)]
            step = accumulation_step(mbs)  # the one collective: counts and Z
            for i, mb in enumerate(mbs):
                if i < len(mbs) - 1:
                    with model.no_sync():
                        step.loss(model(mb["input_ids"]), mb).backward()
                else:
                    step.loss(model(mb["input_ids"]), mb).backward()
            out[resolve(mode).name] = grads(model.module)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_real_ranks_equal_the_reference(tmp_path, world_size):
    """Uneven micro-batches on 1, 2 and 4 gloo ranks (DDP averaging, 2 micro-batches a rank): every rank's
    gradient equals the unpacked reference gradient of each mode within 1e-12."""
    from testlib import free_port, run_processes

    run_processes(ddp_worker, world_size, (world_size, 2, free_port(), str(tmp_path)), timeout_s=120 * max(world_size, 2))
    docs = ddp_documents()
    for mode in DDP_MODES:
        model = tiny_token_lm(VOCAB, 4)
        reference_loss(model, docs, mode).backward()
        want = grads(model)
        for rank in range(world_size):
            got = torch.load(tmp_path / f"rank{rank}.pt")[resolve(mode).name]
            err = float((got - want).abs().max())
            print(f"{resolve(mode).name:>28} rank {rank}/{world_size}: max |d grad| {err:.1e}")
            assert err <= 1e-12


# -- elastic resume: the global steps, so every weight, survive a new world size ----------------------------


def step_weights(sched, examples, mode):
    """``{example: a_c / Z}`` over every whole step of a sampler's schedule: each step's micro-batches (every
    rank's) collated, ``Z`` from their accumulation_step."""
    from packkit.batch import loss_factors

    coll, R, out = PaddingFreeCollator(loss_weighting=mode), sched.world_size, {}
    for s in range(sched.step_start.size):
        lo, hi = int(sched.step_row[s]), int(sched.step_row[s + 1])
        if lo < 0:
            continue
        parts = [sched.flat[sched.ptr[b]:sched.ptr[b + 1]].tolist() for b in range(lo * R, hi * R)]
        parts = [p for p in parts if p]
        mbs = [coll([examples[i] for i in p]) for p in parts]
        z = accumulation_step(mbs, all_reduce=False).loss_normalizer
        for part, mb in zip(parts, mbs):
            factors, cu = loss_factors(mb["labels"])[0].reshape(-1), mb.cu_seqlens.tolist()
            for i, ex in enumerate(part):
                out[ex] = float(factors[cu[i]:cu[i + 1]].max()) / z
    return out


@pytest.mark.parametrize("new_world", [1, 4])
def test_resume_onto_another_world_size_keeps_every_weight(new_world):
    """A run on 2 ranks (4 micro-batches a step) saved after two steps and resumed on 1 or 4 ranks: every
    example left gets the weight a_c / Z it had in the uninterrupted run (the global steps are the same)."""
    from packkit.sampler import PackedBatchSampler

    rng = np.random.default_rng(5)
    lengths = rng.integers(2, 40, 90)
    examples = []
    for n in lengths.tolist():
        ids = rng.integers(0, VOCAB, n).tolist()
        prompt = int(rng.integers(0, n + 1))
        examples.append({"input_ids": ids, "labels": [IGNORE] * prompt + ids[prompt:]})
    for mode in ("sample", "sqrt", DrGRPO(L_MAX)):
        a = PackedBatchSampler(lengths, window=64, step_batches=4, rank=0, world_size=2, seed=3)
        b = PackedBatchSampler(lengths, window=64, step_batches=4, rank=0, world_size=new_world, seed=3)
        whole = step_weights(a.schedule(), examples, mode)
        b.load_state_dict(a.state_dict(batches_consumed=4))  # two whole steps of 2 rows
        resumed = step_weights(b.schedule(), examples, mode)
        done = a.schedule().ptr[4 * 2]  # the examples of the first 4 rows of 2 ranks
        assert resumed and len(resumed) + done == len(whole)
        worst = max(abs(resumed[e] - whole[e]) for e in resumed)
        print(f"{resolve(mode).name}: {len(resumed)} examples after the resume on {new_world} ranks, max |d w| {worst:.1e}")
        assert worst <= 1e-15


# -- context parallelism: the factors of the whole row, taken by each CP rank -------------------------------


@pytest.mark.parametrize("layout", ["zigzag", "contiguous", "ulysses", "hybrid"])
@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_cp_shards_sum_to_the_whole_row(layout, cp_size):
    """A packed row sharded over a CP group (every layout, 1/2/4 ranks): each rank's weighted loss, its weights
    taken by the shard from the whole row's factors (shifted with the labels), sums to the row's loss within
    1e-12; no rank needs another's |O_c|."""
    from packkit.batch import loss_factors
    from packkit.cp import shard

    rng = np.random.default_rng(cp_size)
    docs = []
    for n in (17, 3, 29, 8, 1, 12):
        ids = rng.integers(0, VOCAB, n).tolist()
        docs.append({"input_ids": ids, "labels": [IGNORE] * (n // 3) + ids[n // 3:]})
    model = tiny_token_lm(VOCAB, 4)
    for mode in ("sample", "sqrt", DrGRPO(L_MAX)):
        batch = PaddingFreeCollator(loss_weighting=mode)(docs)
        step = accumulation_step([batch], all_reduce=False)
        whole = step.loss(model(batch["input_ids"]), batch)
        factors = loss_factors(batch["labels"])[0]
        shifted = F.pad(factors[..., 1:], (0, 1))  # the weight of each token's target, as shift_labels
        parts = []
        for rank in range(cp_size):
            part = shard(batch, cp_size=cp_size, rank=rank, cp_layout=layout)
            parts.append(token_normalized_loss(model(part.input_ids), part.shift_labels, shifted=True,
                                               loss_weight=part.take(shifted)[None], num_loss_tokens=step.loss_normalizer))
        err = abs(float(sum(parts).detach()) - float(whole.detach()))
        print(f"{resolve(mode).name} {layout} cp={cp_size}: |sum of ranks - row| {err:.1e}")
        assert err <= 1e-12


def test_weighing_keeps_the_labels_loss_token_count():
    """Regression: ``PackedBatch._weigh`` dropped every ``loss_`` note of the labels, the collator's loss-token
    count (``loss_tokens``) with the weighting's, so ``accumulation_step`` recounted every weighted batch over all
    its labels. The count stays; a batch weighed again drops the old weights only."""
    from packkit.batch import _note

    docs = [{"input_ids": list(range(1, n + 1)), "labels": [IGNORE] * (n // 2) + list(range(n // 2 + 1, n + 1))}
            for n in (5, 9, 40, 3)]
    for coll in (PaddingFreeCollator(loss_weighting="sample"),
                 FixedWindowCollator(window=16, overflow="split", loss_weighting="sqrt"),
                 PackedRowsCollator(window=64, loss_weighting="sample")):
        batch = coll(docs if not isinstance(coll, PackedRowsCollator) else
                     [{"input_ids": sum((d["input_ids"] for d in docs), []), "labels": sum((d["labels"] for d in docs), []),
                       "seq_lengths": [len(d["input_ids"]) for d in docs]}])
        note = _note(batch["labels"])
        assert note.get("loss_tokens") == int(batch["labels"].ne(IGNORE).sum()), (type(coll).__name__, sorted(note))
        first = batch.loss_weight.clone()
        batch._weigh(resolve("sample" if coll.loss_weighting.name == "sqrt" else "sqrt"), cu=batch.cu_seqlens)
        assert "loss_factor" not in note and "loss_tokens" in note and not torch.equal(batch.loss_weight, first)


def test_verl_per_micro_batch_and_tunix_per_row_regressions():
    """The other per-micro-batch and per-row reductions the issue cites, each against the optimiser step's formula.

    verl's ``loss_agg_mode="seq-mean-token-sum"`` reduces over the tensor it is given, a micro-batch: on TRL #7206's
    two micro-batches (one sequence of two loss tokens losing 2.0 each; nine of one token losing 0.5) the mean of
    the micro-batches' own means is (4.0 + 4.5 / 9) / 2 = 2.25; over the step's ten sequences it is 8.5 / 10 = 0.85.
    google/tunix #1662: under packing a per-sequence mean taken per packed row treats the row as one sequence: rows
    [A(2 tokens, 2.0) B(1, 0.5)] and [C(1, 0.5) D(1, 0.5)] give (4.5 / 3 + 0.5) / 2 = 1.0 against the documents'
    (2.0 + 0.5 + 0.5 + 0.5) / 4 = 0.875."""
    mb0 = PaddingFreeCollator(loss_weighting="seq-mean-token-sum")([{"input_ids": [1, 1, 1]}])
    mb1 = PaddingFreeCollator(loss_weighting="seq-mean-token-sum")([{"input_ids": [1, 1]}] * 9)
    ce = {id(mb0): [2.0] * 3, id(mb1): [0.5] * 18}
    step = accumulation_step([mb0, mb1], all_reduce=False)
    exact = float(sum(step.loss(_logits_with_ce(ce[id(mb)])[None], mb) for mb in (mb0, mb1)))
    naive = (2 * 2.0 / 1 + 9 * 0.5 / 9) / 2
    print(f"verl seq-mean-token-sum: per micro-batch {naive:.4f}, over the step {exact:.4f}")
    assert exact == pytest.approx(0.85, abs=1e-12) and naive == pytest.approx(2.25)

    rows = [{"input_ids": [1] * 5, "seq_lengths": [3, 2]}, {"input_ids": [1] * 4, "seq_lengths": [2, 2]}]
    mb = PackedRowsCollator(window=5, loss_weighting="sample")(rows)
    logits = _logits_with_ce([2.0, 2.0, 2.0, 0.5, 0.5] + [0.5] * 5).reshape(2, 5, 2)
    exact = float(accumulation_step([mb], all_reduce=False).loss(logits, mb))
    per_row = ((2 * 2.0 + 0.5) / 3 + (0.5 + 0.5) / 2) / 2
    print(f"tunix per-row mean {per_row:.4f}, per document {exact:.4f}")
    assert exact == pytest.approx(0.875, abs=1e-12) and per_row == pytest.approx(1.0)
