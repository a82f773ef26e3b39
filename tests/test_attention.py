"""``packkit.attention.varlen_attention``: every backend against a float64 reference, document
isolation (hypothesis), backend dispatch, input checks, and a torch.compile smoke test.

Backends that need CUDA (flash-attn, torch's varlen_attn, the compiled Triton kernels) run in the
"cuda" cases and skip, with the reason, elsewhere. Triton on the CPU runs under ``TRITON_INTERPRET=1``,
set below before packkit.kernels can be imported (Triton reads it when the kernels are defined); where
it could not take effect and there is no CUDA device, the Triton CPU cases fail naming the cause
rather than skip (tests/test_kernels_flash_varlen.py explains the cases).
"""

import contextlib
import importlib.util
import math
import os

import pytest
import torch
from attention_testlib import (
    TOLERANCES,
    assert_close,
    attention_ref,
    check_against_float64,
    cu_seqlens_of,
    fake_flash_attn_varlen_func,
    fake_varlen_attn,
    random_qkv,
)
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before packkit.kernels is imported: see above

from packkit import attention  # noqa: E402
from packkit.attention import BackendUnavailableError, use_kernel, varlen_attention  # noqa: E402

LENGTHS = [1, 17, 0, 97, 123]


CPU = ("cpu",)  # a stand-in registered with use_kernel(..., devices=CPU) runs on CPU tensors


def skip_if_unavailable(backend, q, k, v):
    """Skip, with the reason, a backend that cannot run here; but fail the Triton CPU cases on a machine
    without CUDA (the interpreter is the only way these kernels get tested there)."""
    problem = attention.backend_problems(q, k, v)[backend]
    if problem is None:
        return
    if backend == "triton" and q.device.type == "cpu" and not torch.cuda.is_available() \
            and importlib.util.find_spec("triton") is not None:
        pytest.fail(f"no CUDA device and the Triton interpreter is off, so the Triton backend would go "
                    f"untested: {problem}")
    pytest.skip(f"backend {backend!r} cannot run here: {problem}")


# (device, backend, dtype) for every backend and the dtypes it takes. The CPU rows run here; the
# CUDA rows run on a GPU machine (benchmarks/gpu_check.sh) and skip elsewhere. Triton on the CPU (its
# interpreter) is tested through this same function in tests/test_kernels_flash_varlen.py.
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
BACKEND_CASES = [
    pytest.param("cpu", "reference", torch.float64, id="cpu-reference-float64"),
    pytest.param("cpu", "reference", torch.float32, id="cpu-reference-float32"),
    pytest.param("cpu", "reference", torch.bfloat16, id="cpu-reference-bfloat16"),
    *[pytest.param("cuda", b, dt, id=f"cuda-{b}-{str(dt)[6:]}", marks=CUDA)
      for b in ("flash_attn", "torch", "triton", "reference") for dt in (torch.float16, torch.bfloat16)],
    pytest.param("cuda", "triton", torch.float32, id="cuda-triton-float32", marks=CUDA),
]


@pytest.mark.parametrize("device,backend,dtype", BACKEND_CASES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_backend_matches_float64(device, backend, dtype, causal):
    q, k, v = random_qkv(LENGTHS, 2, 1, 32, dtype, device)
    skip_if_unavailable(backend, q, k, v)
    check_against_float64(
        lambda q, k, v, cu: varlen_attention(q, k, v, cu, max(LENGTHS), causal=causal, backend=backend),
        LENGTHS, 2, 1, 32, dtype, device, causal)


# -- isolation: no token sees another document, in values or in gradients --

segment_lengths = st.lists(st.integers(min_value=0, max_value=24), min_size=2, max_size=5).filter(
    lambda ls: sum(1 for n in ls if n > 0) >= 2)


@st.composite
def isolation_cases(draw):
    """Segment lengths (at least two documents, empty segments allowed), causal or not, the document
    whose tokens are perturbed and the one whose output is differentiated (indices into ``lengths``)."""
    lengths = draw(segment_lengths)
    nonempty = [i for i, n in enumerate(lengths) if n > 0]
    return dict(lengths=lengths, causal=draw(st.booleans(), label="causal"),
                perturbed=draw(st.sampled_from(nonempty), label="perturbed document"),
                differentiated=draw(st.sampled_from(nonempty), label="document whose output is differentiated"))


def inputs_reached(length, causal):
    """Which of q, k, v a document's output depends on, hence where its gradient must be non-zero.

    Always ``v``. ``q`` and ``k`` only when the document has two tokens or more: a one-token document's
    softmax has a single key, its output is ``v`` exactly, and ``dq``, ``dk`` are exactly zero (before the
    fix, this check demanded ``dq != 0`` and failed on ``lengths=[1, 1]``, a correct backend). With two
    tokens or more the last query sees two keys, under causal attention as under full.
    """
    return "qkv" if length >= 2 else "v"


def check_isolation(backend, device, dtype, lengths, causal, perturbed, differentiated, attend=None,
                    heads=(4, 2, 32)):
    """Perturb one document's q/k/v: every other document's output is bit-identical, and that document's
    output changes. Then the gradient of one document's output with respect to every other document's
    q/k/v is exactly zero, and it is non-zero on that document's own inputs that its output depends on
    (:func:`inputs_reached`). ``attend`` replaces ``varlen_attention`` (tests that this check can fail);
    ``heads`` is (nheads, nheads_kv, headdim)."""
    q, k, v = random_qkv(lengths, *heads, dtype, device, seed=len(lengths))
    if attend is None:
        skip_if_unavailable(backend, q, k, v)
        attend = varlen_attention
    cu = cu_seqlens_of(lengths, device)
    offsets = cu.tolist()
    gen = torch.Generator().manual_seed(sum(lengths))  # not the global RNG: a failure replays exactly
    run = lambda q_, k_, v_: attend(q_, k_, v_, cu, max(lengths), causal=causal, backend=backend)  # noqa: E731

    # -- values: perturb document j --
    j = perturbed
    inside_j = torch.zeros(sum(lengths), dtype=torch.bool, device=device)
    inside_j[offsets[j]:offsets[j + 1]] = True
    out = run(q, k, v)
    noisy = [t.clone() for t in (q, k, v)]
    for t in noisy:
        t[inside_j] = torch.randn(t[inside_j].shape, generator=gen).to(t) * 3
    out_noisy = run(*noisy)
    assert torch.equal(out[~inside_j], out_noisy[~inside_j]), "another document's output changed"
    assert not torch.equal(out[inside_j], out_noisy[inside_j]), "the perturbation did not reach its document"

    # -- gradients: of document i's output, with respect to everything --
    i = differentiated
    inside_i = torch.zeros(sum(lengths), dtype=torch.bool, device=device)
    inside_i[offsets[i]:offsets[i + 1]] = True
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = run(*leaves)
    weights = torch.randn(out[inside_i].shape, generator=gen).to(device)
    (out[inside_i].float() * weights).sum().backward()
    for name, leaf in zip("qkv", leaves):
        grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)  # None: the input was not used
        assert torch.count_nonzero(grad[~inside_i]) == 0, f"d out[doc {i}] / d {name}[other docs] != 0"
        if name in inputs_reached(lengths[i], causal):
            assert torch.count_nonzero(grad[inside_i]) > 0, \
                f"gradient did not reach document {i} ({lengths[i]} tokens) through {name}"


ISOLATION_CASES = [
    pytest.param("reference", "cpu", torch.float32, id="cpu-reference"),
    *[pytest.param(b, "cuda", torch.bfloat16, id=f"cuda-{b}", marks=CUDA)
      for b in ("flash_attn", "torch", "triton", "reference")],
]

# One-token documents (their dq and dk are exactly zero), under causal and full attention: before the fix
# the isolation check demanded dq != 0 and failed a correct backend on them.
ONE_TOKEN_DOCUMENTS = [dict(lengths=[1, 1], causal=c, perturbed=0, differentiated=1) for c in (True, False)]


@pytest.mark.parametrize("backend,device,dtype", ISOLATION_CASES)
@given(case=isolation_cases())
@example(case=ONE_TOKEN_DOCUMENTS[0])
@example(case=ONE_TOKEN_DOCUMENTS[1])
def test_isolation(backend, device, dtype, case):
    check_isolation(backend, device, dtype, **case)


@pytest.mark.slow
@settings(max_examples=5)  # each example runs the Triton interpreter four times, about 0.5 s each
@given(case=isolation_cases())
@example(case=ONE_TOKEN_DOCUMENTS[0])
def test_isolation_triton_interpreter(case):
    """The interpreter's cost is its number of programs (heads x blocks): two query heads over one kv
    head (GQA, so a document could leak through a shared kv head) at d=16; five drawn cases under
    ``ci`` (``make test-thorough``: 50), the reference backend takes the long search (test_isolation)."""
    check_isolation("triton", "cpu", torch.float32, **case, heads=(2, 1, 16))


def _attention_over_the_whole_pack(q, k, v, cu_seqlens, max_seqlen, causal, backend):
    """A broken backend: ignores the document boundaries (one segment holding every token)."""
    whole = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    return attention.reference_varlen_attention(q, k, v, whole, q.shape[0], causal=causal)


def _attention_without_dq(q, k, v, cu_seqlens, max_seqlen, causal, backend):
    """A broken backend: right values, but no gradient flows back to q."""
    return attention.reference_varlen_attention(q.detach(), k, v, cu_seqlens, max_seqlen, causal=causal)


@pytest.mark.parametrize("attend, message", [
    (_attention_over_the_whole_pack, "another document's output changed|d out.doc .*other docs. != 0"),
    (_attention_without_dq, "gradient did not reach document .* through q"),
], ids=["leaks-across-documents", "drops-dq"])
def test_isolation_check_catches_broken_backends(attend, message):
    """The isolation property can fail: hypothesis, searching as test_isolation does, finds a
    counterexample for a backend that attends across documents and for one whose q gets no gradient."""
    @settings(max_examples=100, derandomize=True, database=None, phases=[Phase.generate])  # no shrinking
    @given(case=isolation_cases())
    def isolation(case):
        check_isolation("broken", "cpu", torch.float32, **case, attend=attend)

    with pytest.raises(AssertionError, match=message):
        isolation()


# -- dispatch --

def _cpu_qkv(dtype=torch.float32):
    return random_qkv([3, 0, 4], 4, 2, 16, dtype, "cpu")


def test_auto_picks_the_reference_on_cpu():
    """Even with TRITON_INTERPRET=1 set: the interpreter is for tests, not for "auto"."""
    q, k, v = _cpu_qkv()
    assert attention.select_backend(q, k, v) == "reference"
    out = varlen_attention(q, k, v, cu_seqlens_of([3, 0, 4]), 4)
    ref = attention.reference_varlen_attention(q, k, v, cu_seqlens_of([3, 0, 4]), 4)
    assert torch.equal(out, ref)


@pytest.mark.parametrize(
    "available, expected",
    [
        ({"flash_attn", "torch", "triton", "reference"}, "flash_attn"),
        ({"torch", "triton", "reference"}, "torch"),
        ({"triton", "reference"}, "triton"),
        ({"reference"}, "reference"),
    ],
)
def test_auto_takes_the_first_available_backend(monkeypatch, available, expected):
    """The order of backend="auto" over a table of which backends can run (the table is patched: no
    machine has every combination)."""
    q, k, v = _cpu_qkv()
    monkeypatch.setattr(attention, "_on_cuda", lambda t: True)
    for name in attention.BACKENDS:
        problem = None if name in available else f"{name} is off in this test"
        monkeypatch.setitem(attention._PROBLEMS, name, lambda q, k, v, problem=problem: problem)
    assert attention.select_backend(q, k, v) == expected


@pytest.mark.parametrize("stand_ins, expected", [(("flash_attn", "torch"), "flash_attn"), (("torch",), "torch"),
                                                 ((), "reference")], ids=["both", "torch-only", "none"])
def test_auto_prefers_the_varlen_kernels_it_can_run(stand_ins, expected):
    """The same order through the public seam: stand-ins registered for CPU tensors are picked, first
    flash-attn, then torch's varlen_attn; without them the CPU gets the reference."""
    q, k, v = _cpu_qkv(torch.bfloat16)
    with contextlib.ExitStack() as stack:
        for name in stand_ins:
            fake = fake_flash_attn_varlen_func([]) if name == "flash_attn" else fake_varlen_attn([])
            stack.enter_context(use_kernel(name, fake, devices=CPU))
        assert attention.select_backend(q, k, v) == expected
    assert attention.select_backend(q, k, v) == "reference"  # and the stand-ins are gone after the block


def test_auto_skips_triton_on_cpu():
    """The Triton kernels can run here (under the interpreter: no problem reported), yet auto skips them."""
    q, k, v = _cpu_qkv()
    problem = attention.backend_problems(q, k, v)["triton"]
    if problem is not None:
        pytest.skip(f"the Triton kernels cannot run here: {problem}")
    assert attention.select_backend(q, k, v) == "reference"


def test_forcing_flash_attn_when_not_installed():
    if attention.kernel("flash_attn")[0] is not None:
        pytest.skip("flash-attn is installed here")
    q, k, v = _cpu_qkv(torch.bfloat16)
    with pytest.raises(BackendUnavailableError, match="not installed"):
        varlen_attention(q, k, v, cu_seqlens_of([3, 0, 4]), 4, backend="flash_attn")


def stand_in(backend, calls=None, **options):
    """A fake of ``backend``'s library function (see attention_testlib), recording into ``calls``."""
    calls = [] if calls is None else calls
    return fake_flash_attn_varlen_func(calls) if backend == "flash_attn" else fake_varlen_attn(calls, **options)


@pytest.mark.parametrize("backend", ["flash_attn", "torch"])
def test_forcing_a_cuda_backend_on_cpu(backend):
    q, k, v = _cpu_qkv(torch.bfloat16)
    with use_kernel(backend, stand_in(backend)), pytest.raises(BackendUnavailableError, match="needs CUDA"):
        varlen_attention(q, k, v, cu_seqlens_of([3, 0, 4]), 4, backend=backend)


@pytest.mark.parametrize("backend", ["flash_attn", "torch"])
def test_forcing_a_half_precision_backend_with_fp32(backend):
    q, k, v = _cpu_qkv(torch.float32)
    with use_kernel(backend, stand_in(backend), devices=CPU), \
            pytest.raises(BackendUnavailableError, match="float16 or bfloat16"):
        varlen_attention(q, k, v, cu_seqlens_of([3, 0, 4]), 4, backend=backend)


def test_use_kernel_restores_what_was_there():
    """use_kernel swaps a function for one block, errors included, and gives back what was registered
    before it (nested blocks unwind in order); a wrong name or devices is refused, naming the choices."""
    q, k, v = _cpu_qkv(torch.bfloat16)
    outer, inner = [], []
    outer_fn, inner_fn = fake_varlen_attn(outer), fake_varlen_attn(inner)
    with use_kernel("torch", outer_fn, devices=CPU):
        with pytest.raises(RuntimeError, match="inside"), use_kernel("torch", inner_fn, devices=CPU):
            assert attention.kernel("torch") == (inner_fn, None)
            varlen_attention(q, k, v, cu_seqlens_of([3, 0, 4]), 4, backend="torch")
            raise RuntimeError("inside")
        assert attention.kernel("torch") == (outer_fn, None)
        varlen_attention(q, k, v, cu_seqlens_of([3, 0, 4]), 4, backend="torch")
    assert [c["cu"] for c in inner][-1:] == [c["cu"] for c in outer][-1:] == [[0, 3, 7]]
    assert len(outer) == 3 and len(inner) == 3  # each: the grouped-heads probe (2 calls), then the call
    assert attention.kernel("torch")[0] is not outer_fn and attention.select_backend(q, k, v) == "reference"
    with pytest.raises(ValueError, match="one of \\('flash_attn', 'torch'\\)"):
        attention.register_kernel("triton", fake_varlen_attn([]))
    with pytest.raises(TypeError, match="tuple of device types"):
        attention.register_kernel("torch", fake_varlen_attn([]), devices="cpu")


def test_forcing_triton_without_the_interpreter_on_cpu(monkeypatch):
    kernels = pytest.importorskip("packkit.kernels.flash_varlen", reason="triton is not installed")
    monkeypatch.setattr(kernels, "interpreted", lambda: False)
    q, k, v = _cpu_qkv()
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):
        varlen_attention(q, k, v, cu_seqlens_of([3, 0, 4]), 4, backend="triton")


def test_unknown_backend():
    q, k, v = _cpu_qkv()
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        varlen_attention(q, k, v, cu_seqlens_of([3, 0, 4]), 4, backend="flash")


def test_flash_attn_never_sees_empty_segments():
    """Regression guard for Dao-AILab/flash-attention#1537 (empty segments with max_seqlen == 1):
    static-shape padding repeats offsets, so packkit compacts cu_seqlens before calling flash-attn."""
    calls = []
    lengths = [1, 0, 1, 1, 0, 0]
    q, k, v = random_qkv(lengths, 4, 2, 16, torch.bfloat16, "cpu")
    cu = cu_seqlens_of(lengths)
    with use_kernel("flash_attn", fake_flash_attn_varlen_func(calls), devices=CPU):
        assert attention.select_backend(q, k, v) == "flash_attn"
        out = varlen_attention(q, k, v, cu, 1)
    assert calls == [[0, 1, 2, 3]]
    assert torch.equal(out, attention.reference_varlen_attention(q, k, v, cu, 1))


def test_torch_varlen_attn_call():
    """torch 2.13's signature: causal is window_size=(-1, 0), GQA through enable_gqa (k, v keep their 2
    heads: not repeated), no empty segment."""
    calls = []
    q, k, v = _cpu_qkv(torch.bfloat16)
    cu = cu_seqlens_of([3, 0, 4])
    with use_kernel("torch", fake_varlen_attn(calls, release="2.13"), devices=CPU):
        for causal in (True, False):
            out = varlen_attention(q, k, v, cu, 4, causal=causal, scale=0.5, backend="torch")
            ref = attention.reference_varlen_attention(q, k, v, cu, 4, causal=causal, scale=0.5)
            assert torch.equal(out, ref)
    assert calls == [dict(kv_heads=2, cu=[0, 3, 7], window_size=(-1, 0), enable_gqa=True, scale=0.5),
                     dict(kv_heads=2, cu=[0, 3, 7], window_size=(-1, -1), enable_gqa=True, scale=0.5)]


def kv_heads(calls):
    return [c["kv_heads"] for c in calls]


def test_torch_2_11_signature_with_grouped_heads():
    """torch 2.11's varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux, scale,
    window_size) has no enable_gqa, and its kernel takes grouped k, v: the probe finds that once, and
    every call after passes k, v with their own heads (no repeat, which would slow the baseline)."""
    calls = []
    q, k, v = _cpu_qkv(torch.bfloat16)
    cu = cu_seqlens_of([3, 0, 4])
    with use_kernel("torch", fake_varlen_attn(calls), devices=CPU):
        for _ in range(3):
            out = varlen_attention(q, k, v, cu, 4, backend="torch")
            assert torch.equal(out, attention.reference_varlen_attention(q, k, v, cu, 4))
        plan = attention.torch_varlen_call(q)
    assert plan.gqa == "native" and plan.causal_arg == "window_size" and plan.takes_scale
    assert "window_size" in plan.signature and "enable_gqa" not in plan.signature
    assert kv_heads(calls)[:2] == [1, 2]  # the probe: grouped, then repeated (once)
    assert kv_heads(calls)[2:] == [2, 2, 2]  # then the three calls: k, v with their 2 heads, never repeated to 4


@pytest.mark.parametrize("first_call_mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_probe_under_no_grad_or_inference_mode_still_finds_grouped_heads(first_call_mode):
    """Regression (the grouped-heads probe under no_grad / inference_mode): the probe differentiates a tiny
    call; when the first torch-backend call ran under torch.no_grad() or torch.inference_mode(), its
    backward raised, the probe answered False and torch_varlen_call cached gqa="repeat" for good, so every
    later training call repeated k and v. The probe now enables grad itself: the plan is "native"."""
    calls = []
    q, k, v = _cpu_qkv(torch.bfloat16)
    cu = cu_seqlens_of([3, 0, 4])
    with use_kernel("torch", fake_varlen_attn(calls), devices=CPU):  # torch 2.11's signature: no enable_gqa
        with first_call_mode():
            out = varlen_attention(q, k, v, cu, 4, backend="torch")
        assert torch.equal(out, attention.reference_varlen_attention(q, k, v, cu, 4))
        assert attention.torch_varlen_call(q).gqa == "native"
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        varlen_attention(*leaves, cu, 4, backend="torch").float().sum().backward()  # a training call after
    assert kv_heads(calls) == [1, 2, 2, 2]  # probe (grouped, repeated), then both calls with k, v's own 2 heads


def test_no_probe_inside_a_graph_and_nothing_cached(monkeypatch):
    """While torch.compile traces or a CUDA graph is captured (_graph_unfriendly), the probe's tiny
    launches and backward would spoil the graph: k, v are repeated for that call and no plan is cached,
    so the next eager call probes and passes grouped heads."""
    calls = []
    lengths = [3, 4, 0]  # static-shape padding: inside a graph num_segments is needed anyway
    q, k, v = random_qkv(lengths, 4, 2, 16, torch.bfloat16, "cpu")
    cu = cu_seqlens_of(lengths)
    with use_kernel("torch", fake_varlen_attn(calls), devices=CPU):
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # as while torch.compile traces
        varlen_attention(q, k, v, cu, 4, backend="torch", num_segments=2)
        assert kv_heads(calls) == [4]  # repeated to q's 4 heads, no probe
        monkeypatch.undo()
        varlen_attention(q, k, v, cu, 4, backend="torch")  # no plan was kept: this eager call probes
        assert kv_heads(calls) == [4, 1, 2, 2] and attention.torch_varlen_call(q).gqa == "native"


def test_torch_varlen_attn_older_signature():
    """A release with is_causal and without enable_gqa / scale, whose kernel refuses grouped k, v:
    the probe finds that once, then k, v are repeated and q pre-scaled."""
    calls = []
    q, k, v = (t.to(torch.float16) for t in _cpu_qkv(torch.float32))
    cu = cu_seqlens_of([3, 0, 4])
    with use_kernel("torch", fake_varlen_attn(calls, release="2.10"), devices=CPU):
        out = varlen_attention(q, k, v, cu, 4, scale=0.1, backend="torch")
    assert calls[-1] == dict(kv_heads=4, cu=[0, 3, 7], is_causal=True)  # repeated to q's 4 heads
    ref, _ = attention_ref(q, k, v, cu, True, 0.1)
    assert_close("out", out, ref, *TOLERANCES[torch.float16]["fwd"])


# -- input checks --

@pytest.mark.parametrize(
    "cu, max_seqlen, error, message",
    [
        ([0, 3, 7], torch.tensor(4), TypeError, "Python int"),
        ([0, 3, 7], 3, ValueError, "max_seqlen=3 is below the longest segment"),
        ([0, 3, 6], 4, ValueError, "must equal total_tokens=7"),
        ([1, 3, 7], 4, ValueError, "start at 0"),
        ([0, 5, 3, 7], 4, ValueError, "non-decreasing"),
    ],
    ids=["tensor-max-seqlen", "max-seqlen-too-small", "cu-end", "cu-start", "cu-decreasing"],
)
def test_bad_input_is_named(cu, max_seqlen, error, message):
    q, k, v = _cpu_qkv()
    with pytest.raises(error, match=message):
        varlen_attention(q, k, v, torch.tensor(cu, dtype=torch.int32), max_seqlen)


def test_bad_shapes_and_dtypes():
    q, k, v = _cpu_qkv()
    cu = cu_seqlens_of([3, 0, 4])
    with pytest.raises(ValueError, match="int32"):
        varlen_attention(q, k, v, cu.long(), 4)
    with pytest.raises(ValueError, match="multiple of nheads_kv"):
        varlen_attention(q[:, :3], k, v, cu, 4)
    with pytest.raises(TypeError, match="share a dtype"):
        varlen_attention(q, k.double(), v, cu, 4)


def test_no_tokens():
    q, k, v = (t[:0] for t in _cpu_qkv())
    out = varlen_attention(q, k, v, torch.tensor([0, 0], dtype=torch.int32), 0)
    assert out.shape == (0, 4, 16)


# -- torch.compile --

# Inductor needs a minute of C++ compilation on a 2-core CI box; aot_eager still runs dynamo and AOT
# autograd (the parts that break on graph-unfriendly code). PACKKIT_COMPILE_BACKEND=inductor for the full path.
COMPILE_BACKEND = os.environ.get("PACKKIT_COMPILE_BACKEND", "aot_eager")


@pytest.mark.slow
def test_torch_compile_smoke():
    """The public function under torch.compile on the CPU path (the reference backend): same values
    and gradients as eager. The reference reads cu_seqlens on the host, so dynamo breaks the graph
    there; that is expected of the reference, and the Triton op compiles in one graph
    (tests/test_kernels_flash_varlen.py)."""
    torch._dynamo.reset()
    lengths = [5, 0, 11]
    cu = cu_seqlens_of(lengths)
    base = random_qkv(lengths, 4, 2, 16, torch.float32, "cpu")

    def step(q, k, v):
        return varlen_attention(q, k, v, cu, 11).square().sum()

    results = []
    for fn in (step, torch.compile(step, backend=COMPILE_BACKEND)):
        q, k, v = (t.clone().requires_grad_() for t in base)
        loss = fn(q, k, v)
        loss.backward()
        results.append((loss, q.grad, k.grad, v.grad))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


# -- num_segments: no compaction (sync, data-dependent shape) when the segment count is known --

def _no_compaction(cu):
    raise AssertionError("compact_cu_seqlens ran although num_segments was given")


@pytest.mark.parametrize("backend", ["flash_attn", "torch"])
def test_num_segments_slices_without_compacting(monkeypatch, backend):
    """Before the fix, every call compacted cu_seqlens, even with the count known. With a host-side num_segments, the flash_attn / torch backends get
    cu_seqlens[:num_segments + 1] (a view, no sync, no data-dependent shape) and compact_cu_seqlens
    (unique_consecutive) never runs; the static-shape padding still never reaches the kernel."""
    calls = []
    monkeypatch.setattr(attention, "compact_cu_seqlens", _no_compaction)
    lengths = [3, 5, 2, 0, 0, 0]  # three real segments, then static-shape padding
    q, k, v = random_qkv(lengths, 4, 2, 16, torch.bfloat16, "cpu")
    cu = cu_seqlens_of(lengths)
    with use_kernel(backend, stand_in(backend, calls, release="2.13"), devices=CPU):
        out = varlen_attention(q, k, v, cu, 5, backend=backend, num_segments=3)
    assert [c if backend == "flash_attn" else c["cu"] for c in calls] == [[0, 3, 8, 10]]
    assert torch.equal(out, attention.reference_varlen_attention(q, k, v, cu, 5))


def test_without_num_segments_compaction_is_refused_inside_a_graph(monkeypatch):
    """On a GPU under torch.compile / CUDA-graph capture, with no num_segments,
    varlen_attention refuses to compact (it would sync and give a data-dependent shape) and names
    the fix, rather than breaking the graph (a sync, before the fix) or letting empty segments reach flash-attn (#1537)."""
    calls = []
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # as while torch.compile traces
    lengths = [3, 5, 0]
    q, k, v = random_qkv(lengths, 4, 2, 16, torch.bfloat16, "cpu")
    with use_kernel("flash_attn", fake_flash_attn_varlen_func(calls), devices=CPU):
        with pytest.raises(ValueError, match="num_segments="):
            varlen_attention(q, k, v, cu_seqlens_of(lengths), 5)
        assert calls == []
        out = varlen_attention(q, k, v, cu_seqlens_of(lengths), 5, num_segments=2)  # the fix works there
    assert calls == [[0, 3, 8]] and out.shape == q.shape


def test_without_num_segments_eager_still_compacts():
    """Eager mode with no num_segments keeps the #1537 guard by compacting."""
    calls = []
    lengths = [3, 0, 5, 0]
    q, k, v = random_qkv(lengths, 4, 2, 16, torch.bfloat16, "cpu")
    with use_kernel("flash_attn", fake_flash_attn_varlen_func(calls), devices=CPU):
        varlen_attention(q, k, v, cu_seqlens_of(lengths), 5)
    assert calls == [[0, 3, 8]]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_num_segments_on_the_other_backends(backend):
    """num_segments is honoured (same result) by the reference and Triton backends."""
    lengths = [4, 9, 1, 0, 0]
    q, k, v = random_qkv(lengths, 2, 1, 16, torch.float32, "cpu")
    skip_if_unavailable(backend, q, k, v)
    cu = cu_seqlens_of(lengths)
    out = varlen_attention(q, k, v, cu, 9, backend=backend, num_segments=3)
    ref, _ = attention_ref(q, k, v, cu, True, 1 / math.sqrt(16))
    assert_close("out", out, ref, *TOLERANCES[torch.float32]["fwd"])


@pytest.mark.parametrize(
    "lengths, num_segments, error, message",
    [
        ([3, 0, 4], 3, ValueError, "segment 1, which is empty"),
        ([3, 4, 0], 1, ValueError, "leaves out non-empty segments"),
        ([3, 4, 0], 4, ValueError, r"must be in \[0, 3\]"),
        ([3, 4, 0], -1, ValueError, r"must be in \[0, 3\]"),
        ([3, 4, 0], torch.tensor(2), TypeError, "Python int"),
        ([3, 4, 0], True, TypeError, "Python int"),
    ],
    ids=["counts-an-empty", "too-few", "too-many", "negative", "tensor", "bool"],
)
def test_bad_num_segments_is_named(lengths, num_segments, error, message):
    """A wrong num_segments is refused with the fix, never silently used."""
    q, k, v = random_qkv(lengths, 2, 1, 16, torch.float32, "cpu")
    with pytest.raises(error, match=message):
        varlen_attention(q, k, v, cu_seqlens_of(lengths), 4, num_segments=num_segments)


@pytest.mark.slow
def test_num_segments_compiles_in_one_graph():
    """With num_segments the static-shape path needs no sync and no data-dependent
    shape, so varlen_attention (Triton backend, here under the interpreter) compiles with
    fullgraph=True and matches eager. (The first call is eager: it imports the backend, which a
    traced first call cannot.)"""
    lengths = [3, 5, 0, 0, 0]
    q, k, v = random_qkv(lengths, 2, 1, 16, torch.float32, "cpu")
    skip_if_unavailable("triton", q, k, v)
    torch._dynamo.reset()
    cu = cu_seqlens_of(lengths)

    def step(q, k, v):
        return varlen_attention(q, k, v, cu, 5, backend="triton", num_segments=2)

    eager = step(q, k, v)
    compiled = torch.compile(step, backend=COMPILE_BACKEND, fullgraph=True)(q, k, v)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
