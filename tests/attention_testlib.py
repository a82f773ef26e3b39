"""What the attention and kernel tests share (not a test module): the one float64 reference, the one
tolerance table, inputs, and the verbose comparison."""

from __future__ import annotations

import torch

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
