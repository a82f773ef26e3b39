"""Every mask view of a packed batch against each document run alone, on real Hugging Face models (tiny,
random, CPU, fp32): Llama, Qwen2 and Mistral with a sliding window shorter than the longest document,
Gemma2, Gemma3 (full and sliding layers mixed) and Phi3 (sliding window), each with sdpa and eager.

Views: the batch as is (``model(**batch)``: no mask, documents found from ``position_ids``), the
explicit mask ``hf_mask(model)`` (additive float, 4-D, windowed; a dict per layer type where layers
mix), and the padded fallback's own 2-D mask. Regression tests pin the two wrong masks packkit advised before the fix: a
bool mask under eager attention (added to the scores: documents attend across) and a mask without the
window on a sliding-window model (any explicit mask replaces the model's own window).
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from testlib import FAMILIES, tiny_causal_lm, tiny_config  # noqa: E402

from packkit.collate import FixedWindowCollator, PaddedCollator, PaddingFreeCollator  # noqa: E402

TOL = 1e-5  # fp32 logits; measured differences are about 1e-6
WINDOW = 4  # sliding window, shorter than the longest document (9)
LENGTHS = (5, 9, 3, 7, 1, 6)
# family -> its config beyond testlib.TINY (and pad_token_id=0): every sliding one with a window of WINDOW.
FAMILY_CONFIGS = {
    "llama": {},
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),  # layer 0 full, 1 sliding
    "mistral": dict(sliding_window=WINDOW),
    "gemma2": dict(head_dim=8, sliding_window=WINDOW),  # sliding, full
    "gemma3": dict(head_dim=8, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "phi3": dict(sliding_window=WINDOW),
}
SLIDING = {"qwen2", "mistral", "gemma2", "gemma3", "phi3"}
CASES = [(f, impl) for f in FAMILY_CONFIGS for impl in ("sdpa", "eager")]


def config(family, **overrides):
    return tiny_config(family, pad_token_id=0, **overrides)


def build(family, impl):
    cls = getattr(transformers, FAMILIES[family][0])
    if impl == "sdpa" and not cls._supports_sdpa:
        pytest.skip(f"transformers {transformers.__version__}: {cls.__name__} has no sdpa attention (eager only)")
    return tiny_causal_lm(family, dtype=torch.float32, attn_implementation=impl,
                          config=config(family, **FAMILY_CONFIGS[family])).eval()


@pytest.fixture(scope="module")
def examples():
    g = torch.Generator().manual_seed(1)
    out = []
    for n in LENGTHS:
        ids = torch.randint(1, 101, (n,), generator=g)
        out.append({"input_ids": ids.tolist()})
    return out


def alone(model, examples):
    """Logits ``(n, vocab)`` of every document run by itself (the model applies its own window)."""
    with torch.no_grad():
        return {tuple(ex["input_ids"]): model(input_ids=torch.tensor([ex["input_ids"]]), use_cache=False).logits[0]
                for ex in examples}


def max_diff_per_document(batch, logits, refs):
    """Largest |packed - alone| over every document of a packed batch, each found by its tokens."""
    flat_ids = batch.input_ids.reshape(-1).tolist()
    flat = logits.reshape(-1, logits.shape[-1])
    cu = batch.cu_seqlens.tolist()
    diff, seen = 0.0, 0
    for a, b in zip(cu, cu[1:]):
        ref = refs.get(tuple(flat_ids[a:b]))
        if ref is not None:
            diff = max(diff, (flat[a:b] - ref).abs().max().item())
            seen += 1
    assert seen == len(refs)
    return diff


def run(model, kwargs):
    with torch.no_grad():
        return model(**kwargs).logits


@pytest.mark.parametrize("family, impl", CASES, ids=[f"{f}-{i}" for f, i in CASES])
def test_every_mask_view_equals_each_document_alone(family, impl, examples):
    model = build(family, impl)
    refs = alone(model, examples)
    diffs = {}
    for name, batch in (("padding_free", PaddingFreeCollator()(examples)),
                        ("windows", FixedWindowCollator(window=12)(examples))):
        diffs[f"{name}, no mask"] = max_diff_per_document(batch, run(model, batch), refs)
        mask = batch.hf_mask(model)
        assert isinstance(mask, dict) == (family in ("qwen2", "gemma2", "gemma3"))
        diffs[f"{name}, hf_mask"] = max_diff_per_document(batch, run(model, {**batch, "attention_mask": mask}), refs)
    padded = PaddedCollator()(examples)
    logits = run(model, padded)
    diffs["padded"] = max(
        (logits[r, :len(ex["input_ids"])] - refs[tuple(ex["input_ids"])]).abs().max().item()
        for r, ex in enumerate(examples))
    for name, d in diffs.items():
        print(f"{family}/{impl} {name}: max abs diff {d:.2e}")
    assert max(diffs.values()) < TOL


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("family", sorted(SLIDING))
def test_a_mask_without_the_window_loses_it(family, impl, examples):
    """Any explicit 4-D mask replaces a sliding-window model's own window (0.16 to 0.6 logit
    error): the full block-diagonal mask ``dense_mask()`` (the advice before the fix) lets tokens see past it."""
    model = build(family, impl)
    batch = PaddingFreeCollator()(examples)
    full = torch.zeros(batch.dense_mask().shape, dtype=torch.float32).masked_fill_(~batch.dense_mask(), torch.finfo(
        torch.float32).min)[:, None]
    diff = max_diff_per_document(batch, run(model, {**batch, "attention_mask": full}), alone(model, examples))
    print(f"{family}/{impl}: window-less mask, max abs diff {diff:.2e}")
    assert diff > 1e-2


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_a_bool_mask_under_eager_attends_across_documents(family, examples):
    """``attention_mask=batch.dense_mask()[:, None]`` (the advice before the fix) is added to the scores by
    eager attention: True/False become +1/0 and every token attends across documents."""
    model = build(family, "eager")
    batch = PaddingFreeCollator()(examples)
    bool_mask = batch.dense_mask(sliding_window=WINDOW if family in SLIDING else None)[:, None]
    diff = max_diff_per_document(batch, run(model, {**batch, "attention_mask": bool_mask}), alone(model, examples))
    print(f"{family}/eager: bool mask, max abs diff {diff:.2e}")
    assert diff > 1e-2


def test_hf_mask_values_and_layouts():
    """The docstring's drawing: 0 where a query may attend, the dtype's minimum elsewhere, 4-D."""
    batch = PaddingFreeCollator()([{"input_ids": [11, 12, 13]}, {"input_ids": [21, 22]}, {"input_ids": [31, 32]}])
    llama = config("llama")
    m = batch.hf_mask(llama, dtype=torch.bfloat16)
    assert m.shape == (1, 1, 7, 7) and m.dtype == torch.bfloat16
    lo = torch.finfo(torch.bfloat16).min
    drawn = ["0mmmmmm", "00mmmmm", "000mmmm", "mmm0mmm", "mmm00mm", "mmmmm0m", "mmmmm00"]
    assert ["".join("0" if x == 0 else "m" if x == lo else "?" for x in row) for row in m[0, 0].tolist()] == drawn
    # a window of 2 on a 3-token document: a2 no longer sees a0
    mistral = config("mistral", sliding_window=2)
    assert batch.hf_mask(mistral)[0, 0, 2].tolist()[:3] == [torch.finfo(torch.float32).min, 0, 0]
    # mixed layers: one mask per layer type, the sliding one windowed
    gemma = config("gemma2", head_dim=8, sliding_window=2)
    masks = batch.hf_mask(gemma)
    assert set(masks) == {"full_attention", "sliding_attention"}
    assert masks["full_attention"][0, 0, 2, 0] == 0 and masks["sliding_attention"][0, 0, 2, 0] < 0
    # the default dtype follows the model's parameters
    model = tiny_causal_lm(config=llama)
    assert batch.hf_mask(model).dtype == torch.float64


def test_dense_mask_sliding_window_matches_reference():
    batch = FixedWindowCollator(window=9)([{"input_ids": [1] * n} for n in (6, 3, 5, 2)])
    seg = batch.seq_idx.tolist()
    B, L = batch.shape
    for w in (1, 2, 4):
        want = torch.tensor([[[seg[b][q] == seg[b][k] and 0 <= q - k < w for k in range(L)] for q in range(L)]
                             for b in range(B)])
        assert torch.equal(batch.dense_mask(sliding_window=w), want)
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        batch.dense_mask(sliding_window=0)


def test_hf_mask_refuses_what_it_cannot_build():
    batch = PaddingFreeCollator()([{"input_ids": [1, 2, 3]}])
    flash = config("llama")
    flash._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="flash attention reads cu_seq_lens_q/k"):
        batch.hf_mask(flash)
    chunked = config("llama")
    chunked.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match=r"\['chunked_attention'\] layers"):
        batch.hf_mask(chunked)
    no_window = config("gemma2", head_dim=8, sliding_window=None)
    with pytest.raises(ValueError, match="config.sliding_window is None"):
        batch.hf_mask(no_window)
    bidirectional = config("gemma3", head_dim=8, use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="bidirectional"):
        batch.hf_mask(bidirectional)
    with pytest.raises(TypeError, match="floating-point"):
        batch.hf_mask(config("llama"), dtype=torch.int64)
