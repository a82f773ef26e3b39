"""packkit's Triton varlen attention kernels against a slow float64 reference.

On a machine without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``), at
small sizes. Triton reads that variable when a kernel is *defined* (the first import of
``packkit.kernels.flash_varlen_kernels``), not when triton is imported nor at launch, so setting it
here, before that import, is reliable, unless something in this process imported packkit.kernels
earlier (e.g. ``pytest kernels tests``: doctest collection imports the kernels first) or it is set to 0.
Then the "cpu" cases FAIL naming the cause (on a machine without CUDA a skip would leave the kernels
untested without a word); ``make test`` exports it. On a CUDA machine run without the interpreter:
the "cuda" cases run the compiled kernels and the "cpu" ones skip, saying why.
"""

import json
import os
import subprocess
import sys
import types

import pytest
import torch
from attention_testlib import TOLERANCES, assert_close, attention_ref, check_against_float64, cu_seqlens_of

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before packkit.kernels is imported: see above

pytest.importorskip("triton", reason="the Triton kernels need triton (pip install 'packkit[triton]')")

from packkit.attention import varlen_attention  # noqa: E402  (after TRITON_INTERPRET is decided)
from packkit.kernels import flash_varlen  # noqa: E402

# Odd lengths, a single token, a length that is a block plus a ragged tail, and an empty segment.
LENGTHS = [1, 17, 0, 97, 123]
# The same under the interpreter's 32-token blocks at about a third of its cost (a case costs about its
# number of programs and block pairs): 33 is a block and one token, 59 two blocks with a ragged tail, so
# full, diagonal and masked blocks, the online softmax across blocks and the empty segment all still run.
INTERPRETER_LENGTHS = [1, 17, 0, 33, 59]


def sweep_lengths(device: str) -> list[int]:
    """The segment lengths a kernel sweep runs on ``device``: ``sweep_lengths("cpu") -> [1, 17, 0, 33, 59]``."""
    return INTERPRETER_LENGTHS if device == "cpu" else LENGTHS

NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def device_params():
    return [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=NO_CUDA)]


def skip_unless_runnable(device: str) -> None:
    """Skip a "cpu" case where CUDA runs the kernels instead; fail it, naming the cause, where nothing would."""
    problem = flash_varlen.interpreter_problem() if device == "cpu" else None
    if problem is not None:
        if torch.cuda.is_available():
            pytest.skip(f"the compiled kernels run in the 'cuda' cases here; the CPU interpreter is off: {problem}")
        pytest.fail(f"no CUDA device and the Triton interpreter is off, so these kernels would go untested: {problem}")


# (dtype, causal, headdim, nheads, nheads_kv). On CUDA: every dtype both ways with GQA at d=32, then MHA
# at 64, 128, the padded head dims 80 and 96 (96 with MQA, a group of 3).
CUDA_CASES = [
    (torch.float32, True, 32, 2, 1),
    (torch.float32, False, 32, 2, 1),
    (torch.float16, True, 32, 2, 1),
    (torch.float16, False, 32, 2, 1),
    (torch.bfloat16, True, 32, 2, 1),
    (torch.bfloat16, False, 32, 2, 1),
    (torch.float16, True, 64, 2, 2),
    (torch.bfloat16, True, 128, 2, 2),
    (torch.float16, False, 80, 2, 1),
    (torch.float32, True, 96, 3, 1),
]
# Under the interpreter a case costs about its number of programs (heads x blocks); the head dim hardly
# matters, and no code path depends on its size (the interpreter runs one block size, and a head dim is
# padded to a power of two the same way at 24 as at 80). So: every dtype both ways, one head at d=16,
# except where the heads are what is tested: GQA (a group of 2), MHA (kv head 1 read by query head 1),
# and the padded head dims 24 and 40 (40 with MQA, a group of 3).
CPU_CASES = [
    (torch.float32, True, 16, 2, 1),
    (torch.float32, False, 16, 1, 1),
    (torch.float16, True, 16, 1, 1),
    (torch.float16, False, 16, 2, 1),
    (torch.bfloat16, True, 16, 2, 2),
    (torch.bfloat16, False, 16, 1, 1),
    (torch.float16, False, 24, 1, 1),
    (torch.float32, True, 40, 3, 1),
]


def case_params(cpu_cases, cuda_cases):
    """pytest params: the CPU (interpreter) cases, then the CUDA ones, each with its id. The CPU sweep past
    its first case is ``slow`` (make test-fast runs one interpreter case, make test all)."""
    def name(device, c):
        return f"{str(c[0])[6:]}-{'causal' if c[1] else 'full'}-d{c[2]}-h{c[3]}kv{c[4]}-{device}"
    return ([pytest.param("cpu", *c, id=name("cpu", c), marks=[pytest.mark.slow] if i else [])
             for i, c in enumerate(cpu_cases)]
            + [pytest.param("cuda", *c, id=name("cuda", c), marks=NO_CUDA) for c in cuda_cases])


@pytest.mark.parametrize("device,dtype,causal,headdim,nheads,nheads_kv", case_params(CPU_CASES, CUDA_CASES))
def test_forward_and_gradients_match_float64(device, dtype, causal, headdim, nheads, nheads_kv):
    skip_unless_runnable(device)
    lengths = sweep_lengths(device)
    check_against_float64(triton_attention(max(lengths), causal), lengths, nheads, nheads_kv, headdim, dtype,
                          device, causal)


def triton_attention(max_seqlen, causal, **options):
    """``run(q, k, v, cu)`` through the public function, pinned to the Triton backend."""
    return lambda q, k, v, cu: varlen_attention(q, k, v, cu, max_seqlen, causal=causal, backend="triton", **options)


@pytest.mark.parametrize("device,dtype,causal,headdim,nheads,nheads_kv", case_params(
    [(torch.float32, True, 16, 2, 1), (torch.float32, False, 16, 3, 1), (torch.bfloat16, True, 16, 2, 2)],
    [(torch.float32, True, 32, 4, 2), (torch.float32, False, 32, 3, 1), (torch.bfloat16, True, 32, 2, 2)]))
def test_atomic_dq_matches_float64(device, dtype, causal, headdim, nheads, nheads_kv):
    """deterministic=False: dq added with atomics from the dk/dv kernel (FlashAttention-2's backward)."""
    skip_unless_runnable(device)
    lengths = sweep_lengths(device)
    check_against_float64(triton_attention(max(lengths), causal, deterministic=False), lengths, nheads, nheads_kv,
                          headdim, dtype, device, causal)


@pytest.mark.parametrize("device", device_params())
def test_padding_segments_counted_on_the_device(device, monkeypatch):
    """Static-shape padding (trailing empty segments) without num_segments: the launcher counts the live
    segments on the device; the result equals num_segments given on the host, forward and backward,
    and the reference. The forward op counts them once and returns the count, and the backward reuses it
    (before the fix it ran the searchsorted again); with num_segments nothing is counted (an empty count)."""
    skip_unless_runnable(device)
    calls = []

    def live_count(cu_seqlens, num_segments):
        out = real(cu_seqlens, num_segments)
        calls.append(tuple(out.shape))
        return out

    real = flash_varlen._live_count
    monkeypatch.setattr(flash_varlen, "_live_count", live_count)
    lengths = [9, 40, 1, 0, 0, 0, 0]
    results, counted = [], []
    for num_segments in (None, 3):
        calls.clear()
        results.append(check_against_float64(triton_attention(40, True, num_segments=num_segments), lengths, 1, 1,
                                             16, torch.float32, device, True))
        counted.append(list(calls))
    assert counted == [[(1,)], [(0,)]]  # one count per step, forward and backward together
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", device_params())
def test_strided_cu_seqlens(device):
    """The launcher makes cu_seqlens contiguous (the kernels index it as a flat array)."""
    skip_unless_runnable(device)
    lengths = [5, 0, 12, 3]
    cu = cu_seqlens_of(lengths, device)
    strided = torch.stack([cu, torch.full_like(cu, -7)], dim=1)[:, 0]
    assert not strided.is_contiguous()
    q, k, v = (torch.randn(20, h, 16, device=device) for h in (2, 1, 1))
    out, lse = flash_varlen.attention_forward(q, k, v, strided, 12, True, 0.25)
    ref_out, ref_lse = attention_ref(q, k, v, cu, True, 0.25)
    assert_close("out", out, ref_out, *TOLERANCES[torch.float32]["fwd"])
    assert_close("lse", lse, ref_lse, *TOLERANCES[torch.float32]["fwd"])


@pytest.mark.parametrize("device", device_params())
def test_logsumexp_and_explicit_scale(device):
    """The launcher's lse (natural log, (nheads, total) fp32) and a non-default softmax scale."""
    skip_unless_runnable(device)
    torch.manual_seed(1)
    lengths = [5, 0, 40]
    cu = cu_seqlens_of(lengths, device)
    q = torch.randn(45, 2, 32, device=device)
    k = torch.randn(45, 1, 32, device=device)
    v = torch.randn(45, 1, 32, device=device)
    out, lse = flash_varlen.attention_forward(q, k, v, cu, 40, True, 0.3)
    ref_out, ref_lse = attention_ref(q, k, v, cu, True, 0.3)
    assert lse.dtype == torch.float32 and lse.shape == (2, 45)
    assert_close("lse", lse, ref_lse, *TOLERANCES[torch.float32]["fwd"])
    assert_close("out", out, ref_out, *TOLERANCES[torch.float32]["fwd"])


def check_bf16_against_float64(lengths, nheads, nheads_kv, headdim, causal, **options):
    """bf16 forward and gradients on CUDA against the float64 reference, within the bf16 tolerances."""
    return check_against_float64(triton_attention(max(lengths), causal, **options), lengths, nheads, nheads_kv,
                                 headdim, torch.bfloat16, "cuda", causal)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (long segments are too slow for the interpreter)")
@pytest.mark.parametrize("causal", [True, False])
def test_long_segments_on_cuda(causal):
    """Segments spanning many blocks, GQA 8/2, head dim 128, bf16: the benchmark's regime, smaller."""
    torch.manual_seed(2)
    lengths = [1, 17, 0, 97, 123, 1025, 2048, 515]
    check_bf16_against_float64(lengths, 8, 2, 128, causal)


@pytest.mark.parametrize("device", device_params())
def test_no_tokens_and_zero_max_seqlen(device):
    skip_unless_runnable(device)
    q = torch.randn(0, 2, 32, device=device, requires_grad=True)
    k = torch.randn(0, 1, 32, device=device, requires_grad=True)
    v = torch.randn(0, 1, 32, device=device, requires_grad=True)
    for cu in ([0], [0, 0, 0]):
        out = flash_varlen.flash_varlen_attention(q, k, v, torch.tensor(cu, dtype=torch.int32, device=device), 0)
        assert out.shape == (0, 2, 32)
        out.sum().backward()
        assert q.grad.shape == q.shape


@pytest.mark.parametrize("device", device_params())
def test_deterministic(device):
    """Same inputs, same bits: dk/dv are reduced in registers, never with atomics."""
    skip_unless_runnable(device)
    torch.manual_seed(3)
    cu = cu_seqlens_of([9, 40], device)
    grads = []
    base = [torch.randn(49, h, 16, device=device, dtype=torch.float16) for h in (2, 1, 1)]
    for _ in range(2):
        q, k, v = (t.clone().requires_grad_() for t in base)
        out = varlen_attention(q, k, v, cu, 40, backend="triton")
        out.backward(torch.ones_like(out))
        grads.append((out, q.grad, k.grad, v.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(q=torch.randn(4, 2, 32, dtype=torch.float64)), "dtype"),
        (dict(q=torch.randn(4, 2, 256), k=torch.randn(4, 1, 256), v=torch.randn(4, 1, 256)), "head dims"),
        (dict(q=torch.randn(4, 3, 32), k=torch.randn(4, 2, 32), v=torch.randn(4, 2, 32)), "multiple"),
        (dict(cu=torch.tensor([0, 4], dtype=torch.int64)), "int32"),
        (dict(k=torch.randn(5, 1, 32), v=torch.randn(5, 1, 32)), "total_tokens"),
    ],
    ids=["float64", "headdim-256", "heads-not-multiple", "cu-int64", "kv-length"],
)
def test_launcher_rejects_bad_inputs(change, message):
    skip_unless_runnable("cpu")  # the CPU checks reach the shape checks only under the interpreter
    args = dict(q=torch.randn(4, 2, 32), k=torch.randn(4, 1, 32), v=torch.randn(4, 1, 32),
                cu=torch.tensor([0, 4], dtype=torch.int32))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        flash_varlen.attention_forward(args["q"], args["k"], args["v"], args["cu"], 4, True, 0.1)


@pytest.mark.parametrize("num_segments, error", [(4, ValueError), (-1, ValueError), (True, TypeError)])
def test_launcher_and_varlen_attention_refuse_num_segments_alike(num_segments, error):
    """One check (varlen_layout.check_num_segments) behind both entry points: the same error and words."""
    skip_unless_runnable("cpu")
    q, k, v = torch.randn(7, 2, 32), torch.randn(7, 1, 32), torch.randn(7, 1, 32)
    cu = cu_seqlens_of([3, 4, 0])
    messages = []
    for call in (lambda: flash_varlen.attention_forward(q, k, v, cu, 4, True, 0.1, num_segments),
                 lambda: varlen_attention(q, k, v, cu, 4, backend="triton", num_segments=num_segments)):
        with pytest.raises(error, match=r"must be in \[0, 3\]|Python int") as caught:
            call()
        messages.append(str(caught.value))
    assert messages[0] == messages[1]


@pytest.mark.slow
@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("num_segments,deterministic", [(None, True), (2, False)])
def test_custom_op_registration(device, num_segments, deterministic):
    """torch.library.opcheck: schema, fake (meta) implementation and autograd registration agree."""
    skip_unless_runnable(device)
    torch.manual_seed(4)
    cu = cu_seqlens_of([3, 6, 0], device)
    q = torch.randn(9, 2, 16, device=device, requires_grad=True)
    k = torch.randn(9, 1, 16, device=device, requires_grad=True)
    v = torch.randn(9, 1, 16, device=device, requires_grad=True)
    result = torch.library.opcheck(torch.ops.packkit.varlen_attn_fwd.default,
                                   (q, k, v, cu, 6, True, 0.25, num_segments, deterministic))
    assert result and all(outcome == "SUCCESS" for outcome in result.values()), result


@pytest.mark.slow
@pytest.mark.parametrize("device", device_params())
def test_torch_compile_fullgraph(device):
    """The custom op compiles into one graph (fake tensors through register_fake), forward and backward."""
    skip_unless_runnable(device)
    torch._dynamo.reset()
    torch.manual_seed(5)
    cu = cu_seqlens_of([7, 0, 20], device)
    base = [torch.randn(27, h, 16, device=device) for h in (2, 1, 1)]

    def step(q, k, v):
        return flash_varlen.flash_varlen_attention(q, k, v, cu, 20, causal=True).square().sum()

    # aot_eager: traces forward and backward through the ops without needing a C++/CUDA toolchain.
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (step, compiled):
        q, k, v = (t.clone().requires_grad_() for t in base)
        loss = fn(q, k, v)
        loss.backward()
        results.append((loss, q.grad, k.grad, v.grad))
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager, rtol=0, atol=0)


# -- tuning and the launch boundary, the parts a CPU can check --

@pytest.mark.parametrize("limit, head_dim, expected", [
    (232_448, 128, [(128, 64, 8, 3), (64, 64, 4, 3)]),  # H100/H200; the d<=64 rows are not listed for 128
    (232_448, 64, [(128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3)]),
    (100_000, 64, [(128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 4, 3)]),  # (128, 128, 8, 3) needs ~115 KB
    (50_000, 128, [(128, 64, 8, 3)]),  # nothing fits: the fixed config, which the compiler then judges
])
def test_autotune_configs_pruned_by_head_dim_and_shared_memory(monkeypatch, limit, head_dim, expected):
    monkeypatch.setattr(flash_varlen, "_max_shared_memory", lambda device: limit)
    configs = [c for c, _ in flash_varlen.CONFIGS[("fwd", "half")]]
    q = torch.empty(1, 1, head_dim, dtype=torch.bfloat16)
    kept = flash_varlen._pruner("fwd")(configs, {"q_ptr": q}, BLOCK_D=head_dim)
    assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept] == expected


def test_fixed_configs_cover_every_kernel_and_head_dim():
    """One fixed config per (kernel, dtype class), valid up to MAX_HEAD_DIM; the forward's blocks nest."""
    assert set(flash_varlen.FIXED_CONFIGS) == set(flash_varlen.CONFIGS) == {
        (kernel, cls) for kernel in ("fwd", "dkdv", "dkdv_atomic", "dq") for cls in ("half", "fp32")}
    for (kernel, cls), rows in flash_varlen.CONFIGS.items():
        assert rows[0][0] is flash_varlen.FIXED_CONFIGS[(kernel, cls)] and rows[0][1] == flash_varlen.MAX_HEAD_DIM
        if kernel == "fwd":
            assert all(c.kwargs["BLOCK_M"] % c.kwargs["BLOCK_N"] == 0 for c, _ in rows)


@pytest.mark.parametrize("value, enabled", [(None, True), ("1", True), ("0", False), ("off", False), ("False", False)])
def test_autotune_switch(monkeypatch, value, enabled):
    if value is None:
        monkeypatch.delenv(flash_varlen.AUTOTUNE_ENV, raising=False)
    else:
        monkeypatch.setenv(flash_varlen.AUTOTUNE_ENV, value)
    assert flash_varlen.autotune_enabled() is enabled


def test_launches_are_guarded_to_the_tensors_device():
    """Triton launches on the current CUDA device: the launcher enters q's (cuda:1 while cuda:0 is current)."""
    guard = flash_varlen._device_guard(types.SimpleNamespace(device=torch.device("cuda", 1)))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert not isinstance(flash_varlen._device_guard(torch.empty(1)), torch.cuda.device)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_second_device_while_first_is_current():
    with torch.cuda.device(0):
        check_against_float64(triton_attention(40, True), [9, 40], 2, 1, 32, torch.bfloat16, "cuda:1", True)


# -- (segment, block) pairs on grid axis 0, so any number of segments launches (before the fix segments
# sat on grid axis 1, whose CUDA limit is 65,535) --

def test_segment_grid_goes_past_cudas_65535_on_axis_0():
    """A static-shape batch of 16 x 4096 with max_segments = B * W = 65,536 (and a
    padding-free batch of 70,000 documents) needs more than 65,535 segment slots. The grid puts them
    on axis 0 (limit 2**31 - 1) and keeps the heads on axis 1, inside CUDA's limits."""
    for total, segments in [(16 * 4096, 16 * 4096), (140_000, 70_000)]:
        grid = flash_varlen.segment_grid(total, segments, 128, 32)
        assert grid == (total // 128 + segments, 32)
        assert grid[0] > 65_535 and all(size <= limit for size, limit in zip(grid, flash_varlen.CUDA_MAX_GRID))
    with pytest.raises(ValueError, match="axis 0"):
        flash_varlen.segment_grid(2**36, 2**20, 16, 8)
    with pytest.raises(ValueError, match="axis 1"):
        flash_varlen.segment_grid(100, 2, 16, 70_000)


if flash_varlen.interpreted() or torch.cuda.is_available():
    import triton
    import triton.language as tl

    from packkit.kernels.flash_varlen_kernels import _locate_block

    @triton.jit
    def _locate_many(cu_ptr, num_segments, pids_ptr, seg_out, start_out, N: tl.constexpr, BLOCK: tl.constexpr):
        """For each of N program ids: the (segment, block start) that _locate_block gives it."""
        for i in range(N):
            seg, _, _, start = _locate_block(cu_ptr, num_segments, tl.load(pids_ptr + i), BLOCK)
            tl.store(seg_out + i, seg)
            tl.store(start_out + i, start)


def locate(cu, pids, block):
    """Run _locate_block (interpreter on the CPU, compiled on CUDA) for the given program ids."""
    pids = torch.as_tensor(pids, dtype=torch.int32, device=cu.device)
    seg = torch.empty_like(pids)
    start = torch.empty_like(pids)
    _locate_many[(1,)](cu, cu.numel() - 1, pids, seg, start, N=pids.numel(), BLOCK=block)
    return seg.tolist(), start.tolist()


def needed_blocks(lengths, block):
    """The slow obvious list of (segment, first row) pairs some program must handle."""
    return sorted((s, b) for s, n in enumerate(lengths) for b in range(0, n, block))


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("lengths, block", [([1, 17, 0, 97, 123], 32), ([0, 0, 5], 16), ([64, 64, 0, 0, 1], 32),
                                            ([0], 16), ([31, 32, 33, 0, 95, 96, 97], 32)])
def test_locate_block_covers_every_block_once(device, lengths, block):
    """Over the whole flat grid, every block of every segment is owned by exactly one
    program, and every other program (an empty segment's, a spare one) lands past its segment's end."""
    skip_unless_runnable(device)
    cu = cu_seqlens_of(lengths, device)
    grid0, _ = flash_varlen.segment_grid(sum(lengths), len(lengths), block, 1)
    seg, start = locate(cu, range(grid0), block)
    useful = sorted((s, b) for s, b in zip(seg, start) if b < lengths[s])
    assert useful == needed_blocks(lengths, block)
    assert all(0 <= s < len(lengths) and b >= 0 for s, b in zip(seg, start))


@pytest.mark.slow
@pytest.mark.parametrize("device", device_params())
def test_locate_block_past_65535_segments(device):
    """With 70,000 segments (padding-free, 1-3 tokens each, then static-shape
    padding) the programs past id 65,535 find their segment; checked on a slice of ids around 65,535
    and at the end of the grid (the whole grid would take the interpreter too long)."""
    skip_unless_runnable(device)
    gen = torch.Generator().manual_seed(6)
    lengths = (torch.randint(1, 4, (69_000,), generator=gen).tolist()) + [0] * 1_000
    block = 32
    cu = cu_seqlens_of(lengths, device)
    grid0, _ = flash_varlen.segment_grid(sum(lengths), len(lengths), block, 1)
    pids = list(range(65_520, 65_552)) + list(range(grid0 - 8, grid0))
    seg, start = locate(cu, pids, block)
    # Reference over the whole grid in Python: block-start b(s) = cu[s] // block + s, every pid after.
    offsets = cu.tolist()
    owner, first = [], []
    for s, n in enumerate(lengths):
        first_pid = offsets[s] // block + s
        owner.extend([s] * (offsets[s + 1] // block + s + 1 - first_pid))
        first.append(first_pid)
    for pid, s, b in zip(pids, seg, start):
        expected = owner[pid] if pid < len(owner) else len(lengths) - 1
        assert s == expected, f"program {pid}: segment {s}, expected {expected}"
        assert b == (pid - first[s]) * block
    assert max(seg) > 65_535


# -- a wrong TRITON_INTERPRET is named, never a silent skip (as the CPU cases did before the fix) --

def _without_interpret(value=None) -> dict:
    """This process's environment with TRITON_INTERPRET removed, or set to ``value``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if value is not None:
        env["TRITON_INTERPRET"] = value
    return env


def _run_together(commands):
    """Run ``(argv, env)`` pairs as concurrent subprocesses (each one a fresh interpreter: the variable is
    read at import); returns ``(returncode, stdout + stderr)`` for each, in order."""
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for argv, env in commands]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in procs]
        return [(p.returncode, out) for p, out in zip(procs, outputs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour (here CUDA runs the kernels)")
def test_interpreter_setting_outside_make_test():
    """Run outside ``make test`` (TRITON_INTERPRET unset) the CPU cases really run,
    because the module sets it before packkit.kernels is imported; with TRITON_INTERPRET=0 they fail
    naming the variable instead of skipping in silence; set after the import, the message says so.
    (Three fresh interpreters, run side by side.)"""
    here = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-k", "logsumexp"]
    late = [sys.executable, "-c", "import os, packkit.kernels.flash_varlen as f; os.environ['TRITON_INTERPRET'] = '1'; "
                                  "print(f.interpreter_problem())"]
    (unset_rc, unset), (off_rc, off), (_, late_out) = _run_together(
        [(here, _without_interpret()), (here, _without_interpret("0")), (late, _without_interpret())])
    assert unset_rc == 0 and "1 passed" in unset, unset[-2000:]
    assert off_rc == 1 and "TRITON_INTERPRET is '0'" in off, off[-2000:]
    assert "was set after packkit.kernels was imported (it was unset then)" in late_out, late_out


# -- the compiled path, checked without a GPU: the kernels compile for sm_90 --

RESOURCES = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "kernel_resources.py")


@pytest.mark.slow
def test_fixed_configs_compile_for_sm90_without_spills():
    """The interpreter does not type-check the kernels
    (the binary search's loop-carried scalars, the flat grid's int32 arithmetic), so compile them for
    sm_90 through Triton and its ptxas, in a process without TRITON_INTERPRET, at the largest head dim:
    every fixed half-precision config (what PACKKIT_TRITON_AUTOTUNE=0 and the GPU tests launch)
    compiles within the shared-memory estimate the autotuner prunes with, and with Triton 3.6 (the
    release the configs were chosen with: benchmarks/kernel_resources.py) spills no register; other
    releases allocate registers differently, so there the spills are printed, not asserted. Needs no
    GPU. Skips, saying so, if this Triton's internal compile API differs or it has no ptxas."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, RESOURCES, "--fixed", "--head-dims", "128", "--dtype-class", "half"],
                         env=env, capture_output=True, text=True, timeout=600)
    last = (run.stderr.strip().splitlines() or [""])[-1]
    if run.returncode == 2 and "ptxas" in last:
        pytest.skip(last)
    if run.returncode != 0 and last.startswith(("ImportError", "ModuleNotFoundError", "AttributeError", "KeyError")):
        pytest.skip(f"this Triton's internal compile API differs: {last}")
    assert run.returncode == 0, run.stderr[-3000:]
    print(run.stdout)
    report = json.loads(run.stdout.strip().splitlines()[-1])
    rows = report["rows"]
    assert {(r["kernel"], r["dtype_class"]) for r in rows} == {k for k in flash_varlen.FIXED_CONFIGS if k[1] == "half"}
    for r in rows:
        assert r["shared"] <= r["shared_estimate"], r
        if report["triton"].startswith("3.6."):
            assert r["spill_bytes"] == 0, f"{r['kernel']} {r['config']} spills {r['spill_bytes']} B"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (65,536 segments are too slow for the interpreter)")
@pytest.mark.parametrize("known", [False, True], ids=["counted-on-device", "num_segments"])
def test_static_shape_batch_of_65536_segments_on_cuda(known):
    """On the GPU: a static-shape batch of 16 x 4096 tokens with cu_seqlens padded to
    max_segments = 65,536 (the collator's default B * W) launches, forward and backward, and matches
    the reference; before, segments sat on grid axis 1 (CUDA's limit 65,535) and the launch failed.
    Without num_segments the padding segments are counted on the device and their programs return
    before the binary search; with it they are cut off on the host."""
    gen = torch.Generator().manual_seed(7)
    lengths = []
    while sum(lengths) < 16 * 4096 - 600:
        lengths.append(int(torch.randint(1, 600, (1,), generator=gen)))
    lengths.append(16 * 4096 - sum(lengths))
    real = len(lengths)
    lengths += [0] * (16 * 4096 - len(lengths))  # static-shape padding: repeated last offset
    assert len(lengths) == 65_536
    check_bf16_against_float64(lengths, 4, 2, 64, causal=True, num_segments=real if known else None)
