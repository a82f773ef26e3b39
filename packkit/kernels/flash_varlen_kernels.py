"""Triton kernels for FlashAttention-2-style attention over packed, variable-length segments.

Only ``@triton.jit`` code lives here; :mod:`packkit.kernels.flash_varlen` holds the launchers, the
``torch.library`` ops and the public function.

Layout shared by every kernel::

    q:          (total_tokens, nheads, headdim)
    k, v:       (total_tokens, nheads_kv, headdim), nheads == GROUP * nheads_kv
    o:          (total_tokens, nheads, headdim)
    lse, delta: (nheads, total_tokens) float32
    dq_acc:     (total_tokens, nheads, headdim) float32, zeroed (atomic dq only)
    cu_seqlens: (num_segments + 1,) int32; segment s owns tokens cu_seqlens[s] : cu_seqlens[s + 1]
    count:      (1,) int32, the segments that start before total_tokens (DEVICE_COUNT only)

Grids are (segment, block) pairs flattened on axis 0 (up to 2**31 - 1 programs; CUDA caps axes 1 and
2 at 65,535, fewer than a static-shape batch's segments), heads on axis 1; see ``_locate_block``.
A program whose id lies past every live segment's blocks (static-shape padding) returns before the
search (``_live_segments``). With ``REVERSE_GRID`` program ids are taken from the end, so that the
heaviest causal query blocks (the last of each segment) start first and the light ones fill the tail.

Query head ``h`` reads key/value head ``h // GROUP`` (flash-attn's GQA convention). A program only ever
reads the tokens of its own segment, which is what keeps documents from attending to each other.
Scores are kept in base-2 units (``s * scale * log2(e)``) so that the softmax uses ``exp2``; ``lse`` is
stored in natural-log units. Offsets are widened to int64 before they meet a stride.
"""

import os

import triton
import triton.language as tl

# Triton reads TRITON_INTERPRET when each @triton.jit below runs (at this module's first import), not
# at launch: what it was then, so that a later setting can be explained (flash_varlen.interpreter_problem).
INTERPRET_AT_DEFINITION = os.environ.get("TRITON_INTERPRET")

# exp(x) == exp2(x * LOG2E); exp2 is the native instruction.
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """a @ b with an fp32 result. UPCAST_DOT: Triton's interpreter does no bfloat16 arithmetic (it
    multiplies the raw bits), so there bf16 operands go through fp32, which is what the tensor cores
    compute anyway: bf16 products are exact in fp32 and accumulate in fp32."""
    if UPCAST_DOT:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=DOT_PRECISION)
    return out


@triton.jit
def _locate_block(cu_seqlens_ptr, num_segments, pid, BLOCK: tl.constexpr):
    """Map a flat program id to (segment, segment start, segment length, first row of the block).

    Segment s owns the program ids [b(s), b(s + 1)) with b(s) = cu_seqlens[s] // BLOCK + s: that is
    cdiv(len_s, BLOCK) ids or one more (an empty segment owns one), so a grid of
    total_tokens // BLOCK + num_segments programs covers every block of every segment on grid axis 0
    (2**31 - 1 programs on CUDA, where axes 1 and 2 stop at 65,535). b is non-decreasing, so a binary
    search over cu_seqlens finds s: log2(num_segments) scalar loads, no table to precompute, and it
    holds for whichever BLOCK the autotuner picks. A block at or past the segment's end (the spare id,
    or an id past b(num_segments)) has start >= seqlen and its program returns at once.
    """
    lo = tl.full([], 0, tl.int32)  # explicit int32 scalars: both are loop-carried
    hi = tl.full([], 0, tl.int32) + num_segments - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        owned_from = tl.load(cu_seqlens_ptr + mid) // BLOCK + mid
        go_right = owned_from <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    seg_start = tl.load(cu_seqlens_ptr + lo)
    seqlen = tl.load(cu_seqlens_ptr + lo + 1) - seg_start  # int32: a segment is < 2**31 tokens
    start = (pid - (seg_start // BLOCK + lo)) * BLOCK
    return lo, seg_start.to(tl.int64), seqlen, start


@triton.jit
def _program_id(REVERSE_GRID: tl.constexpr):
    """This program's flat id on axis 0, counted from the end of the grid under REVERSE_GRID."""
    pid = tl.program_id(0)
    if REVERSE_GRID:
        pid = tl.num_programs(0) - 1 - pid
    return pid


@triton.jit
def _live_segments(count_ptr, num_segments, DEVICE_COUNT: tl.constexpr):
    """Segments that start before total_tokens: the rest (static-shape padding, all at total_tokens)
    own the last ids of the grid, one each, and nothing to compute. The launcher counts them on the
    device (one searchsorted, no sync) when the host does not know the count (DEVICE_COUNT), so that
    their programs return after one load instead of a binary search over every segment."""
    if DEVICE_COUNT:
        live = tl.load(count_ptr)
    else:
        live = tl.full([], 0, tl.int32) + num_segments
    return live


@triton.jit
def _fwd_block(
    acc, m_i, l_i, q,
    k_base_ptr, v_base_ptr,
    stride_kt, stride_kd, stride_vt, stride_vd,
    start_n, offs_m, offs_d, seqlen, qk_scale,
    HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_SCORES: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One key block of the online softmax: returns the updated (acc, m_i, l_i)."""
    # -- load K^T and V for keys start_n .. start_n + BLOCK_N --
    offs_n = start_n + tl.arange(0, BLOCK_N)
    mask_n = offs_n < seqlen
    mask_d = offs_d < HEAD_DIM
    rows_n = offs_n.to(tl.int64)
    kt = tl.load(
        k_base_ptr + rows_n[None, :] * stride_kt + offs_d[:, None] * stride_kd,
        mask=mask_n[None, :] & mask_d[:, None], other=0.0,
    )
    v = tl.load(
        v_base_ptr + rows_n[:, None] * stride_vt + offs_d[None, :] * stride_vd,
        mask=mask_n[:, None] & mask_d[None, :], other=0.0,
    )
    # -- scores (fp32, base-2 units) --
    s = _dot(q, kt, DOT_PRECISION, UPCAST_DOT) * qk_scale
    if MASK_SCORES:
        keep = mask_n[None, :]
        if IS_CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(keep, s, float("-inf"))
    # -- online softmax update --
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["total_tokens", "num_segments"])  # one compile whatever the counts
def attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_seqlens_ptr, count_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_lh, stride_lt,
    sm_scale, total_tokens, num_segments,
    max_seqlen_key,  # unused in the body; an autotuning key (rounded max_seqlen)
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    DEVICE_COUNT: tl.constexpr, REVERSE_GRID: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid: (total_tokens // BLOCK_M + num_segments, nheads) (see _locate_block). Writes o and lse
    for one query block."""
    # Phase 1 below needs start_m (a multiple of BLOCK_M) to be a key-block boundary too.
    tl.static_assert(BLOCK_M % BLOCK_N == 0, "the forward needs BLOCK_M to be a multiple of BLOCK_N")
    # -- locate the segment and the query block --
    pid = _program_id(REVERSE_GRID)
    live = _live_segments(count_ptr, num_segments, DEVICE_COUNT)
    if pid >= total_tokens // BLOCK_M + live:
        return  # past every live segment's blocks: static-shape padding
    head = tl.program_id(1).to(tl.int64)
    kv_head = head // GROUP
    _, seg_start, seqlen, start_m = _locate_block(cu_seqlens_ptr, live, pid, BLOCK_M)
    if start_m >= seqlen:
        return  # shorter segment than max_seqlen (or an empty one): nothing to do
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < seqlen
    mask_d = offs_d < HEAD_DIM
    rows_m = seg_start + offs_m.to(tl.int64)

    # -- load the query block --
    q = tl.load(
        q_ptr + rows_m[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask_m[:, None] & mask_d[None, :], other=0.0,
    )
    k_base_ptr = k_ptr + seg_start * stride_kt + kv_head * stride_kh
    v_base_ptr = v_ptr + seg_start * stride_vt + kv_head * stride_vh
    qk_scale = sm_scale * LOG2E
    # fp32 statistics and accumulator whatever the input dtype: exp-sums of 4k fp16 terms overflow.
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # -- phase 1: key blocks wholly inside the segment and (causal) wholly below the diagonal --
    # BLOCK_M is a multiple of BLOCK_N, so start_m is a block boundary for keys too.
    if IS_CAUSAL:
        full_end = start_m
        hi = tl.minimum(start_m + BLOCK_M, seqlen)
    else:
        full_end = (seqlen // BLOCK_N) * BLOCK_N
        hi = seqlen
    for start_n in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _fwd_block(
            acc, m_i, l_i, q, k_base_ptr, v_base_ptr, stride_kt, stride_kd, stride_vt, stride_vd,
            start_n, offs_m, offs_d, seqlen, qk_scale,
            HEAD_DIM, IS_CAUSAL, False, DOT_PRECISION, UPCAST_DOT, BLOCK_N,
        )
    # -- phase 2: the diagonal blocks and the segment's ragged tail, with the score mask --
    # The first key block always holds key 0, which every query row may see, so m_i is finite after it.
    for start_n in range(full_end, hi, BLOCK_N):
        acc, m_i, l_i = _fwd_block(
            acc, m_i, l_i, q, k_base_ptr, v_base_ptr, stride_kt, stride_kd, stride_vt, stride_vd,
            start_n, offs_m, offs_d, seqlen, qk_scale,
            HEAD_DIM, IS_CAUSAL, True, DOT_PRECISION, UPCAST_DOT, BLOCK_N,
        )

    # -- epilogue: normalise, store o and the natural-log logsumexp --
    acc = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) / LOG2E
    tl.store(
        o_ptr + rows_m[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
        acc.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :],
    )
    tl.store(lse_ptr + head * stride_lh + rows_m * stride_lt, lse, mask=mask_m)


@triton.jit
def attn_bwd_preprocess_kernel(
    o_ptr, do_ptr, delta_ptr,
    stride_ot, stride_oh, stride_od,
    stride_dot, stride_doh, stride_dod,
    stride_dh, stride_dt,
    total_tokens,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid: (cdiv(total_tokens, BLOCK_T), nheads). delta[h, t] = sum_d o[t, h, d] * do[t, h, d] in fp32."""
    # -- load o and do rows --
    pid_t = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    offs_t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_t = offs_t < total_tokens
    mask = mask_t[:, None] & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(o_ptr + offs_t[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + offs_t[:, None] * stride_dot + head * stride_doh + offs_d[None, :] * stride_dod,
                 mask=mask, other=0.0).to(tl.float32)
    # -- reduce and store --
    tl.store(delta_ptr + head * stride_dh + offs_t * stride_dt, tl.sum(o * do, 1), mask=mask_t)


@triton.jit(do_not_specialize=["total_tokens", "num_segments"])  # one compile whatever the counts
def attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dq_acc_ptr, cu_seqlens_ptr, count_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_dot, stride_doh, stride_dod,
    stride_lh, stride_lt,
    stride_dkt, stride_dkh, stride_dkd,
    stride_dvt, stride_dvh, stride_dvd,
    stride_dqt, stride_dqh, stride_dqd,
    sm_scale, total_tokens, num_segments,
    max_seqlen_key,  # unused in the body; an autotuning key (rounded max_seqlen)
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    DEVICE_COUNT: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid: (total_tokens // BLOCK_N + num_segments, nheads_kv) (see _locate_block).

    One program owns a key block of one kv head and runs over every (query head of the group, query
    block) pair in one flat loop (which Triton pipelines as a whole), so dk and dv are summed in
    registers: no atomics, deterministic. Causal blocks already run heaviest first: a segment's first
    key block is seen by every query.

    ATOMIC_DQ (FlashAttention-2's backward): also add dS K into the fp32 dq_acc with atomics, so that
    no dq kernel recomputes S and dP (5 matrix products instead of 7); the order of the additions, and
    so dq's last bits, then varies from run to run.
    """
    # -- locate the segment and the key block --
    pid = tl.program_id(0)
    live = _live_segments(count_ptr, num_segments, DEVICE_COUNT)
    if pid >= total_tokens // BLOCK_N + live:
        return  # past every live segment's blocks: static-shape padding
    kv_head = tl.program_id(1).to(tl.int64)
    _, seg_start, seqlen, start_n = _locate_block(cu_seqlens_ptr, live, pid, BLOCK_N)
    if start_n >= seqlen:
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n = offs_n < seqlen
    mask_d = offs_d < HEAD_DIM
    rows_n = seg_start + offs_n.to(tl.int64)
    kv_mask = mask_n[:, None] & mask_d[None, :]

    # -- load the key and value block --
    k = tl.load(k_ptr + rows_n[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :] * stride_kd,
                mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + rows_n[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :] * stride_vd,
                mask=kv_mask, other=0.0)
    # fp32 accumulators: dk and dv sum over every query of the segment and every head of the group.
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E
    # Causal: queries before start_n cannot see this key block.
    lo = (start_n // BLOCK_M) * BLOCK_M if IS_CAUSAL else 0
    blocks_m = tl.cdiv(seqlen - lo, BLOCK_M)

    # -- one loop over (query head of the group, query block) --
    for it in range(0, GROUP * blocks_m):
        g = it // blocks_m
        start_m = lo + (it - g * blocks_m) * BLOCK_M
        head = kv_head * GROUP + g
        offs_m = start_m + tl.arange(0, BLOCK_M)
        mask_m = offs_m < seqlen
        rows_m = seg_start + offs_m.to(tl.int64)
        q_mask = mask_m[:, None] & mask_d[None, :]
        qt = tl.load(q_ptr + rows_m[None, :] * stride_qt + head * stride_qh + offs_d[:, None] * stride_qd,
                     mask=mask_m[None, :] & mask_d[:, None], other=0.0)
        do = tl.load(do_ptr + rows_m[:, None] * stride_dot + head * stride_doh + offs_d[None, :] * stride_dod,
                     mask=q_mask, other=0.0)
        lse = tl.load(lse_ptr + head * stride_lh + rows_m * stride_lt, mask=mask_m, other=0.0)
        delta = tl.load(delta_ptr + head * stride_lh + rows_m * stride_lt, mask=mask_m, other=0.0)
        # -- recompute P^T from the saved logsumexp --
        st = _dot(k, qt, DOT_PRECISION, UPCAST_DOT) * qk_scale
        keep = mask_n[:, None] & mask_m[None, :]
        if IS_CAUSAL:
            keep = keep & (offs_m[None, :] >= offs_n[:, None])
        pt = tl.where(keep, tl.exp2(st - lse[None, :] * LOG2E), 0.0)
        # -- dV += P^T dO ; dS^T = P^T * (dP^T - delta) ; dK += dS^T Q --
        dv += _dot(pt.to(do.dtype), do, DOT_PRECISION, UPCAST_DOT)
        dpt = _dot(v, tl.trans(do), DOT_PRECISION, UPCAST_DOT)
        dst = (pt * (dpt - delta[None, :])).to(qt.dtype)
        dk += _dot(dst, tl.trans(qt), DOT_PRECISION, UPCAST_DOT)
        if ATOMIC_DQ:
            # -- dQ += dS K * scale, added in fp32 --
            dq = _dot(tl.trans(dst), k, DOT_PRECISION, UPCAST_DOT) * sm_scale
            tl.atomic_add(dq_acc_ptr + rows_m[:, None] * stride_dqt + head * stride_dqh + offs_d[None, :] * stride_dqd,
                          dq, mask=q_mask, sem="relaxed")

    # -- store dk (scaled once here rather than per block) and dv --
    dk = dk * sm_scale
    tl.store(dk_ptr + rows_n[:, None] * stride_dkt + kv_head * stride_dkh + offs_d[None, :] * stride_dkd,
             dk.to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + rows_n[:, None] * stride_dvt + kv_head * stride_dvh + offs_d[None, :] * stride_dvd,
             dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit(do_not_specialize=["total_tokens", "num_segments"])  # one compile whatever the counts
def attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, cu_seqlens_ptr, count_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_dot, stride_doh, stride_dod,
    stride_lh, stride_lt,
    stride_dqt, stride_dqh, stride_dqd,
    sm_scale, total_tokens, num_segments,
    max_seqlen_key,  # unused in the body; an autotuning key (rounded max_seqlen)
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    DEVICE_COUNT: tl.constexpr, REVERSE_GRID: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid: (total_tokens // BLOCK_M + num_segments, nheads) (see _locate_block). dq for one query
    block, no atomics."""
    # -- locate the segment and the query block --
    pid = _program_id(REVERSE_GRID)
    live = _live_segments(count_ptr, num_segments, DEVICE_COUNT)
    if pid >= total_tokens // BLOCK_M + live:
        return  # past every live segment's blocks: static-shape padding
    head = tl.program_id(1).to(tl.int64)
    kv_head = head // GROUP
    _, seg_start, seqlen, start_m = _locate_block(cu_seqlens_ptr, live, pid, BLOCK_M)
    if start_m >= seqlen:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < seqlen
    mask_d = offs_d < HEAD_DIM
    rows_m = seg_start + offs_m.to(tl.int64)
    q_mask = mask_m[:, None] & mask_d[None, :]

    # -- load the query-side block and its softmax statistics --
    q = tl.load(q_ptr + rows_m[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
                mask=q_mask, other=0.0)
    do = tl.load(do_ptr + rows_m[:, None] * stride_dot + head * stride_doh + offs_d[None, :] * stride_dod,
                 mask=q_mask, other=0.0)
    lse = tl.load(lse_ptr + head * stride_lh + rows_m * stride_lt, mask=mask_m, other=0.0)
    delta = tl.load(delta_ptr + head * stride_lh + rows_m * stride_lt, mask=mask_m, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E
    hi = tl.minimum(start_m + BLOCK_M, seqlen) if IS_CAUSAL else seqlen
    k_base_ptr = k_ptr + seg_start * stride_kt + kv_head * stride_kh
    v_base_ptr = v_ptr + seg_start * stride_vt + kv_head * stride_vh

    # -- loop over key blocks: dS = P * (dO V^T - delta) ; dQ += dS K --
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < seqlen
        rows_n = offs_n.to(tl.int64)
        kt = tl.load(k_base_ptr + rows_n[None, :] * stride_kt + offs_d[:, None] * stride_kd,
                     mask=mask_n[None, :] & mask_d[:, None], other=0.0)
        vt = tl.load(v_base_ptr + rows_n[None, :] * stride_vt + offs_d[:, None] * stride_vd,
                     mask=mask_n[None, :] & mask_d[:, None], other=0.0)
        s = _dot(q, kt, DOT_PRECISION, UPCAST_DOT) * qk_scale
        keep = mask_m[:, None] & mask_n[None, :]
        if IS_CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        p = tl.where(keep, tl.exp2(s - lse[:, None] * LOG2E), 0.0)
        dp = _dot(do, vt, DOT_PRECISION, UPCAST_DOT)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(kt.dtype), tl.trans(kt), DOT_PRECISION, UPCAST_DOT)

    # -- store dq --
    dq = dq * sm_scale
    tl.store(dq_ptr + rows_m[:, None] * stride_dqt + head * stride_dqh + offs_d[None, :] * stride_dqd,
             dq.to(dq_ptr.dtype.element_ty), mask=q_mask)
