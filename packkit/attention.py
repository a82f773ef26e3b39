"""Attention that stays inside each packed document: ``varlen_attention`` and its backends.

A packed row holds several documents back to back; ``cu_seqlens`` marks where each one starts. For
``cu_seqlens = [0, 3, 5]`` (documents of 3 and 2 tokens) the causal mask every backend applies is::

    key ->   0 1 2 3 4
    query 0  x . . . .
    query 1  x x . . .
    query 2  x x x . .
    query 3  . . . x .
    query 4  . . . x x

Backends, in the order ``backend="auto"`` tries them (each only where it can run):

1. ``"flash_attn"``: flash-attn's ``flash_attn_varlen_func`` (CUDA, fp16/bf16, when installed).
2. ``"torch"``: PyTorch's ``torch.nn.attention.varlen.varlen_attn`` (CUDA, fp16/bf16, torch >= 2.10),
   called as :func:`torch_varlen_call` decides once per function and device (grouped heads passed as
   they are when the op takes them, without repeating k and v).
3. ``"triton"``: packkit's Triton kernels (``packkit.kernels.flash_varlen``); CUDA, fp16/bf16/fp32.
   On the CPU they run only under ``TRITON_INTERPRET=1`` (for tests), so "auto" does not pick them there.
4. ``"reference"``: per-document ``scaled_dot_product_attention``; any device, any float dtype; slow.

Forcing a backend that cannot run raises :class:`BackendUnavailableError` saying why.

The library functions behind ``"flash_attn"`` and ``"torch"`` can be swapped for a stand-in with the
same signature (:func:`register_kernel`, or :func:`use_kernel` for one block): the benchmarks' CPU
smoke runs and the tests run packkit's whole call path on the CPU that way, e.g.::

    with use_kernel("torch", my_varlen_attn, devices=("cpu",)):
        varlen_attention(q, k, v, cu_seqlens, max_seqlen, backend="torch")   # calls my_varlen_attn

Empty segments (static-shape padding of ``cu_seqlens``) never reach flash-attn or torch's varlen_attn
(flash-attention#1537). Pass ``num_segments`` (a Python int from the collator) and they are sliced
off with no GPU sync, which keeps ``torch.compile`` graphs whole; without it they are dropped by
reading ``cu_seqlens`` (a sync on a GPU; refused inside a compiled or captured graph). The Triton
kernels need neither: without ``num_segments`` they count the live segments on the device (one
searchsorted in the forward, kept for the backward; with it, nothing is counted).

Hugging Face models reach the varlen backends through :func:`register_hf_attention` (an attention
function reading the packed batch's ``cu_seq_lens_q``; see ``PackedBatch.hf_kwargs``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

# Shape checks shared with the Triton launcher; varlen_layout imports torch only (no triton).
from packkit.kernels.varlen_layout import check_num_segments, check_varlen_shapes

from .integrations import transformers as hf  # transformers' attention call, read in one place

BACKENDS = ("flash_attn", "torch", "triton", "reference")
_HALF_DTYPES = (torch.float16, torch.bfloat16)


class BackendUnavailableError(RuntimeError):
    """A forced attention backend cannot run on these inputs (not installed, no CUDA, dtype...)."""


# -- small pure helpers --

def compact_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Drop zero-length segments: ``[0, 3, 3, 5, 5] -> [0, 3, 5]``.

    flash-attn's varlen kernels mishandle empty segments (Dao-AILab/flash-attention#1537), and the
    static-shape padding of ``cu_seqlens`` (repeating the last offset) produces them. Attention over
    the remaining segments is unchanged. The output's length depends on the values: on a GPU this
    reads them back (one synchronisation) and it cannot live in a CUDA graph or a compiled graph;
    :func:`varlen_attention` avoids it when given ``num_segments``.
    """
    return torch.unique_consecutive(cu_seqlens)


def _graph_unfriendly() -> bool:
    """True while torch.compile traces or a CUDA graph is being captured: no sync, no data-dependent shape."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _nonempty_cu_seqlens(cu_seqlens: torch.Tensor, *, sliced: bool) -> torch.Tensor:
    """cu_seqlens with no zero-length segment, for flash-attn / torch's varlen_attn (#1537 guard).

    ``sliced``: already cut to ``num_segments + 1`` entries (every kept segment is non-empty): returned
    as is, with no sync. Otherwise compacted: free on the CPU, one sync on a GPU in eager mode; under
    torch.compile or CUDA-graph capture that would break the graph, so it raises, naming the fix.
    """
    if sliced:
        return cu_seqlens
    # Only the CUDA kernels (or a stand-in for one) come here: the device is not asked.
    if _graph_unfriendly():
        raise ValueError(
            "varlen_attention needs num_segments=<Python int, the number of real (non-empty) segments> "
            "under torch.compile / CUDA graphs on the flash_attn and torch backends: without it packkit "
            "would have to read cu_seqlens back to drop empty segments (flash-attention#1537), a sync with "
            "a data-dependent shape. The collator knows the count (segments before the static-shape padding)")
    return compact_cu_seqlens(cu_seqlens)


def _on_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


_IMPORTS: dict[tuple[str, str | None], tuple[object, str | None]] = {}


def _import(module: str, attr: str | None = None):
    """(object, None) on success, (None, reason) when the import fails; cached either way so that
    "auto" does not retry a missing package on every call (a plain dict: torch.compile reads it)."""
    key = (module, attr)
    if key not in _IMPORTS:
        try:
            obj = importlib.import_module(module)
            _IMPORTS[key] = (getattr(obj, attr) if attr else obj), None
        except (ImportError, AttributeError) as err:
            _IMPORTS[key] = None, f"{type(err).__name__}: {err}"
    return _IMPORTS[key]


# -- the library functions behind the flash_attn and torch backends, and their stand-ins --

# backend -> (module, attribute) of the library function it calls.
KERNELS = {"flash_attn": ("flash_attn", "flash_attn_varlen_func"), "torch": ("torch.nn.attention.varlen", "varlen_attn")}

# backend -> (stand-in function, device types it runs on). A registry in the manner of transformers'
# AttentionInterface: process-wide by nature (a stand-in must reach every call, in any thread), empty
# unless a benchmark's smoke run or a test registers one. A plain dict: torch.compile reads it.
_STAND_INS: dict[str, tuple[Callable, tuple[str, ...]]] = {}


def _check_kernel_name(backend: str) -> None:
    if backend not in KERNELS:
        raise ValueError(f"backend {backend!r} calls no library function that a stand-in could replace; "
                         f"choose one of {tuple(KERNELS)}")


def register_kernel(backend: str, fn: Callable | None, *, devices: tuple[str, ...] = ("cuda",)) -> None:
    """From now on, ``backend`` ("flash_attn" or "torch") calls ``fn`` in place of its library function
    (``flash_attn_varlen_func`` / ``torch.nn.attention.varlen.varlen_attn``), on tensors of the device
    types ``devices``; ``fn=None`` gives the library's own back. ``fn`` takes the library function's
    signature (packkit reads it, as it reads the real one's: see :func:`torch_varlen_call`).

    ``register_kernel("torch", fake_varlen_attn, devices=("cpu",))`` -> the torch backend runs on CPU
    tensors through ``fake_varlen_attn``: every check and argument packkit passes, nothing measured.
    """
    _check_kernel_name(backend)
    if fn is None:
        _STAND_INS.pop(backend, None)
        return
    if isinstance(devices, str) or not devices or not all(isinstance(d, str) for d in devices):
        raise TypeError(f"devices must be a tuple of device types such as ('cpu',); got {devices!r}")
    _STAND_INS[backend] = fn, tuple(devices)


@contextlib.contextmanager
def use_kernel(backend: str, fn: Callable | None, *, devices: tuple[str, ...] = ("cuda",)) -> Iterator[None]:
    """:func:`register_kernel` for the block only: what was registered before (or the library's own
    function) comes back when it ends, errors included.

    ``with use_kernel("flash_attn", fake, devices=("cpu",)): varlen_attention(..., backend="flash_attn")``
    """
    _check_kernel_name(backend)
    before = _STAND_INS.get(backend)
    register_kernel(backend, fn, devices=devices)
    try:
        yield
    finally:
        if before is None:
            register_kernel(backend, None)
        else:
            register_kernel(backend, before[0], devices=before[1])


def kernel(backend: str) -> tuple[Callable | None, str | None]:
    """``(function, None)``: what ``backend`` ("flash_attn" or "torch") calls, its stand-in if one is
    registered, else the library's (imported on first use); ``(None, why)`` when it cannot be imported.

    ``kernel("flash_attn")`` on a machine without flash-attn -> ``(None, "ModuleNotFoundError: ...")``.
    """
    _check_kernel_name(backend)
    if backend in _STAND_INS:
        return _STAND_INS[backend][0], None
    return _import(*KERNELS[backend])


def _kernel_devices(backend: str) -> tuple[str, ...]:
    """The device types ``backend``'s function runs on: a stand-in's own, else CUDA's."""
    return _STAND_INS[backend][1] if backend in _STAND_INS else ("cuda",)


def _triton_kernels():
    """packkit.kernels.flash_varlen (imports triton); None without triton."""
    return _import("packkit.kernels.flash_varlen")


# -- availability: why a backend cannot run here, or None --

def _flash_attn_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    fn, err = kernel("flash_attn")
    if fn is None:
        return f"flash-attn is not installed ({err}); pip install 'packkit[flash]' on a CUDA machine"
    if q.device.type not in _kernel_devices("flash_attn"):
        return f"flash-attn needs CUDA tensors; q is on {q.device}"
    if q.dtype not in _HALF_DTYPES:
        return f"flash-attn takes float16 or bfloat16; got {q.dtype} (cast q, k, v, or use backend='triton')"
    if q.shape[-1] > 256:
        return f"flash-attn supports head dims up to 256; got {q.shape[-1]}"
    return None


def _torch_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    fn, err = kernel("torch")
    if fn is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (needs >= 2.10): {err}"
    if q.device.type not in _kernel_devices("torch"):
        return f"torch's varlen_attn needs CUDA tensors; q is on {q.device}"
    if q.dtype not in _HALF_DTYPES:
        return f"torch's varlen_attn takes float16 or bfloat16; got {q.dtype}"
    return None


def _triton_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    kernels, err = _triton_kernels()
    if kernels is None:
        return f"triton is not installed ({err}); pip install 'packkit[triton]'"
    return kernels.unsupported_reason(q, k, v)


def _reference_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    if not q.dtype.is_floating_point:
        return f"attention needs floating-point inputs; got {q.dtype}"
    return None


_PROBLEMS = {
    "flash_attn": _flash_attn_problem,
    "torch": _torch_problem,
    "triton": _triton_problem,
    "reference": _reference_problem,
}


def backend_problems(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, str | None]:
    """For each backend, why it cannot run on (q, k, v), or None if it can. Example on a CPU box
    without flash-attn: ``{"flash_attn": "flash-attn is not installed ...", ..., "reference": None}``."""
    return {name: _PROBLEMS[name](q, k, v) for name in BACKENDS}


def select_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backend: str = "auto") -> str:
    """The backend ``varlen_attention`` would use: the forced one, or the first that can run.

    Raises BackendUnavailableError when the forced backend cannot run, ValueError for an unknown name.
    """
    if backend != "auto":
        if backend not in _PROBLEMS:
            raise ValueError(f"unknown attention backend {backend!r}; choose 'auto' or one of {BACKENDS}")
        problem = _PROBLEMS[backend](q, k, v)
        if problem is not None:
            raise BackendUnavailableError(f"backend={backend!r} cannot run: {problem}")
        return backend
    for name in BACKENDS:
        # The CPU runs Triton only through its interpreter, which is for tests: auto skips it there.
        if name == "triton" and not _on_cuda(q):
            continue
        if _PROBLEMS[name](q, k, v) is None:
            return name
    raise BackendUnavailableError(f"no attention backend can run: {backend_problems(q, k, v)}")


# -- backends: each takes validated inputs and a resolved scale --

def reference_varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
    *, causal: bool = True, scale: float | None = None,
) -> torch.Tensor:
    """Per-document ``scaled_dot_product_attention``: exact, slow, obvious; runs anywhere.

    Shapes as in :func:`varlen_attention`. Reads ``cu_seqlens`` back to the host (a sync on a GPU).
    """
    offsets = cu_seqlens.tolist()
    group = q.shape[1] // k.shape[1]
    pieces = []
    for start, end in zip(offsets[:-1], offsets[1:]):
        if end == start:
            continue  # an empty segment (static-shape padding) owns no token
        # (L, heads, D) -> (heads, L, D): SDPA attends over the second-to-last dim.
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale, enable_gqa=group > 1)
        pieces.append(out.transpose(0, 1))
    if not pieces:
        return q.clone()  # no tokens at all: an empty, still differentiable, output
    return torch.cat(pieces, dim=0)


def _flash_attn_backend(q, k, v, cu_seqlens, max_seqlen, causal, scale, sliced, deterministic):
    cu = _nonempty_cu_seqlens(cu_seqlens, sliced=sliced)
    extra = {} if deterministic is None else {"deterministic": deterministic}
    return kernel("flash_attn")[0](
        q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=0.0, softmax_scale=scale, causal=causal, **extra,
    )


@dataclasses.dataclass(frozen=True)
class TorchVarlenCall:
    """How packkit calls torch's ``varlen_attn``, decided once per function and device.

    signature: the function's signature, as printed by ``inspect.signature``.
    causal_arg: "window_size" (torch >= 2.11: causal is ``window_size=(-1, 0)``) or "is_causal".
    takes_scale: whether it has a ``scale`` keyword (else q is pre-scaled, the op applies 1/sqrt(d)).
    gqa: how k, v with fewer heads than q are passed: "enable_gqa" (the keyword exists), "native"
        (no keyword, but grouped k, v give the same values and gradients as repeated ones: probed
        once on a tiny problem), or "repeat" (k, v repeated to q's heads before each call).
    """

    signature: str
    causal_arg: str
    takes_scale: bool
    gqa: str


_TORCH_CALLS: dict[tuple[object, str], TorchVarlenCall] = {}  # (function, device) -> plan


def _probe_grouped_heads(fn, params, device: torch.device, dtype: torch.dtype) -> bool:
    """True when fn gives grouped k, v the values and gradients of repeated ones (2 query heads over
    1 kv head, two segments of 3 and 5 tokens, head dim 64). An error from fn counts as False.

    Grad is enabled here whatever the caller's mode: a first call under ``torch.no_grad()`` or
    ``torch.inference_mode()`` would otherwise fail the backward and cache "repeat" for good."""
    outs = []
    with torch.inference_mode(False), torch.enable_grad():
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(8, h, 64, generator=gen).to(device=device, dtype=dtype) for h in (2, 1, 1))
        cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
        causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        try:
            for repeat in (False, True):
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                kk, vv = (t.repeat_interleave(2, dim=1) if repeat else t for t in leaves[1:])
                out = fn(leaves[0], kk, vv, cu, cu, 5, 5, **causal)
                out.float().square().sum().backward()
                outs.append([out.float(), *(t.grad.float() for t in leaves)])
        except (RuntimeError, ValueError, TypeError):
            return False
    return all(a.shape == b.shape and torch.allclose(a, b, rtol=2e-2, atol=2e-2) for a, b in zip(*outs))


def torch_varlen_call(q: torch.Tensor) -> TorchVarlenCall:
    """The :class:`TorchVarlenCall` for torch's ``varlen_attn`` on q's device: read from the signature
    once, and for grouped heads without ``enable_gqa`` probed once (a few tiny launches), then cached.
    Inside a compiled graph or a CUDA-graph capture an unprobed function is called with repeated k, v
    and nothing is cached (the probe runs eagerly, on the next call outside)."""
    fn = kernel("torch")[0]
    key = (fn, str(q.device))
    plan = _TORCH_CALLS.get(key)
    if plan is not None:
        return plan
    signature = inspect.signature(fn)
    params = signature.parameters
    in_graph = _graph_unfriendly()
    gqa = "enable_gqa" if "enable_gqa" in params else None
    if gqa is None:
        if in_graph:
            gqa = "repeat"  # not cached: the next eager call probes
        else:
            gqa = "native" if _probe_grouped_heads(fn, params, q.device, q.dtype) else "repeat"
    plan = TorchVarlenCall(str(signature), "window_size" if "window_size" in params else "is_causal",
                           "scale" in params, gqa)
    if not in_graph:
        _TORCH_CALLS[key] = plan
    return plan


def _torch_backend(q, k, v, cu_seqlens, max_seqlen, causal, scale, sliced, deterministic):
    plan = torch_varlen_call(q)
    kwargs = {}
    if plan.causal_arg == "window_size":
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        kwargs["is_causal"] = causal
    if plan.takes_scale:
        kwargs["scale"] = scale
    elif scale is not None:
        q = q * (scale * math.sqrt(q.shape[-1]))  # the op applies 1/sqrt(d) itself
    group = q.shape[1] // k.shape[1]
    if group > 1:
        if plan.gqa == "enable_gqa":
            kwargs["enable_gqa"] = True
        elif plan.gqa == "repeat":
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    cu = _nonempty_cu_seqlens(cu_seqlens, sliced=sliced)
    return kernel("torch")[0](q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)


def _triton_backend(q, k, v, cu_seqlens, max_seqlen, causal, scale, sliced, deterministic):
    # Empty segments need no compaction: cut off by num_segments, or counted on the device.
    return _triton_kernels()[0].flash_varlen_attention(
        q, k, v, cu_seqlens, max_seqlen, causal=causal, scale=scale,
        num_segments=cu_seqlens.numel() - 1 if sliced else None,
        deterministic=True if deterministic is None else deterministic)


def _reference_backend(q, k, v, cu_seqlens, max_seqlen, causal, scale, sliced, deterministic):
    return reference_varlen_attention(q, k, v, cu_seqlens, max_seqlen, causal=causal, scale=scale)


_RUNNERS = {
    "flash_attn": _flash_attn_backend,
    "torch": _torch_backend,
    "triton": _triton_backend,
    "reference": _reference_backend,
}


# -- input checks --

def _check_inputs(q, k, v, cu_seqlens, max_seqlen, num_segments=None, deterministic=None) -> None:
    if isinstance(max_seqlen, torch.Tensor) or not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool):
        raise TypeError(f"max_seqlen must be a Python int computed on the CPU (reading it from a tensor "
                        f"forces a sync and breaks torch.compile graphs); got {type(max_seqlen).__name__}")
    check_varlen_shapes(q, k, v, cu_seqlens, max_seqlen)
    check_num_segments(num_segments, cu_seqlens)
    if deterministic is not None and not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be None, True or False; got {deterministic!r}")
    if cu_seqlens.device.type != "cpu" or torch.compiler.is_compiling():
        return  # checking values would read a GPU tensor back (a sync) or break a compiled graph
    offsets = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
    if offsets[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0; got {offsets[0]}")
    bad = next((i for i, n in enumerate(lengths) if n < 0), None)
    if bad is not None:
        raise ValueError(f"cu_seqlens must be non-decreasing; segment {bad} has length {lengths[bad]}")
    if offsets[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens[-1]={offsets[-1]} must equal total_tokens={q.shape[0]}")
    if num_segments is not None:
        empty = next((i for i, n in enumerate(lengths[:num_segments]) if n == 0), None)
        if empty is not None:
            raise ValueError(f"num_segments={num_segments} counts segment {empty}, which is empty: the first "
                             f"num_segments segments must all be non-empty (pass the number of real segments)")
        if offsets[num_segments] != offsets[-1]:
            raise ValueError(f"num_segments={num_segments} leaves out non-empty segments (cu_seqlens"
                             f"[{num_segments}]={offsets[num_segments]} < {offsets[-1]}); pass the number of "
                             f"real segments, counting every non-empty one")
    longest = max(lengths, default=0)
    if longest > max_seqlen:
        raise ValueError(f"max_seqlen={max_seqlen} is below the longest segment ({longest} tokens, "
                         f"segment {lengths.index(longest)}); pass max_seqlen >= {longest}")


# -- the public function --

def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
    *, causal: bool = True, scale: float | None = None, backend: str = "auto",
    num_segments: int | None = None, deterministic: bool | None = None,
) -> torch.Tensor:
    """Attention over packed documents: no token attends outside its own segment (differentiable).

    Args:
        q: (total_tokens, nheads, headdim).
        k, v: (total_tokens, nheads_kv, headdim), same dtype and device; nheads % nheads_kv == 0
            (query head h uses kv head h // (nheads // nheads_kv), as in flash-attn).
        cu_seqlens: (num_segments + 1,) int32 on q's device, starts at 0, non-decreasing,
            cu_seqlens[-1] == total_tokens. Repeated offsets (empty segments) are allowed.
        max_seqlen: Python int, at least the longest segment.
        causal: each token sees itself and the earlier tokens of its segment (default); else the
            whole segment.
        scale: softmax scale; default 1 / sqrt(headdim).
        backend: "auto", "flash_attn", "torch", "triton" or "reference" (see the module docstring).
        num_segments: optional Python int, the number of real segments: the first ``num_segments``
            segments are non-empty and any after them are empty (static-shape padding). When given,
            ``cu_seqlens[:num_segments + 1]`` is used, a slice with no sync. When None, the flash_attn
            and torch backends drop empty segments themselves (flash-attention#1537): free on the CPU,
            one GPU sync in eager mode, and a ValueError under torch.compile / CUDA-graph capture, where
            a sync with a data-dependent shape would break the graph. Pass it on a GPU to avoid the sync.
        deterministic: the backward's reduction of dq. None: each backend's default (Triton:
            deterministic; flash-attn: its ``deterministic=False``). True / False: Triton runs its dq
            kernel / FlashAttention-2's atomic dq accumulation (faster, last bits vary between runs);
            flash-attn gets it as ``deterministic``; torch's varlen_attn has no such argument and
            ignores it; the reference is deterministic.

    Returns:
        (total_tokens, nheads, headdim), dtype of q.

    Values of cu_seqlens are checked when it lives on the CPU; on a GPU they are trusted (checking
    would synchronise).
    """
    _check_inputs(q, k, v, cu_seqlens, max_seqlen, num_segments, deterministic)
    name = select_backend(q, k, v, backend=backend)
    if q.shape[0] == 0:
        return q.clone()  # no tokens: nothing to attend; native kernels need not see this case
    sliced = num_segments is not None
    if sliced:
        cu_seqlens = cu_seqlens[: num_segments + 1]  # host-side count: a view, no sync
    scale = None if scale is None else float(scale)
    return _RUNNERS[name](q, k, v, cu_seqlens, max_seqlen, bool(causal), scale, sliced, deterministic)


# -- Hugging Face models: the attention function of a packed batch --

HF_ATTENTION_NAME = "packkit_varlen"


def hf_varlen_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                        scaling: float | None = None, dropout: float = 0.0, *, backend: str = "auto", **kwargs):
    """A Hugging Face attention function (``transformers.AttentionInterface``) over a packed batch.

    query: (batch, nheads, seq, headdim); key, value: (batch, nheads_kv, seq, headdim). The documents
    come from the batch's ``cu_seq_lens_q`` / ``max_length_q`` kwargs (``PackedBatch.hf_kwargs()``),
    and an optional ``num_segments`` kwarg (a Python int, e.g. ``batch.num_real_segments`` with
    ``hf_kwargs(static=True)``) spares the flash_attn / torch backends a sync, and the Triton backend
    its count of the live segments on the device (a searchsorted launch per layer). Returns
    ``(out: (batch, seq, nheads, headdim), None)``, as Hugging Face's attention functions do.

    Registered under a name of its own, transformers builds no mask for it (its padding mask would
    not reach this function), so a batch without ``cu_seq_lens_q`` is refused rather than guessed.
    """
    q, k, v, (cu_seqlens, max_seqlen), is_causal = hf.read_call(
        HF_ATTENTION_NAME, module, query, key, value, attention_mask, dropout, kwargs,
        needs=("cu_seq_lens_q", "max_length_q"), instead="; use attn_implementation='sdpa'",
        hint="a packed batch's cu_seq_lens_q and max_length_q (model(**packed_batch.hf_kwargs())); for padded "
             "batches use attn_implementation='sdpa'")
    batch, nheads, seq, head_dim = query.shape
    out = varlen_attention(q, k, v, cu_seqlens, int(max_seqlen), causal=is_causal,
                           scale=scaling, backend=backend, num_segments=kwargs.get("num_segments"))
    return out.view(batch, seq, nheads, head_dim), None


def register_hf_attention(name: str = HF_ATTENTION_NAME, *, backend: str = "auto") -> str:
    """Register :func:`hf_varlen_attention` with transformers under ``name`` (pinned to ``backend``)
    and return the name, for ``from_pretrained(..., attn_implementation=name)``."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        return hf_varlen_attention(module, query, key, value, attention_mask, backend=backend, **kwargs)

    return hf.register(name, attention)
