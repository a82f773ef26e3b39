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
from packkit.model_inputs import (VISION_KEYS, HybridCollator, VisionLanguageCollator,  # noqa: E402
                                  example_positions, mrope_position_ids)

from testlib import VL_TOKENS, tiny_vl_model, vl_example  # noqa: E402

TOL = 1e-10  # float64


@pytest.fixture(scope="module")
def model():
    return tiny_vl_model()


@pytest.fixture(scope="module")
def examples():
    g = torch.Generator().manual_seed(1)
    out = [vl_example(g, 4, images=[(1, 4, 4)]), vl_example(g, 6), vl_example(g, 2, images=[(1, 2, 4), (1, 4, 2)]),
           vl_example(g, 4, images=[(1, 4, 4)]), vl_example(g, 3), vl_example(g, 2, videos=[(2, 4, 4)])]
    # a look-alike of example 3: the same tokens and grid, another image (only its logits tell them apart)
    out.append(dict(out[3], pixel_values=torch.randn(out[3]["pixel_values"].shape, generator=g, dtype=torch.float64)))
    return out


def model_inputs(ex):
    """One example as a batch of one, as the processor returns it."""
    out = {"input_ids": torch.tensor([ex["input_ids"]]), "mm_token_type_ids": torch.tensor([ex["mm_token_type_ids"]])}
    return dict(out, **{key: ex[key] for key in VISION_KEYS if key in ex})


@pytest.fixture(scope="module")
def alone(model, examples):
    """Logits ``(n, vocab)`` of every example run alone (the model computes its own mRoPE positions)."""
    with torch.no_grad():
        return [model(**model_inputs(ex), use_cache=False).logits[0] for ex in examples]


def rope_index_alone(model, ex):
    """``(3, n)``: the model's own ``get_rope_index`` of one example (text positions for text only)."""
    if not any(key in ex for key in VISION_KEYS):
        return torch.arange(len(ex["input_ids"])).expand(3, -1)
    return model.model.get_rope_index(**model_inputs(ex))[0][:, 0]


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
    for key in VISION_KEYS:  # in document order, as the model scatters the features
        parts = [ex[key] for ex in examples if key in ex]
        assert torch.equal(batch[key], torch.cat(parts)) if parts else key not in batch
    text = PaddingFreeCollator()(examples)
    assert torch.equal(batch.cu_seqlens, text.cu_seqlens) and torch.equal(batch["cu_seq_lens_q"], text.cu_seqlens)
    assert torch.equal(batch["position_ids"][0], text.position_ids)
    assert check_documents(model, batch, examples, alone) == list(range(len(examples)))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_other_families_equal_each_document_alone(examples, family):
    """Qwen2.5-VL (windowed vision attention) and Qwen3-VL (interleaved mRoPE, deepstack), images only;
    Qwen3-VL reads 2-D ids as the text row, but then rotates the images' tokens as text."""
    model, docs = tiny_vl_model(family), examples[:3]
    with torch.no_grad():
        alone = [model(**model_inputs(ex), use_cache=False).logits[0] for ex in docs]
        plain = model(**PaddingFreeCollator()(docs)).logits[0]
    assert check_documents(model, VisionLanguageCollator(PaddingFreeCollator(), rope_index=model.model.get_rope_index)(
        docs), docs, alone) == [0, 1, 2]
    diff = (plain - torch.cat(alone)).abs().max().item()
    print(f"{family}, 2-D positions: logits max abs diff {diff:.3e}")
    assert diff > 1e-3


def test_fixed_windows_reordered_with_stored_positions(model, examples, alone):
    """Best-fit packing reorders the documents: the images follow their documents (two look-alike
    documents hold different pixels), padding tails extend every row, stored positions (as a dataset holds
    them, from example_positions) are used as given; through a DataLoader with two workers."""
    rope_index = model.model.get_rope_index
    stored = [dict(ex, position_ids=example_positions(ex, rope_index=rope_index).tolist()) for ex in examples]
    for ex in stored:
        del ex["mm_token_type_ids"]  # not needed once positions are stored
    collate = VisionLanguageCollator(FixedWindowCollator(window=32, num_windows=4), config=model.config)
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


def test_media_given_as_lists_take_torchs_dtypes(model, examples):
    """Media as Python lists (a ``datasets`` row without a format) become what ``torch.tensor`` and transformers'
    collators make of them: pixels in torch's default dtype, grids int64, the values unchanged. Before, numpy
    made the pixels float64 (twice the memory, float64 into a float32 vision tower)."""
    listed = [{k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in ex.items()} for ex in examples]
    collate = VisionLanguageCollator(PaddingFreeCollator(), rope_index=model.model.get_rope_index)
    want, got = collate(examples), collate(listed)
    for default in (torch.float32, torch.float64):
        torch.set_default_dtype(default)
        try:
            got = collate(listed)
        finally:
            torch.set_default_dtype(torch.float32)
        for key in VISION_KEYS:
            if key in want:
                floats = want[key].is_floating_point()
                assert got[key].dtype == (default if floats else torch.int64), key
                assert torch.equal(got[key], want[key].to(got[key].dtype)), key
        assert torch.equal(got.position_ids, want.position_ids)


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
    with pytest.raises(ValueError, match=r"example 0 has images or videos, which VisionLanguageCollator checks against "
                                         r"the model's placeholder tokens and merge size; pass config=model.config"):
        VisionLanguageCollator(PaddingFreeCollator())(examples)
    with pytest.raises(ValueError, match=r"example 0 has images or videos but no 3-D position_ids; pass rope_index="):
        VisionLanguageCollator(PaddingFreeCollator(), config=model.config)(examples)
    bad = [examples[1], dict(examples[0], position_ids=[[0, 1]] * 3)]
    with pytest.raises(ValueError, match=r"example 1 has position_ids of shape \[3, 2\] .* for 13 input_ids"):
        VisionLanguageCollator(PaddingFreeCollator(), config=model.config)(bad)
    no_grid = [examples[1], {k: v for k, v in examples[0].items() if k != "image_grid_thw"}]
    with pytest.raises(ValueError, match="example 1 has 'pixel_values' but no 'image_grid_thw'"):
        VisionLanguageCollator(PaddingFreeCollator(), rope_index=lambda **kw: 1 / 0)(
            [examples[1], dict(no_grid[1], position_ids=rope_index_alone(model, examples[0]))])
    no_types = [{k: v for k, v in examples[0].items() if k != "mm_token_type_ids"}]
    with pytest.raises(ValueError, match="example 0 has images or videos but no 'mm_token_type_ids'"):
        VisionLanguageCollator(PaddingFreeCollator(), rope_index=model.model.get_rope_index)(no_types)
    with pytest.raises(ValueError, match=r"overflow='split'\) would cut documents"):
        VisionLanguageCollator(FixedWindowCollator(window=8, overflow="split"))


def test_padded_view_rebuilt_from_a_plain_dict_reads_segments_from_the_text_row(model, examples):
    """A padded view rebuilt from a plain dict (no cu_seq_lens_q) finds its segments from the text row of its
    [4, B, L] positions, not from the four rows flattened (which gave 4x the segments)."""
    from packkit.batch import PackedBatch

    vl = VisionLanguageCollator(PaddedCollator(), rope_index=model.model.get_rope_index)(examples)
    rebuilt = PackedBatch({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in vl.items()})
    assert torch.equal(rebuilt.cu_seqlens, vl.cu_seqlens)


def test_explicit_4d_mask_view_with_mrope_positions(model, examples, alone):
    """The explicit-mask view (``hf_mask``: additive float [B, 1, L, L]) with the [4, B, L] positions: the
    mask isolates the documents by itself, the positions rotate them; each document as alone."""
    batch = VisionLanguageCollator(FixedWindowCollator(window=32, num_windows=4),
                                   rope_index=model.model.get_rope_index)(examples)
    inputs = {k: v for k, v in batch.items() if not k.startswith(("cu_seq_lens", "max_length"))}
    with torch.no_grad():
        out = model(**inputs, attention_mask=batch.hf_mask(model)).logits.reshape(-1, 128)
    ids = batch.input_ids.reshape(-1).tolist()
    diff = 0.0
    for a, n in documents(batch):
        i = min((i for i, ex in enumerate(examples) if ex["input_ids"] == ids[a: a + n]),
                key=lambda i: (out[a: a + n] - alone[i]).abs().max().item())
        diff = max(diff, (out[a: a + n] - alone[i]).abs().max().item())
    print(f"4-D mask logits max abs diff {diff:.3e}")
    assert diff < TOL


def offline_rows(examples):
    """The examples as a dataset holds them (lists; every row every key, None where it has no such media),
    with labels (-100 on the vision tokens), for ``pack_dataset``."""
    keys = ["input_ids", "mm_token_type_ids", *VISION_KEYS]
    rows = [{k: (ex[k].tolist() if torch.is_tensor(ex[k]) else ex[k]) if k in ex else None for k in keys}
            for ex in examples]
    for row in rows:
        row["labels"] = [-100 if t else x for x, t in zip(row["input_ids"], row["mm_token_type_ids"])]
    return [{k: v for k, v in row.items() if k != "second_per_grid_ts"} for row in rows]


@pytest.mark.parametrize("where", ["memory", "parquet", "arrow"])
def test_offline_packed_rows_equal_each_document_alone(model, examples, alone, where, tmp_path, float64_default):
    """pack_dataset of Qwen-VL rows keeps each document's images, grids and mm_token_type_ids with it (in memory,
    or written to a file and read back), and VisionLanguageCollator(PackedRowsCollator, rope_index=) makes each
    document's mRoPE positions from them: every document's logits equal it alone (best-fit moved the documents,
    and two look-alike documents hold other pixels), the images follow their documents, and the summed loss
    equals the same examples collated online."""
    datasets = pytest.importorskip("datasets")
    from packkit.offline import pack_dataset

    ds = datasets.Dataset.from_list(offline_rows(examples))
    window = 32
    if where == "memory":
        packed = pack_dataset(ds, window=window, seed=3, progress=False)
    else:
        path = pack_dataset(ds, window=window, seed=3, progress=False, output=tmp_path / f"packed.{where}")
        packed = datasets.Dataset.from_parquet(str(path)) if where == "parquet" else datasets.Dataset.from_file(str(path))
    assert {"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"} <= set(packed.column_names)
    assert any(len(r["seq_lengths"]) > 1 for r in packed)
    rope_index = model.model.get_rope_index
    offline = VisionLanguageCollator(PackedRowsCollator(window=window), rope_index=rope_index)(list(packed))
    assert offline["pixel_values"].dtype == torch.float64  # the rows' lists in the default dtype (float64_default)
    order = check_documents(model, offline, examples, alone)
    assert order != sorted(order)
    assert torch.equal(offline["image_grid_thw"], torch.cat([examples[i]["image_grid_thw"] for i in order
                                                             if "image_grid_thw" in examples[i]]))
    labelled = [dict(ex, labels=row["labels"]) for ex, row in zip(examples, offline_rows(examples))]
    online = VisionLanguageCollator(FixedWindowCollator(window=window), rope_index=rope_index)(labelled)
    with torch.no_grad():
        loss = [model(**b).loss * b.num_loss_tokens for b in (offline, online)]
    assert offline.num_loss_tokens == online.num_loss_tokens > 0
    assert torch.allclose(loss[0], loss[1], rtol=1e-6, atol=0)  # transformers' loss upcasts logits to float32 only


def test_offline_packed_rows_without_rope_index_name_the_document(model, examples):
    """Read back without rope_index (and no stored 3-D positions), a document with images is refused by its
    place in the batch, as online."""
    datasets = pytest.importorskip("datasets")
    from packkit.offline import pack_dataset

    packed = pack_dataset(datasets.Dataset.from_list(offline_rows(examples)), window=32, seed=3, progress=False)
    with pytest.raises(ValueError, match=r"example \d+ has images or videos but no 3-D position_ids; pass rope_index="):
        VisionLanguageCollator(PackedRowsCollator(window=32), config=model.config)(list(packed))


def test_offline_rows_given_by_position_ids_read_as_by_seq_lengths(model, examples):
    """Packed rows whose documents are marked by position_ids restarting at 0 (PackedRowsCollator's other form) read
    back as the same rows with seq_lengths (before: KeyError 'seq_lengths', naming neither the row nor the fix)."""
    datasets = pytest.importorskip("datasets")
    from packkit.offline import pack_dataset

    rows = list(pack_dataset(datasets.Dataset.from_list(offline_rows(examples)), window=32, seed=3, progress=False))
    by_pos = [dict({k: v for k, v in r.items() if k != "seq_lengths"},
                   position_ids=np.concatenate([np.arange(n) for n in r["seq_lengths"]]).tolist()) for r in rows]
    collate = VisionLanguageCollator(PackedRowsCollator(window=32), rope_index=model.model.get_rope_index)
    a, b = collate(rows), collate(by_pos)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if torch.is_tensor(a[k]))
    with pytest.raises(ValueError, match="packed row 0 has no 'seq_lengths' or 'position_ids'"):
        from packkit.mediarows import row_lengths
        row_lengths({"input_ids": [1, 2]})
