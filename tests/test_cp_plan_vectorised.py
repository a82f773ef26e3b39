"""The hybrid CP plan made with numpy passes against Python loops, one document at a time: ``ref_halves`` (the long
documents' zigzag, as it stood at 5803dad), ``ref_dealing`` (the short documents' dealing: catch-up, snake, lay-over,
as :func:`packkit.cp_plan._deal_short` describes it): the same pieces, bit for bit, on drawn rows (thousands of short
documents, equal lengths, rows no rank has room for, cp 1 to 16); and ``ref_hybrid`` (5803dad's exact LPT, which the
dealing replaced): the busiest rank's work against it.

The causes: the 26 ms a rank on a 32k row of 2,443 chat turns (the LPT placed the short documents one Python step
at a time), then a Python step a run of equal lengths (a batch without a plan sharded 1.28-2.10x the plain
zigzag). ``test_planning_a_hybrid_row_takes_the_same_steps_whatever_its_lengths`` keeps them from coming back.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from packkit import cp_plan
from packkit.cp_plan import HYBRID_WORK_FRACTION, causal_work, plan_cp
from packkit.segments import lengths_to_offsets


def ref_halves(seg, lengths, cp):
    """5803dad's zigzag without padding, one segment at a time."""
    held = np.zeros(cp, np.int64)
    ranks = np.arange(cp)
    rank_col = np.concatenate([ranks, ranks[::-1]])
    out = []
    for s in np.asarray(seg).tolist():
        n = int(lengths[s])
        share = np.full(cp, n // cp, np.int64)
        share[np.argsort(held, kind="stable")[: n % cp]] += 1
        held += share
        head = share // 2
        sizes = np.concatenate([head, (share - head)[::-1]])
        out.append(np.stack([rank_col, np.full(2 * cp, s), lengths_to_offsets(sizes)[:-1], sizes], 1))
    return tuple((np.concatenate(out) if out else np.zeros((0, 4), np.int64)).T)


def ref_hybrid(lengths, cp):
    """5803dad's hybrid plan, the LPT one document at a time: ``(padded, lengths, {(rank, seg, off, len)})``."""
    lengths = np.asarray(lengths, np.int64)
    local_len = -(-int(lengths.sum()) // cp)
    doc_work = causal_work(lengths)
    long = (lengths > local_len) | ((doc_work > HYBRID_WORK_FRACTION * doc_work.sum() / cp) & (lengths >= 2 * cp))
    z = ref_halves(np.flatnonzero(long), lengths, cp)
    work = np.bincount(z[0], weights=causal_work(z[3], z[2]), minlength=cp).astype(np.float64)
    room = local_len - np.bincount(z[0], weights=z[3], minlength=cp).astype(np.int64)
    pieces = list(zip(*(x.tolist() for x in z)))
    short = np.flatnonzero(~long)
    for s in short[np.argsort(-lengths[short], kind="stable")].tolist():
        n = int(lengths[s])
        fits = room >= n
        if fits.any():
            r = int(np.argmin(np.where(fits, work, np.inf)))
            pieces.append((r, s, 0, n))
            room[r] -= n
            work[r] += n * (n + 1) // 2
            continue
        off = 0
        for r in np.argsort(-room, kind="stable").tolist():
            take = int(min(room[r], n - off))
            if take:
                pieces.append((r, s, off, take))
                work[r] += int(causal_work(take, off))
                room[r] -= take
                off += take
            if off == n:
                break
    fill = np.flatnonzero(room > 0)
    pieces += [(int(r), len(lengths) + i, 0, int(room[r])) for i, r in enumerate(fill)]
    padded = np.concatenate([lengths, room[fill]])
    return padded, np.concatenate([lengths, np.zeros(fill.size, np.int64)]), {p for p in pieces if p[3] > 0}


rows = st.one_of(
    st.lists(st.integers(1, 30), min_size=1, max_size=3000),             # many short turns, equal lengths
    st.lists(st.integers(1, 5000), min_size=1, max_size=60),              # chat rows
    st.lists(st.sampled_from([1, 2, 3, 64, 97, 4096, 40_000]), min_size=1, max_size=40),
)


def ref_dealing(lengths, cp):
    """The hybrid plan with its short documents dealt one at a time, as :func:`packkit.cp_plan._deal_short` says:
    the ranks behind the busiest catch up (the largest documents laid over their shortfalls, each where its middle
    falls), then a snake over the ranks least work first; each rank keeps its documents while they fit; the rest
    laid end to end, in row order, over the room left, the roomiest rank first. ``(padded, lengths, {pieces})``."""
    lengths = np.asarray(lengths, np.int64)
    local_len = -(-int(lengths.sum()) // cp)
    doc_work = causal_work(lengths)
    long = (lengths > local_len) | ((doc_work > HYBRID_WORK_FRACTION * doc_work.sum() / cp) & (lengths >= 2 * cp))
    z = ref_halves(np.flatnonzero(long), lengths, cp)
    work = np.bincount(z[0], weights=causal_work(z[3], z[2]), minlength=cp).astype(np.int64).tolist()
    room = (local_len - np.bincount(z[0], weights=z[3], minlength=cp).astype(np.int64)).tolist()
    pieces = list(zip(*(x.tolist() for x in z)))
    short = np.flatnonzero(~long)
    docs = short[np.argsort(-lengths[short], kind="stable")].tolist()
    dealt = []  # (rank, seg) in dealing order
    shortfall = [max(work) - w for w in work]
    by = sorted(range(cp), key=lambda r: -shortfall[r])  # stable: the lower rank first among equal ones
    done = total = 0
    while done < len(docs) and any(shortfall):
        n = int(lengths[docs[done]])
        middle = total + n * (n + 1) // 2 - (n * (n + 1) // 2 + 1) // 2
        if middle >= sum(shortfall):
            break
        at, q = 0, 0
        while at + shortfall[by[q]] <= middle:
            at += shortfall[by[q]]
            q += 1
        dealt.append((by[q], docs[done]))
        total += n * (n + 1) // 2
        done += 1
    for r, s in dealt:
        work[r] += int(lengths[s] * (lengths[s] + 1) // 2)
    order = sorted(range(cp), key=lambda r: work[r])  # stable
    for k, s in enumerate(docs[done:]):
        j = k % (2 * cp)
        dealt.append((order[min(j, 2 * cp - 1 - j)], s))
    full, over = [False] * cp, []
    for r, s in dealt:
        n = int(lengths[s])
        if not full[r] and n <= room[r]:
            pieces.append((r, s, 0, n))
            room[r] -= n
        else:
            full[r] = True
            over.append(s)
    by = sorted(range(cp), key=lambda r: -room[r])
    q = 0
    for s in sorted(over):
        off, n = 0, int(lengths[s])
        while off < n:
            while room[by[q]] == 0:
                q += 1
            take = min(room[by[q]], n - off)
            pieces.append((by[q], s, off, take))
            room[by[q]] -= take
            off += take
    fill = [r for r in range(cp) if room[r] > 0]
    pieces += [(r, len(lengths) + i, 0, room[r]) for i, r in enumerate(fill)]
    padded = np.concatenate([lengths, np.array([room[r] for r in fill], np.int64)])
    return padded, np.concatenate([lengths, np.zeros(len(fill), np.int64)]), {p for p in pieces if p[3] > 0}


@given(lengths=rows, cp=st.sampled_from([1, 2, 3, 4, 5, 8, 16]))
def test_hybrid_plan_equals_the_loop(lengths, cp):
    plan = plan_cp(lengths, cp_size=cp, cp_layout="hybrid")
    padded, lens, pieces = ref_dealing(lengths, cp)
    assert plan.padded.tolist() == padded.tolist()
    assert plan.lengths.tolist() == lens.tolist()
    got = set(zip(*(x.tolist() for x in (plan.piece_rank, plan.piece_seg, plan.piece_offset, plan.piece_len))))
    assert got == pieces and len(got) == plan.piece_rank.size


@given(lengths=rows, cp=st.sampled_from([1, 2, 3, 4, 5, 8, 16]))
def test_hybrid_plan_holds_every_token_once_and_pads_as_the_lpt(lengths, cp):
    """Every token of the batch on exactly one rank, every rank ``local_len`` tokens, and the same padding and
    long documents' pieces as the exact LPT it replaced (5803dad's loop)."""
    plan = plan_cp(lengths, cp_size=cp, cp_layout="hybrid")
    padded, _, pieces = ref_hybrid(lengths, cp)
    assert plan.padding_tokens == int(padded.sum()) - sum(lengths) < cp
    seen = np.zeros(int(plan.padded.sum()), np.int64)
    for r in range(cp):
        where = plan.g_index(r)
        assert where.size == plan.local_len
        np.add.at(seen, where, 1)
    assert (seen == 1).all()
    n = len(lengths)
    zig = {p for p in pieces if p[1] < n and (p[2] > 0 or p[3] < lengths[p[1]]) and
           lengths[p[1]] >= 2 * cp and sum(q[1] == p[1] for q in pieces) == 2 * cp}
    got = set(zip(*(x.tolist() for x in (plan.piece_rank, plan.piece_seg, plan.piece_offset, plan.piece_len))))
    assert zig <= got


def _chat_lengths() -> np.ndarray:
    from pathlib import Path

    return np.load(Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "sharegpt_qwen3_lengths.npy").astype(
        np.int64)


def _real_rows(cp_window=32768):
    """Rows of real chat lengths (tests/data's ShareGPT turn lengths, packed best fit decreasing) and rows of the
    short ones (at most 32 and 16 tokens, drawn up to the window: thousands of documents)."""
    from packkit.binpack import pack

    real = _chat_lengths()
    rng = np.random.default_rng(0)
    plan = pack(rng.choice(real, 5_000), window=cp_window, overflow="split").shuffled(seed=0)
    rows = [plan.segments(i)[2] for i in range(plan.num_windows)]
    for top in (32, 16):
        draw = rng.choice(real[real <= top], cp_window)
        row = draw[: int(np.searchsorted(np.cumsum(draw), cp_window)) + 1].copy()
        row[-1] -= int(row.sum()) - cp_window
        rows.append(row[row > 0])
    return rows


@pytest.mark.parametrize("cp", [2, 8, 16])
def test_the_dealing_balances_real_rows_as_the_exact_lpt(cp):
    """The busiest rank's causal work (what every rank waits for) summed over real rows, against the exact LPT it
    replaced: within 0.1% summed over the rows, and within 5% on every row (measured on 234 rows: the worst row
    1.3% above at cp 8 and 4.4% at cp 16, both on a row of 183 documents whose 106 long ones, of 75-173 tokens,
    zigzag unevenly; the rows of thousands of short documents 0.02-0.26% above)."""
    top = mean = top_lpt = 0.0
    for row in _real_rows():
        work = plan_cp(row, cp_size=cp, cp_layout="hybrid").work()
        _, _, pieces = ref_hybrid(row, cp)
        lpt = np.zeros(cp)
        for r, s, off, n in pieces:
            if s < row.size:
                lpt[r] += causal_work(min(n, row[s] - off), off)
        assert work.max() <= lpt.max() * 1.05, (row.size, work.max() / lpt.max())
        top, mean, top_lpt = top + work.max(), mean + work.mean(), top_lpt + lpt.max()
    assert top <= top_lpt * 1.001


@given(lengths=st.lists(st.integers(1, 5000), min_size=0, max_size=50), cp=st.sampled_from([1, 2, 3, 4, 8, 16]))
def test_zigzag_halves_equal_the_loop(lengths, cp):
    lengths = np.asarray(lengths, np.int64)
    seg = np.flatnonzero(lengths % 3 != 1)
    for got, want in zip(cp_plan._halves_pieces(seg, lengths, cp), ref_halves(seg, lengths, cp)):
        assert got.tolist() == want.tolist()
    for got, want in zip(cp_plan._halves_few(seg, lengths, cp), ref_halves(seg, lengths, cp)):  # in Python lists
        assert got.dtype == np.int64 and got.tolist() == want.tolist()


@given(lengths=st.lists(st.integers(1, 5000), min_size=0, max_size=50), cp=st.sampled_from([1, 2, 3, 4, 5, 8, 16]))
def test_one_ranks_halves_in_closed_form_equal_the_loop(lengths, cp):
    """:func:`packkit.cp_plan._halves_rank` (one rank's zigzag halves read in closed form, a few steps a document) holds
    the rank's rows of the loop's halves, in their order (empty chunks of documents under ``2 * cp`` tokens aside),
    and every rank's room left and causal work of them."""
    lengths = np.asarray(lengths, np.int64)
    seg = np.flatnonzero(lengths % 3 != 1)
    rank_of, seg_of, off_of, len_of = ref_halves(seg, lengths, cp)
    local_len = -(-int(lengths.sum()) // cp)
    room = local_len - np.bincount(rank_of, weights=len_of, minlength=cp).astype(np.int64)
    work = np.bincount(rank_of, weights=causal_work(len_of, off_of), minlength=cp).astype(np.int64)
    for rank in range(cp):
        got_work = [0] * cp
        flat, got_room = cp_plan._halves_rank(seg.tolist(), lengths[seg].tolist(), cp, rank, local_len, got_work)
        mine = (rank_of == rank) & (len_of > 0)
        want = list(zip(seg_of[mine].tolist(), off_of[mine].tolist(), len_of[mine].tolist()))
        assert [t for t in zip(flat[0::3], flat[1::3], flat[2::3]) if t[2]] == want
        assert got_room == room.tolist() and got_work == work.tolist()


@given(lengths=rows, cp=st.sampled_from([1, 2, 3, 4, 8]), layout=st.sampled_from(cp_plan.LAYOUTS))
def test_pieces_in_plan_order_without_a_sort(lengths, cp, layout):
    """Every layout's pieces come rank by rank in their order in the padded stream, none empty (zigzag and
    contiguous pieces are built in that order: no sort of every rank's pieces to shard one rank)."""
    plan = plan_cp(lengths, cp_size=cp, cp_layout=layout)
    g = lengths_to_offsets(plan.padded)[:-1][plan.piece_seg] + plan.piece_offset
    assert (plan.piece_len > 0).all()
    assert np.array_equal(np.lexsort((g, plan.piece_rank)), np.arange(g.size))
    assert np.array_equal(np.bincount(plan.piece_rank, weights=plan.piece_len, minlength=cp), [plan.local_len] * cp)


@given(lengths=rows, cp=st.sampled_from([1, 2, 3, 4, 8]), layout=st.sampled_from(cp_plan.LAYOUTS))
def test_one_ranks_pieces_built_alone_equal_its_rows_of_every_ranks(lengths, cp, layout):
    """``own_pieces(rank)`` built for that rank alone (zigzag, contiguous: from ``padded``; hybrid: its dealt pieces
    sorted alone) are the rank's rows of the plan's piece arrays, and ``local``'s tokens follow from them."""
    alone = [plan_cp(lengths, cp_size=cp, cp_layout=layout).own_pieces(r) for r in range(cp)]
    plan = plan_cp(lengths, cp_size=cp, cp_layout=layout)
    for r in range(cp):
        p = plan.rank_pieces(r)
        for got, want in zip(alone[r], (plan.piece_seg[p], plan.piece_offset[p], plan.piece_len[p])):
            assert got.tolist() == want.tolist()


def test_sharding_one_rank_builds_only_its_pieces(monkeypatch):
    """Regression: ``shard`` built every rank's pieces (2 x cp a document: 23,552 for 1,472 documents at cp 8) to use
    one rank's. The zigzag and contiguous plans now build a rank's alone; every rank's only when asked for."""
    import torch

    from packkit.batch import PackedBatch
    from packkit.cp import shard
    from packkit.segments import lengths_to_cu_seqlens, lengths_to_position_ids

    lengths = np.random.default_rng(0).integers(1, 33, 1472)
    ids = torch.arange(int(lengths.sum()))[None]
    batch = PackedBatch(input_ids=ids, labels=ids, cu_seqlens=torch.from_numpy(lengths_to_cu_seqlens(lengths)),
                        position_ids=torch.from_numpy(lengths_to_position_ids(lengths))[None])
    built = []
    for name in ("_zigzag_pieces", "_contiguous_pieces"):  # every rank's pieces
        real = getattr(cp_plan, name)
        monkeypatch.setattr(cp_plan, name, lambda *a, real=real, name=name: built.append(name) or real(*a))
    for layout in ("zigzag", "contiguous", "ulysses"):
        s = shard(batch, cp_size=8, rank=7, cp_layout=layout)
        assert built == [], layout
        assert s.plan.piece_rank.size >= 8 and len(built) == 1  # built when asked for
        built.clear()


def _short_row_batch(n=1472, seed=0):
    import torch

    from packkit.batch import PackedBatch
    from packkit.segments import lengths_to_cu_seqlens, lengths_to_position_ids

    lengths = np.random.default_rng(seed).integers(1, 33, n)
    ids = torch.arange(int(lengths.sum()))[None]
    return lengths, PackedBatch(input_ids=ids, labels=ids, cu_seqlens=torch.from_numpy(lengths_to_cu_seqlens(lengths)),
                                position_ids=torch.from_numpy(lengths_to_position_ids(lengths))[None])


def test_shard_checks_the_lengths_once_and_plans_without_a_second_sort(monkeypatch):
    """Regression: ``shard`` checked the batch's segment lengths twice (reading ``cu_seqlens``, then again in
    ``plan_cp``), clipped the pieces' real tokens with ``np.clip`` (whose Python wrapper cost as much as the
    arithmetic), and the hybrid sorted the short documents twice (a stable sort, then ``np.unique``'s own)."""
    from packkit import cp
    from packkit.cp import shard

    _, batch = _short_row_batch()
    counted = []
    real_plan = cp_plan.plan_cp
    monkeypatch.setattr(cp_plan, "plan_cp", lambda *a, **k: counted.append(1) or real_plan(*a, **k))
    monkeypatch.setattr(cp, "plan_cp", cp_plan.plan_cp, raising=False)

    def refuse(*a, **k):
        raise AssertionError("not on shard's path")

    monkeypatch.setattr(np, "clip", refuse)
    monkeypatch.setattr(np, "unique", refuse)
    for layout in cp_plan.LAYOUTS:
        s = shard(batch, cp_size=8, rank=7, cp_layout=layout)
        assert s.index.numel() == s.plan.local_len
    assert counted == []


def test_a_rows_starts_are_made_once_for_every_rank(monkeypatch):
    """Regression: every rank's tokens (``local``, ``g_index``) recomputed the row's segment starts, a cumsum over
    the whole row's segments per rank (per-row work done per rank); the plan keeps them."""
    lengths, _ = _short_row_batch()
    plan = plan_cp(lengths, cp_size=8, cp_layout="zigzag")
    whole_row = []
    real = cp_plan.lengths_to_offsets
    monkeypatch.setattr(cp_plan, "lengths_to_offsets",
                        lambda x: (whole_row.append(1) if np.size(x) == lengths.size else None) or real(x))
    for r in range(8):
        plan.local(r), plan.g_index(r)
    assert len(whole_row) == 2  # the flat starts and the padded starts, once each


def test_every_rank_reads_the_batchs_loss_token_count_instead_of_counting_the_row(monkeypatch):
    """Regression: every ``shard`` call counted the whole batch's loss tokens (a pass over every label of the row, per
    rank); it is the batch's count, kept on its labels tensor (``batch.count_loss_tokens``), counted once."""
    import torch

    from packkit.cp import shard

    _, batch = _short_row_batch()
    want = batch.num_loss_tokens
    sizes = []
    real = np.count_nonzero
    monkeypatch.setattr(np, "count_nonzero", lambda a, *k, **kw: sizes.append(np.size(a)) or real(a, *k, **kw))
    monkeypatch.setattr(torch, "count_nonzero", lambda a, *k, **kw: sizes.append(a.numel()) or real(a.numpy()))
    for r in range(8):
        assert shard(batch, cp_size=8, rank=r, cp_layout="zigzag").num_loss_tokens == want
    assert sizes and max(sizes) < batch.input_ids.numel() // 2  # this rank's targets only


_SHARD_FIELDS = ("input_ids", "shift_labels", "position_ids", "seq_idx", "index")


def test_a_collated_batch_is_sharded_without_planning(monkeypatch):
    """Regression: every rank's ``shard`` planned the batch (the hybrid's LPT on 1,472 short documents: 2.4x the
    plain zigzag's whole time at cp 8) and read its ``cu_seqlens`` back from the tensor. ``PackedRowsCollator(cp_size=
    ...)`` plans each batch in the DataLoader worker (``plan_batch``); the plan travels with the batch through the
    worker's queue (pickled) and every rank's ``shard`` reads it: the same shards, with no planning on the rank."""
    import pickle

    from packkit import cp
    from packkit.collate import PackedRowsCollator
    from packkit.cp import shard

    lengths = np.random.default_rng(0).integers(1, 33, 1472)
    window = int((-(-lengths // 16) * 16).sum())  # the row fits once zigzag pads it for cp 8
    rows = [{"input_ids": np.arange(int(lengths.sum())) % 1000 + 1, "seq_lengths": lengths}]
    for layout in cp_plan.LAYOUTS:
        plain = PackedRowsCollator(window=window, loss_mask="none")(rows)
        want = [shard(plain, cp_size=8, rank=r, cp_layout=layout) for r in range(8)]
        collate = PackedRowsCollator(window=window, cp_size=8, cp_layout=layout, loss_mask="none")
        batch = pickle.loads(pickle.dumps(collate(rows)))
        with monkeypatch.context() as m:
            def refuse(*a, **k):
                raise AssertionError("planned on the rank's path")

            m.setattr(cp, "_plan", refuse)
            m.setattr(cp, "_segments_of", refuse)
            got = [shard(batch, cp_size=8, rank=r, cp_layout=layout) for r in range(8)]
        for g, w in zip(got, want):
            for name in _SHARD_FIELDS:
                assert torch_equal(getattr(g, name), getattr(w, name)), (layout, name)
            assert (g.num_loss_tokens, g.num_local_loss_tokens, g.max_seqlen) == \
                (w.num_loss_tokens, w.num_local_loss_tokens, w.max_seqlen)
        if layout == "hybrid":  # another layout's shard of the same batch plans for itself
            assert shard(batch, cp_size=8, rank=0, cp_layout="zigzag").plan.layout == "zigzag"


def torch_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and torch.equal(a, b)


def test_zigzag_ranks_share_the_columns_of_their_pieces(monkeypatch):
    """Regression: every rank's zigzag shard rebuilt what all ranks' pieces share (the chunk of every segment, the
    pieces' places among the rank's tokens: a cumsum over 2 x 1,472 pieces, the segments' first tokens and real
    lengths gathered): the plan makes them once (``plan_batch``, in the collator), a rank only its offsets."""
    from packkit.cp import plan_batch, shard

    lengths, batch = _short_row_batch()
    plan = plan_batch(batch, cp_size=8, cp_layout="zigzag")
    sizes = []
    real = cp_plan.lengths_to_offsets
    monkeypatch.setattr(cp_plan, "lengths_to_offsets", lambda x: sizes.append(np.size(x)) or real(x))
    for r in range(8):
        assert shard(batch, cp_size=8, rank=r, cp_layout="zigzag").plan is plan
    assert 2 * lengths.size not in sizes


def test_one_hybrid_rank_reads_no_places_in_the_padded_stream(monkeypatch):
    """Regression: one hybrid rank's shard summed the row's padded lengths twice (a cumsum over every segment, for
    where each sits in the padded stream ``G``: to sort its pieces, and with the flat starts) though it needs only
    the flat starts: its pieces sort by (segment, offset). And the flat starts are read from the batch's own
    ``cu_seqlens`` (a cumsum over the segments before: 8 of them here, one a rank's plan)."""
    from packkit.cp import shard

    lengths, batch = _short_row_batch()
    want = [shard(batch, cp_size=8, rank=r, cp_layout="hybrid") for r in range(8)]
    sizes = []
    real = cp_plan.lengths_to_offsets
    monkeypatch.setattr(cp_plan, "lengths_to_offsets", lambda x: sizes.append(np.size(x)) or real(x))
    for r in range(8):
        got = shard(batch, cp_size=8, rank=r, cp_layout="hybrid")
        assert got.index.tolist() == want[r].index.tolist() and got.position_ids.tolist() == \
            want[r].position_ids.tolist()
    assert sum(s >= lengths.size for s in sizes) == 0  # the flat starts too are the batch's cu_seqlens, not summed


def test_planning_a_hybrid_row_takes_steps_per_run_not_per_document():
    """CP sharding at the speed of a plain zigzag: the hybrid plans a row of thousands of short documents with no Python step a document: rows of
    1,000 and 10,000 documents of the same 26 lengths take the same number of Python calls (one step a run)."""
    import sys

    def calls(n):
        lengths = np.random.default_rng(0).integers(1, 27, n)
        count = [0]
        sys.setprofile(lambda frame, event, arg: count.__setitem__(0, count[0] + (event in ("call", "c_call"))))
        try:
            plan_cp(lengths, cp_size=8, cp_layout="hybrid").own_pieces(7)
        finally:
            sys.setprofile(None)
        return count[0]

    small, large = calls(1_000), calls(10_000)
    print(small, large)
    assert large <= small * 1.1 + 20


def test_planning_a_hybrid_row_takes_the_same_steps_whatever_its_lengths():
    """Regression: the hybrid dealt its short documents by an exact LPT, a Python step a run of
    equal lengths (21 on a row of 1,472 chat turns), so a batch without a plan was sharded 1.28-2.10x slower than a
    plain zigzag. Now a few numpy passes: a row of 1,000 documents of 40 lengths and one of 20,000 documents of 2,000
    lengths take the same Python calls, a long document beside them or not."""
    import sys

    def calls(lengths):
        count = [0]
        sys.setprofile(lambda frame, event, arg: count.__setitem__(0, count[0] + (event in ("call", "c_call"))))
        try:
            plan_cp(lengths, cp_size=8, cp_layout="hybrid").own_pieces(7)
        finally:
            sys.setprofile(None)
        return count[0]

    rng = np.random.default_rng(0)
    few, many = rng.integers(1, 41, 1_000), rng.integers(1, 2_001, 20_000)
    assert calls(many) <= calls(few) * 1.1 + 10
    assert calls(np.append(many, 10_000_000)) <= calls(np.append(few, 20_000)) * 1.1 + 10


@given(lengths=st.one_of(rows, st.lists(st.integers(1, 400), min_size=1, max_size=30)),
       cp=st.sampled_from([1, 2, 3, 4, 5, 8, 16]))
def test_a_few_documents_dealt_in_python_plan_as_the_numpy_passes(lengths, cp):
    """:func:`packkit.cp_plan._deal_few` (at most ``_FEW`` short documents, in Python lists) makes the plan the
    numpy passes of ``_deal_short`` make, array for array: the padding, the lengths and every piece as dealt, in the
    same order (``dealt``)."""
    fast = plan_cp(lengths, cp_size=cp, cp_layout="hybrid")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cp_plan, "_FEW", 0)
        slow = plan_cp(lengths, cp_size=cp, cp_layout="hybrid")
    assert fast.local_len == slow.local_len
    for a, b in zip((fast.padded, fast.lengths, *fast.dealt), (slow.padded, slow.lengths, *slow.dealt)):
        assert a.dtype == b.dtype == np.int64 and np.array_equal(a, b)


def test_a_few_short_documents_are_dealt_without_numpy_passes(monkeypatch):
    """Regression: the median chat row at cp 2 (15 long documents and one short one) dealt its one short document
    with ~60 numpy calls on arrays of a few elements (the catch-up, the listed dealing, the lay-over), 1.2x slower
    than the exact LPT's loop it replaced. A few short documents are now dealt in Python lists; the numpy passes
    run for many only."""
    def refuse(*args, **kwargs):
        raise AssertionError("a numpy pass of the dealing ran for a few documents")

    for name in ("_catch_up", "_deal_listed", "_lay_over"):
        monkeypatch.setattr(cp_plan, name, refuse)
    row = np.array([4100, 3900, 3000, 2500, 2400, 2300, 2000, 1900, 1800, 1700, 1650, 1600, 1500, 1400, 1318, 700])
    for cp in (2, 3, 4):
        plan = plan_cp(row, cp_size=cp, cp_layout="hybrid")
        assert plan.piece_len.sum() == plan.cp_size * plan.local_len
    plan_cp(np.full(cp_plan._FEW - 1, 3), cp_size=2, cp_layout="hybrid")  # one over a rank's room: laid over
    with pytest.raises(AssertionError, match="numpy pass"):
        plan_cp(np.full(cp_plan._FEW + 1, 3), cp_size=2, cp_layout="hybrid")


def test_one_hybrid_rank_is_dealt_without_every_ranks_table(monkeypatch):
    """Regression (the hybrid planned vectorised for one rank, RESULTS.md "CP shard, round 8"): a hybrid rank's shard dealt every
    rank's pieces (the snake's whole table, its cells picked by a mask over ``(4, rows, cp)``, every rank's lay-over),
    then sorted its own out of them (``_plan_order``): a third of its CPU on a row of 1,472 short documents. It now
    reads its column of the snake's grid and its run of the lay-over (``_deal_column``, ``_lay_over_rank``): the same
    shards, and the plan deals every rank's pieces only when asked for (then the same as ``plan_cp``'s)."""
    from packkit.cp import shard

    for n, seed in ((1472, 0), (2727, 1), (300, 2)):
        lengths, batch = _short_row_batch(n, seed)
        for cp in (2, 3, 8, 16):
            whole = plan_cp(lengths, cp_size=cp, cp_layout="hybrid")
            want = [shard(batch, cp_size=cp, rank=r, cp_layout="hybrid", plan=whole) for r in range(cp)]
            with monkeypatch.context() as m:
                def refuse(*a, **k):
                    raise AssertionError("every rank's pieces dealt for one rank")

                for name in ("_plan_order", "_lay_over"):
                    m.setattr(cp_plan, name, refuse)
                got = [shard(batch, cp_size=cp, rank=r, cp_layout="hybrid") for r in range(cp)]
                assert all(g.plan._dealt is None for g in got)
            for g, w in zip(got, want):
                for name in _SHARD_FIELDS:
                    assert torch_equal(getattr(g, name), getattr(w, name)), (n, cp, name)
            assert np.array_equal(got[-1].plan.padded, whole.padded)
            for a, b in zip(got[-1].plan.dealt, whole.dealt):  # every rank's, dealt when asked for
                assert np.array_equal(a, b)


def test_one_hybrid_rank_of_a_few_long_documents_reads_its_halves_in_closed_form(monkeypatch):
    """Regression (a few long documents, RESULTS.md "CP shard, round 9"): one hybrid rank of one 32k document, or of
    the median chat row (16 long documents at cp 4-16), made every rank's
    zigzag halves (a ``(documents, cp)`` table in two dozen numpy calls, or every rank's in Python lists), summed
    every rank's tokens with a bincount and sorted its own pieces out of them: 1.37x and 1.57x the plain zigzag's
    instructions at cp 16. Its share of each document is now read in closed form (``n // cp``, one more where the
    dealt remainders cover it; its offsets the shares before it), a few steps a document, and with short documents
    beside a few long ones every rank's room and work in Python lists: the same shards as every rank's plan gives."""
    from packkit.cp import shard

    median = np.array([2104] * 14 + [2103, 1209])
    cases = [(np.array([32768]), (2, 4, 8, 16)), (median, (2, 4, 8, 16)), (np.array([700, 40, 9, 3, 1]), (2, 3, 4)),
             (np.array([5000, 4900, 30, 3]), (5, 8))]
    for lengths, cps in cases:
        batch = _batch_of(lengths)
        for cp in cps:
            whole = plan_cp(lengths, cp_size=cp, cp_layout="hybrid")
            want = [shard(batch, cp_size=cp, rank=r, cp_layout="hybrid", plan=whole) for r in range(cp)]
            with monkeypatch.context() as m:
                def refuse(*a, **k):
                    raise AssertionError("every rank's halves made for one rank")

                for name in ("_halves_pieces", "_halves_few", "_plan_order"):
                    m.setattr(cp_plan, name, refuse)
                got = [shard(batch, cp_size=cp, rank=r, cp_layout="hybrid") for r in range(cp)]
            for g, w in zip(got, want):
                for name in _SHARD_FIELDS:
                    assert torch_equal(getattr(g, name), getattr(w, name)), (lengths.size, cp, name)
                assert np.array_equal(g.plan.padded, whole.padded) and np.array_equal(g.plan.lengths, whole.lengths)


def _batch_of(lengths):
    import torch

    from packkit.batch import PackedBatch
    from packkit.segments import lengths_to_cu_seqlens, lengths_to_position_ids

    ids = torch.arange(int(lengths.sum()))[None] % 1000 + 1
    return PackedBatch(input_ids=ids, labels=ids, cu_seqlens=torch.from_numpy(lengths_to_cu_seqlens(lengths)),
                       position_ids=torch.from_numpy(lengths_to_position_ids(lengths))[None])
