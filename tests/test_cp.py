"""packkit.cp on one process: what every rank holds (properties over hypothesis-drawn lengths), the
consumers' arguments on known cases, and the regressions other stacks shipped.

The distributed half (gloo processes, attention equal to the unsharded one) is tests/test_cp_distributed.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from packkit.collate import FixedWindowCollator, PaddingFreeCollator
from packkit.cp import plan_batch, restore, shard
from packkit.cp_plan import LAYOUTS, cp_padding, plan_cp
from packkit.segments import IGNORE_INDEX, lengths_to_cu_seqlens


def examples(lengths, seed=0):
    """Tokenized examples of the given lengths; a third of each is a masked prompt."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(1, 100, n).tolist()
        out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * (n // 3) + ids[n // 3:]})
    return out


def unsharded_targets(batch):
    """The target of every token of the batch, flat: the label of the next token of its row, -100 at a
    row's end (the slow obvious way, per token)."""
    labels = batch.labels.tolist()
    return [row[t + 1] if t + 1 < len(row) else IGNORE_INDEX for row in labels for t in range(len(row))]


lengths_st = st.lists(st.integers(1, 40), min_size=1, max_size=7)


@given(lengths=lengths_st, cp=st.sampled_from([1, 2, 3, 4, 8]), layout=st.sampled_from(LAYOUTS),
       windows=st.booleans())
def test_every_rank_keeps_what_the_row_meant(lengths, cp, layout, windows):
    """Every real token on exactly one rank; positions are the unsharded per-document ones (restart at
    every document); each token's shifted label is the unsharded one; loss counts sum to the global
    count, which every rank carries; restore(shard(x)) == x; every rank holds the same number of tokens."""
    if windows:  # [B, W] windows with padding tails (segments of their own)
        batch = FixedWindowCollator(window=max(lengths) + 5, strategy="next_fit")(examples(lengths))
    else:
        batch = PaddingFreeCollator()(examples(lengths))
    shards = [shard(batch, cp_size=cp, rank=r, cp_layout=layout) for r in range(cp)]
    T = batch.input_ids.numel()
    sources = torch.cat([s.index for s in shards])
    real = sources[sources >= 0]
    assert sorted(real.tolist()) == list(range(T))  # every token exactly once
    assert len({s.input_ids.shape[1] for s in shards}) == 1
    flat_pos = batch.position_ids.reshape(-1)
    flat_seg = batch.seq_idx.reshape(-1)
    targets = unsharded_targets(batch)
    for s in shards:
        keep = s.index >= 0
        assert torch.equal(s.position_ids[0][keep], flat_pos[s.index[keep]])
        assert torch.equal(s.seq_idx[0][keep].long(), flat_seg[s.index[keep]].long())
        assert s.shift_labels[0][keep].tolist() == [targets[i] for i in s.index[keep].tolist()]
        assert (s.shift_labels[0][~keep] == IGNORE_INDEX).all()
        assert s.num_loss_tokens == batch.num_loss_tokens
        assert s.max_seqlen == batch.max_seqlen
        assert isinstance(s.max_seqlen, int)
    assert sum(s.num_local_loss_tokens for s in shards) == batch.num_loss_tokens
    plan = shards[0].plan
    for name in ("input_ids", "position_ids"):
        assert torch.equal(restore([getattr(s, name) for s in shards], plan=plan, shape=batch.input_ids.shape),
                           getattr(batch, name))
    assert torch.equal(restore([s.shift_labels for s in shards], plan=plan), torch.tensor(targets))
    assert plan.padding_tokens == cp * plan.local_len - T >= 0
    if layout == "zigzag":
        assert (plan.padded % (2 * cp) == 0).all()
        assert plan.padding_tokens == cp_padding(plan.lengths, cp_size=cp, cp_layout="zigzag")
    if layout in ("contiguous", "ulysses"):
        assert plan.padding_tokens == (-T) % cp
    if layout == "hybrid":
        assert (plan.padded[:plan.num_segments] == plan.lengths[:plan.num_segments]).all()  # no padding inside
        assert plan.padding_tokens < cp


def test_megatron_5243_positions_and_packed_table_index():
    """Megatron-LM #5243: cu_seqlens=[0, 4, 8], cp=2: rank 0 holds tokens [0, 3, 4, 7] of the packed row
    (the rows of a packed per-token RoPE table it must read), whose per-document positions are
    [0, 3, 0, 3]. Megatron read the table at [0, 3, 0, 3], reusing sequence 0's positions."""
    batch = PaddingFreeCollator()(examples([4, 4]))
    s0 = shard(batch, cp_size=2, rank=0, cp_layout="zigzag")
    assert s0.index.tolist() == [0, 3, 4, 7]
    assert s0.position_ids.tolist() == [[0, 3, 0, 3]]
    table = torch.randn(8, 6)  # a packed per-token table (freqs.size(0) == cu_seqlens[-1])
    assert torch.equal(s0.take(table), table[[0, 3, 4, 7]])
    te = s0.te_params()
    assert te.cu_seqlens_q.tolist() == [0, 4, 8] and te.cu_seqlens_q_padded.tolist() == [0, 4, 8]


def test_te_params_padded_and_real_cannot_be_swapped():
    """TE #1409 (NaNs from cu_seqlens given for cu_seqlens_padded): the padded offsets are a view of their
    own, each length a multiple of 2*cp, checked against the real ones; a swap raises."""
    batch = PaddingFreeCollator()(examples([9, 3, 4]))
    te = shard(batch, cp_size=2, rank=1, cp_layout="zigzag").te_params()
    assert te.qkv_format == "thd"
    assert te.cu_seqlens_q.tolist() == te.cu_seqlens_kv.tolist() == [0, 9, 12, 16]
    assert te.cu_seqlens_q_padded.tolist() == te.cu_seqlens_kv_padded.tolist() == [0, 12, 16, 20]
    assert te.max_seqlen_q == te.max_seqlen_kv == 12 and isinstance(te.max_seqlen_q, int)
    swapped = te._replace(cu_seqlens_q=te.cu_seqlens_q_padded, cu_seqlens_q_padded=te.cu_seqlens_q)
    with pytest.raises(ValueError, match="are they swapped"):
        swapped.check(2)
    with pytest.raises(ValueError, match="cp_layout='zigzag'"):
        shard(batch, cp_size=2, rank=0, cp_layout="contiguous").te_params()


def test_llama3_args_match_ring_flash_attn_example():
    """ring-flash-attn's own example (cu_seqlens=[0, 7, 14, 16], world 8: 2 tokens a rank): rank 3 holds
    tokens 6..7 (doc 0's last, doc 1's first), keys from doc 0's start; max_seqlen are Python ints."""
    batch = PaddingFreeCollator()(examples([7, 7, 2]))
    a = shard(batch, cp_size=8, rank=3, cp_layout="contiguous").llama3_args()
    assert a.cu_seqlens_q.tolist() == [0, 1, 2]
    assert a.cu_seqlens_k.tolist() == [0, 7, 8]
    assert a.local_k_slice == slice(0, 8)
    assert (a.max_seqlen_q, a.max_seqlen_k) == (1, 7) and all(type(x) is int for x in a[2:4])
    a = shard(batch, cp_size=8, rank=7, cp_layout="contiguous").llama3_args()
    assert a.cu_seqlens_q.tolist() == [0, 2] and a.cu_seqlens_k.tolist() == [0, 2] and a.local_k_slice == slice(14, 16)


def test_zigzag_indices_equal_torch_head_tail_load_balancer():
    """One document filling the row: the zigzag order (the plan's numpy index, the shard's tensor) is torch's
    own head-tail load balancer's."""
    lb = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._load_balancer")
    batch = PaddingFreeCollator()(examples([64]))
    for cp in (2, 4, 8):
        s = shard(batch, cp_size=cp, rank=0, cp_layout="zigzag")
        for restore_ in (False, True):
            theirs = lb._HeadTailLoadBalancer(64, cp, "cpu")._generate_indices(restore=restore_).long()
            assert torch.equal(torch.from_numpy(s.plan.rearrange_index(restore=restore_)), theirs)
            assert torch.equal(s.torch_indices(restore=restore_), theirs)


def test_hybrid_balances_short_documents_and_pads_little():
    """Many short documents and a long one: the hybrid adds under cp tokens of padding and keeps the
    ranks' causal work within 5% of each other; contiguous pieces give the last ranks far more."""
    rng = np.random.default_rng(0)
    lengths = np.append(rng.integers(20, 600, 60), 9000)
    hybrid = plan_cp(lengths, cp_size=8, cp_layout="hybrid")
    contiguous = plan_cp(lengths, cp_size=8, cp_layout="contiguous")
    assert hybrid.padding_tokens < 8
    assert hybrid.work().max() / hybrid.work().mean() < 1.05
    assert hybrid.work().sum() == contiguous.work().sum()  # the same attention, placed otherwise
    assert contiguous.work().max() / contiguous.work().mean() > hybrid.work().max() / hybrid.work().mean()


def test_bad_arguments_are_one_line_errors():
    batch = PaddingFreeCollator()(examples([5, 3]))
    with pytest.raises(ValueError, match="cp_size must be at least 1, got"):
        shard(batch, cp_size=0, rank=0)
    with pytest.raises(ValueError, match="rank must be between 0 and 1, got"):
        shard(batch, cp_size=2, rank=2)
    with pytest.raises(ValueError, match="unknown CP layout 'ring'"):
        shard(batch, cp_size=2, rank=0, cp_layout="ring")
    with pytest.raises(ValueError, match="made for another batch"):
        shard(batch, cp_size=2, rank=0, cp_layout="zigzag", plan=plan_cp([8], cp_size=2, cp_layout="zigzag"))
    with pytest.raises(ValueError, match="one part per rank"):
        restore([batch.input_ids], plan=plan_cp([5, 3], cp_size=2, cp_layout="zigzag"))
    assert lengths_to_cu_seqlens([5, 3]).tolist() == batch.cu_seqlens.tolist()


def test_the_cp_layout_knob_has_one_name():
    """The CP layout is ``cp_layout`` in every function of the API, as on the command line (``--cp-layout``) and in
    the collators, the budget and the offline packer; ``shard``'s old keyword ``layout=`` still works, with a
    one-line DeprecationWarning naming ``cp_layout``, and gives the same shard."""
    import inspect
    import warnings

    from packkit import cp, cp_plan

    for module in (cp, cp_plan):
        for name in module.__all__:
            fn = getattr(module, name)
            if callable(fn) and not isinstance(fn, type):
                assert "layout" not in inspect.signature(fn).parameters, f"{module.__name__}.{name}"
    assert "cp_layout" in inspect.signature(cp_plan.cp_multiples).parameters
    assert cp_plan.check_cp_window(32, cp_size=4, cp_layout="zigzag") == 32
    assert cp_padding([9, 3, 4], cp_size=2, cp_layout="zigzag") == 4
    batch = PaddingFreeCollator()(examples([9, 3, 4]))
    new = shard(batch, cp_size=2, rank=1, cp_layout="zigzag")
    with pytest.warns(DeprecationWarning) as caught:
        old = shard(batch, cp_size=2, rank=1, layout="zigzag")
    assert len(caught) == 1 and "cp_layout='zigzag'" in str(caught[0].message) and "\n" not in str(caught[0].message)
    assert caught[0].filename == __file__  # the warning names the caller's line
    assert old.layout == "zigzag" and torch.equal(old.input_ids, new.input_ids) and torch.equal(old.index, new.index)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shard(batch, cp_size=2, rank=1, cp_layout="contiguous")  # the new name warns nothing
    with pytest.raises(TypeError, match="layout='zigzag' and cp_layout='contiguous'"):
        shard(batch, cp_size=2, rank=1, cp_layout="contiguous", layout="zigzag")
    with pytest.raises(TypeError, match="unexpected keyword argument 'lay_out'"):
        shard(batch, cp_size=2, rank=1, lay_out="zigzag")


def test_waste_and_plan_count_cp_padding(tmp_path, capsys):
    """The planner learns CP: zigzag pads every example to a multiple of 2*cp before packing (the padding
    fills window slots, never counted as tokens); row layouts need W to be a multiple of cp; the command
    line says so in its own syntax."""
    from packkit.budget import AdviceOptions, plan_budget
    from packkit.cli import main
    from packkit.waste import format_table, measure_waste

    lengths = np.random.default_rng(0).integers(1, 900, 400)
    plain = measure_waste(lengths, window=2048, strategies=("bfd", "random"))
    zig = measure_waste(lengths, window=2048, strategies=("bfd", "random"), cp_size=8, cp_layout="zigzag")
    extra = int((-lengths % 16).sum())
    for a, b in zip(plain.strategies, zig.strategies):
        assert a.real_tokens == b.real_tokens == lengths.sum()
        assert b.padding_fraction > a.padding_fraction
    assert zig.strategies[0].slot_tokens >= lengths.sum() + extra  # windows hold the padded examples
    assert f"padded to a multiple of 16 ({extra:,} tokens" in format_table(zig)
    assert zig.to_dict()["cp_size"] == 8 and zig.to_dict()["cp_layout"] == "zigzag"
    hyb = measure_waste(lengths, window=2048, strategies=("bfd",), cp_size=8, cp_layout="hybrid")
    assert hyb.strategies[0].padding_fraction == plain.strategies[0].padding_fraction
    with pytest.raises(ValueError, match="window=2050 is not a multiple of 16, which cp_layout='zigzag' with "
                                         "cp_size=8 needs; raise window to 2,064"):
        measure_waste(lengths, window=2050, cp_size=8, cp_layout="zigzag")

    b0 = plan_budget(lengths, per_device_batch=1, window=2048, advice=AdviceOptions(warn=False))
    b8 = plan_budget(lengths, per_device_batch=1, window=2048, advice=AdviceOptions(warn=False), cp_size=8,
                     cp_layout="zigzag")
    assert b8.num_tokens == b0.num_tokens == lengths.sum()
    assert b8.padding_fraction > b0.padding_fraction
    assert b8.loss_tokens_per_step.mean * b8.steps_per_epoch == pytest.approx(b0.loss_tokens_per_step.mean
                                                                             * b0.steps_per_epoch, rel=0.05)

    np.save(tmp_path / "lengths.npy", lengths)
    assert main(["waste", str(tmp_path / "lengths.npy"), "-w", "100", "--cp", "3", "--cp-layout", "zigzag"]) == 2
    err = capsys.readouterr().err
    assert "--window 100 is not a multiple of 6, which --cp-layout zigzag with --cp 3 needs; raise --window to 102" in err
    assert main(["plan", str(tmp_path / "lengths.npy"), "-w", "2048", "--cp", "8", "--cp-layout", "zigzag",
                 "--json"]) == 0
    import json

    assert json.loads(capsys.readouterr().out)["padding_fraction"] == pytest.approx(b8.padding_fraction)


def test_rows_packed_for_a_cp_group_fit_their_window_once_sharded(tmp_path):
    """pack_dataset(cp_size=, cp_layout='zigzag') and `packkit pack --cp`: every row's documents, padded
    to a multiple of 2*cp as TE needs, still fit the window, so each rank holds W / cp tokens; rows
    packed without it overflow, and PackedRowsCollator(cp_size=, cp_layout=) refuses them (a file packed
    for another CP size is not used silently)."""
    datasets = pytest.importorskip("datasets")
    import json

    from packkit.cli import main
    from packkit.collate import PackedRowsCollator
    from packkit.offline import pack_dataset

    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 30, 80)
    ds = datasets.Dataset.from_list(examples(lengths))
    W, cp = 64, 4

    def worst(rows):
        return max(int(sum(-(-n // (2 * cp)) * 2 * cp for n in r)) for r in rows["seq_lengths"])

    plain = pack_dataset(ds, window=W)
    packed = pack_dataset(ds, window=W, cp_size=cp, cp_layout="zigzag")
    assert worst(plain) > W >= worst(packed)
    assert sum(map(sum, packed["seq_lengths"])) == lengths.sum()  # no token lost or added
    # a row as TE's THD batch (its documents, no padding tail): every rank holds at most W / cp tokens
    assert max(plan_cp(r, cp_size=cp, cp_layout="zigzag").local_len for r in packed["seq_lengths"]) <= W // cp
    assert max(plan_cp(r, cp_size=cp, cp_layout="zigzag").local_len for r in plain["seq_lengths"]) > W // cp
    batch = PackedRowsCollator(window=W, cp_size=cp, cp_layout="zigzag")([packed[i] for i in range(len(packed))])
    assert shard(batch, cp_size=cp, rank=0, cp_layout="zigzag").num_loss_tokens == batch.num_loss_tokens
    # rows packed for no CP are refused by a collator told the CP group they go to, naming the row and the fix
    with pytest.raises(ValueError, match=r"once padded to multiples of 8 for cp_size=4 cp_layout='zigzag' > "
                                         r"window=64: the rows were packed for another CP size; repack with "
                                         r"pack_dataset\(..., cp_size=4, cp_layout='zigzag'\)"):
        PackedRowsCollator(window=W, cp_size=cp, cp_layout="zigzag")([plain[i] for i in range(len(plain))])
    PackedRowsCollator(window=W, cp_size=cp, cp_layout="hybrid")([plain[i] for i in range(len(plain))])
    with pytest.raises(ValueError, match="not a multiple of 8"):
        pack_dataset(ds, window=60, cp_size=cp, cp_layout="zigzag")

    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"input_ids": e["input_ids"]}) + "\n" for e in examples(lengths)))
    out = tmp_path / "packed.parquet"
    assert main(["pack", str(path), str(out), "-w", str(W), "--cp", str(cp), "--cp-layout", "zigzag", "--json",
                 "-q"]) == 0
    written = datasets.Dataset.from_parquet(str(out))
    assert worst(written) <= W and sum(map(sum, written["seq_lengths"])) == lengths.sum()


@given(lengths=lengths_st, cp=st.sampled_from([1, 2, 3, 4, 8]), layout=st.sampled_from(LAYOUTS),
       windows=st.booleans())
def test_a_batch_planned_once_shards_as_one_each_rank_plans(lengths, cp, layout, windows):
    """``plan_batch`` (what a collator runs in its DataLoader worker) keeps the plan with the batch, through
    pickling and ``.to()``; every rank's ``shard`` of it equals the shard the rank plans itself, field by field.
    A batch whose ``input_ids`` no longer match the planned segments is refused in one line."""
    import pickle

    if windows:
        batch = FixedWindowCollator(window=max(lengths) + 5, strategy="next_fit")(examples(lengths))
    else:
        batch = PaddingFreeCollator()(examples(lengths))
    want = [shard(batch, cp_size=cp, rank=r, cp_layout=layout) for r in range(cp)]
    plan = plan_batch(batch, cp_size=cp, cp_layout=layout)
    moved = pickle.loads(pickle.dumps(batch)).to("cpu")
    for r, w in enumerate(want):
        s = shard(moved, cp_size=cp, rank=r, cp_layout=layout)
        assert s.plan.local_len == plan.local_len and s.plan.layout == layout
        for name in ("input_ids", "shift_labels", "position_ids", "seq_idx", "index"):
            assert getattr(s, name).dtype == getattr(w, name).dtype and torch.equal(getattr(s, name), getattr(w, name))
        assert (s.num_loss_tokens, s.num_local_loss_tokens, s.max_seqlen) == \
            (w.num_loss_tokens, w.num_local_loss_tokens, w.max_seqlen)
    moved["input_ids"] = torch.cat([moved["input_ids"], moved["input_ids"]], -1)
    with pytest.raises(ValueError, match="cu_seqlens covers"):
        shard(moved, cp_size=cp, rank=0, cp_layout=layout)


def ref_tokens_and_documents(cu, labels):
    """The slow obvious count: a segment of a row's end whose every label is -100 is padding; the others with
    tokens are documents. ``(real tokens, documents)``."""
    flat, width = labels.reshape(-1).tolist(), labels.shape[-1]
    cu = [int(c) for c in cu]
    tokens, docs = len(flat), 0
    for a, b in zip(cu[:-1], cu[1:]):
        if b == a:
            continue
        if b % width == 0 and all(x == IGNORE_INDEX for x in flat[a:b]):
            tokens -= b - a
        else:
            docs += 1
    return tokens, docs


@given(rows=st.lists(st.lists(st.tuples(st.integers(1, 9), st.sampled_from(["loss", "none", "last"])), min_size=1,
                              max_size=5), min_size=1, max_size=4), empty=st.booleans())
def test_the_host_count_of_tokens_and_documents_equals_the_device_one(rows, empty):
    """``real_tokens_and_documents`` on CPU tensors reads only the segments that end a row, on the host; it
    equals the device path (whole-batch tensor passes) and the slow reference on drawn batches: rows of segments
    with loss tokens, none, or only the last one (the host path's shortcut), zero-length segments between."""
    from packkit.batch import _device_tokens_and_documents, real_tokens_and_documents

    width = max(sum(n for n, _ in row) for row in rows)
    labels, cu = [], [0]
    for i, row in enumerate(rows):
        line = []
        for n, kind in row:
            line += {"loss": [5] * n, "none": [IGNORE_INDEX] * n, "last": [IGNORE_INDEX] * (n - 1) + [7]}[kind]
            cu.append(i * width + len(line))
            if empty:
                cu.append(cu[-1])
        if len(line) < width:  # the row's padding tail
            line += [IGNORE_INDEX] * (width - len(line))
            cu.append((i + 1) * width)
        labels.append(line)
    labels, cu = torch.tensor(labels), torch.tensor(cu, dtype=torch.int32)
    want = ref_tokens_and_documents(cu, labels)
    assert tuple(int(x) for x in real_tokens_and_documents(cu, labels)) == want
    assert tuple(int(x) for x in _device_tokens_and_documents(cu, labels)) == want


class _Sizes(torch.utils._python_dispatch.TorchDispatchMode):
    """Every tensor op run under it, with the largest numel of its outputs."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.ops.append((str(func), max(sizes, default=0)))
        return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_shard_makes_no_tensor_past_torchs_grain(layout):
    """A 32k row's shard for one rank, from a batch that carries no counts (built from its tensors), makes no
    tensor of more than the row's 32,768 tokens and no whole-batch cumsum. The regression: ``shard`` read the
    batch's ``num_tokens`` and ``num_examples`` apart, each counting both with a dozen tensor passes, one a
    32,769-entry pad: past torch's grain (32,768), it woke torch's thread pool, 2-8 ms of CPU a shard on the
    loaded 2 cores against a plain zigzag's 0.4 ms (every layout, 20-50x); counted once on the host, 0.06 ms."""
    from packkit.batch import PackedBatch

    row = np.array([5000, 1, 700, 26000, 1067])
    ids = torch.arange(int(row.sum()))[None] % 1000
    batch = PackedBatch(input_ids=ids, labels=ids.clone(), cu_seqlens=torch.from_numpy(lengths_to_cu_seqlens(row)),
                        position_ids=torch.cat([torch.arange(n) for n in row.tolist()])[None])
    with _Sizes() as seen:
        s = shard(batch, cp_size=2, rank=1, cp_layout=layout)
    assert (s.num_tokens, s.num_examples) == (32768, 5)
    assert max(n for _, n in seen.ops) <= 32768, max(seen.ops, key=lambda x: x[1])
    assert not [f for f, _ in seen.ops if "cumsum" in f]


def _short_documents_row(n=1472, seed=0):
    """A ``[1, T]`` PackedBatch of ``n`` short documents (1-32 tokens), built from its tensors (no noted counts)."""
    from packkit.batch import PackedBatch

    row = np.random.default_rng(seed).integers(1, 33, n)
    ids = torch.arange(int(row.sum()))[None] % 1000 + 1
    return PackedBatch(input_ids=ids, labels=ids.clone(), cu_seqlens=torch.from_numpy(lengths_to_cu_seqlens(row)),
                       position_ids=torch.cat([torch.arange(k) for k in row.tolist()])[None])


def _python_calls(fn) -> int:
    """Python-visible calls (functions, and C functions such as numpy's) made by ``fn()``."""
    import sys

    count = [0]
    sys.setprofile(lambda frame, event, arg: count.__setitem__(0, count[0] + (event in ("call", "c_call"))))
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count[0]


#: the most Python-visible calls of one rank's shard of a batch without a plan (a plain numpy/torch zigzag: 74); at
#: c85c656: zigzag 213-228, contiguous and ulysses 218, hybrid 280-369 (each small numpy call costs 2-8 us here); at
#: 68e14a9: zigzag 151-177, contiguous and ulysses 148-169, hybrid 181-193; now (cp35: the checks pass a valid int or
#: name without a call, no ABC check of a PackedBatch, no numpy wrapper for a count, a minimum or a maximum, the hybrid
#: deals one rank's pieces alone) zigzag 116-130, contiguous and ulysses 116-137, hybrid 138-178; now (cp36: one hybrid
#: rank's halves read in closed form, its tokens in fewer passes) hybrid 125-174
_SHARD_CALLS = {"zigzag": 135, "contiguous": 145, "ulysses": 145, "hybrid": 178}


@pytest.mark.parametrize("layout", sorted(_SHARD_CALLS))
def test_a_shard_takes_a_bounded_number_of_calls(layout):
    """Regression (the CP shard against a plain zigzag, RESULTS.md "CP shard"): one rank's shard made 213-228 Python-visible calls
    for zigzag against the plain zigzag's 74, whatever the row: each a numpy or torch call on a small array
    (2-8 us of CPU here). The causes: the batch's counts tested every segment's end ``% width`` (27 us for 1,472
    segments) and filtered them in a dozen calls (one row whose last label is a loss token has no padding tail);
    the flat starts were summed back from the lengths (they are ``cu_seqlens``); the zigzag rank's row end was
    found with a dozen numpy calls on one element; and its pieces were built per piece (2 x 1,472) where per
    segment does. The bound holds on a row of one document and on one of 1,472."""
    from packkit.batch import PackedBatch

    one = PackedBatch(input_ids=torch.arange(1, 32769)[None], labels=torch.arange(1, 32769)[None],
                      cu_seqlens=torch.tensor([0, 32768], dtype=torch.int32), position_ids=torch.arange(32768)[None])
    for batch in (one, _short_documents_row()):
        for cp in (2, 8):
            calls = min(_python_calls(lambda: shard(batch, cp_size=cp, rank=cp - 1, cp_layout=layout))
                        for _ in range(2))
            assert calls <= _SHARD_CALLS[layout], (layout, cp, calls)


def test_a_zigzag_rank_of_short_documents_marks_its_padding_per_token(monkeypatch):
    """Regression: a zigzag rank of 1,472 short documents (1-32 tokens, padded to 16 or 32 at cp 8) found its CP
    padding piece by piece (``range_index`` over the 2,000-odd pieces that end in padding, a cumsum, a repeat and an
    arange over them), where the plain zigzag compares each token's position with its document's length once: the
    padding is most of a short document's tail chunk. It now marks it per token (a bool mask) when the segments are
    many; a row of a few long documents still marks its few padding slots by their places."""
    from packkit import cp_plan

    batch = _short_documents_row()
    want = [shard(batch, cp_size=8, rank=r, cp_layout="zigzag") for r in (0, 7)]

    def refuse(*a, **k):
        raise AssertionError("padding marked piece by piece")

    monkeypatch.setattr(cp_plan, "range_index", refuse)
    for r, w in zip((0, 7), want):
        s = shard(batch, cp_size=8, rank=r, cp_layout="zigzag")
        for name in ("input_ids", "shift_labels", "position_ids", "seq_idx", "index"):
            assert torch.equal(getattr(s, name), getattr(w, name)), name
        assert (s.index < 0).sum() > s.index.numel() // 8  # padding: an eighth of the rank's tokens and more


@pytest.mark.parametrize("layout", ["contiguous", "ulysses"])
def test_a_contiguous_rank_sums_no_segment_lengths(monkeypatch, layout):
    """Regression: a contiguous (or ulysses) rank found the segments crossing its slots ``G[rank * n : (rank + 1) *
    n]`` by summing every segment's padded length (a cumsum over the row's 1,472 segments), then summed its own
    pieces' lengths for their places, and tested each piece for the row's end: the padded stream is the row itself
    (then one padding segment), so its offsets are the batch's ``cu_seqlens``, two searches find the rank's
    segments, and its tokens' flat indices are its slots."""
    from packkit import cp_plan, segments

    batch = _short_documents_row()
    want = [shard(batch, cp_size=8, rank=r, cp_layout=layout) for r in (0, 7)]

    def refuse(*a, **k):
        raise AssertionError("summed the segments' lengths")

    monkeypatch.setattr(cp_plan, "lengths_to_offsets", refuse)
    monkeypatch.setattr(segments, "lengths_to_offsets", refuse)
    for r, w in zip((0, 7), want):
        s = shard(batch, cp_size=8, rank=r, cp_layout=layout)
        for name in ("input_ids", "shift_labels", "position_ids", "seq_idx", "index"):
            assert torch.equal(getattr(s, name), getattr(w, name)), name


def test_a_hybrid_rank_calls_none_of_numpys_python_wrappers(monkeypatch):
    """Regression: the hybrid's dealing built its table with ``np.stack`` of an ``np.broadcast_to`` and cut its pieces
    with ``np.diff(..., append=)`` (each a Python function making a dozen calls: 258-347 a shard, against a plain
    zigzag's 74), and found its pieces with ``np.flatnonzero`` (``ravel`` then ``nonzero``, through their
    dispatchers). The same arrays are made by assignment into one array and by the arrays' own methods."""
    batch = _short_documents_row()
    rows = (batch, _short_documents_row(n=16, seed=1))
    want = [shard(b, cp_size=8, rank=7, cp_layout="hybrid") for b in rows]

    def refuse(*a, **k):
        raise AssertionError("a numpy Python wrapper on the hybrid's path")

    for name in ("stack", "broadcast_to", "diff", "flatnonzero", "full"):
        monkeypatch.setattr(np, name, refuse)
    for b, w in zip(rows, want):
        s = shard(b, cp_size=8, rank=7, cp_layout="hybrid")
        for name in ("input_ids", "shift_labels", "position_ids", "seq_idx", "index"):
            assert torch.equal(getattr(s, name), getattr(w, name)), name
