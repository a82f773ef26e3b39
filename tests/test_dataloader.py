"""Every collator through a real ``torch.utils.data.DataLoader`` with ``num_workers=2`` and
``pin_memory=True``: batches made in worker processes (and pickled back) equal the batches made here.

On a machine without an accelerator torch warns and does not pin (a plain tensor's ``pin_memory()``
raises there too); with one, every tensor of the batch arrives pinned.
"""

import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from packkit.batch import PackedBatch
from packkit.collate import FixedWindowCollator, PackedRowsCollator, PaddedCollator, PaddingFreeCollator

FIELDS = ("input_ids", "labels", "position_ids", "cu_seqlens", "seq_idx", "attention_mask")


def dataset(n=24, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = int(rng.integers(1, 30))
        ids = rng.integers(0, 1000, k)
        # the three input kinds, mixed across the dataset
        kind = i % 3
        ids = ids.tolist() if kind == 0 else ids if kind == 1 else torch.from_numpy(ids)
        out.append({"input_ids": ids, "completion_mask": [0] * (k // 2) + [1] * (k - k // 2)})
    return out


def rows(n=24, window=32, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        segs = rng.integers(1, 9, int(rng.integers(1, 4))).tolist()
        out.append({"input_ids": rng.integers(0, 1000, sum(segs)).tolist(), "seq_lengths": segs})
    return out


CASES = [
    ("padding_free", PaddingFreeCollator(), dataset),
    ("fixed_window", FixedWindowCollator(window=32), dataset),
    ("fixed_window_static", FixedWindowCollator(window=32, num_windows=6, static_shape=True, max_segments=16),
     dataset),
    ("packed_rows", PackedRowsCollator(window=32, num_windows=4, static_shape=True, max_segments=16), rows),
    ("padded", PaddedCollator(pad_to_multiple_of=8), dataset),
]


@pytest.mark.parametrize("name, collator, make", CASES, ids=[c[0] for c in CASES])
def test_dataloader_workers_and_pin_memory(name, collator, make):
    data = make()
    loader = DataLoader(data, batch_size=4, shuffle=False, num_workers=2, pin_memory=True, collate_fn=collator,
                        timeout=120, persistent_workers=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "pin_memory ... no accelerator is found"
        got = list(loader)
    expect = [collator(data[i:i + 4]) for i in range(0, len(data), 4)]
    assert len(got) == len(expect)
    pinned = torch.accelerator.is_available()
    for a, b in zip(got, expect):
        assert isinstance(a, PackedBatch)
        for f in FIELDS:
            x, y = getattr(a, f), getattr(b, f)
            assert (x is None) == (y is None), f
            if x is not None:
                assert torch.equal(x, y) and x.dtype == y.dtype, f
                if pinned:
                    assert x.is_pinned(), f
        assert a.max_seqlen == b.max_seqlen and a.num_loss_tokens == b.num_loss_tokens
        assert type(a.max_seqlen) is int and type(a.num_loss_tokens) is int
