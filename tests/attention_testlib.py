"""What the attention and kernel tests share (not a test module): the one float64 reference, the one
tolerance table, inputs, the verbose comparison, and the stand-ins for the CUDA-only library functions
(registered through ``packkit.attention.use_kernel``)."""

from __future__ import annotations

import torch

from packkit.attention import reference_varlen_attention
from packkit.segments import lengths_to_cu_seqlens

# Max |err| <= atol + rtol * max|ref| against float64, per dtype: (forward, gradients). fp32 runs
# IEEE fp32 products; fp16 / bf16 round the inputs, P and the output to 11 / 8 significant bits
# (eps 9.8e-4 / 7.8e-3).
TOLERANCES = {
    torch.float64: dict(fwd=(1e-10, 1e-10), bwd=(1e-10, 1e-10)),
    torch.float32: dict(fwd=(2e-5, 1e-5), bwd=(1e-4, 1e-5)),
    torch.float16: dict(fwd=(5e-3, 2e-3), bwd=(1e-2, 4e-3)),
    torch.bfloat16: dict(fwd=(4e-2, 1.6e-2), bwd=(8e-2, 3e-2)),
}


def cu_seqlens_of(lengths, device="cpu") -> torch.Tensor:
    """``[2, 0, 3] -> tensor([0, 2, 2, 5], dtype=int32)`` on ``device``."""
    return torch.from_numpy(lengths_to_cu_seqlens(list(lengths))).to(device)


def attention_ref(q, k, v, cu_seqlens, causal, scale):
    """The obvious definition in float64, one segment and one head at a time: for each, softmax(q k^T *
    scale) v, query head h reading kv head h // (nheads // nheads_kv). Differentiable.

    Returns (out: (total, nheads, d), lse: (nheads, total)), both float64; empty segments own nothing.
    """
    q, k, v = q.double(), k.double(), v.double()
    total, nheads, _ = q.shape
    group = nheads // k.shape[1]
    outs, lses = [], []
    offsets = cu_seqlens.tolist()
    for start, end in zip(offsets[:-1], offsets[1:]):
        n = end - start
        if n == 0:
            continue
        allowed = torch.ones(n, n, dtype=torch.bool, device=q.device)
        if causal:
            allowed = allowed.tril()
        heads_out, heads_lse = [], []
        for h in range(nheads):
            scores = (q[start:end, h] @ k[start:end, h // group].T * scale).masked_fill(~allowed, float("-inf"))
            heads_lse.append(torch.logsumexp(scores, dim=-1))
            heads_out.append(torch.softmax(scores, dim=-1) @ v[start:end, h // group])
        outs.append(torch.stack(heads_out, dim=1))
        lses.append(torch.stack(heads_lse, dim=0))
    if not outs:
        return q * 0, q.new_zeros(nheads, total)
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def random_qkv(lengths, nheads, nheads_kv, headdim, dtype, device, seed=0):
    """(q, k, v) for segments of ``lengths``: standard normal, drawn in fp32 on the CPU, then cast."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    shapes = [(total, nheads, headdim), (total, nheads_kv, headdim), (total, nheads_kv, headdim)]
    return [torch.randn(s, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype) for s in shapes]


def assert_close(name, actual, expected, atol, rtol):
    """Print max / mean difference, then assert max |err| <= atol + rtol * max|expected|."""
    diff = (actual.double() - expected.double()).abs()
    bound = atol + rtol * expected.abs().max().item()
    print(f"{name}: max diff {diff.max().item():.3e}, mean diff {diff.mean().item():.3e}, bound {bound:.3e}")
    assert diff.max().item() <= bound, f"{name}: max diff {diff.max().item():.3e} > {bound:.3e}"


def check_against_float64(run, lengths, nheads, nheads_kv, headdim, dtype, device, causal, scale=None, seed=0):
    """``run(q, k, v, cu) -> out`` forward and gradients against :func:`attention_ref`, within the
    dtype's tolerances. Returns the (out, dq, dk, dv) it checked."""
    q, k, v = (t.requires_grad_() for t in random_qkv(lengths, nheads, nheads_kv, headdim, dtype, device, seed))
    cu = cu_seqlens_of(lengths, device)
    out = run(q, k, v, cu)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(out)
    out.backward(grad_out)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_ref(q64, k64, v64, cu, causal, headdim ** -0.5 if scale is None else scale)
    ref.backward(grad_out.double())
    tol = TOLERANCES[dtype]
    assert out.shape == q.shape and out.dtype == dtype
    assert_close("out", out, ref, *tol["fwd"])
    assert_close("dq", q.grad, q64.grad, *tol["bwd"])
    assert_close("dk", k.grad, k64.grad, *tol["bwd"])
    assert_close("dv", v.grad, v64.grad, *tol["bwd"])
    return out, q.grad, k.grad, v.grad


# -- stand-ins for flash-attn's and torch's varlen functions, with their real signatures --

def fake_varlen_attn(calls: list, *, release: str = "2.11"):
    """A stand-in for ``torch.nn.attention.varlen.varlen_attn`` with the signature of torch ``release``,
    computing through packkit's reference; each call appends ``dict(kv_heads=, cu=, **its keywords)``.

    - "2.13": causal as ``window_size``, ``scale``, ``enable_gqa`` (and the paged-attention keywords).
    - "2.11": ``window_size`` and ``scale``, no ``enable_gqa``; its kernel takes grouped k, v as they are.
    - "2.10": ``is_causal`` only (no scale: q comes pre-scaled); grouped k, v refused, as the real op does.

    ``use_kernel("torch", fake_varlen_attn(calls), devices=("cpu",))`` runs the torch backend on the CPU.
    """
    def run(query, key, value, cu, max_q, causal, softmax_scale, **keywords):
        calls.append(dict(kv_heads=key.shape[1], cu=cu.tolist(), **keywords))
        return reference_varlen_attention(query, key, value, cu, max_q, causal=causal, scale=softmax_scale)

    def varlen_attn_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                         window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        assert return_aux is None and window_size in ((-1, 0), (-1, -1))
        return run(query, key, value, cu_seq_q, max_q, window_size == (-1, 0), scale, window_size=window_size,
                   enable_gqa=enable_gqa, scale=scale)

    def varlen_attn_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                         window_size=(-1, -1)):
        assert return_aux is None and window_size in ((-1, 0), (-1, -1))
        return run(query, key, value, cu_seq_q, max_q, window_size == (-1, 0), scale, window_size=window_size,
                   scale=scale)

    def varlen_attn_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):
        if key.shape[1] != query.shape[1]:  # what the real op raises for heads it cannot group
            raise RuntimeError(f"number of heads in key/value must equal query's; got {key.shape[1]} and "
                               f"{query.shape[1]}")
        return run(query, key, value, cu_seq_q, max_q, is_causal, None, is_causal=is_causal)

    return {"2.13": varlen_attn_2_13, "2.11": varlen_attn_2_11, "2.10": varlen_attn_2_10}[release]


def fake_flash_attn_varlen_func(calls: list):
    """A stand-in for flash-attn's ``flash_attn_varlen_func`` (its signature), computing through packkit's
    reference; each call appends its ``cu_seqlens_q`` as a list, and an empty segment reaching it fails
    the test (flash-attention#1537)."""
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        calls.append(cu_seqlens_q.tolist())
        assert cu_seqlens_q is cu_seqlens_k and max_seqlen_q == max_seqlen_k and dropout_p == 0.0
        assert bool((cu_seqlens_q[1:] > cu_seqlens_q[:-1]).all()), f"empty segment reached flash-attn: {calls[-1]}"
        return reference_varlen_attention(q, k, v, cu_seqlens_q, max_seqlen_q, causal=causal, scale=softmax_scale)

    return flash_attn_varlen_func
