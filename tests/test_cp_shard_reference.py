"""Every field of a CP shard against a slow, obvious reference written here, token by token in Python: drawn rows
(one row or ``[B, W]`` windows with padding tails, labels shifted or not, thousands of short documents among them),
every layout, cp 1 to 16, every rank. The reference reads where each token goes from the layouts' rules
(zigzag: chunks ``r`` and ``2cp-1-r`` of every document padded to a multiple of ``2 cp``; contiguous and
ulysses: the row padded to a multiple of cp and cut in cp equal pieces) and, for the hybrid, from every rank's piece
table of a fresh plan (``plan_cp(...).piece_*``, sorted over every rank: its dealing is checked against a Python
loop in ``test_cp_plan_vectorised.py``). A shard made for one rank alone (its own pieces, its own tokens) must hold
exactly this; and its plan must be the whole plan (every rank's pieces, as ``plan_cp`` makes them).
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from packkit.batch import PackedBatch
from packkit.cp import shard
from packkit.cp_plan import LAYOUTS, plan_cp
from packkit.segments import IGNORE_INDEX

CPS = (1, 2, 3, 4, 5, 8, 16)


def ref_pieces(lengths, cp, layout):
    """``[[(seg, offset, len), ...] for each rank]`` and the padded lengths ``padded`` (segments the layout adds
    at the end hold no token), by the layouts' rules, one piece at a time."""
    lengths = [int(x) for x in lengths]
    if layout == "zigzag":
        padded = [-(-n // (2 * cp)) * 2 * cp for n in lengths]
        ranks = [[] for _ in range(cp)]
        for r in range(cp):
            for s, p in enumerate(padded):
                c = p // (2 * cp)
                ranks[r] += [(s, r * c, c), (s, (2 * cp - 1 - r) * c, c)]
        return [[x for x in rk if x[2] > 0] for rk in ranks], padded
    if layout in ("contiguous", "ulysses"):
        pad = (-sum(lengths)) % cp
        padded = lengths + ([pad] if pad else [])
        local = sum(padded) // cp
        ranks = [[] for _ in range(cp)]
        start = 0
        for s, p in enumerate(padded):
            for i in range(p):  # token by token: the rank of G's slot start + i
                r = (start + i) // local
                if ranks[r] and ranks[r][-1][0] == s:
                    seg, off, n = ranks[r][-1]
                    ranks[r][-1] = (seg, off, n + 1)
                else:
                    ranks[r].append((s, i, 1))
            start += p
        return ranks, padded
    plan = plan_cp(lengths, cp_size=cp, cp_layout="hybrid")
    ranks = [[] for _ in range(cp)]
    for r, s, o, n in zip(plan.piece_rank.tolist(), plan.piece_seg.tolist(), plan.piece_offset.tolist(),
                          plan.piece_len.tolist()):
        ranks[r].append((s, o, n))
    return ranks, plan.padded.tolist()


def ref_shard(ids, labels, shifted, cu, cp, rank, layout, pad_id):
    """The rank's ``(input_ids, shift_labels, position_ids, seq_idx, index)`` as lists, token by token."""
    cu = [int(c) for c in cu]
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:]) if b > a]
    starts = [a for a, b in zip(cu[:-1], cu[1:]) if b > a]
    width = ids.shape[-1]
    flat_ids, flat_labels = ids.reshape(-1).tolist(), labels.reshape(-1).tolist()
    pieces, _ = ref_pieces(lengths, cp, layout)
    out = ([], [], [], [], [])
    for seg, off, n in pieces[rank]:
        for p in range(off, off + n):
            real = seg < len(lengths) and p < lengths[seg]
            src = starts[seg] + p if real else -1
            if not real:
                target = IGNORE_INDEX
            elif shifted:
                target = flat_labels[src]
            else:
                target = flat_labels[src + 1] if (src + 1) % width else IGNORE_INDEX
            for lst, v in zip(out, (flat_ids[src] if real else pad_id, target, p, seg, src)):
                lst.append(v)
    return out


@st.composite
def batches(draw):
    """A ``PackedBatch``: one row of documents, or ``[B, W]`` windows each ending in a padding tail (a segment of
    -100 labels) where the documents leave room; labels with masked prompts, some pre-shifted."""
    many = draw(st.booleans())
    size = st.integers(1, 6) if many else st.integers(1, 90)
    rows = draw(st.lists(st.lists(size, min_size=1, max_size=400 if many else 8), min_size=1, max_size=3))
    one_row = draw(st.booleans())
    if one_row:
        rows = [sum(rows, [])]
    width = max(map(sum, rows)) + (0 if one_row else draw(st.integers(0, 5)))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    ids, labels, cu = [], [], [0]
    for i, row in enumerate(rows):
        line_ids, line_labels = [], []
        for n in row:
            tok = rng.integers(1, 1000, n).tolist()
            masked = int(rng.integers(0, n + 1))
            line_ids += tok
            line_labels += [IGNORE_INDEX] * max(masked, 1) + tok[max(masked, 1):]
            cu.append(i * width + len(line_ids))
        if len(line_ids) < width:
            line_labels += [IGNORE_INDEX] * (width - len(line_ids))
            line_ids += [0] * (width - len(line_ids))
            cu.append((i + 1) * width)
        ids.append(line_ids)
        labels.append(line_labels)
    ids, labels = torch.tensor(ids), torch.tensor(labels)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    pos = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])]).reshape(ids.shape)
    if draw(st.booleans()):  # pre-shifted labels (a DeepSpeed-style batch)
        batch = PackedBatch(input_ids=ids, labels=labels, cu_seqlens=cu_t, position_ids=pos)
        batch["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        return batch
    return PackedBatch(input_ids=ids, labels=labels, cu_seqlens=cu_t, position_ids=pos)


@settings(max_examples=40)
@given(batch=batches(), cp=st.sampled_from(CPS), layout=st.sampled_from(LAYOUTS))
@example(batch=PackedBatch(input_ids=torch.arange(1, 9)[None], labels=torch.arange(1, 9)[None],
                           cu_seqlens=torch.tensor([0, 5, 8], dtype=torch.int32),
                           position_ids=torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]])), cp=16, layout="hybrid")
def test_every_shard_field_equals_the_token_by_token_reference(batch, cp, layout):
    """Every rank's shard of a batch that carries no plan (the rank plans it), field by field, against
    :func:`ref_shard`; its counts against the batch's; its plan against ``plan_cp``'s, every rank's pieces."""
    shifted = "shift_labels" in batch
    labels = batch["shift_labels"] if shifted else batch["labels"]
    cu = batch.cu_seqlens
    lengths = np.diff(cu.numpy().astype(np.int64))
    lengths = lengths[lengths > 0]
    want_plan = plan_cp(lengths, cp_size=cp, cp_layout=layout)
    n_loss = int((labels if shifted else labels[:, 1:]).ne(IGNORE_INDEX).sum())
    for rank in range(cp):
        s = shard(batch, cp_size=cp, rank=rank, cp_layout=layout, pad_id=7)
        want = ref_shard(batch.input_ids, labels, shifted, cu, cp, rank, layout, 7)
        got = (s.input_ids[0], s.shift_labels[0], s.position_ids[0], s.seq_idx[0], s.index)
        for name, g, w, dtype in zip(("input_ids", "shift_labels", "position_ids", "seq_idx", "index"), got, want,
                                     (torch.int64, torch.int64, torch.int64, torch.int32, torch.int64)):
            assert g.dtype == dtype and g.tolist() == w, (name, rank)
        assert s.num_loss_tokens == n_loss
        assert s.num_local_loss_tokens == sum(t != IGNORE_INDEX for t in want[1])
        assert s.max_seqlen == int(lengths.max())
        assert (s.num_tokens, s.num_examples) == (batch.num_tokens, batch.num_examples)
        plan = s.plan
        assert plan.local_len == want_plan.local_len == len(want[0])
        for name in ("lengths", "padded", "piece_rank", "piece_seg", "piece_offset", "piece_len"):
            assert np.array_equal(getattr(plan, name), getattr(want_plan, name)), name
