"""A real vision-language model (tiny random Qwen2VLForConditionalGeneration, CPU, float64, sdpa) fed packed
documents with images through ``packkit.model_inputs.VisionLanguageCollator``: every document's logits
equal those of the document run alone, its mRoPE rows equal the model's own ``get_rope_index`` of that
document, and the pitfalls that break it (2-D or 3-row positions: no document mask) are shown.

Found with transformers 5.24: Qwen2-VL and Qwen2.5-VL read ``position_ids`` of shape ``[4, B, L]`` as
(text row, temporal, height, width) and find packed documents from the text row only; a 2-D or 3-row
``position_ids`` gives them no text row, and their sdpa/eager mask then spans every document.
"""

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from packkit.collate import FixedWindowCollator, PackedRowsCollator, PaddedCollator, PaddingFreeCollator  # noqa: E402
from packkit.model_inputs import HybridCollator, VisionLanguageCollator, mrope_position_ids  # noqa: E402

TOL = 1e-10  # float64
IMG, VS, VE = 120, 122, 123  # image, vision start, vision end tokens
MERGE = 2  # spatial_merge_size
PATCH_DIM = 3 * 2 * 2 * 2  # channels * temporal_patch_size * patch_size**2


def tiny_vl_model(dtype=torch.float64):
    """A tiny random Qwen2VLForConditionalGeneration (2 text layers, 1 vision block) on sdpa."""
    torch.manual_seed(0)
    config = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=None, eos_token_id=None, sliding_window=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, patch_size=2,
                           spatial_merge_size=MERGE, temporal_patch_size=2, in_channels=3),
        image_token_id=IMG, video_token_id=121, vision_start_token_id=VS, vision_end_token_id=VE)
    return transformers.Qwen2VLForConditionalGeneration._from_config(config, attn_implementation="sdpa", dtype=dtype)


@pytest.fixture(scope="module")
def model():
    return tiny_vl_model().eval()


def make_example(g, text, grids):
    """What the processor gives for one conversation: text tokens (ids from 1: 0 pads), then per image
    ``<vs> <im>*k <ve>`` and three text tokens; ``pixel_values (patches, PATCH_DIM)``,
    ``image_grid_thw (images, 3)``, ``mm_token_type_ids`` (1 on image tokens); no loss on vision tokens."""
    ids = torch.randint(1, 100, (text,), generator=g).tolist()
    pixels = []
    for t, h, w in grids:
        ids += [VS] + [IMG] * (t * h * w // MERGE ** 2) + [VE] + torch.randint(1, 100, (3,), generator=g).tolist()
        pixels.append(torch.randn(t * h * w, PATCH_DIM, generator=g, dtype=torch.float64))
    ex = {"input_ids": ids, "labels": [-100 if x in (IMG, VS, VE) else x for x in ids],
          "mm_token_type_ids": [int(x == IMG) for x in ids]}
    if grids:
        ex["pixel_values"] = torch.cat(pixels)
        ex["image_grid_thw"] = torch.tensor(grids)
    return ex


@pytest.fixture(scope="module")
def examples():
    g = torch.Generator().manual_seed(1)
    out = [make_example(g, 4, [(1, 4, 4)]), make_example(g, 6, []), make_example(g, 2, [(1, 2, 4), (1, 4, 2)]),
           make_example(g, 4, [(1, 4, 4)]), make_example(g, 3, [])]
    # a look-alike of example 3: the same tokens and grid, another image (only its logits tell them apart)
    out.append(dict(out[3], pixel_values=torch.randn(out[3]["pixel_values"].shape, generator=g, dtype=torch.float64)))
    return out


def model_inputs(ex):
    """One example as a batch of one, as the processor returns it."""
    out = {"input_ids": torch.tensor([ex["input_ids"]]), "mm_token_type_ids": torch.tensor([ex["mm_token_type_ids"]])}
    for key in ("pixel_values", "image_grid_thw"):
        if key in ex:
            out[key] = ex[key]
    return out


@pytest.fixture(scope="module")
def alone(model, examples):
    """Logits ``(n, vocab)`` of every example run alone (the model computes its own mRoPE positions)."""
    with torch.no_grad():
        return [model(**model_inputs(ex), use_cache=False).logits[0] for ex in examples]


def rope_index_alone(model, ex):
    """``(3, n)``: the model's own ``get_rope_index`` of one example (text positions for text only)."""
    if "image_grid_thw" not in ex:
        return torch.arange(len(ex["input_ids"])).expand(3, -1)
    inputs = model_inputs(ex)
    pos, _ = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                        image_grid_thw=inputs["image_grid_thw"])
    return pos[:, 0]


def documents(batch):
    """``(flat start, length)`` of every non-padding segment (padding is id 0 here; no example holds a 0)."""
    cu = batch.cu_seqlens.tolist()
    ids = batch.input_ids.reshape(-1)
    return [(a, b - a) for a, b in zip(cu, cu[1:]) if b > a and ids[a] != 0]


def check_documents(model, batch, examples, alone):
    """Every document's logits equal those of one example alone (which one: by its tokens, and by its
    logits among look-alikes), every example once; its mRoPE rows equal its own get_rope_index, its text
    row 0..n-1. Returns the example of every document, in batch order."""
    with torch.no_grad():
        out = model(**batch)
    flat_logits = out.logits.reshape(-1, out.logits.shape[-1])
    flat_pos = batch["position_ids"].reshape(4, -1)
    ids = batch.input_ids.reshape(-1).tolist()
    order, diff = [], 0.0
    for a, n in documents(batch):
        candidates = [i for i, ex in enumerate(examples) if ex["input_ids"] == ids[a: a + n]]
        diffs = {i: (flat_logits[a: a + n] - alone[i]).abs().max().item() for i in candidates}
        i = min(diffs, key=diffs.get)
        order.append(i)
        diff = max(diff, diffs[i])
        assert torch.equal(flat_pos[0, a: a + n], torch.arange(n))
        assert torch.equal(flat_pos[1:, a: a + n], rope_index_alone(model, examples[i]))
    print(f"logits max abs diff {diff:.3e}")
    assert diff < TOL
    assert sorted(order) == list(range(len(examples)))
    return order


def test_padding_free_row_equals_each_document_alone(model, examples, alone):
    batch = VisionLanguageCollator(PaddingFreeCollator(), rope_index=model.model.get_rope_index)(examples)
    assert batch["position_ids"].shape == (4, 1, sum(len(ex["input_ids"]) for ex in examples))
    assert torch.equal(batch["image_grid_thw"], torch.cat([ex["image_grid_thw"] for ex in examples
                                                           if "image_grid_thw" in ex]))
    text = PaddingFreeCollator()(examples)
    assert torch.equal(batch.cu_seqlens, text.cu_seqlens) and torch.equal(batch["cu_seq_lens_q"], text.cu_seqlens)
    assert torch.equal(batch["position_ids"][0], text.position_ids)
    assert check_documents(model, batch, examples, alone) == list(range(len(examples)))


def test_fixed_windows_reordered_with_stored_positions(model, examples, alone):
    """Best-fit packing reorders the documents: the images follow their documents (two look-alike
    documents hold different pixels), padding tails extend every row, stored positions (as a dataset holds
    them, from get_rope_index) are used as given; through a DataLoader with two workers."""
    stored = [dict(ex, position_ids=rope_index_alone(model, ex).tolist()) for ex in examples]
    for ex in stored:
        del ex["mm_token_type_ids"]  # not needed once positions are stored
    collate = VisionLanguageCollator(FixedWindowCollator(window=32, num_windows=4))
    loader = torch.utils.data.DataLoader(stored, batch_size=len(stored), collate_fn=collate, num_workers=2)
    (batch,) = list(loader)
    assert batch["position_ids"].shape == (4, 4, 32)
    order = check_documents(model, batch, examples, alone)
    assert order != sorted(order)  # packing moved documents: images had to follow them
    assert torch.equal(batch["image_grid_thw"], torch.cat([examples[i]["image_grid_thw"] for i in order
                                                           if "image_grid_thw" in examples[i]]))
    # padding: a tail is its own segment on every row, its positions from 0
    pos, ids = batch["position_ids"], batch.input_ids
    for r in range(ids.shape[0]):
        tail = int((ids[r].flip(0).cumsum(0) == 0).sum())
        if tail:
            assert all(torch.equal(pos[k, r, -tail:], torch.arange(tail)) for k in range(4))


def test_padded_fallback_equals_each_document_alone(model, examples, alone):
    batch = VisionLanguageCollator(PaddedCollator(), rope_index=model.model.get_rope_index)(examples)
    with torch.no_grad():
        out = model(**batch)
    diff = max((out.logits[r, :len(ex["input_ids"])] - alone[r]).abs().max().item() for r, ex in enumerate(examples))
    print(f"padded logits max abs diff {diff:.3e}")
    assert diff < TOL
    assert batch.cu_seqlens.numel() == 2 * len(examples) + 1 - sum(
        len(ex["input_ids"]) == batch.shape[1] for ex in examples)


def test_hybrid_wrapper_composes(model, examples):
    batch = HybridCollator(VisionLanguageCollator(PaddingFreeCollator(), rope_index=model.model.get_rope_index))(
        examples)
    lengths = [len(ex["input_ids"]) for ex in examples]
    assert batch["seq_idx"].tolist() == [np.repeat(np.arange(len(lengths)), lengths).tolist()]
    assert batch["seq_idx"].dtype == torch.int32


@pytest.mark.parametrize("positions", ["collator_2d", "three_rows"])
def test_positions_without_a_text_row_make_documents_attend_across(model, examples, alone, positions):
    """Regression tests (axolotl PR #3817; LLaMA-Factory #10736 padded ids, not positions): a text
    collator's 2-D position_ids, or the three mRoPE rows without the text row, give Qwen2-VL no document
    boundaries, and documents attend across each other with nothing said."""
    vl = VisionLanguageCollator(PaddingFreeCollator(), rope_index=model.model.get_rope_index)(examples)
    batch = dict(vl)
    batch["position_ids"] = vl["position_ids"][0] if positions == "collator_2d" else vl["position_ids"][1:]
    with torch.no_grad():
        out = model(**batch)
    diff = max((out.logits[0, a: a + n] - alone[i]).abs().max().item() for (a, n), i in
               zip(documents(vl), range(len(examples))))
    print(f"{positions}: logits max abs diff {diff:.3e}")
    assert diff > 1e-3


def test_mrope_position_ids_against_a_loop():
    """The layout against a per-token loop: every real token takes its source's three rows, padding the text row."""
    rng = np.random.default_rng(0)
    text = np.array([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    positions = rng.integers(0, 50, (3, 9))
    index = np.array([4, 5, 6, 0, 1, 7, 8, 2, 3])
    dest = np.array([0, 1, 2, 3, 4, 6, 7, 8, 9])
    out = mrope_position_ids(text, positions, index, dest)
    want = np.repeat(text.reshape(1, -1), 4, 0)
    for src, d in zip(index, dest):
        want[1:, d] = positions[:, src]
    assert out.shape == (4, 2, 6) and np.array_equal(out.reshape(4, -1), want)


def test_errors_name_the_example_and_the_fix(model, examples):
    with pytest.raises(ValueError, match=r"example 0 has images or videos but no 3-D position_ids; pass rope_index="):
        VisionLanguageCollator(PaddingFreeCollator())(examples)
    bad = [examples[1], dict(examples[0], position_ids=[[0, 1]] * 3)]
    with pytest.raises(ValueError, match=r"example 1 has position_ids of shape \[3, 2\] .* for 13 input_ids"):
        VisionLanguageCollator(PaddingFreeCollator())(bad)
    no_grid = [examples[1], {k: v for k, v in examples[0].items() if k != "image_grid_thw"}]
    with pytest.raises(ValueError, match="example 1 has 'pixel_values' but no 'image_grid_thw'"):
        VisionLanguageCollator(PaddingFreeCollator(), rope_index=lambda **kw: 1 / 0)(
            [examples[1], dict(no_grid[1], position_ids=rope_index_alone(model, examples[0]))])
    no_types = [{k: v for k, v in examples[0].items() if k != "mm_token_type_ids"}]
    with pytest.raises(ValueError, match="example 0 has images or videos but no 'mm_token_type_ids'"):
        VisionLanguageCollator(PaddingFreeCollator(), rope_index=model.model.get_rope_index)(no_types)
    with pytest.raises(ValueError, match=r"overflow='split'\) would cut documents"):
        VisionLanguageCollator(FixedWindowCollator(window=8, overflow="split"))
    with pytest.raises(TypeError, match="rows packed offline"):
        VisionLanguageCollator(PackedRowsCollator(window=8))


def test_padded_view_rebuilt_from_a_plain_dict_reads_segments_from_the_text_row(model, examples):
    """A padded view rebuilt from a plain dict (no cu_seq_lens_q) finds its segments from the text row of its
    [4, B, L] positions, not from the four rows flattened (which gave 4x the segments)."""
    from packkit.batch import PackedBatch

    vl = VisionLanguageCollator(PaddedCollator(), rope_index=model.model.get_rope_index)(examples)
    rebuilt = PackedBatch({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in vl.items()})
    assert torch.equal(rebuilt.cu_seqlens, vl.cu_seqlens)
