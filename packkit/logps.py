"""Log-probabilities of chosen tokens, in tiles: never a ``[tokens, vocab]`` log-softmax, and with the LM head
fused, never the ``[tokens, vocab]`` logits.

A sequence-level loss (DPO's, GRPO's) reads, for ``M`` scored tokens, ``log p(target) = z[target] - logsumexp(z)``
with ``z`` the logits at the token that predicts it (its *source*: in a packed row the token before it; in a tree,
a continuation's first token reads the prompt's last). Taking ``log_softmax`` over the ``[M, V]`` rows copies the
rows twice and keeps them for the backward: at a 150k vocabulary that is what made packed DPO peak above TRL's
unpacked trainer. Here a tile of ``rows x vocab_chunk`` logits (:data:`TILE_ELEMENTS` at most) is the largest
thing made; the log-sum-exp is combined across vocabulary chunks (``logaddexp``) and the backward recomputes each
tile::

    sources      s0 s1 s1 s2          flat indices into the logits (or hidden states), a source may repeat
    targets      t0 t1 t1' t2         the token ids they predict
    tile         z = logits[s, v0:v1] / T        (fused: hidden[s] @ weight[v0:v1].T, scaled, soft-capped, / T)
    out          z[target] - logsumexp over every tile of the row

Two entry points, one tile loop:

* :func:`logits_logps`: from logits a model already returned (``[..., V]``); the gradient is a ``[..., V]`` tensor
  like the logits' own, nothing more.
* :func:`head_logps`: from hidden states and the model's LM head (:class:`LMHead`): the fused path.
  :func:`forward_hidden` runs a Hugging Face causal LM so that it returns its last hidden states and computes the
  logits of one position only (``logits_to_keep=1``), through the model's own forward (wrappers such as DDP see
  the call).

:func:`scored_logps` is the whole path for any layout that names its scored tokens by ``(source, target)``
(packed pairs, groups, prefix trees); :func:`segment_sums` adds them up per sample. Exact: float64 results equal
the unchunked ``log_softmax`` within 1e-10, gradients too (``tests/test_logps.py``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import torch

from .errors import ArgumentError, arg

__all__ = ["TILE_ELEMENTS", "LMHead", "logits_logps", "head_logps", "forward_hidden", "scored_logps", "segment_sums"]

#: Logits in one tile at most (rows x vocabulary chunk): 8M, 32 MiB in float32.
TILE_ELEMENTS = 1 << 23
#: Rows of a tile at most (each tile reads the head's weight once: more rows, fewer reads).
TILE_ROWS = 1024


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # the log-sum-exp of a vocabulary loses digits in 16 bits: half-precision logits are read in float32
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _tiles(m: int, vocab: int, tile_elements: int):
    """``(r0, r1, [(v0, v1), ...])`` per row tile: ``_tiles(3, 10, 8) -> (0, 3, [(0, 2), (2, 4), ... (8, 10)])``."""
    rows = max(1, min(m, TILE_ROWS, tile_elements))
    width = max(1, min(vocab, tile_elements // rows))
    chunks = [(v, min(v + width, vocab)) for v in range(0, vocab, width)]
    for r0 in range(0, m, rows):
        yield r0, min(r0 + rows, m), chunks


@dataclasses.dataclass(frozen=True)
class LMHead:
    """A causal LM's output layer as its forward applies it: ``z = softcap(scale * (h @ weight.T + bias))``,
    ``softcap(y) = c * tanh(y / c)`` when ``softcap`` is set (Gemma 2/3's ``final_logit_softcapping``).

    weight: ``[V, H]``; bias: ``[V]`` or None; scale: float (Cohere's ``logit_scale``, Granite's
    ``1 / logits_scaling``); softcap: float or None.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, model) -> "LMHead | None":
        """The head of a Hugging Face causal LM (unwrapped from DDP/FSDP ``.module`` and PEFT), or None when it is
        not a plain ``nn.Linear`` (a LoRA-wrapped head, say) or the config scales the logits in a way not read here."""
        inner = unwrap(model)
        get = getattr(inner, "get_output_embeddings", None)
        head = get() if get is not None else None
        if type(head) is not torch.nn.Linear:
            return None
        config = inner.config.get_text_config() if hasattr(inner.config, "get_text_config") else inner.config
        scale = getattr(config, "logit_scale", None)
        if getattr(config, "logits_scaling", None) is not None:
            if scale is not None or config.model_type == "hyperclovax":  # hyperclovax multiplies by it
                return None
            scale = 1.0 / config.logits_scaling
        if any(getattr(config, name, None) is not None for name in ("output_multiplier", "lm_head_multiplier")):
            return None
        return cls(head.weight, head.bias, 1.0 if scale is None else float(scale),
                   getattr(config, "final_logit_softcapping", None))

    def logits(self, h: torch.Tensor, v0: int, v1: int, dtype: torch.dtype) -> torch.Tensor:
        """``[n, v1 - v0]`` logits of ``h`` ``[n, H]`` for vocabulary ``v0:v1`` in ``dtype`` (scaled, not capped)."""
        z = (h.to(dtype) @ self.weight[v0:v1].to(dtype).t()).to(dtype)  # under autocast the product is half
        if self.bias is not None:
            z = z + self.bias[v0:v1].to(dtype)
        return z * self.scale if self.scale != 1.0 else z


def _transform(y: torch.Tensor, softcap, temperature: float):
    """``(z, dz/dy)`` of the soft cap and the temperature (``dz/dy`` None where it is ``1 / T``)."""
    if softcap is None:
        return (y / temperature if temperature != 1.0 else y), None
    t = torch.tanh(y / softcap)
    return softcap * t / temperature, (1 - t * t) / temperature


def _tile_z(source, values, head, rows, v0, v1, dtype, temperature):
    """``(z, dz/dy or None)`` of one tile: rows ``rows`` of the scored tokens, vocabulary ``v0:v1``."""
    if head is None:
        y = values[source[rows], v0:v1].to(dtype)
        return (y / temperature if temperature != 1.0 else y), None
    return _transform(head.logits(values[rows], v0, v1, dtype), head.softcap, temperature)


def _forward(values, source, target, head, temperature, tile_elements):
    """``(logps, lse)``, ``[M]`` each: the target's log-probability and each row's log-sum-exp."""
    m = target.shape[0]
    vocab = values.shape[-1] if head is None else head.weight.shape[0]
    dtype = _compute_dtype(values.dtype)
    lse = torch.full((m,), -math.inf, dtype=dtype, device=values.device)
    hit = torch.zeros(m, dtype=dtype, device=values.device)
    for r0, r1, chunks in _tiles(m, vocab, tile_elements):
        rows, tgt = slice(r0, r1), target[r0:r1]
        for v0, v1 in chunks:
            z, _ = _tile_z(source, values, head, rows, v0, v1, dtype, temperature)
            lse[rows] = torch.logaddexp(lse[rows], torch.logsumexp(z, -1))
            inside = (tgt >= v0) & (tgt < v1)
            picked = z.gather(1, (tgt - v0).clamp(0, v1 - v0 - 1)[:, None])[:, 0]
            hit[rows] = torch.where(inside, picked, hit[rows])
    return hit - lse, lse


class _TiledLogps(torch.autograd.Function):
    """``values``: logits ``[R, V]`` (``head`` None; ``source`` picks the rows) or gathered hidden states ``[M, H]``
    (``head`` an :class:`LMHead`; ``weight`` and ``bias`` passed again so that autograd sees them)."""

    @staticmethod
    def forward(ctx, values, weight, bias, source, target, head, temperature, tile_elements):
        logps, lse = _forward(values, source, target, head, temperature, tile_elements)
        ctx.save_for_backward(values, source, target, lse)
        ctx.head, ctx.temperature, ctx.tile_elements = head, temperature, tile_elements
        return logps

    @staticmethod
    def backward(ctx, grad):
        values, source, target, lse = ctx.saved_tensors
        head, temperature = ctx.head, ctx.temperature
        need_values, need_w, need_b = ctx.needs_input_grad[:3]
        dtype = lse.dtype
        vocab = values.shape[-1] if head is None else head.weight.shape[0]
        # accumulators in the compute dtype (float32 for half inputs), cast back at the end; the logits' gradient
        # (head None) in their own dtype, as autograd would make it: a float32 copy would double it
        g_dtype = values.dtype if head is None else dtype
        g_values = torch.zeros(values.shape, dtype=g_dtype, device=values.device) if need_values else None
        g_w = torch.zeros(head.weight.shape, dtype=dtype, device=values.device) if need_w else None
        g_b = torch.zeros(head.bias.shape, dtype=dtype, device=values.device) if need_b else None
        grad = grad.to(dtype)
        for r0, r1, chunks in _tiles(target.shape[0], vocab, ctx.tile_elements):
            rows, tgt = slice(r0, r1), target[r0:r1]
            for v0, v1 in chunks:
                z, dz = _tile_z(source, values, head, rows, v0, v1, dtype, temperature)
                # d(z[target] - lse)/dz = onehot(target) - softmax(z)
                gz = -torch.exp(z - lse[rows, None]) * grad[rows, None]
                inside = torch.nonzero((tgt >= v0) & (tgt < v1))[:, 0]
                gz[inside, tgt[inside] - v0] += grad[rows][inside]
                gy = gz * dz if dz is not None else (gz / temperature if temperature != 1.0 else gz)
                if head is None:
                    g_values[:, v0:v1].index_add_(0, source[rows], gy.to(g_dtype))
                    continue
                gy = gy * head.scale if head.scale != 1.0 else gy
                if g_values is not None:
                    g_values[rows] += gy @ head.weight[v0:v1].to(dtype)
                if g_w is not None:
                    g_w[v0:v1] += gy.t() @ values[rows].to(dtype)
                if g_b is not None:
                    g_b[v0:v1] += gy.sum(0)
        cast = (lambda t, like: None if t is None else t.to(like.dtype))
        return (cast(g_values, values), cast(g_w, head.weight if head else values),
                cast(g_b, head.bias if head and head.bias is not None else values), None, None, None, None, None)


def _check(source, target, temperature):
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < math.inf:
        raise ArgumentError("{t} must be a finite number > 0, got {got!r}", t=arg("temperature"), got=temperature)
    if source.shape != target.shape or source.dim() != 1:
        raise ValueError(f"source {tuple(source.shape)} and target {tuple(target.shape)} must be two [M] index "
                         "tensors, one entry per scored token")


def logits_logps(logits: torch.Tensor, source: torch.Tensor, target: torch.Tensor, *, temperature: float = 1.0,
                 tile_elements: int | None = None) -> torch.Tensor:
    """``[M]`` log-probabilities of ``target`` under the logits at ``source``, without a ``[M, V]`` log-softmax.

    Args:
        logits: ``[..., V]`` (``[B, L, V]`` of a model), any float dtype; read as ``logits.reshape(-1, V)``.
        source: int64 ``[M]``, flat index of the row predicting each scored token (may repeat).
        target: int64 ``[M]``, the token ids.
        tile_elements: logits in one tile at most (default :data:`TILE_ELEMENTS`, read at the call).
    Returns:
        ``[M]``, float32 for half-precision logits, else the logits' dtype: ``log_softmax(logits[source] / T)``
        at ``target``. ``logits_logps(torch.zeros(1, 2, 4), torch.tensor([0]), torch.tensor([3])) -> [-1.3863]``.
    """
    _check(source, target, temperature)
    flat = logits.reshape(-1, logits.shape[-1])
    return _TiledLogps.apply(flat, None, None, source.to(flat.device), target.to(flat.device), None,
                             float(temperature), int(tile_elements or TILE_ELEMENTS))


def head_logps(hidden: torch.Tensor, head: LMHead, source: torch.Tensor, target: torch.Tensor, *,
               temperature: float = 1.0, tile_elements: int | None = None) -> torch.Tensor:
    """:func:`logits_logps` of ``head``'s logits of ``hidden`` ``[..., H]`` (the fused LM head): the logits exist
    one tile at a time, in the forward and again in the backward; gradients reach ``hidden``, the weight and the
    bias. Same result as ``logits_logps(head(hidden), ...)``."""
    _check(source, target, temperature)
    flat = hidden.reshape(-1, hidden.shape[-1])
    picked = flat[source.to(flat.device)]  # [M, H]: H numbers a scored token, not V
    rows = torch.arange(picked.shape[0], device=flat.device)  # the head path reads picked row by row
    return _TiledLogps.apply(picked, head.weight, head.bias, rows, target.to(flat.device), head,
                             float(temperature), int(tile_elements or TILE_ELEMENTS))


def unwrap(model):
    """The Hugging Face model inside DDP/FSDP (``.module``) and PEFT (``get_base_model()``) wrappers."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def forward_hidden(model, inputs: dict):
    """``(outputs, hidden)``: the model run on ``inputs`` through its own forward with ``logits_to_keep=1`` (the
    logits of the last position only, ``[B, 1, V]``), and ``hidden`` ``[B, L, H]``, the last hidden states its LM
    head reads (caught from the backbone, ``model.base_model``, as it returns). None for ``hidden`` when the model
    takes no ``logits_to_keep``: then ``outputs`` holds the full logits."""
    inner = unwrap(model)
    if "logits_to_keep" not in inspect.signature(type(inner).forward).parameters:
        return model(**inputs), None
    caught = []

    def catch(module, args, output):
        caught.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    handle = inner.base_model.register_forward_hook(catch)
    try:
        outputs = model(**inputs, logits_to_keep=1)
    finally:
        handle.remove()
    if len(caught) != 1:
        raise RuntimeError(f"the backbone of {type(inner).__name__} ran {len(caught)} times in one forward; "
                           "pass its logits to logits_logps instead")
    return outputs, caught[0]


#: How far the fused head's logits may stray from the model's own (relative to their largest), by dtype.
HEAD_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}


def _check_head(model, head: LMHead, hidden: torch.Tensor, logits: torch.Tensor) -> None:
    """The head read by :meth:`LMHead.of` gives the model's own logits at the position the model computed (its
    last): a forward that transforms the logits in a way not read there is refused, never approximated."""
    with torch.no_grad():
        want = logits[:, -1].float()
        last = hidden[:, -1].reshape(-1, hidden.shape[-1])
        z, _ = _transform(head.logits(last, 0, head.weight.shape[0], _compute_dtype(hidden.dtype)), head.softcap, 1.0)
        tol = HEAD_TOLERANCE.get(logits.dtype, 5e-2) * max(1.0, float(want.abs().max()))
        diff = float((z.float() - want).abs().max()) if want.numel() else 0.0
    if not diff <= tol:
        raise ArgumentError(f"{type(unwrap(model)).__name__}'s logits are not its LM head's output as packkit reads it "
                            f"(max difference {diff:.3g} > {tol:.3g}: its forward transforms them): compute logits "
                            "with model(**inputs).logits and pass them to packkit.logps.logits_logps")


def scored_logps(model, inputs: dict, source: torch.Tensor, target: torch.Tensor, *, temperature: float = 1.0):
    """``(logps [M], outputs)``: run ``model(**inputs)`` and score ``target`` from ``source`` (flat indices into the
    ``[B, L]`` tokens), with the LM head fused when the model allows it (:func:`forward_hidden`, :meth:`LMHead.of`),
    else from its logits (:func:`logits_logps`). The entry point of every layout: pairs, groups, trees."""
    head = LMHead.of(model)
    if head is None:
        outputs = model(**inputs)
        return logits_logps(outputs.logits, source, target, temperature=temperature), outputs
    outputs, hidden = forward_hidden(model, inputs)
    if hidden is None:
        return logits_logps(outputs.logits, source, target, temperature=temperature), outputs
    _check_head(model, head, hidden, outputs.logits)
    return head_logps(hidden, head, source, target, temperature=temperature), outputs


def segment_sums(values: torch.Tensor, segment: torch.Tensor, num_segments: int) -> torch.Tensor:
    """``[num_segments]`` sums of ``values`` ``[M]`` by ``segment`` ``[M]`` (int64):
    ``segment_sums([1., 2., 4.], [0, 1, 0], 2) -> [5., 2.]``."""
    return values.new_zeros(num_segments).index_add_(0, segment.to(values.device), values)
