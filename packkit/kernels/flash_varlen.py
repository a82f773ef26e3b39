"""Varlen attention on packkit's Triton kernels: launchers, ``torch.library`` ops, public function.

Layers, each thin::

    flash_varlen_kernels.attn_*_kernel    (@triton.jit)
    attention_forward / attention_backward (launchers: check inputs, allocate, pick configs and grids)
    packkit::varlen_attn_fwd / _bwd        (torch.library custom ops with register_fake + autograd)
    flash_varlen_attention                 (the public function)

On the CPU the kernels only run under Triton's interpreter (``TRITON_INTERPRET=1`` set before this
module is imported); that is for tests. Devices are read from the tensors at call time, and every
launch runs under ``torch.cuda.device(q.device)`` (Triton launches on the current device).

Tuning on a GPU: each kernel autotunes over a short list per dtype class (half: fp16/bf16 on tensor
cores; fp32: IEEE fp32), pruned by head dim (configs that spill registers at large head dims are left
out; ``python benchmarks/kernel_resources.py`` shows registers, spills and shared memory per config,
compiled for sm_90 without a GPU) and by the device's shared memory. Results are cached on disk across
processes where Triton offers it (``cache_results``). ``PACKKIT_TRITON_AUTOTUNE=0`` launches one fixed
configuration per kernel instead (no tuning: what the GPU tests use).
"""

from __future__ import annotations

import contextlib
import inspect
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
from packkit.kernels.varlen_layout import check_num_segments, check_varlen_shapes

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 128
AUTOTUNE_ENV = "PACKKIT_TRITON_AUTOTUNE"

# Block sizes under the interpreter: small enough that 97- and 123-token segments span several
# blocks (so the loops and the ragged tails are exercised), large enough to keep tests quick.
_INTERPRETER_BLOCKS = dict(BLOCK_M=32, BLOCK_N=32)


# -- configurations --

def _configs(rows):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, largest BLOCK_D it is listed for) -> [(Config, max_d)]."""
    return [(triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn), num_warps=w, num_stages=s), max_d)
            for bm, bn, w, s, max_d in rows]


# Kernels: "fwd", "dkdv", "dkdv_atomic" (dk, dv and FlashAttention-2's atomic dq), "dq".
# Dtype classes: "half" (fp16 / bf16: tensor cores, wgmma on sm_90 needs a block side >= 64 on the
# rows of each product) and "fp32" (IEEE fp32: FMA, so small tiles). Every row was compiled for sm_90
# with Triton 3.6 (benchmarks/kernel_resources.py): no register spills up to its max head dim.
# The forward needs BLOCK_M % BLOCK_N == 0 (a tl.static_assert in the kernel;
# test_fixed_configs_cover_every_kernel_and_head_dim checks these lists).
CONFIGS = {
    ("fwd", "half"): _configs([(128, 64, 8, 3, 128), (64, 64, 4, 3, 128), (128, 64, 4, 3, 64),
                               (128, 128, 8, 3, 64)]),
    ("fwd", "fp32"): _configs([(32, 32, 8, 2, 128), (32, 16, 4, 2, 128)]),
    ("dkdv", "half"): _configs([(32, 128, 8, 2, 128), (16, 128, 8, 2, 128), (64, 128, 8, 2, 64)]),
    ("dkdv", "fp32"): _configs([(16, 32, 8, 2, 128), (16, 16, 4, 2, 128)]),
    ("dkdv_atomic", "half"): _configs([(16, 128, 8, 2, 128), (32, 128, 8, 2, 64)]),
    ("dkdv_atomic", "fp32"): _configs([(16, 32, 8, 2, 128)]),
    ("dq", "half"): _configs([(128, 64, 8, 2, 128), (64, 64, 4, 2, 128), (128, 32, 8, 2, 128)]),
    ("dq", "fp32"): _configs([(32, 32, 8, 2, 128), (32, 16, 4, 2, 128)]),
}
# PACKKIT_TRITON_AUTOTUNE=0: the first row of each list (valid for every head dim up to MAX_HEAD_DIM).
FIXED_CONFIGS = {key: rows[0][0] for key, rows in CONFIGS.items()}


def shared_memory_estimate(kernel: str, config: triton.Config, block_d: int, element_bytes: int) -> int:
    """Bytes of shared memory a config may take, an upper bound: the tiles a program keeps plus
    ``num_stages`` copies of the tiles its loop streams. Compiled for sm_90 by Triton 3.6 the kernels
    use less (``benchmarks/kernel_resources.py`` prints both). fwd (128, 64, 8, 3) at d=128 in bf16:
    2 * 128 * (128 + 3 * 2 * 64) = 131,072."""
    bm, bn, stages = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_stages
    # dkdv_atomic keeps k twice: once more as the operand of dS K, in another layout.
    kept, streamed = {"fwd": (bm, 2 * bn), "dq": (2 * bm, 2 * bn),
                      "dkdv": (2 * bn, 2 * bm), "dkdv_atomic": (3 * bn, 2 * bm)}[kernel]
    return element_bytes * block_d * (kept + stages * streamed)


def _max_shared_memory(device: torch.device) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(device.index)["max_shared_mem"]


def _pruner(kernel: str):
    """Triton's early_config_prune: configs listed for this head dim that fit the device's shared memory."""
    def prune(configs, named_args, **meta):
        q = named_args["q_ptr"]
        limit = _max_shared_memory(q.device)
        listed = {id(c): max_d for c, max_d in CONFIGS[(kernel, _dtype_class(q.dtype))]}
        kept = [c for c in configs if meta["BLOCK_D"] <= listed[id(c)]
                and shared_memory_estimate(kernel, c, meta["BLOCK_D"], q.element_size()) <= limit]
        return kept or [FIXED_CONFIGS[(kernel, _dtype_class(q.dtype))]]
    return prune


# Keys: the rounded max_seqlen and the compile-time shape of the problem (Triton adds the dtypes).
_TUNE_KEY = ["max_seqlen_key", "GROUP", "HEAD_DIM", "IS_CAUSAL", "DOT_PRECISION"]
_JIT = {"fwd": attn_fwd_kernel, "dkdv": attn_bwd_dkdv_kernel, "dkdv_atomic": attn_bwd_dkdv_kernel,
        "dq": attn_bwd_dq_kernel}
# Autotune timings saved in Triton's cache directory, so a second process does not tune again.
_CACHE = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}


def _autotuner(kernel: str, dtype_class: str):
    return triton.autotune(
        configs=[c for c, _ in CONFIGS[(kernel, dtype_class)]], key=_TUNE_KEY,
        prune_configs_by={"early_config_prune": _pruner(kernel)},
        # Atomic dq adds into dq_acc: every timed run must start from zero.
        reset_to_zero=["dq_acc_ptr"] if kernel == "dkdv_atomic" else None,
        **_CACHE,
    )(_JIT[kernel])


_TUNED = {key: _autotuner(*key) for key in CONFIGS}


def autotune_enabled() -> bool:
    """False when ``PACKKIT_TRITON_AUTOTUNE`` is 0 / false / off (read at each launch)."""
    return os.environ.get(AUTOTUNE_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def _dtype_class(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "half"


def _launch(kernel: str, dtype_class: str, grid_of, args, meta) -> None:
    """Run one kernel: fixed blocks under the interpreter, the autotuner, or the fixed config."""
    if interpreted():
        _JIT[kernel][grid_of(_INTERPRETER_BLOCKS)](*args, **meta, **_INTERPRETER_BLOCKS)
    elif autotune_enabled():
        _TUNED[(kernel, dtype_class)][grid_of](*args, **meta)
    else:
        config = FIXED_CONFIGS[(kernel, dtype_class)]
        _JIT[kernel][grid_of(config.kwargs)](*args, **meta, **config.kwargs, num_warps=config.num_warps,
                                             num_stages=config.num_stages)


# -- availability and checks --

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


def _checked(q, k, v, cu_seqlens, max_seqlen, num_segments):
    """Check shapes, dtypes, devices and num_segments (no tensor value is read: that would sync a GPU);
    return cu_seqlens as the kernels take it (:func:`_kernel_cu_seqlens`). The forward runs it once;
    the backward gets the forward's tensors and does not check them again."""
    reason = unsupported_reason(q, k, v)
    if reason is not None:
        raise ValueError(reason)
    check_varlen_shapes(q, k, v, cu_seqlens, max_seqlen)
    check_num_segments(num_segments, cu_seqlens)
    return _kernel_cu_seqlens(cu_seqlens, num_segments)


def _kernel_cu_seqlens(cu_seqlens: torch.Tensor, num_segments: int | None) -> torch.Tensor:
    """cu_seqlens contiguous (the kernels index it as a flat array), cut to num_segments when known."""
    if num_segments is not None:
        cu_seqlens = cu_seqlens[: num_segments + 1]
    return cu_seqlens.contiguous()


def _device_guard(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it t's (q on cuda:1 while cuda:0 is current)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


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


def _live_count(cu_seqlens: torch.Tensor, num_segments: int | None) -> torch.Tensor:
    """The live segments for the kernels' DEVICE_COUNT mode. When the host does not know how many
    segments are real: (1,) int32, those that start before total_tokens, counted on the device (one
    searchsorted, no sync), so that static-shape padding segments cost their programs one load (see
    _live_segments in the kernels). With num_segments the kernels read that instead: (0,), nothing
    launched. The forward op returns it, and the backward reuses it rather than counting again."""
    if num_segments is not None:
        return cu_seqlens.new_empty(0)
    return torch.searchsorted(cu_seqlens, cu_seqlens[-1:], out_int32=True)


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


# -- launchers --

def attention_forward(q, k, v, cu_seqlens, max_seqlen: int, causal: bool, scale: float,
                      num_segments: int | None = None):
    """Launch the forward kernel. Returns (o: like q, lse: (nheads, total_tokens) float32).

    Every row belongs to a segment (cu_seqlens[-1] == total_tokens, checked by varlen_attention on the
    CPU), so o and lse are written in full and allocated without a fill. ``num_segments``: the number
    of real segments when the host knows it (cu_seqlens is cut there); None counts them on the device.
    """
    o, lse, _ = _forward(q, k, v, cu_seqlens, max_seqlen, causal, scale, num_segments)
    return o, lse


def _forward(q, k, v, cu_seqlens, max_seqlen, causal, scale, num_segments):
    """:func:`attention_forward`, also returning the live count (:func:`_live_count`) for the backward."""
    cu_seqlens = _checked(q, k, v, cu_seqlens, max_seqlen, num_segments)
    total, nheads, head_dim = q.shape
    segments = cu_seqlens.numel() - 1
    if total == 0 or segments == 0:
        return (torch.zeros_like(q), q.new_zeros((nheads, total), dtype=torch.float32),
                cu_seqlens.new_zeros(0 if num_segments is not None else 1))
    o = torch.empty_like(q)
    lse = torch.empty((nheads, total), dtype=torch.float32, device=q.device)
    with _device_guard(q):
        count = _live_count(cu_seqlens, num_segments)
        # count_ptr is read only under DEVICE_COUNT (num_segments unknown); else any int32 tensor will do.
        count_ptr = count if num_segments is None else cu_seqlens
        args = (q, k, v, o, lse, cu_seqlens, count_ptr,
                *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(),
                scale, total, segments, _seqlen_key(max_seqlen))
        meta = dict(GROUP=nheads // k.shape[1], HEAD_DIM=head_dim, IS_CAUSAL=causal,
                    DOT_PRECISION=_dot_precision(q.dtype), UPCAST_DOT=_upcast_dot(q.dtype),
                    DEVICE_COUNT=num_segments is None, REVERSE_GRID=causal, BLOCK_D=_head_block(head_dim))
        _launch("fwd", _dtype_class(q.dtype), lambda c: segment_grid(total, segments, c["BLOCK_M"], nheads),
                args, meta)
    return o, lse, count


def attention_backward(do, q, k, v, o, lse, cu_seqlens, max_seqlen: int, causal: bool, scale: float,
                       num_segments: int | None = None, deterministic: bool = True,
                       live_count: torch.Tensor | None = None):
    """Launch the backward kernels. Returns (dq, dk, dv), shaped and typed like (q, k, v).

    The inputs are the forward's (q, k, v, cu_seqlens and num_segments as checked by
    :func:`attention_forward`, its o and lse): only do's shape is checked here. ``live_count``: the
    forward's count of live segments (the custom op passes it on); None counts them again.
    ``deterministic``: dq from its own kernel (bit-identical runs, 7 matrix products); False adds dq
    into an fp32 buffer with atomics from the dk/dv kernel (FlashAttention-2's way, 5 products; the
    last bits of dq vary between runs).
    """
    if do.shape != q.shape:
        raise ValueError(f"do must have the shape of q and o, {tuple(q.shape)}; got {tuple(do.shape)}")
    cu_seqlens = _kernel_cu_seqlens(cu_seqlens, num_segments)
    total, nheads, head_dim = q.shape
    nheads_kv = k.shape[1]
    segments = cu_seqlens.numel() - 1
    if total == 0 or segments == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dtype_class, block_d = _dtype_class(q.dtype), _head_block(head_dim)
    # Every key row is written by the dk/dv kernel and every query row by the dq kernel: no fills.
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    # One dq buffer: the deterministic dq kernel writes each row once, in q's dtype; atomic dq adds every
    # key block's share into it (an accumulator, so fp32), starting from zero.
    dq_buf = torch.empty_like(q) if deterministic else torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    with _device_guard(q):
        if num_segments is not None:
            count_ptr = cu_seqlens  # unread: the kernels take num_segments
        else:
            count_ptr = _live_count(cu_seqlens, None) if live_count is None else live_count
        # -- delta = rowsum(o * do), fp32, laid out like lse --
        delta = torch.empty_like(lse)
        block_t = 64
        attn_bwd_preprocess_kernel[(triton.cdiv(total, block_t), nheads)](
            o, do, delta, *o.stride(), *do.stride(), *delta.stride(), total,
            HEAD_DIM=head_dim, BLOCK_T=block_t, BLOCK_D=block_d,
        )
        # -- dk, dv (and atomic dq) per key block; dq per query block --
        common = (*q.stride(), *k.stride(), *v.stride(), *do.stride(), *lse.stride())
        meta = dict(GROUP=nheads // nheads_kv, HEAD_DIM=head_dim, IS_CAUSAL=causal,
                    DOT_PRECISION=_dot_precision(q.dtype), UPCAST_DOT=_upcast_dot(q.dtype),
                    DEVICE_COUNT=num_segments is None, BLOCK_D=block_d)
        tail = (scale, total, segments, _seqlen_key(max_seqlen))
        # The dk/dv kernel touches dq_buf only when atomic.
        _launch("dkdv" if deterministic else "dkdv_atomic", dtype_class,
                lambda c: segment_grid(total, segments, c["BLOCK_N"], nheads_kv),
                (q, k, v, do, lse, delta, dk, dv, dq_buf, cu_seqlens, count_ptr, *common, *dk.stride(), *dv.stride(),
                 *dq_buf.stride(), *tail),
                dict(meta, ATOMIC_DQ=not deterministic))
        if deterministic:
            _launch("dq", dtype_class, lambda c: segment_grid(total, segments, c["BLOCK_M"], nheads),
                    (q, k, v, do, lse, delta, dq_buf, cu_seqlens, count_ptr, *common, *dq_buf.stride(), *tail),
                    dict(meta, REVERSE_GRID=causal))
    return dq_buf.to(q.dtype), dk, dv  # a cast only for atomic dq of fp16 / bf16 inputs


# -- torch.library ops: torch.compile traces through them via the fake implementations --

@torch.library.custom_op("packkit::varlen_attn_fwd", mutates_args=())
def _varlen_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, causal: bool, scale: float, num_segments: int | None,
                     deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, lse, live_count): live_count (see _live_count) is kept for the backward."""
    return _forward(q, k, v, cu_seqlens, max_seqlen, causal, scale, num_segments)


@_varlen_attn_fwd.register_fake
def _varlen_attn_fwd_fake(q, k, v, cu_seqlens, max_seqlen, causal, scale, num_segments, deterministic):
    return (torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32),
            cu_seqlens.new_empty(0 if num_segments is not None else 1))


@torch.library.custom_op("packkit::varlen_attn_bwd", mutates_args=())
def _varlen_attn_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                     lse: torch.Tensor, cu_seqlens: torch.Tensor, live_count: torch.Tensor, max_seqlen: int,
                     causal: bool, scale: float, num_segments: int | None,
                     deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attention_backward(do, q, k, v, o, lse, cu_seqlens, max_seqlen, causal, scale, num_segments,
                              deterministic, live_count)


@_varlen_attn_bwd.register_fake
def _varlen_attn_bwd_fake(do, q, k, v, o, lse, cu_seqlens, live_count, max_seqlen, causal, scale, num_segments,
                          deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, causal, scale, num_segments, deterministic = inputs
    o, lse, live_count = output
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens, live_count)
    ctx.args = (max_seqlen, causal, scale, num_segments, deterministic)


def _backward(ctx, do, dlse, dlive_count):
    # lse and live_count are internal outputs (the public function returns only o): no gradient.
    dq, dk, dv = _varlen_attn_bwd(do, *ctx.saved_tensors, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


_varlen_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def flash_varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
    *, causal: bool = True, scale: float | None = None, num_segments: int | None = None,
    deterministic: bool = True,
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
        num_segments: the real segments (the rest of cu_seqlens is static-shape padding), a Python
            int; None lets the kernels count them on the device.
        deterministic: bit-identical gradients (default); False uses atomic dq accumulation.

    Returns:
        (total_tokens, nheads, headdim), dtype of q.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    o, _, _ = _varlen_attn_fwd(q, k, v, cu_seqlens, int(max_seqlen), bool(causal), scale,
                            None if num_segments is None else int(num_segments), bool(deterministic))
    return o
