"""The "Context parallelism" page's blocks (docs/cp.md), run as pasted: packkit's CP attention on a tiny Llama in a
one-process gloo group; Megatron-Core's ``PackedSeqParams``, a ``GPTModel.forward`` and ring-flash-attn's
``llama3_flash_attn_varlen_func`` as signature-level fakes (their parameter names, not their kernels: the
libraries need CUDA); the ALST keys through a real Hugging Face model (cp = 1 on one CPU process).
The attention itself is proven equal to the unsharded one in tests/test_cp_distributed.py.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types

import numpy as np
import pytest
import torch

from tests.test_readme import doc_code

transformers = pytest.importorskip("transformers")

PAGE, HEADING = "docs/cp.md", "# Context parallelism"


def tiny_llama():
    config = transformers.LlamaConfig(vocab_size=101, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float64)


def examples(n=6, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for length in rng.integers(2, 20, n).tolist():
        ids = rng.integers(1, 101, length).tolist()
        out.append({"input_ids": ids, "labels": [-100] * (length // 3) + ids[length // 3:]})
    return out


def unsharded_loss(model, batch):
    """The whole row's mean loss in float64 (HF's own packed path: position_ids, sdpa)."""
    from packkit.loss import token_normalized_loss

    logits = model(**{k: v for k, v in batch.hf_kwargs().items() if k != "labels"}).logits
    return token_normalized_loss(logits, batch.labels, num_loss_tokens=batch.num_loss_tokens)


def run_block(index, **names):
    scope = dict(names)
    exec(compile(doc_code(PAGE, HEADING, "python", index), f"{PAGE} block {index}", "exec"), scope)
    return scope


@dataclasses.dataclass
class PackedSeqParams:
    """megatron.core.packed_seq_params.PackedSeqParams's fields (Megatron-LM main), no defaults needed here."""

    qkv_format: str = None
    cu_seqlens_q: torch.Tensor = None
    cu_seqlens_kv: torch.Tensor = None
    cu_seqlens_q_padded: torch.Tensor = None
    cu_seqlens_kv_padded: torch.Tensor = None
    max_seqlen_q: int = None
    max_seqlen_kv: int = None
    local_cp_size: int = None
    cp_group: object = None


def gpt_model(input_ids, position_ids, attention_mask, decoder_input=None, labels=None, inference_context=None,
              packed_seq_params=None, extra_block_kwargs=None, runtime_gather_output=None):
    """GPTModel.forward's parameters (Megatron-Core); checks what a THD CP batch must carry."""
    assert input_ids.shape == position_ids.shape == labels.shape and input_ids.dim() == 2
    assert packed_seq_params.qkv_format == "thd"
    assert packed_seq_params.cu_seqlens_q.dtype == torch.int32
    return torch.zeros(*input_ids.shape, 7)


def llama3_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride,
                                  local_k_slice, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                  alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    """ring-flash-attn's signature; checks the argument types and shapes it relies on."""
    assert causal is True
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    assert int(cu_seqlens_q[-1]) == q.shape[0]
    assert type(max_seqlen_q) is int and type(max_seqlen_k) is int and isinstance(local_k_slice, slice)
    assert int(cu_seqlens_k[-1]) == local_k_slice.stop - local_k_slice.start
    return torch.zeros_like(q)


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield None
    finally:
        dist.destroy_process_group()


def test_hf_block_as_pasted(one_rank_group):
    """packkit's CP attention in a real model (one rank): the loss is the unsharded model's mean loss."""
    from packkit.collate import PaddingFreeCollator

    model, exs = tiny_llama(), examples()
    scope = run_block(0, examples=exs, model=model, cp_group=one_rank_group)
    batch = PaddingFreeCollator()(exs)
    model.set_attn_implementation("sdpa")
    torch.testing.assert_close(scope["loss"], unsharded_loss(model, batch), rtol=1e-12, atol=1e-12)
    assert all(p.grad is not None for p in model.parameters())


def test_megatron_and_ring_flash_attn_blocks_as_pasted(monkeypatch):
    from packkit.collate import PaddingFreeCollator
    from packkit.cp import shard  # the blocks continue the first one's imports

    mod = types.ModuleType("megatron.core.packed_seq_params")
    mod.PackedSeqParams = PackedSeqParams
    for name in ("megatron", "megatron.core"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "megatron.core.packed_seq_params", mod)
    ring = types.ModuleType("ring_flash_attn")
    ring.llama3_flash_attn_varlen_func = llama3_flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "ring_flash_attn", ring)
    batch = PaddingFreeCollator()(examples(9))
    for rank in range(4):
        scope = run_block(1, batch=batch, cp_size=4, cp_rank=rank, gpt_model=gpt_model, shard=shard)
        p = scope["packed_seq_params"]
        assert p.cu_seqlens_q.tolist() == batch.cu_seqlens.tolist()
        assert all(n % 8 == 0 for n in torch.diff(p.cu_seqlens_q_padded).tolist())
        n = shard(batch, cp_size=4, rank=rank, cp_layout="contiguous").input_ids.shape[1]
        q = torch.randn(n, 4, 8)
        scope = run_block(2, batch=batch, cp_size=4, cp_rank=rank, q=q, k=q[:, :2], v=q[:, :2], cp_group=None,
                          shard=shard)
        assert scope["out"].shape == q.shape
    # the fakes' parameters are the libraries' (GPTModel.forward's first three are positional there too)
    assert list(inspect.signature(gpt_model).parameters)[:7] == [
        "input_ids", "position_ids", "attention_mask", "decoder_input", "labels", "inference_context",
        "packed_seq_params"]


def test_alst_block_as_pasted():
    """The ALST keys run through a real model: on one rank the loss is the unsharded mean loss."""
    import torch.nn.functional as F

    from packkit.collate import PaddingFreeCollator
    from packkit.cp import shard

    model, batch = tiny_llama(), PaddingFreeCollator()(examples())
    scope = run_block(3, batch=batch, model=model, sp_size=1, sp_rank=0, F=F, shard=shard)
    assert set(scope["s"].hf_kwargs()) == {"input_ids", "position_ids", "shift_labels", "use_cache"}
    torch.testing.assert_close(scope["loss"], unsharded_loss(model, batch), rtol=1e-12, atol=1e-12)


def test_weighted_block_as_pasted(one_rank_group):
    """The weighted block (every loss_weighting under CP; cp = 1 on one process here, the gloo ranks in
    tests/test_cp_weighting.py): two micro-batches of the sample mean give the unpacked per-sample mean."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from packkit.collate import PaddingFreeCollator
    from packkit.cp import register_hf_cp_attention, shard

    model = tiny_llama()
    model.set_attn_implementation(register_hf_cp_attention(group=one_rank_group))  # as the first block does
    exs = examples(6, seed=3)
    step_examples = [exs[:4], exs[4:]]
    run_block(4, dist=dist, cp_group=one_rank_group, dp_group=one_rank_group, step_examples=step_examples,
              PaddingFreeCollator=PaddingFreeCollator, shard=shard, model=model)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    model.set_attn_implementation("sdpa")  # the reference: each example alone, unpacked
    per_sample = []
    for ex in exs:
        ids, labels = torch.tensor([ex["input_ids"]]), torch.tensor(ex["labels"][1:])
        logits = model(input_ids=ids).logits[0, :-1]
        per_sample.append(F.cross_entropy(logits, labels, ignore_index=-100))  # the example's own mean
    (sum(per_sample) / len(per_sample)).backward()
    want = torch.cat([p.grad.flatten() for p in model.parameters()])
    err = float((got - want).abs().max())
    print(f"max |d grad| {err:.1e}")
    assert err <= 1e-12
