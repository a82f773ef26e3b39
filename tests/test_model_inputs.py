"""``packkit.model_inputs`` without a model: the layout of mRoPE positions and vision inputs against a
per-token reference, for every collator it wraps (property tests), and ``HybridCollator``'s ``seq_idx``.

Every token id is its global index + 1 (0 pads), so each token of the batch names its source example and
offset: the reference reads the expected four rows and image order straight from there.
"""

import types

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from packkit.collate import FixedWindowCollator, PaddedCollator, PaddingFreeCollator
from packkit.model_inputs import HybridCollator, VisionLanguageCollator

KINDS = ("padding_free", "fixed_bfd", "fixed_next_fit", "fixed_drop", "padded")


#: The image placeholder token, and a model config that says so (no merging: one token a patch).
IMG = 10**6
CONFIG = types.SimpleNamespace(image_token_id=IMG, video_token_id=IMG + 1,
                               vision_config=types.SimpleNamespace(spatial_merge_size=1))


def make(lengths, seed):
    """Examples with unique ids, random (3, n) positions, and every other one of two tokens or more an 'image' of
    ``k`` patches whose rows hold its index, its ``k`` placeholder tokens (``IMG``) ending the text."""
    rng = np.random.default_rng(seed)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    out = []
    for i, n in enumerate(lengths):
        ex = {"input_ids": list(range(starts[i] + 1, starts[i] + n + 1)), "position_ids": rng.integers(0, 99, (3, n))}
        if i % 2 == 0 and n > 1:
            k = int(rng.integers(1, min(3, n - 1) + 1))
            ex["input_ids"][-k:] = [IMG] * k
            ex["pixel_values"] = torch.full((k, 2), float(i))
            ex["image_grid_thw"] = torch.tensor([[1, 1, k]])
        out.append(ex)
    return out


def collator(kind, window):
    if kind == "padding_free":
        return PaddingFreeCollator(loss_mask="none")
    if kind == "padded":
        return PaddedCollator(loss_mask="none")
    strategy = "next_fit" if kind == "fixed_next_fit" else "bfd"
    return FixedWindowCollator(window=window, strategy=strategy, overflow="drop" if kind == "fixed_drop" else "error",
                               loss_mask="none")


@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=12), extra=st.integers(0, 7),
       kind=st.sampled_from(KINDS), seed=st.integers(0, 2**16))
@example(lengths=[5], extra=0, kind="fixed_bfd", seed=0)  # one document filling its window exactly
@example(lengths=[3, 9, 1, 9], extra=4, kind="fixed_drop", seed=1)  # two documents dropped with their images
def test_every_token_takes_its_documents_positions_and_images_follow_their_documents(lengths, extra, kind, seed):
    """``fixed_drop``: the window is ``extra`` below the longest document (those over it are dropped)."""
    window = max(1, max(lengths) - extra) if kind == "fixed_drop" else max(lengths) + extra
    examples = make(lengths, seed)
    if min(lengths) > window:  # every document dropped: an error, as from the collator alone
        with pytest.raises(ValueError, match="dropped all"):
            VisionLanguageCollator(collator(kind, window), config=CONFIG)(examples)
        return
    batch = VisionLanguageCollator(collator(kind, window), config=CONFIG)(examples)
    ids = batch.input_ids.reshape(-1).numpy()
    pos = batch["position_ids"]
    assert pos.shape == (4, *batch.input_ids.shape) and pos.dtype == torch.int64
    pos = pos.reshape(4, -1).numpy()
    assert np.array_equal(pos[0], collator(kind, window)(examples).position_ids.reshape(-1).numpy())
    starts = np.concatenate([[0], np.cumsum(lengths)])
    seen, order = 0, []
    for p, token in enumerate(ids):
        if token == 0:  # padding: every row its text position
            assert (pos[1:, p] == pos[0, p]).all()
            continue
        if token == IMG:  # an image token: the next token of the document before it (documents are whole)
            offset += 1
        else:
            i = int(np.searchsorted(starts, token - 1, side="right") - 1)
            offset = token - 1 - starts[i]
        assert (pos[1:, p] == examples[i]["position_ids"][:, offset]).all()
        if offset == 0:
            order.append(i)
        seen += 1
    kept = [i for i, n in enumerate(lengths) if kind != "fixed_drop" or n <= window]
    assert sorted(order) == kept and seen == sum(lengths[i] for i in kept)
    images = [i for i in order if "pixel_values" in examples[i]]
    if images:
        assert torch.equal(batch["pixel_values"], torch.cat([examples[i]["pixel_values"] for i in images]))
        assert torch.equal(batch["image_grid_thw"], torch.cat([examples[i]["image_grid_thw"] for i in images]))
    else:
        assert "pixel_values" not in batch and "image_grid_thw" not in batch


def test_text_only_examples_need_no_positions():
    examples = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]
    batch = VisionLanguageCollator(PaddingFreeCollator(loss_mask="none"))(examples)
    assert batch["position_ids"].tolist() == [[[0, 1, 2, 0, 1]]] * 4


def test_hybrid_collator_puts_seq_idx_beside_the_segments():
    """``seq_idx`` int32 ``[B, W]``: a padding tail is a segment of its own (the kernels reset there too)."""
    batch = HybridCollator(FixedWindowCollator(window=4, strategy="next_fit", loss_mask="none"))(
        [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}, {"input_ids": [3]}])
    assert batch["seq_idx"].dtype == torch.int32
    assert batch["seq_idx"].tolist() == [[0, 0, 0, 1], [2, 2, 3, 4]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 4, 6, 7, 8]
    moved = batch.to("cpu")
    assert torch.equal(moved["seq_idx"], batch["seq_idx"])
    with pytest.raises(TypeError, match="HybridCollator wraps a collator"):
        HybridCollator(3)
