"""Multimodal families beyond mRoPE (Gemma 3, Gemma 4, PaliGemma, Idefics3, SmolVLM, InternVL, LLaVA-NeXT, LLaVA-OneVision,
Qwen2-Audio) packed through
``VisionLanguageCollator(collator, config=model.config)``, each on a tiny random model built from a config
(float64, CPU): every document's logits equal those of the document run alone, changing one document's
media leaves every other document's logits bit for bit, the media follow their documents after best-fit
packing (checked by content), and the naive text collation is shown wrong for each family.

Tolerance: 1e-10 under every attention implementation. transformers' eager attention takes its softmax in
float32 (``eager_attention_forward``'s ``dtype=torch.float32``), whose sums round differently over rows of
different lengths: the tests run it in float64 (:func:`exact_eager`). PaliGemma numbers a document from 1 when
it runs alone; packed from 0 it would differ by 3.5e-8 to 7.3e-8 (RoPE's float32 angles), packkit numbers its
documents from 1 too (:func:`test_paligemma_documents_numbered_from_one_and_found`).
"""

import os

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from packkit.collate import FixedWindowCollator, PaddedCollator, PaddingFreeCollator  # noqa: E402
from packkit.media import FAMILIES, allowed_mask, span_blocks  # noqa: E402
from packkit.model_inputs import VisionLanguageCollator  # noqa: E402

TOL = {"sdpa": 1e-10, "eager": 1e-10, "flex_attention": 1e-10}  # eager's softmax in float64 (exact_eager below)
IMG, BOI, EOI = 120, 121, 122
TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
            pad_token_id=0)
SLIDING = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2)
GEMMA4_TEXT = dict(vocab_size_per_layer_input=128, hidden_size_per_layer_input=8, global_head_dim=8,
                   use_bidirectional_attention="vision")
GEMMA4_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=8, patch_size=2, pooling_kernel_size=2, position_embedding_size=16)
SIGLIP = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8,
              patch_size=2, num_channels=3)


def build(family: str, impl: str = "sdpa"):
    """``(model, make)``: a tiny random model of ``family`` and ``make(g, text, units)``, one example as its
    processor gives it (``text`` text tokens, ``units`` images or audio clips)."""
    t = transformers
    if family == "gemma3":
        config = t.Gemma3Config(text_config=dict(TEXT, **SLIDING), vision_config=SIGLIP, mm_tokens_per_image=4,
                                image_token_index=IMG, boi_token_index=BOI, eoi_token_index=EOI)
        cls, make = t.Gemma3ForConditionalGeneration, _gemma3_example
    elif family == "gemma4":  # its larger checkpoints' image spans (bidirectional on the sliding layers only)
        config = t.Gemma4Config(text_config=dict(TEXT, **SLIDING, **GEMMA4_TEXT), vision_config=GEMMA4_VISION,
                                audio_config=None, image_token_id=IMG, boi_token_id=BOI, eoi_token_id=EOI,
                                video_token_id=123, audio_token_id=124, boa_token_id=125, eoa_token_index=126)
        cls, make = t.Gemma4ForConditionalGeneration, _gemma4_example
    elif family == "paligemma":  # PaliGemma 2's Gemma 2 text (full and sliding layers) takes eager and flex only;
        # under sdpa, PaliGemma (1)'s Gemma text
        text = dict(TEXT, model_type="gemma") if impl == "sdpa" else dict(TEXT, model_type="gemma2", **SLIDING)
        config = t.PaliGemmaConfig(text_config=text, projection_dim=32, image_token_index=IMG,
                                   vision_config=dict(SIGLIP, model_type="siglip_vision_model"))
        cls, make = t.PaliGemmaForConditionalGeneration, _paligemma_example
    elif family in ("idefics3", "smolvlm"):
        config_cls = t.Idefics3Config if family == "idefics3" else t.SmolVLMConfig
        config = config_cls(text_config=dict(TEXT, model_type="llama"), scale_factor=2, image_token_id=IMG,
                            vision_config=dict(SIGLIP, image_size=8, patch_size=2))
        cls = t.Idefics3ForConditionalGeneration if family == "idefics3" else t.SmolVLMForConditionalGeneration
        make = _idefics3_example
    elif family == "internvl":
        config = t.InternVLConfig(text_config=dict(TEXT, model_type="qwen2"), image_token_id=IMG, downsample_ratio=0.5,
                                  vision_config=dict(SIGLIP, image_size=[8, 8], patch_size=[2, 2]))
        cls, make = t.InternVLForConditionalGeneration, _internvl_example
    elif family == "llava_onevision":  # anyres_max_1: a grid above one tile's patches is shrunk
        config = t.LlavaOnevisionConfig(text_config=dict(TEXT, model_type="qwen2"), image_token_index=IMG,
                                        vision_config=dict(SIGLIP, model_type="siglip_vision_model"),
                                        image_grid_pinpoints=[[8, 16], [16, 8], [16, 16]], vision_feature_layer=-1,
                                        vision_aspect_ratio="anyres_max_1")
        cls, make = t.LlavaOnevisionForConditionalGeneration, None
    elif family == "llava_next":
        config = t.LlavaNextConfig(text_config=dict(TEXT, model_type="llama"), image_token_index=IMG,
                                   vision_config=dict(SIGLIP, model_type="clip_vision_model", projection_dim=16),
                                   image_grid_pinpoints=[[8, 16], [16, 8], [16, 16]], vision_feature_layer=-1)
        cls, make = t.LlavaNextForConditionalGeneration, None
    else:
        config = t.Qwen2AudioConfig(text_config=dict(TEXT, model_type="qwen2"), audio_token_id=IMG,
                                    audio_config=dict(d_model=16, encoder_layers=1, encoder_attention_heads=2,
                                                      encoder_ffn_dim=32, num_mel_bins=8, max_source_positions=8))
        cls, make = t.Qwen2AudioForConditionalGeneration, _audio_example
    torch.manual_seed(0)
    model = cls._from_config(config, attn_implementation=impl, dtype=torch.float64).eval()
    for name, p in model.named_parameters():
        if name.endswith("mm_input_projection_weight"):  # Gemma 3 starts it at zero: images would not count
            torch.nn.init.normal_(p, std=0.5, generator=torch.Generator().manual_seed(1))
    if family in ("llava_next", "llava_onevision"):
        return model, lambda g, text, units: _llava_next_example(model, g, text, units)
    return model, lambda g, text, units: make(model.config, g, text, units)


def _words(g, n):
    return torch.randint(1, 100, (n,), generator=g).tolist()


def _pixels(g, units, size=8):
    return torch.randn(units, 3, size, size, generator=g, dtype=torch.float64)


def _gemma3_example(config, g, text, units):
    ids = _words(g, text)
    for _ in range(units):
        ids += [BOI] + [IMG] * config.mm_tokens_per_image + [EOI] + _words(g, 3)
    ex = {"input_ids": ids, "token_type_ids": [int(x == IMG) for x in ids]}
    return dict(ex, pixel_values=_pixels(g, units)) if units else ex


def _gemma4_example(config, g, text, units):
    """Images of 4x4, 2x4, 4x2 or 2x2 patches (4, 2, 2 or 1 soft tokens: 2x2 patches pooled into one), each padded
    to 16 patches with position (-1, -1), as Gemma 4's image processor pads to its max_patches."""
    ids, grids = _words(g, text), [(4, 4), (2, 4), (4, 2), (2, 2)]
    pixels = torch.rand(units, 16, 12, generator=g, dtype=torch.float64)
    positions = torch.full((units, 16, 2), -1)
    for u in range(units):
        w, h = grids[torch.randint(0, 4, (1,), generator=g).item()]
        grid = torch.stack(torch.meshgrid(torch.arange(w), torch.arange(h), indexing="xy"), -1).reshape(-1, 2)
        positions[u, :len(grid)] = grid
        pixels[u, len(grid):] = 0
        ids += [BOI] + [IMG] * (len(grid) // 4) + [EOI] + _words(g, 3)
    ex = {"input_ids": ids, "mm_token_type_ids": [int(x == IMG) for x in ids]}
    return dict(ex, pixel_values=pixels, image_position_ids=positions) if units else ex


def _paligemma_example(config, g, text, units):
    prefix = [IMG] * (config.text_config.num_image_tokens * units) + _words(g, text)
    suffix = _words(g, 4)
    ex = {"input_ids": prefix + suffix, "token_type_ids": [0] * len(prefix) + [1] * len(suffix)}
    return dict(ex, pixel_values=_pixels(g, units)) if units else ex


def _idefics3_example(config, g, text, units):
    ids = _words(g, text)
    for _ in range(units):
        ids += [BOI] + [IMG] * 4 + [BOI] + _words(g, 2)
    if not units:
        return {"input_ids": ids}
    return {"input_ids": ids, "pixel_values": _pixels(g, units)[None],  # (1, images, C, H, W), as the processor
            "pixel_attention_mask": torch.ones(1, units, 8, 8, dtype=torch.bool)}


def _internvl_example(config, g, text, units):
    ids = _words(g, text)
    for _ in range(units):
        ids += [BOI] + [IMG] * 4 + [EOI] + _words(g, 2)
    return dict({"input_ids": ids}, pixel_values=_pixels(g, units)) if units else {"input_ids": ids}


def _llava_next_example(model, g, text, units):
    """Images of random sizes, each cut in 3 or 5 tiles (the base tile and its grid), padded to the example's
    most; as many placeholders as the model's own get_image_features gives features for each image."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    shapes = torch.tensor([[5, 12], [14, 15], [12, 6], [16, 9]])  # 3, 5, 3 and 5 tiles
    sizes = shapes[torch.randint(0, 4, (units,), generator=g)]
    tiles = [image_size_to_num_patches(s, model.config.image_grid_pinpoints, 8) for s in sizes.tolist()]
    pixels = torch.randn(units, max(tiles, default=1), 3, 8, 8, generator=g, dtype=torch.float64)
    ids = _words(g, text)
    if not units:
        return {"input_ids": ids}
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values=pixels, image_sizes=sizes, return_dict=True)
    for f in features.pooler_output:
        ids += [BOI] + [IMG] * f.shape[0] + [EOI] + _words(g, 2)
    return {"input_ids": ids, "pixel_values": pixels, "image_sizes": sizes}


def _audio_example(config, g, text, units):
    frames = torch.randint(6, 17, (units,), generator=g)  # real frames of each clip, padded to 16
    ids = _words(g, text)
    for n in frames.tolist():
        ids += [BOI] + [IMG] * ((((n - 1) // 2 + 1) - 2) // 2 + 1) + [EOI] + _words(g, 2)
    if not units:
        return {"input_ids": ids}
    mask = (torch.arange(16)[None] < frames[:, None]).to(torch.int64)
    features = torch.randn(units, 8, 16, generator=g, dtype=torch.float64) * mask[:, None]
    return {"input_ids": ids, "input_features": features,
            "feature_attention_mask": mask}


def alone_inputs(ex):
    """One example as a batch of one, as its processor returns it."""
    out = {}
    for key, value in ex.items():
        v = torch.as_tensor(value)
        out[key] = v[None] if key in ("input_ids", "token_type_ids", "mm_token_type_ids") else v
    return out


def eager_float64(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """transformers' ``eager_attention_forward`` (5.24) with one change: the softmax in the query's dtype. It takes
    it in float32 even for a float64 model, which rounds differently with the row length: packed and alone then
    differ by ~1e-7 for reasons that are not packing (the mask is what these tests check)."""
    n_rep = getattr(module, "num_key_value_groups", 1)
    key, value = (x.repeat_interleave(n_rep, dim=1) for x in (key, value))
    scores = torch.matmul(query, key.transpose(2, 3)) * (module.head_dim ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask[..., :key.shape[-2]]
    weights = scores.softmax(-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


@pytest.fixture(scope="module", autouse=True)
def exact_eager():
    """Every eager attention these families run (text and vision towers) with its softmax in float64."""
    import importlib

    with pytest.MonkeyPatch.context() as mp:
        for name in ("gemma2", "gemma3", "gemma4", "paligemma", "llama", "mistral", "qwen2", "idefics3", "smolvlm",
                     "internvl", "siglip", "siglip2", "llava_next", "llava_onevision", "qwen2_audio", "clip"):
            try:
                mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
            except ImportError:
                continue
            if hasattr(mod, "eager_attention_forward"):
                mp.setattr(mod, "eager_attention_forward", eager_float64)
        yield


def logits(model, inputs):
    with torch.no_grad():
        return model(**{**inputs, "use_cache": False}).logits


def documents(batch, examples):
    """``(flat start, example)`` of every document of the batch, in batch order (its tokens tell which:
    every example here has tokens of its own)."""
    cu, ids = batch.cu_seqlens.tolist(), batch.input_ids.reshape(-1).tolist()
    out = []
    for a, b in zip(cu, cu[1:]):
        match = [i for i, ex in enumerate(examples) if list(ex["input_ids"]) == ids[a:b]]
        if match:
            out.append((a, match[0]))
    return out


#: every family once under ``make test``; a second attention implementation under ``-m slow``
FAMILY_IMPLS = [("gemma3", "sdpa"), pytest.param(("gemma3", "eager"), marks=pytest.mark.slow), ("gemma4", "sdpa"),
                pytest.param(("gemma4", "eager"), marks=pytest.mark.slow), ("paligemma", "eager"), ("paligemma", "sdpa"),
                ("idefics3", "sdpa"), ("smolvlm", "eager"), ("internvl", "sdpa"), ("qwen2_audio", "sdpa"),
                ("llava_next", "sdpa"), ("llava_onevision", "sdpa"),
                pytest.param(("internvl", "eager"), marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=FAMILY_IMPLS, ids=lambda p: f"{p[0]}-{p[1]}")
def case(request):
    family, impl = request.param
    model, make = build(family, impl)
    g = torch.Generator().manual_seed(3)
    examples = [make(g, 3, 1), make(g, 5, 0), make(g, 2, 2), make(g, 4, 1), make(g, 6, 0)]
    alone = [logits(model, alone_inputs(ex))[0] for ex in examples]
    return family, impl, model, examples, alone


def best_fit(examples):
    """Best-fit windows of 40 tokens (or the longest example's, LLaVA-NeXT's images being long): they move
    the documents."""
    return FixedWindowCollator(window=max(40, *(len(ex["input_ids"]) for ex in examples)), loss_mask="none")


def against_alone(model, batch, examples, alone):
    """``(diff, order)``: the largest difference of any document's logits in the batch from its example's alone,
    and the examples in the order the batch holds them (every example once when nothing was lost)."""
    out = logits(model, batch)
    flat = out.reshape(-1, out.shape[-1])
    docs = documents(batch, examples)
    diff = max((flat[a:a + len(examples[i]["input_ids"])] - alone[i]).abs().max().item() for a, i in docs)
    print(f"logits max abs diff {diff:.3e}")
    return diff, [i for _, i in docs]


def test_padding_free_equals_each_document_alone(case):
    family, impl, model, examples, alone = case
    batch = VisionLanguageCollator(PaddingFreeCollator(loss_mask="none"), config=model.config)(examples)
    diff, order = against_alone(model, batch, examples, alone)
    assert diff < TOL[impl] and order == list(range(len(examples)))


def test_fixed_windows_media_follow_their_documents(case):
    """Best-fit packing moves documents; each document's media are found, by content, where the model
    reads them: concatenated in the order the batch holds the documents."""
    family, impl, model, examples, alone = case
    batch = VisionLanguageCollator(best_fit(examples), config=model.config)(examples)
    diff, order = against_alone(model, batch, examples, alone)
    assert diff < TOL[impl] and sorted(order) == list(range(len(examples)))
    assert order != sorted(order)
    key = "input_features" if family == "qwen2_audio" else "pixel_values"
    got = batch[key][0] if FAMILIES[family].batch_axis else batch[key]
    dims = dict(FAMILIES[family].media)[key]
    want = [unit for i in order if key in examples[i]
            for unit in torch.as_tensor(examples[i][key]).reshape(-1, *torch.as_tensor(examples[i][key]).shape[-dims:])]
    assert len(got) == len(want)
    assert not FAMILIES[family].ragged or any(len(unit) < got.shape[1] for unit in want)
    for have, unit in zip(got, want):  # LLaVA-NeXT's tiles: padded with zeros to the batch's most
        assert torch.equal(have[:len(unit)], unit) and not have[len(unit):].any()


def test_media_given_as_lists_take_torchs_dtypes(case):
    """A family's media as Python lists become torch's dtypes (floats the default, float32 here), as
    ``torch.tensor`` makes them; before, numpy made them float64. The values are the tensors' own."""
    family, impl, model, examples, alone = case
    collate = VisionLanguageCollator(PaddingFreeCollator(loss_mask="none"), config=model.config)
    listed = [{k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in ex.items()} for ex in examples]
    want, got = collate(examples), collate(listed)
    for key, _ in FAMILIES[family].media:
        if key in want:
            assert got[key].dtype == (torch.float32 if want[key].is_floating_point() else want[key].dtype), key
            assert torch.equal(got[key], want[key].to(got[key].dtype)), key


def test_one_documents_media_changed_leaves_the_others_exactly(case):
    family, impl, model, examples, alone = case
    collate = VisionLanguageCollator(best_fit(examples), config=model.config)
    key = "input_features" if family == "qwen2_audio" else "pixel_values"
    changed = [dict(ex) for ex in examples]
    media = torch.as_tensor(examples[2][key])
    changed[2][key] = media + torch.randn(media.shape, generator=torch.Generator().manual_seed(9), dtype=media.dtype)
    before, after = collate(examples), collate(changed)
    out_before, out_after = logits(model, before), logits(model, after)
    flat_b, flat_a = out_before.reshape(-1, out_before.shape[-1]), out_after.reshape(-1, out_after.shape[-1])
    for a, i in documents(before, examples):
        n = len(examples[i]["input_ids"])
        same = torch.equal(flat_b[a:a + n], flat_a[a:a + n])
        assert same != (i == 2), f"example {i}"


def test_padded_fallback_equals_each_document_alone(case):
    family, impl, model, examples, alone = case
    if family in ("gemma3", "gemma4") and impl == "eager":
        pytest.skip("transformers 5.24's Gemma 3 and Gemma 4 eager attention give NaN on a right-padded row in "
                    "float64 (its float32 softmax turns the float64 minimum into -inf; float32 is fine): no packing "
                    "involved")
    batch = VisionLanguageCollator(PaddedCollator(loss_mask="none"), config=model.config)(examples)
    out = logits(model, batch)
    diff = max((out[r, :len(ex["input_ids"])] - alone[r]).abs().max().item() for r, ex in enumerate(examples))
    print(f"padded logits max abs diff {diff:.3e}")
    assert diff < TOL[impl]


def naive_batch(family, model, examples):
    """What a text collator gives (input_ids, labels, position_ids reset per document), with the media
    concatenated as a user would: for Gemma 3 and PaliGemma its token_type_ids laid out too."""
    text = [{"input_ids": ex["input_ids"]} for ex in examples]
    batch = dict(PaddingFreeCollator(loss_mask="none")(text))
    spec = FAMILIES[family]
    for key, _ in spec.media:
        parts = [torch.as_tensor(ex[key]).reshape(-1, *torch.as_tensor(ex[key]).shape[-(_ + 1) + 1:])
                 for ex in examples if key in ex]
        batch[key] = torch.cat(parts)[None] if spec.batch_axis else torch.cat(parts)
    for key in spec.token_keys:
        batch[key] = torch.tensor([sum((list(ex[key]) for ex in examples), [])])
    return batch


@pytest.mark.parametrize("family", ["gemma3", "gemma4", "paligemma"])
def test_naive_collation_is_wrong(family):
    """Gemma 3 given the text batch and its token_type_ids, Gemma 4 its mm_token_type_ids (transformers 5.24
    composes the mask itself): their sliding layers read each image span at the token's position, not its
    index, so every document after the first attends wrongly inside itself; PaliGemma without token_type_ids
    (a text collator drops them) loses its prefix span."""
    model, make = build(family, "eager" if family == "paligemma" else "sdpa")
    g = torch.Generator().manual_seed(3)
    examples = [make(g, 3, 1), make(g, 5, 0), make(g, 2, 2)]
    alone = [logits(model, alone_inputs(ex))[0] for ex in examples]
    batch = naive_batch(family, model, examples)
    if family == "paligemma":
        del batch["token_type_ids"]
    out = logits(model, batch)[0]
    starts = np.cumsum([0] + [len(ex["input_ids"]) for ex in examples])
    diffs = [(out[a:a + len(ex["input_ids"])] - al).abs().max().item() for a, ex, al in zip(starts, examples, alone)]
    print(f"{family} naive: per-document max abs diff {diffs}")
    assert max(diffs) > 1e-3


def test_paligemma_documents_numbered_from_one_and_found():
    """PaliGemma numbers a document's tokens from 1 when it runs alone (transformers' ``PaliGemmaModel.forward``:
    ``arange(L) + 1``); numbered from 0, a packed document's RoPE angles round differently in float32 (3.5e-8 to
    7.3e-8 in float64 logits). packkit starts every segment at 1 for PaliGemma in every batch it makes (padding-free,
    best-fit windows with padding tails, the padded fallback, rows packed offline), and transformers still finds
    every document from those positions (``find_packed_sequence_indices``: a segment starts where a position does
    not follow the previous one), as does a PackedBatch rebuilt from a dict of copied tensors (what Trainer does
    after moving a batch). Other families keep 0."""
    datasets = pytest.importorskip("datasets")
    from transformers.masking_utils import find_packed_sequence_indices

    from packkit.batch import PackedBatch
    from packkit.collate import PackedRowsCollator
    from packkit.offline import pack_dataset

    model, make = build("paligemma", "sdpa")
    g = torch.Generator().manual_seed(3)
    examples = [make(g, 3, 1), make(g, 5, 0), make(g, 2, 2), make(g, 4, 1), make(g, 6, 0)]
    rows = [{k: v.tolist() if torch.is_tensor(v) else v for k, v in ex.items()} for ex in examples]
    window = best_fit(examples).window
    packed = list(pack_dataset(datasets.Dataset.from_list(rows), window=window, progress=False))
    for collator, batch_examples in ((PaddingFreeCollator(loss_mask="none"), examples), (best_fit(examples), examples),
                                     (PaddedCollator(loss_mask="none"), examples),
                                     (PackedRowsCollator(window=window, loss_mask="none"), packed)):
        batch = VisionLanguageCollator(collator, config=model.config)(batch_examples)
        pos, seg = batch["position_ids"], batch.seq_idx.to(torch.int64)
        starts = seg != torch.nn.functional.pad(seg, (1, 0), value=-1)[:, :-1]
        ranks = torch.cumsum(torch.ones_like(seg), -1) - 1
        first = torch.cummax(torch.where(starts, ranks, 0), -1).values
        assert torch.equal(pos, ranks - first + 1), type(collator).__name__  # 1, 2, ... in every segment
        found = find_packed_sequence_indices(pos)
        if "attention_mask" not in batch:  # packed: the model finds the documents from position_ids
            assert found is not None and torch.equal(found, seg - seg[:, :1]), type(collator).__name__
        rebuilt = PackedBatch({k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()})
        assert torch.equal(rebuilt.cu_seqlens, batch.cu_seqlens), type(collator).__name__
    assert len(packed) < len(examples)
    other, make_other = build("gemma3", "sdpa")
    batch = VisionLanguageCollator(PaddingFreeCollator(loss_mask="none"), config=other.config)(
        [make_other(g, 3, 1), make_other(g, 4, 0)])
    assert batch["position_ids"][0, 0] == 0


def test_span_blocks_and_mask_against_a_loop():
    """The composition (document, causal, span, window) against a per-pair loop."""
    rng = np.random.default_rng(0)
    tt = torch.from_numpy(rng.integers(0, 2, (2, 23)))
    seg = torch.from_numpy(np.sort(rng.integers(0, 4, (2, 23)), axis=1))
    tt[seg != torch.roll(seg, 1, 1)] = 0  # a document starts with text
    for spans in ("image", "prefix"):
        blk = span_blocks(spans, tt, seg)
        for window, bounds in ((None, True), (3, True), (3, False)):
            got = allowed_mask(seg, blk, window=window, window_bounds_spans=bounds)
            for b in range(2):
                for q in range(23):
                    for k in range(23):
                        near = window is None or q - k < window
                        span = blk[b, q] >= 0 and blk[b, q] == blk[b, k] and (near or not bounds)
                        want = seg[b, q] == seg[b, k] and ((k <= q and near) or span)
                        assert bool(got[b, q, k]) == bool(want), (spans, window, bounds, b, q, k)


def test_media_in_example_order_give_documents_each_others_media(case):
    """The naive way for every family: a text packer's batch (best fit moves documents) with the media
    concatenated in the examples' order, as a collator that does not follow the packer gives them: documents
    take each other's images or audio, silently (the model checks only the batch's totals)."""
    family, impl, model, examples, alone = case
    packer = best_fit(examples)
    batch = VisionLanguageCollator(packer, config=model.config)(examples)
    naive = dict(batch)
    for key, dims in FAMILIES[family].media:
        parts = [torch.as_tensor(ex[key]).reshape(-1, *torch.as_tensor(ex[key]).shape[-dims:]) for ex in examples
                 if key in ex]
        if key == FAMILIES[family].ragged:  # tiles padded to the most, as the processor pads a batch
            most = max(p.shape[1] for p in parts)
            parts = [torch.cat([p, p.new_zeros(p.shape[0], most - p.shape[1], *p.shape[2:])], 1) for p in parts]
        naive[key] = torch.cat(parts)[None] if FAMILIES[family].batch_axis else torch.cat(parts)
    out = logits(model, naive)
    flat = out.reshape(-1, out.shape[-1])
    diff = max((flat[a:a + len(examples[i]["input_ids"])] - alone[i]).abs().max().item()
               for a, i in documents(batch, examples))
    print(f"{family}, media in example order: logits max abs diff {diff:.3e}")
    assert diff > 1e-3


def test_errors_name_the_example_and_the_fix(case):
    family, impl, model, examples, alone = case
    collate = VisionLanguageCollator(PaddingFreeCollator(loss_mask="none"), config=model.config)
    key = FAMILIES[family].media[0][0]
    short = dict(examples[2], input_ids=[5] + list(examples[2]["input_ids"]))
    short["input_ids"].remove(IMG)
    if "token_type_ids" in short:
        short["token_type_ids"] = list(short["token_type_ids"])
    with pytest.raises(ValueError, match=r"^example 1 has \d+ placeholder tokens \(id 120\) in 'input_ids' for 2 "
                                         r"media units, which .* turns into \d+ features; keep the text and the media"):
        collate([examples[0], short])
    lost = {k: v for k, v in examples[0].items() if k != key}
    with pytest.raises(ValueError, match=r"^example 1 has (\d+ placeholder tokens|'\w+' but no '\w+')"):
        collate([examples[1], lost])
    video = dict(examples[0], pixel_values_videos=torch.zeros(1, 3, 8, 8))
    with pytest.raises(ValueError, match=r"^example 0 has 'pixel_values_videos', which packkit does not pack for "):
        collate([video])
    with pytest.raises(TypeError, match=r"rope_index is for mRoPE models; .* pass config=model.config alone"):
        VisionLanguageCollator(PaddingFreeCollator(), config=model.config, rope_index=lambda **kw: None)


@pytest.mark.parametrize("family, key", [("gemma3", "token_type_ids"), ("gemma4", "mm_token_type_ids")])
def test_gemma_refuses_flash_attention_and_unmarked_images(family, key):
    model, make = build(family, "sdpa")
    g = torch.Generator().manual_seed(3)
    ex = make(g, 3, 1)
    collate = VisionLanguageCollator(PaddingFreeCollator(loss_mask="none"), config=model.config)
    with pytest.raises(ValueError, match=rf"^example 0 has no '{key}', which mark the image tokens"):
        collate([{k: v for k, v in ex.items() if k != key}])
    with pytest.raises(ValueError, match=rf"^example 0 has '{key}' that do not mark exactly its image"):
        collate([dict(ex, **{key: [0] * len(ex["input_ids"])})])
    model.config.get_text_config()._attn_implementation = "flash_attention_2"
    name = FAMILIES[family].name
    with pytest.raises(ValueError, match=rf"{name}'s image tokens attend both ways, which attn_implementation="
                                         r"'flash_attention_2' cannot express .*never approximated"):
        collate([ex])


def test_gemma4_without_image_spans_is_causal_and_bidirectional_documents_refused():
    """Gemma 4 without use_bidirectional_attention (its small checkpoints) is causal like text: the collator
    lays out its media and mm_token_type_ids and hands no mask, and every document equals itself alone (the
    model finds documents from position_ids); with use_bidirectional_attention='all' (every token both ways)
    the collator refuses by name instead of packing documents that would see each other's future."""
    model, make = build("gemma4", "sdpa")
    model.config.get_text_config().use_bidirectional_attention = None
    g = torch.Generator().manual_seed(3)
    examples = [make(g, 3, 1), make(g, 5, 0), make(g, 2, 2)]
    alone = [logits(model, alone_inputs(ex))[0] for ex in examples]
    batch = VisionLanguageCollator(best_fit(examples), config=model.config)(examples)
    assert "attention_mask" not in batch
    diff, order = against_alone(model, batch, examples, alone)
    assert diff < TOL["sdpa"] and sorted(order) == [0, 1, 2]
    model.config.get_text_config().use_bidirectional_attention = "all"
    with pytest.raises(ValueError, match=r"^Gemma 4 with use_bidirectional_attention='all' attends both ways over "
                                         r"whole documents; packkit packs it with"):
        VisionLanguageCollator(PaddingFreeCollator(loss_mask="none"), config=model.config)(examples)


def test_flex_block_mask_is_the_same_mask():
    """The flex view: the BlockMask's mask_mod, materialised, is the eager/sdpa mask exactly, and
    FlexAttention with it equals SDPA with the bool mask (float32: flex on the CPU takes no float64).
    transformers' flex path compiles flex_attention, which fails to build on this CPU (torch 2.13 inductor):
    the model-level check below runs it uncompiled."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    from packkit.media import span_masks

    model, make = build("gemma3", "sdpa")
    g = torch.Generator().manual_seed(3)
    examples = [make(g, 3, 1), make(g, 5, 0), make(g, 2, 2)]
    batch = VisionLanguageCollator(FixedWindowCollator(window=48, num_windows=2, loss_mask="none"),
                                   config=model.config)(examples)
    config = model.config.get_text_config()
    blocks = span_blocks("image", batch["token_type_ids"], batch.seq_idx)
    config._attn_implementation = "flex_attention"
    try:
        masks = span_masks(model.config, batch.seq_idx, blocks)
    finally:
        config._attn_implementation = "sdpa"
    import pickle

    masks = pickle.loads(pickle.dumps(masks))  # a DataLoader worker sends it through a queue
    q, k, v = torch.randn(3, 2, 2, 48, 8, generator=g).unbind(0)
    for kind, dense in batch["attention_mask"].items():
        block = masks[kind]
        got = flex.create_mask(block.mask_mod, 2, None, 48, 48, device="cpu")
        assert torch.equal(got, dense.expand(2, 1, 48, 48))
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        diff = (flex.flex_attention(q, k, v, block_mask=block) - want).abs().max().item()
        print(f"{kind}: flex against sdpa max abs diff {diff:.1e}")
        assert diff < 1e-5


def flex_uncompiled(query, key, value, training=False, **kwargs):
    """transformers' flex path without ``torch.compile``: Inductor's CPU FlexAttention takes no float64; the
    uncompiled kernel runs the same ``mask_mod`` and ``BlockMask``."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(query, key, value, **kwargs)


@pytest.mark.slow  # uncompiled FlexAttention in float64
@pytest.mark.parametrize("family", ["gemma3", "gemma4", "paligemma", "idefics3", "smolvlm", "internvl", "llava_next",
                                    "llava_onevision"])  # transformers refuses flex for Qwen2-Audio
def test_flex_through_the_model_equals_each_document_alone(family, monkeypatch):
    """The model-level flex check, float64: a tiny model with attn_implementation="flex_attention" (its flex call
    uncompiled) reads best-fit windows through the BlockMasks packkit hands it, and every document's logits equal
    it run alone through the same model."""
    from transformers.integrations import flex_attention

    monkeypatch.setattr(flex_attention, "compile_friendly_flex_attention", flex_uncompiled)
    model, make = build(family, "flex_attention")
    g = torch.Generator().manual_seed(3)
    examples = [make(g, 3, 1), make(g, 5, 0), make(g, 2, 2), make(g, 4, 1)]
    alone = [logits(model, alone_inputs(ex))[0] for ex in examples]
    diff, order = against_alone(model, VisionLanguageCollator(best_fit(examples), config=model.config)(examples),
                                examples, alone)
    assert diff < TOL["flex_attention"] and sorted(order) == list(range(len(examples)))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "idefics3"])
def test_docs_block_trains_as_pasted(family, tmp_path, monkeypatch):
    """docs/vl.md's block, as pasted, trains a tiny Gemma 3 (its mask per layer type moved by Trainer with the
    batch) and a tiny Idefics3 with transformers.Trainer's default arguments: finite losses, 2 steps; and its
    first batch's loss equals the sum of each document's loss alone over all their loss tokens."""
    from pathlib import Path

    from test_readme import page_blocks

    monkeypatch.chdir(tmp_path)
    model, make = build(family, "sdpa")
    model.float().train()
    g = torch.Generator().manual_seed(5)
    dataset = []
    for i in range(16):
        ex = make(g, 3 + i % 5, i % 3)
        ids = list(ex["input_ids"])
        ex["labels"] = [-100 if x >= IMG else x for x in ids]
        dataset.append({k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in ex.items()})
    code = [c for page in ["docs/vl.md"] for h, lang, i, c in page_blocks(page) if h == "More model families"]
    assert len(code) == 1 and (Path(__file__).resolve().parents[1] / "docs/vl.md").exists()
    scope = {"model": model, "dataset": dataset}
    exec(compile(code[0], "docs/vl.md More model families block 0", "exec"), scope)
    trainer = scope["trainer"]
    assert trainer.state.global_step == 3 * 2  # 3 epochs of 16 examples, 8 a step
    assert all(np.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)
    model.eval()
    batch = scope["collate"](dataset[:8])
    with torch.no_grad():
        packed = model(**batch).loss * batch.num_loss_tokens
        alone = 0.0
        for ex in dataset[:8]:
            inputs = alone_inputs({k: v for k, v in ex.items() if k != "labels"})
            labels = torch.tensor([ex["labels"]])
            out = model(**inputs, labels=labels, use_cache=False)
            alone += out.loss * (labels[0, 1:] != -100).sum()
    print(f"{family}: summed loss packed {packed.item():.6f}, alone {alone.item():.6f}")
    assert torch.allclose(packed, alone, rtol=1e-5)


@pytest.mark.parametrize("per_image, window", [(256, 4096), (256, 8192), (1024, 16384)])
def test_best_fit_fills_windows_on_vlm_like_lengths(per_image, window):
    """A document's length is its input_ids, placeholders included, so the planner packs media as tokens:
    real ShareGPT text lengths (Qwen3 tokenizer) plus 0-4 images of ``per_image`` tokens and two markers
    each (Gemma 3 takes 256 an image), examples above the window left out; best fit's windows within 1% of
    the lower bound max(ceil(tokens / W), documents longer than W / 2)."""
    from pathlib import Path

    from packkit.binpack import pack

    text = np.load(Path(__file__).resolve().parents[1] / "benchmarks/data/sharegpt_qwen3_lengths.npy")
    images = np.random.default_rng(0).choice([0, 1, 1, 2, 3, 4], size=len(text))
    lengths = text + images * (per_image + 2)
    lengths = lengths[lengths <= window]
    windows = pack(lengths, window=window).num_windows
    bound = max(-(-int(lengths.sum()) // window), int((lengths > window / 2).sum()))
    print(f"W={window}, {per_image} tokens an image: {windows} windows, lower bound {bound}, "
          f"fill {bound / windows:.4f}")
    assert bound / windows >= 0.99


def test_gemma3_masks_cross_dataloader_workers():
    """Gemma 3's batch with its mask per layer type, made in two DataLoader workers (pickled across the
    queue), equals the batch made in the process, and the model's documents equal each alone."""
    model, make = build("gemma3", "sdpa")
    g = torch.Generator().manual_seed(3)
    examples = [make(g, 3, 1), make(g, 5, 0), make(g, 2, 2), make(g, 4, 1)]
    alone = [logits(model, alone_inputs(ex))[0] for ex in examples]
    collate = VisionLanguageCollator(best_fit(examples), config=model.config)
    loader = torch.utils.data.DataLoader(examples, batch_size=len(examples), collate_fn=collate, num_workers=2)
    (batch,) = list(loader)
    here = collate(examples)
    assert sorted(batch["attention_mask"]) == ["full_attention", "sliding_attention"]
    assert all(torch.equal(batch["attention_mask"][k], here["attention_mask"][k]) for k in here["attention_mask"])
    diff, order = against_alone(model, batch, examples, alone)
    assert diff < TOL["sdpa"] and sorted(order) == list(range(len(examples)))


def test_a_family_not_packed_is_refused_by_name():
    """Gemma 4 unified (transformers' gemma4_unified: another vision embedder and mask code) is not one of the
    families packkit packs: VisionLanguageCollator refuses its config naming the model_type and the families."""
    config = transformers.AutoConfig.for_model("gemma4_unified")
    with pytest.raises(TypeError, match=r"^packkit packs the mRoPE vision-language models \(Qwen-VL\) and gemma3, "
                                        r"gemma4, .*; model_type 'gemma4_unified' is not one of them yet"):
        VisionLanguageCollator(PaddingFreeCollator(), config=config)


def test_llava_onevision_refuses_a_per_row_image_count():
    """LLaVA-OneVision reads batch_num_images per batch row (several images of one row go untiled): a packed
    row would give one document's count to all of them, so an example carrying it is refused by name."""
    model, make = build("llava_onevision", "sdpa")
    ex = make(torch.Generator().manual_seed(3), 3, 1)
    collate = VisionLanguageCollator(PaddingFreeCollator(loss_mask="none"), config=model.config)
    with pytest.raises(ValueError, match=r"^example 1 has 'batch_num_images', which LLaVA-OneVision reads per batch "
                                         r"row \(not per document\), so packkit does not pack it: drop the column"):
        collate([ex, dict(ex, batch_num_images=torch.tensor([1]))])


def test_waste_and_plan_read_multimodal_rows(tmp_path):
    """``packkit waste`` and ``packkit plan`` on a file of Gemma 3 rows as a processor writes them (input_ids with
    their image placeholders, token_type_ids, pixel_values as nested lists, labels -100 on the image tokens):
    a document's length is its input_ids, placeholders included, and its loss tokens are its labels'."""
    import json
    import subprocess
    import sys

    model, make = build("gemma3", "sdpa")
    g = torch.Generator().manual_seed(4)
    rows = []
    for i in range(12):
        ex = make(g, 2 + i, i % 3)
        rows.append(dict(ex, labels=[-100 if x >= IMG else x for x in ex["input_ids"]],
                         **({"pixel_values": ex["pixel_values"].tolist()} if "pixel_values" in ex else {})))
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokens = sum(len(r["input_ids"]) for r in rows)
    loss = sum(sum(x != -100 for x in r["labels"][1:]) for r in rows)
    for command, keys in (("waste", ("examples", "input_tokens")), ("plan", ("num_examples", "num_tokens"))):
        out = subprocess.run([sys.executable, "-m", "packkit", command, str(path), "--window", "64", "--json"],
                             capture_output=True, text=True, check=True).stdout
        report = json.loads(out.strip().splitlines()[-1])
        print(command, {k: report[k] for k in (*keys, "loss_tokens")})
        assert [report[k] for k in (*keys, "loss_tokens")] == [12, tokens, loss]


@pytest.mark.parametrize("family", ["gemma3", "idefics3", "llava_next", "paligemma"])
def test_offline_packed_rows_train_equal_to_online(family, float64_default):
    """pack_dataset of multimodal rows keeps each document's media with it in its packed row (a list over the
    row's documents, null for text-only ones; token_type_ids packed like the tokens), and
    VisionLanguageCollator(PackedRowsCollator) reads them back: every document's logits equal it alone, and
    the summed loss equals the same rows collated online (best-fit windows): logits in float64, the loss at
    float32's level (transformers' ForCausalLMLoss takes ``logits.float()``)."""
    datasets = pytest.importorskip("datasets")
    from packkit.collate import PackedRowsCollator
    from packkit.offline import pack_dataset

    model, make = build(family, "sdpa")
    g = torch.Generator().manual_seed(5)
    examples = [make(g, 3 + i % 4, (i + 1) % 3) for i in range(10)]
    for ex in examples:
        ex["labels"] = [-100 if x >= IMG else x for x in ex["input_ids"]]
    rows = [{k: v.tolist() if torch.is_tensor(v) else v for k, v in ex.items()} for ex in examples]
    window = max(40, *(len(ex["input_ids"]) for ex in examples))
    packed = pack_dataset(datasets.Dataset.from_list(rows), window=window, progress=False)
    media = [k for k, _ in FAMILIES[family].media]
    assert set(media) <= set(packed.column_names) and "example_ids" not in packed.column_names
    assert all(len(r[media[0]]) == len(r["seq_lengths"]) for r in packed)  # one entry a document
    offline = VisionLanguageCollator(PackedRowsCollator(window=window), config=model.config)(list(packed))
    online = VisionLanguageCollator(FixedWindowCollator(window=window), config=model.config)(examples)
    alone = [logits(model, alone_inputs({k: v for k, v in ex.items() if k != "labels"}))[0] for ex in examples]
    diff, order = against_alone(model, offline, examples, alone)
    assert diff < TOL["sdpa"] and sorted(order) == list(range(len(examples))) and order != sorted(order)
    with torch.no_grad():
        loss = [model(**b).loss * b.num_loss_tokens for b in (offline, online)]
    print(f"{family}: summed loss offline {loss[0].item():.12f}, online {loss[1].item():.12f}")
    assert offline.num_loss_tokens == online.num_loss_tokens > 0
    assert torch.allclose(loss[0], loss[1], rtol=1e-6, atol=0)  # transformers' loss upcasts logits to float32 only


def same(a, b) -> bool:
    """``a`` and ``b`` equal, tensor for tensor, through lists, tuples and dicts."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("family", ["gemma3", "idefics3", "llava_next"])
def test_offline_packed_media_files_read_back_as_in_memory(family, tmp_path):
    """pack_dataset(..., output=) of multimodal rows writes each document's media with it, in parquet, an
    Arrow stream and an Arrow file (written beside OUT, renamed when complete): read back with
    datasets.Dataset.from_parquet / from_file / pyarrow.ipc, VisionLanguageCollator makes the batches of the in-memory packed rows, tensor for tensor, and
    the model's logits on them are equal."""
    datasets = pytest.importorskip("datasets")
    import pyarrow.ipc
    import pyarrow.parquet

    from packkit.collate import PackedRowsCollator
    from packkit.offline import pack_dataset

    model, make = build(family, "sdpa")
    g = torch.Generator().manual_seed(7)
    rows = [{k: v.tolist() if torch.is_tensor(v) else v for k, v in make(g, 3 + i % 4, (i + 1) % 3).items()}
            for i in range(10)]
    for r in rows:
        r["labels"] = [-100 if x >= IMG else x for x in r["input_ids"]]
    ds = datasets.Dataset.from_list(rows)
    window = max(40, *(len(r["input_ids"]) for r in rows))
    collate = VisionLanguageCollator(PackedRowsCollator(window=window), config=model.config)
    memory = collate(list(pack_dataset(ds, window=window, seed=3, progress=False)))
    assert any(len(r["seq_lengths"]) > 1 for r in pack_dataset(ds, window=window, seed=3, progress=False))
    with torch.no_grad():
        want = model(**memory).logits
    feather = lambda p: datasets.Dataset(pyarrow.ipc.open_file(p).read_all())  # noqa: E731
    written = set()
    for name, read in (("out.parquet", datasets.Dataset.from_parquet), ("out.arrow", datasets.Dataset.from_file),
                       ("out.feather", feather)):
        # buffer_bytes=1: a record batch a window, the media gathered batch by batch as they are written
        path = pack_dataset(ds, window=window, seed=3, progress=False, output=tmp_path / name, buffer_bytes=1)
        written.add(name)
        assert {p.name for p in tmp_path.iterdir()} == written  # renamed into place, nothing left beside it
        packed = read(str(path))
        if name == "out.parquet":
            assert pyarrow.parquet.ParquetFile(path).num_row_groups == len(packed) > 1  # a row group a batch
        media = [k for k, _ in FAMILIES[family].media]
        assert set(media) <= set(packed.column_names) and "example_ids" not in packed.column_names
        batch = collate(list(packed))
        assert sorted(batch) == sorted(memory)
        for k in memory:
            assert same(memory[k], batch[k]), (name, k)
        with torch.no_grad():
            assert torch.equal(model(**batch).logits, want), name
        print(f"{family}: {name} {path.stat().st_size:,} bytes, {len(packed)} rows, batches and logits equal")


def test_offline_media_rows_refused_where_media_would_be_lost(tmp_path):
    """A document longer than the window would be cut from its media; a stream, an output format of tokens only
    (jsonl, Megatron, Bridge, MDS, a plan, a datasets folder) or packkit pack would drop the media: each refused
    in one line, nothing written."""
    import json
    import subprocess
    import sys

    datasets = pytest.importorskip("datasets")
    from packkit.offline import pack_dataset

    model, make = build("gemma3", "sdpa")
    g = torch.Generator().manual_seed(5)
    rows = [{k: v.tolist() if torch.is_tensor(v) else v for k, v in make(g, 3 + i, 1).items()} for i in range(4)]
    ds = datasets.Dataset.from_list(rows)
    with pytest.raises(ValueError, match=r"^example \d has \d+ tokens > window=12 and media: cutting it would part "
                                         r"its placeholder tokens from its images; pass overflow='drop'"):
        pack_dataset(ds, window=12, overflow="split", progress=False)
    with pytest.raises(ValueError, match=r"^example \d has \d+ tokens > window=12 and media: cutting"):
        pack_dataset(ds, window=12, overflow="split", progress=False, output=tmp_path / "cut.parquet")
    assert not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match=r"carry media \(pixel_values\), which only pack_dataset keeps \(in the "
                                         r"datasets.Dataset it returns, or an output= file of parquet/arrow/feather: "
                                         r"packkit.mediarows\); load the dataset \(not streaming\)"):
        pack_dataset(ds.to_iterable_dataset(), window=64)
    for name, fmt in (("out.jsonl", "jsonl"), ("out.megatron", "megatron"), ("out.idx.parquet", "bridge"),
                      ("out.mds", "mds"), ("out.packplan", "plan"), ("out", "folder")):
        with pytest.raises(ValueError, match=rf"carry media \(pixel_values\), .*; the {fmt} format holds tokens "
                                             r"only: write OUT as .parquet, .arrow, .feather$"):
            pack_dataset(ds, window=64, output=tmp_path / name)
        assert not (tmp_path / name).exists()
    dropped = pack_dataset(ds, window=12, overflow="drop", progress=False)
    assert len(dropped) > 0 and all(r["pixel_values"] for r in dropped)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = subprocess.run([sys.executable, "-m", "packkit", "pack", str(path), str(tmp_path / "packed.parquet"),
                          "--window", "64"], capture_output=True, text=True)
    print(run.stderr.strip().splitlines()[-1])
    assert run.returncode != 0 and not (tmp_path / "packed.parquet").exists()
    assert "carry media (pixel_values), which only pack_dataset keeps" in run.stderr


def test_offline_cli_packs_media_rows_as_pack_dataset(tmp_path):
    """packkit pack of a .parquet or .arrow file of Gemma 3 rows with their images writes, through the real
    command, the same file pack_dataset(..., output=) writes for the same options (pyarrow tables equal, media
    and all), read back by VisionLanguageCollator; --overwrite replaces OUT; an OUT of tokens only is refused in
    one line, nothing written."""
    import subprocess
    import sys

    import pyarrow.parquet

    datasets = pytest.importorskip("datasets")
    from packkit.collate import PackedRowsCollator
    from packkit.offline import pack_dataset

    model, make = build("gemma3", "sdpa")
    g = torch.Generator().manual_seed(11)
    rows = [{k: v.tolist() if torch.is_tensor(v) else v for k, v in make(g, 3 + i % 4, (i + 1) % 3).items()}
            for i in range(10)]
    for r in rows:
        r["labels"] = [-100 if x >= IMG else x for x in r["input_ids"]]
    window = max(40, *(len(r["input_ids"]) for r in rows))
    src = tmp_path / "in.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(src))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    arrow_in = next((tmp_path / "saved").glob("*.arrow"))

    cache = tmp_path / "hf-cache"  # the command's datasets cache: IN's Arrow copy must not be left there

    def cli(inp, out, *extra):
        return subprocess.run([sys.executable, "-m", "packkit", "pack", str(inp), str(out), "-w", str(window),
                               "--seed", "3", "--buffer-mb", "1", *extra], capture_output=True, text=True,
                              env=dict(os.environ, HF_DATASETS_CACHE=str(cache)))

    read = {".parquet": pyarrow.parquet.read_table, ".arrow": lambda p: datasets.Dataset.from_file(str(p)).data.table}
    for inp, name, extra in ((src, "cli.parquet", ()), (src, "cli.arrow", ("--strategy", "ffd", "--example-ids")),
                             (arrow_in, "cli2.parquet", ("--no-shuffle",))):
        run = cli(inp, tmp_path / name, *extra)
        assert run.returncode == 0, run.stderr
        print(run.stdout.strip())
        ds = datasets.Dataset.from_parquet(str(src))
        want = pack_dataset(ds, window=window, seed=3, output=tmp_path / f"lib-{name}", buffer_bytes=2**20,
                            strategy="ffd" if "ffd" in extra else "bfd", example_ids="--example-ids" in extra,
                            shuffle="--no-shuffle" not in extra, progress=False)
        got, lib = read[want.suffix](tmp_path / name), read[want.suffix](want)
        assert "pixel_values" in got.column_names and got.equals(lib), name
        assert ("example_ids" in got.column_names) == ("--example-ids" in extra)
        assert f"into {got.num_rows} windows of {window}" in run.stdout
        assert "with their media (pixel_values)" in run.stdout
    collate = VisionLanguageCollator(PackedRowsCollator(window=window), config=model.config)
    memory = collate(list(pack_dataset(datasets.Dataset.from_parquet(str(src)), window=window, seed=3, progress=False)))
    batch = collate(list(datasets.Dataset.from_parquet(str(tmp_path / "cli.parquet"))))
    assert all(same(memory[k], batch[k]) for k in memory) and sorted(batch) == sorted(memory)
    before = (tmp_path / "cli.parquet").read_bytes()
    assert cli(src, tmp_path / "cli.parquet", "--seed", "4").returncode != 0  # OUT exists: refused
    assert (tmp_path / "cli.parquet").read_bytes() == before
    run = cli(src, tmp_path / "cli.parquet", "--seed", "4", "--overwrite")
    assert run.returncode == 0, run.stderr
    assert pyarrow.parquet.read_table(tmp_path / "cli.parquet").equals(pyarrow.parquet.read_table(pack_dataset(
        datasets.Dataset.from_parquet(str(src)), window=window, seed=4, output=tmp_path / "lib4.parquet",
        buffer_bytes=2**20, progress=False)))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing left beside OUT
    assert not [p for p in cache.rglob("*") if p.is_file()], "a copy of IN was left in datasets' cache"
    run = cli(src, tmp_path / "none.parquet", "--overflow", "drop", "-w", "2")  # every example dropped: refused
    assert run.returncode != 0 and "is left to write" in run.stderr and not (tmp_path / "none.parquet").exists()
    run = cli(src, tmp_path / "out.jsonl")
    assert run.returncode != 0 and not (tmp_path / "out.jsonl").exists() and len(run.stderr.strip().splitlines()) == 1
    assert "carry media (pixel_values)" in run.stderr and ".parquet, .arrow, .feather" in run.stderr


@pytest.mark.parametrize("family", ["gemma3", "paligemma"])
def test_context_parallel_refused_where_the_shard_would_lose_the_mask(family):
    """Under context parallelism a rank's shard carries positions from 0 and no token_type_ids: Gemma 3's image spans
    and PaliGemma's prefix would be attended causally and PaliGemma's positions numbered from 0, silently. Refused
    in one line; a family that attends causally (Idefics3) is not."""
    from packkit.collate import PackedRowsCollator

    model, _ = build(family, "sdpa")
    with pytest.raises(ValueError, match=r"under context parallelism \(cp_size=2\): its (image|prefix) tokens attend "
                                         r"both ways, which packkit.cp.shard does not carry to the ranks; train it with "
                                         r"cp_size=1"):
        VisionLanguageCollator(PackedRowsCollator(window=64, cp_size=2, cp_layout="contiguous"), config=model.config)
    VisionLanguageCollator(PackedRowsCollator(window=64, cp_size=2, cp_layout="contiguous"),
                           config=build("idefics3", "sdpa")[0].config)
