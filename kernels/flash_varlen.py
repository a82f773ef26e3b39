"""Varlen attention on packkit's Triton kernels: launchers, ``torch.library`` ops, public function.

Layers, each thin::

    flash_varlen_kernels.attn_*_kernel    (@triton.jit)
    attention_forward / attention_backward (launchers: check inputs, allocate, pick the grid)
    packkit::varlen_attn_fwd / _bwd        (torch.library custom ops with register_fake + autograd)
    flash_varlen_attention                 (the public function)

On the CPU the kernels only run under Triton's interpreter (``TRITON_INTERPRET=1`` set before this
module is imported); that is for tests. Devices are read from the tensors at call time.
"""

from __future__ import annotations

import math
import os

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from packkit.kernels.flash_varlen_kernels import (
    INTERPRET_AT_DEFINITION,
    attn_bwd_dkdv_kernel,
    attn_bwd_dq_kernel,
    attn_bwd_preprocess_kernel,
    attn_fwd_kernel,
)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 128

# Block sizes under the interpreter: small enough that 97- and 123-token segments span several
# blocks (so the loops and the ragged tails are exercised), large enough to keep tests quick.
_INTERPRETER_FWD = dict(BLOCK_M=32, BLOCK_N=32)
_INTERPRETER_BWD = dict(BLOCK_M=32, BLOCK_N=32)

# GPU configurations tried by the autotuner, keyed on head dim, causality, GQA group, dtype and a
# rounded max_seqlen. BLOCK_M must be a multiple of BLOCK_N in the forward (see the kernel's phase 1).
_FWD_CONFIGS = [
    triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn), num_warps=w, num_stages=s)
    for bm, bn, w, s in [
        (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 32, 4, 4),
        (64, 64, 4, 3), (64, 32, 4, 4), (128, 64, 8, 2),
    ]
]
_BWD_CONFIGS = [
    triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn), num_warps=w, num_stages=s)
    for bm, bn, w, s in [
        (32, 128, 8, 2), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 2), (16, 128, 4, 2),
        (128, 32, 8, 2), (64, 32, 4, 3),
    ]
]
_TUNE_KEY = ["max_seqlen_key", "GROUP", "HEAD_DIM", "IS_CAUSAL", "DOT_PRECISION"]
_fwd_tuned = triton.autotune(configs=_FWD_CONFIGS, key=_TUNE_KEY)(attn_fwd_kernel)
_dkdv_tuned = triton.autotune(configs=_BWD_CONFIGS, key=_TUNE_KEY)(attn_bwd_dkdv_kernel)
_dq_tuned = triton.autotune(configs=_BWD_CONFIGS, key=_TUNE_KEY)(attn_bwd_dq_kernel)


def interpreted() -> bool:
    """True when the kernels were built for Triton's interpreter (``TRITON_INTERPRET=1`` at import)."""
    return isinstance(attn_fwd_kernel, InterpretedFunction)


def interpreter_problem() -> str | None:
    """Why the kernels cannot run on the CPU in this process (the interpreter is off), or None.

    Example: ``TRITON_INTERPRET=1`` exported only after ``packkit.kernels`` was imported gives
    "TRITON_INTERPRET=1 was set after packkit.kernels was imported (it was unset then) ...".
    """
    if interpreted():
        return None
    then = "unset" if INTERPRET_AT_DEFINITION is None else f"{INTERPRET_AT_DEFINITION!r}"
    if triton.knobs.runtime.interpret:  # reads the environment now
        return (f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')} was set after packkit.kernels was imported "
                f"(it was {then} then); Triton reads it when the kernels are defined, so set it in the "
                f"environment before the process starts (make test does), or use a CUDA device")
    return (f"packkit's Triton kernels run on the CPU only under the interpreter, and TRITON_INTERPRET is "
            f"{then}: set TRITON_INTERPRET=1 before importing packkit.kernels (tests only; it is slow), "
            f"or use a CUDA device")


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why these kernels cannot run on (q, k, v), or None if they can. Shapes are checked elsewhere."""
    if q.device.type == "cpu" and not interpreted():
        return interpreter_problem()
    if q.device.type not in ("cpu", "cuda"):
        return f"packkit's Triton kernels support CUDA (and the CPU interpreter), not {q.device.type}"
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return (f"packkit's Triton kernels take q, k, v all of one dtype in {SUPPORTED_DTYPES}; "
                f"got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"packkit's Triton kernels support head dims up to {MAX_HEAD_DIM}; got {q.shape[-1]}"
    return None


def _check_inputs(q, k, v, cu_seqlens, max_seqlen) -> None:
    """Shapes, dtypes and devices only: nothing here reads tensor values (that would sync a GPU)."""
    reason = unsupported_reason(q, k, v)
    if reason is not None:
        raise ValueError(reason)
    from packkit.attention import check_varlen_shapes  # no import cycle at load time: attention
                                                         # imports the kernels lazily
    check_varlen_shapes(q, k, v, cu_seqlens, max_seqlen)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs ask for fp32 accuracy: TF32 products would cost ~3 decimal digits, so use IEEE fp32.
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast_dot(dtype: torch.dtype) -> bool:
    # The interpreter computes bf16 tl.dot on raw bits (Triton documents no bf16 arithmetic there).
    return interpreted() and dtype == torch.bfloat16


def _head_block(head_dim: int) -> int:
    # Pad the head dim to a power of two (80 -> 128) and mask the extra lanes; tl.dot needs >= 16.
    return max(16, triton.next_power_of_2(head_dim))


def _seqlen_key(max_seqlen: int) -> int:
    # Autotune per power-of-two bucket of max_seqlen rather than per exact value.
    return triton.next_power_of_2(max(max_seqlen, 1))


CUDA_MAX_GRID = (2**31 - 1, 65535, 65535)  # programs per grid axis on CUDA


def segment_grid(total_tokens: int, num_segments: int, block: int, nheads: int) -> tuple[int, int]:
    """Launch grid for the kernels: (segment, block) pairs flattened on axis 0, heads on axis 1.

    Segment s owns cdiv(len_s, block) blocks, or one more (see ``_locate_block`` in the kernels), so
    ``total_tokens // block + num_segments`` programs cover them all, whatever the lengths: no value
    of cu_seqlens is read on the host. segment_grid(300, 4, 64, 8) -> (8, 8). Raises ValueError when
    a CUDA grid limit would be passed (2**31 - 1 on axis 0, 65,535 on axis 1).
    """
    grid = (total_tokens // block + num_segments, nheads)
    for axis, (size, limit) in enumerate(zip(grid, CUDA_MAX_GRID)):
        if size > limit:
            raise ValueError(f"launch grid axis {axis} would be {size} programs, above CUDA's {limit} "
                             f"(total_tokens={total_tokens}, num_segments={num_segments}, block={block}, "
                             f"nheads={nheads}); split the batch")
    return grid


def attention_forward(q, k, v, cu_seqlens, max_seqlen: int, causal: bool, scale: float):
    """Launch the forward kernel. Returns (o: like q, lse: (nheads, total_tokens) float32).

    Rows outside every segment (if cu_seqlens[-1] < total_tokens) are left at zero.
    """
    _check_inputs(q, k, v, cu_seqlens, max_seqlen)
    total, nheads, head_dim = q.shape
    num_segments = cu_seqlens.numel() - 1
    # Zero-filled so that tokens no segment covers read as 0 rather than as leftover memory.
    o = torch.zeros_like(q)
    lse = torch.zeros((nheads, total), dtype=torch.float32, device=q.device)
    if total == 0 or num_segments == 0:
        return o, lse
    args = (
        q, k, v, o, lse, cu_seqlens,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(),
        scale, num_segments, _seqlen_key(max_seqlen),
    )
    meta = dict(GROUP=nheads // k.shape[1], HEAD_DIM=head_dim, IS_CAUSAL=causal,
                DOT_PRECISION=_dot_precision(q.dtype), UPCAST_DOT=_upcast_dot(q.dtype), BLOCK_D=_head_block(head_dim))
    if interpreted():
        grid = segment_grid(total, num_segments, _INTERPRETER_FWD["BLOCK_M"], nheads)
        attn_fwd_kernel[grid](*args, **meta, **_INTERPRETER_FWD)
    else:
        def grid(cfg):
            return segment_grid(total, num_segments, cfg["BLOCK_M"], nheads)
        _fwd_tuned[grid](*args, **meta)
    return o, lse


def attention_backward(do, q, k, v, o, lse, cu_seqlens, max_seqlen: int, causal: bool, scale: float):
    """Launch the backward kernels. Returns (dq, dk, dv), shaped and typed like (q, k, v)."""
    _check_inputs(q, k, v, cu_seqlens, max_seqlen)
    total, nheads, head_dim = q.shape
    nheads_kv = k.shape[1]
    num_segments = cu_seqlens.numel() - 1
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if total == 0 or num_segments == 0:
        return dq, dk, dv
    block_d = _head_block(head_dim)

    # -- delta = rowsum(o * do), fp32, laid out like lse --
    delta = torch.empty_like(lse)
    block_t = 64
    attn_bwd_preprocess_kernel[(triton.cdiv(total, block_t), nheads)](
        o, do, delta, *o.stride(), *do.stride(), *delta.stride(), total,
        HEAD_DIM=head_dim, BLOCK_T=block_t, BLOCK_D=block_d,
    )
    # -- dk, dv per key block; dq per query block --
    common = (*q.stride(), *k.stride(), *v.stride(), *do.stride(), *lse.stride())
    meta = dict(GROUP=nheads // nheads_kv, HEAD_DIM=head_dim, IS_CAUSAL=causal,
                DOT_PRECISION=_dot_precision(q.dtype), UPCAST_DOT=_upcast_dot(q.dtype), BLOCK_D=block_d)
    key = _seqlen_key(max_seqlen)
    dkdv_args = (q, k, v, do, lse, delta, dk, dv, cu_seqlens, *common, *dk.stride(), *dv.stride(), scale,
                 num_segments, key)
    dq_args = (q, k, v, do, lse, delta, dq, cu_seqlens, *common, *dq.stride(), scale, num_segments, key)
    if interpreted():
        blocks = _INTERPRETER_BWD
        attn_bwd_dkdv_kernel[segment_grid(total, num_segments, blocks["BLOCK_N"], nheads_kv)](
            *dkdv_args, **meta, **blocks)
        attn_bwd_dq_kernel[segment_grid(total, num_segments, blocks["BLOCK_M"], nheads)](
            *dq_args, **meta, **blocks)
    else:
        def dkdv_grid(cfg):
            return segment_grid(total, num_segments, cfg["BLOCK_N"], nheads_kv)

        def dq_grid(cfg):
            return segment_grid(total, num_segments, cfg["BLOCK_M"], nheads)
        _dkdv_tuned[dkdv_grid](*dkdv_args, **meta)
        _dq_tuned[dq_grid](*dq_args, **meta)
    return dq, dk, dv


# -- torch.library ops: torch.compile traces through them via the fake implementations --

@torch.library.custom_op("packkit::varlen_attn_fwd", mutates_args=())
def _varlen_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return attention_forward(q, k, v, cu_seqlens, max_seqlen, causal, scale)


@_varlen_attn_fwd.register_fake
def _varlen_attn_fwd_fake(q, k, v, cu_seqlens, max_seqlen, causal, scale):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("packkit::varlen_attn_bwd", mutates_args=())
def _varlen_attn_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                     lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, causal: bool,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attention_backward(do, q, k, v, o, lse, cu_seqlens, max_seqlen, causal, scale)


@_varlen_attn_bwd.register_fake
def _varlen_attn_bwd_fake(do, q, k, v, o, lse, cu_seqlens, max_seqlen, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, causal, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
    ctx.max_seqlen, ctx.causal, ctx.scale = max_seqlen, causal, scale


def _backward(ctx, do, dlse):
    # lse is an internal output (the public function returns only o), so dlse carries no gradient.
    q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = _varlen_attn_bwd(do, q, k, v, o, lse, cu_seqlens, ctx.max_seqlen, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None, None


_varlen_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def flash_varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
    *, causal: bool = True, scale: float | None = None,
) -> torch.Tensor:
    """Attention inside each packed segment, on packkit's Triton kernels (differentiable).

    Args:
        q: (total_tokens, nheads, headdim), fp16 / bf16 / fp32, headdim <= 128.
        k, v: (total_tokens, nheads_kv, headdim), same dtype; nheads % nheads_kv == 0 (GQA / MQA).
        cu_seqlens: (num_segments + 1,) int32, starts at 0, non-decreasing (empty segments allowed),
            cu_seqlens[-1] == total_tokens.
        max_seqlen: int, the longest segment; it only picks tuned block sizes (the launch grid comes
            from total_tokens and the number of segments, so any count of segments launches).
        causal: each token attends to itself and earlier tokens of its segment only.
        scale: softmax scale; default 1 / sqrt(headdim).

    Returns:
        (total_tokens, nheads, headdim), dtype of q.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    o, _ = _varlen_attn_fwd(q, k, v, cu_seqlens, int(max_seqlen), bool(causal), scale)
    return o
