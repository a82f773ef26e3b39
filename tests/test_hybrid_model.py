"""Hybrid linear-attention / state-space models from transformers (tiny random Qwen3.5 with GatedDeltaNet
layers, Bamba with Mamba-2 layers; CPU, float64) fed packkit batches.

Found with transformers 5.24: no hybrid model keeps packed documents apart on the CPU. Their layers carry a
state along the sequence that no attention mask reaches; the kernels that reset it per document
(``causal-conv1d`` and ``mamba-ssm`` through ``seq_idx``, ``flash-linear-attention`` through
``cu_seqlens``, which the layers take from ``cu_seq_lens_q``) need CUDA, and the PyTorch fallbacks ignore
both, refusing with a ``ValueError`` when either arrives. Without ``seq_idx`` in the batch nothing
refuses: the Mamba-2 and convolution layers mix documents silently. So packkit's
``HybridCollator`` puts ``seq_idx`` beside ``cu_seq_lens_q``, and these tests prove, on the CPU:

* the silent failure without ``seq_idx`` (Bamba), and Jamba's Mamba-1 layers mixing documents whatever
  the batch holds (they take no ``seq_idx``);
* the refusal of the PyTorch fallbacks once ``seq_idx`` / ``cu_seqlens`` arrive (nothing silent);
* packed logits equal each document run alone when the layers' kernels are test-local references that
  honour ``seq_idx`` and ``cu_seqlens`` as the CUDA kernels document it (each document run alone through
  the model's own PyTorch fallback): what packkit emits is what the models hand to their kernels, in the
  shapes and dtypes those read. The CUDA kernels themselves are not run here.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.bamba import modeling_bamba  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: E402

from packkit.collate import FixedWindowCollator, PaddingFreeCollator  # noqa: E402
from packkit.model_inputs import VISION_KEYS, HybridCollator, VisionLanguageCollator  # noqa: E402
from testlib import tiny_vl_model, vl_example  # noqa: E402

#: float64, but the GatedDeltaNet fallback computes in float32 inside (transformers casts to it)
TOL = {"bamba": 1e-10, "qwen3_5": 1e-6}
LENGTHS = (5, 9, 3, 7, 1, 6)
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def build(name):
    torch.manual_seed(0)
    if name == "bamba":  # a Mamba-2 layer, then an attention layer
        config = transformers.BambaConfig(**COMMON, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16,
                                          mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8, mamba_expand=2)
        cls = transformers.BambaForCausalLM
    elif name == "qwen3_5":  # a GatedDeltaNet layer, then an attention layer
        config = transformers.Qwen3_5TextConfig(**COMMON, layer_types=["linear_attention", "full_attention"],
                                                linear_num_value_heads=2, linear_num_key_heads=2, head_dim=8,
                                                linear_key_head_dim=8, linear_value_head_dim=8)
        cls = transformers.Qwen3_5ForCausalLM
    else:  # jamba: a Mamba-1 layer, then an attention layer
        config = transformers.JambaConfig(**COMMON, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=100,
                                          num_experts=1, mamba_d_state=8, mamba_dt_rank=4, mamba_expand=2)
        cls = transformers.JambaForCausalLM
    return cls._from_config(config, attn_implementation="sdpa", dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def models():
    return {name: build(name) for name in ("bamba", "qwen3_5", "jamba")}


@pytest.fixture(scope="module")
def examples():
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(1, 64, (n,), generator=g).tolist()} for n in LENGTHS]


@pytest.fixture(scope="module")
def alone(models, examples):
    """``{model name: [logits (n, vocab) of every example run by itself]}``."""
    with torch.no_grad():
        return {name: [model(input_ids=torch.tensor([ex["input_ids"]]), use_cache=False).logits[0] for ex in examples]
                for name, model in models.items()}


def real_logits(model, batch):
    """The logits of the real tokens of ``batch``, document after document (padding is id 0 here)."""
    with torch.no_grad():
        logits = model(**batch).logits
    flat = logits.reshape(-1, logits.shape[-1])
    return flat[batch.input_ids.reshape(-1) != 0]


def max_diff(model, batch, examples, refs) -> float:
    """Largest difference between the real tokens' logits of ``batch`` and those of their examples alone
    (found by their tokens: the fixed windows reorder them)."""
    cu, ids = batch.cu_seqlens.tolist(), batch.input_ids.reshape(-1).tolist()
    order = [next(i for i, ex in enumerate(examples) if ex["input_ids"] == ids[a:b])
             for a, b in zip(cu, cu[1:]) if b > a and ids[a] != 0]
    assert sorted(order) == list(range(len(examples)))
    return (real_logits(model, batch) - torch.cat([refs[i] for i in order])).abs().max().item()


# -- reference kernels: every document alone through the model's own PyTorch fallback ------------------

def runs(seq_idx_row):
    """``(start, end)`` of every run of equal values: ``[0, 0, 1, 1, 1] -> [(0, 2), (2, 5)]``."""
    change = torch.nonzero(seq_idx_row[1:] != seq_idx_row[:-1]).reshape(-1) + 1
    bounds = [0, *change.tolist(), seq_idx_row.numel()]
    return list(zip(bounds, bounds[1:]))


def reference_conv(torch_fn):
    """``causal_conv1d_fn(x (B, C, L), weight, bias, activation, seq_idx=(B, L))``: with ``seq_idx``, no
    output reads an input of another segment (causal-conv1d's contract); without it, the plain convolution."""
    def conv(x, weight, bias=None, activation=None, seq_idx=None, **kwargs):
        if seq_idx is None:
            return torch_fn(x, weight, bias, activation)
        assert seq_idx.dtype == torch.int32 and seq_idx.shape == (x.shape[0], x.shape[2])
        return torch.cat([torch.cat([torch_fn(x[b:b + 1, :, s:e], weight, bias, activation)
                                     for s, e in runs(seq_idx[b])], dim=2) for b in range(x.shape[0])])
    return conv


def reference_mamba2_scan(torch_fn):
    """``mamba_chunk_scan_combined`` with ``seq_idx (B, L)``: the state restarts at every new segment."""
    def scan(hidden_states, dt, A, B, C, chunk_size, seq_idx=None, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k in ("D", "dt_bias", "dt_softplus", "dt_limit")}
        if seq_idx is None:
            return torch_fn(hidden_states, dt, A, B, C, chunk_size, **kwargs)
        assert seq_idx.dtype == torch.int32 and seq_idx.shape == hidden_states.shape[:2]
        return torch.cat([torch.cat([torch_fn(hidden_states[b:b + 1, s:e], dt[b:b + 1, s:e], A, B[b:b + 1, s:e],
                                              C[b:b + 1, s:e], chunk_size, **kwargs) for s, e in runs(seq_idx[b])],
                                    dim=1) for b in range(hidden_states.shape[0])])
    return scan


def reference_gated_delta_rule(torch_fn):
    """flash-linear-attention's ``chunk_gated_delta_rule`` with ``cu_seqlens`` (a ``[1, T]`` batch only,
    as fla requires): the state restarts at every offset."""
    def rule(query, key, value, g, beta, cu_seqlens=None, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k in ("use_qk_l2norm_in_kernel",)}
        if cu_seqlens is None:
            return torch_fn(query, key, value, g, beta, **kwargs)
        if query.shape[0] != 1:
            raise ValueError(f"the batch size is expected to be 1 rather than {query.shape[0]} with cu_seqlens")
        cu = cu_seqlens.tolist()
        outs = [torch_fn(query[:, a:b], key[:, a:b], value[:, a:b], g[:, a:b], beta[:, a:b], **kwargs)[0]
                for a, b in zip(cu, cu[1:]) if b > a]
        return torch.cat(outs, dim=1), None
    return rule


def torch_path(kernel):
    """The model's own PyTorch function behind a hub-kernel name: transformers decorates it (``__wrapped__``), and
    from 5.25 on, with the ``kernels`` package it requires, wraps that in an ``nn.Module`` (``Func``) whose forward
    closes over the decorated function."""
    if isinstance(kernel, torch.nn.Module):
        kernel = next(c.cell_contents for c in type(kernel).forward.__closure__ or ()
                      if callable(c.cell_contents) and hasattr(c.cell_contents, "__wrapped__"))
    return kernel.__wrapped__


@pytest.fixture
def reference_kernels(monkeypatch):
    """Install the reference kernels in the models' modules (where the layers look them up)."""
    for module in (modeling_bamba, modeling_qwen3_5):
        monkeypatch.setattr(module, "causal_conv1d_fn", reference_conv(torch_path(module.causal_conv1d_fn)))
    monkeypatch.setattr(modeling_bamba, "mamba2_chunk_scan",
                        reference_mamba2_scan(torch_path(modeling_bamba.mamba2_chunk_scan)))
    monkeypatch.setattr(modeling_qwen3_5, "torch_chunk_gated_delta_rule",
                        reference_gated_delta_rule(torch_path(modeling_qwen3_5.torch_chunk_gated_delta_rule)))


# -- the tests ---------------------------------------------------------------------------------------

PLAIN = PaddingFreeCollator(loss_mask="none")  # packkit's plain view: cu_seq_lens_q, no seq_idx
HYBRID = HybridCollator(PLAIN)  # and seq_idx


@pytest.mark.parametrize("name,collator", [
    ("bamba", HYBRID),
    ("bamba", HybridCollator(FixedWindowCollator(window=12, num_windows=4, loss_mask="none"))),
    ("qwen3_5", HYBRID),
], ids=["bamba-padding_free", "bamba-fixed_windows", "qwen3_5-padding_free"])
def test_packed_equals_each_document_alone_with_kernels_that_read_the_batch(models, examples, alone,
                                                                             reference_kernels, name, collator):
    diff = max_diff(models[name], collator(examples), examples, alone[name])
    print(f"{name} {collator.collator!r}: logits max abs diff {diff:.3e}")
    assert diff < TOL[name]


@pytest.mark.parametrize("name", ["bamba", "qwen3_5"])
def test_without_seq_idx_the_convolution_mixes_documents(models, examples, alone, reference_kernels, name):
    """Regression test (transformers #46093): cu_seq_lens_q alone is not enough, even with the kernels
    installed: the causal convolution reads seq_idx only, and a document leaks into the next one's first
    tokens. (Bamba's scan, which reads seq_idx too, mixes them further.)"""
    diff = max_diff(models[name], PLAIN(examples), examples, alone[name])
    print(f"{name} without seq_idx: logits max abs diff {diff:.3e}")
    assert diff > 100 * TOL[name]


@pytest.mark.parametrize("name,collator,package", [("bamba", HYBRID, "causal_conv1d"),
                                                   ("qwen3_5", HYBRID, "causal_conv1d"),
                                                   ("qwen3_5", PLAIN, "flash-linear-attention")],
                         ids=["bamba-seq_idx", "qwen3_5-seq_idx", "qwen3_5-plain"])
def test_the_pytorch_fallbacks_refuse_packed_batches(models, examples, name, collator, package):
    """On the CPU (no kernels) transformers refuses a batch that says where its documents are, naming the
    package: nothing silent once the batch carries seq_idx (Qwen3.5 refuses the plain view already: its
    GatedDeltaNet takes cu_seqlens from cu_seq_lens_q)."""
    with pytest.raises(ValueError, match=f"can't keep packed sequences apart without `{package}`"):
        real_logits(models[name], collator(examples))


def test_bamba_without_seq_idx_mixes_documents_silently(models, examples, alone):
    """The finding behind HybridCollator: packkit's plain view (cu_seq_lens_q, no seq_idx) runs on the
    CPU without a word, and Bamba's Mamba-2 layer carries its state across documents."""
    diff = max_diff(models["bamba"], PLAIN(examples), examples, alone["bamba"])
    print(f"bamba, plain view: logits max abs diff {diff:.3e}")
    assert diff > 1e-3


def test_jamba_mamba1_layers_take_no_seq_idx(models, examples, alone):
    """Jamba's Mamba-1 layers read no seq_idx (nor does mamba-ssm's selective scan): documents mix even
    with HybridCollator, and nothing refuses; its data must be padded (PaddedCollator), not packed."""
    diff = max_diff(models["jamba"], HYBRID(examples), examples, alone["jamba"])
    print(f"jamba with seq_idx: logits max abs diff {diff:.3e}")
    assert diff > 1e-6


def test_qwen3_5_vision_language_needs_both_wrappers(examples, reference_kernels):
    """Qwen3.5 is both: mRoPE positions [4, B, L] with its images (VisionLanguageCollator) and seq_idx beside
    cu_seq_lens_q (HybridCollator); with both, every document's logits are its own alone, and without
    seq_idx its convolution mixes documents."""
    model = tiny_vl_model("qwen3_5")
    g = torch.Generator().manual_seed(1)
    docs = [vl_example(g, 4, images=[(1, 4, 4)]), vl_example(g, 6), vl_example(g, 2, images=[(1, 2, 4), (1, 4, 2)])]
    with torch.no_grad():
        refs = [model(input_ids=torch.tensor([ex["input_ids"]]), use_cache=False,
                      mm_token_type_ids=torch.tensor([ex["mm_token_type_ids"]]),
                      **{k: ex[k] for k in VISION_KEYS if k in ex}).logits[0] for ex in docs]
        vl = VisionLanguageCollator(PaddingFreeCollator(), rope_index=model.model.get_rope_index)
        both = (model(**HybridCollator(vl)(docs)).logits[0] - torch.cat(refs)).abs().max().item()
        vl_only = (model(**vl(docs)).logits[0] - torch.cat(refs)).abs().max().item()
    print(f"qwen3_5 VL: both wrappers {both:.3e}, without seq_idx {vl_only:.3e}")
    assert both < TOL["qwen3_5"] < 100 * TOL["qwen3_5"] < vl_only


def test_seq_idx_reaches_the_layers_under_trainer(models, examples, reference_kernels, monkeypatch, tmp_path):
    """Under ``transformers.Trainer`` (default arguments: it moves and rebuilds the batch), in train mode, the
    layers' kernels receive HybridCollator's seq_idx. (Bamba's fused train-mode kernel, mamba-ssm's, is
    absent here: its fallback says so by returning None, and the layer runs the kernels above.)"""
    seen = []
    conv = modeling_bamba.causal_conv1d_fn

    def recording_conv(*args, seq_idx=None, **kwargs):
        seen.append(seq_idx)
        return conv(*args, seq_idx=seq_idx, **kwargs)

    monkeypatch.setattr(modeling_bamba, "causal_conv1d_fn", recording_conv)
    monkeypatch.setattr(modeling_bamba, "mamba2_split_conv1d_scan_combined", lambda *args, **kwargs: None)
    model = build("bamba")
    collate = HybridCollator(PLAIN)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=len(examples))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=examples, data_collator=collate)
    trainer.train()
    assert trainer.state.global_step == 3 and len(seen) == 3  # 3 epochs of one step, one Mamba-2 layer
    for s in seen:  # the step's documents (Trainer shuffles them), one segment each
        assert s is not None and s.dtype == torch.int32 and s.shape == (1, sum(LENGTHS))
        assert s[0].tolist() == sorted(s[0].tolist()) and sorted(e - a for a, e in runs(s[0])) == sorted(LENGTHS)
