"""Varlen attention: packkit's Triton kernel vs flash-attn vs torch's varlen_attn vs padded SDPA.

One packed batch of SFT-like documents (lognormal lengths, median ~250, clipped to [8, 4096]) packed
first-fit into 8 windows of 4096 tokens; bf16, 32 query heads, 8 kv heads, head dim 128, causal.
Every provider computes the same attention over the same documents:

    packkit_triton  packkit.kernels.flash_varlen.flash_varlen_attention over cu_seqlens
    flash_attn      flash_attn.flash_attn_varlen_func (when installed)
    torch_varlen    torch.nn.attention.varlen.varlen_attn (torch >= 2.10)
    padded_sdpa     each document its own row, right-padded to the longest, F.scaled_dot_product_attention
                    (is_causal: padding keys sit after every real query); the pad and unpad copies count

FLOPs (causal, useful work only, the same for every provider): a document of L tokens has L(L+1)/2
query-key pairs per head; the forward does two matmuls over them (Q K^T and P V), 2 FLOPs per
multiply-add, so forward = 4 * headdim * nheads * sum_L L(L+1)/2. The backward does five such
matmuls, 2.5x the forward; forward+backward = 3.5x the forward. TFLOP/s = FLOPs / median time.

Prints one JSON line, then a table. Exits 2 without CUDA unless --cpu-smoke (tiny sizes on the CPU,
Triton under its interpreter: checks that the script runs, measures nothing worth recording).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import numpy as np
from benchlib import sft_like_lengths, versions


def pack_first_fit(lengths: np.ndarray, window: int, num_windows: int) -> list[list[int]]:
    """Place lengths in order into the first of num_windows windows with room; drop what fits nowhere.

    pack_first_fit([3, 2, 4], window=5, num_windows=2) -> [[3, 2], [4]].
    """
    windows: list[list[int]] = [[] for _ in range(num_windows)]
    free = [window] * num_windows
    for n in lengths.tolist():
        for w in range(num_windows):
            if n <= free[w]:
                windows[w].append(n)
                free[w] -= n
                break
    return windows


def causal_attention_flops(doc_lengths: list[int], nheads: int, headdim: int) -> float:
    """Forward FLOPs of causal attention over the documents (see the module docstring)."""
    pairs = sum(n * (n + 1) // 2 for n in doc_lengths)
    return 4.0 * headdim * nheads * pairs


def median_time(fn, *, warmup: int, reps: int, device: str) -> float:
    """Median seconds per call of fn(), timed with CUDA events (or perf_counter on the CPU)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny sizes on the CPU (Triton under TRITON_INTERPRET=1) to check the script runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()

    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before packkit.kernels is imported
    import torch
    import torch.nn.functional as F

    if args.cpu_smoke:
        device, dtype = "cpu", torch.float32
        window, num_windows, nheads, nheads_kv, headdim, median = 128, 2, 2, 1, 32, 24
        warmup, reps = 1, 2
    else:
        if not torch.cuda.is_available():
            print("bench_attention.py needs a CUDA GPU (none found); run with --cpu-smoke to check the script "
                  "on the CPU", file=sys.stderr)
            return 2
        device, dtype = "cuda", torch.bfloat16
        window, num_windows, nheads, nheads_kv, headdim, median = 4096, 8, 32, 8, 128, 250
        warmup, reps = 5, args.reps

    from packkit import attention
    from packkit.kernels import flash_varlen

    # -- the packed batch --
    rng = np.random.default_rng(args.seed)
    lengths = sft_like_lengths(40 * num_windows * window // median, seed=args.seed, median=median, high=window)
    windows = pack_first_fit(lengths, window, num_windows)
    docs = [n for w in windows for n in w]
    total = sum(docs)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(docs)]), dtype=torch.int32, device=device)
    max_seqlen = max(docs)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    q = torch.randn(total, nheads, headdim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(total, nheads_kv, headdim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(total, nheads_kv, headdim, device=device, dtype=dtype, generator=gen)
    grad_out = torch.randn(total, nheads, headdim, device=device, dtype=dtype, generator=gen)
    scale = 1.0 / math.sqrt(headdim)

    # -- padded layout for SDPA: (num_docs, heads, max_len, d), right padding --
    lengths_t = torch.tensor(docs, device=device)
    row = torch.repeat_interleave(torch.arange(len(docs), device=device), lengths_t)
    col = torch.arange(total, device=device) - cu[:-1].long()[row]

    def padded_sdpa(q_, k_, v_):
        def pad(t):
            out = t.new_zeros(len(docs), max_seqlen, t.shape[1], headdim)
            out[row, col] = t
            return out.transpose(1, 2)
        o = F.scaled_dot_product_attention(pad(q_), pad(k_), pad(v_), is_causal=True, scale=scale,
                                           enable_gqa=nheads != nheads_kv)
        return o.transpose(1, 2)[row, col]

    # -- providers: name -> fn(q, k, v) -> out, or the reason it cannot run --
    providers: dict[str, object] = {}
    problems = attention.backend_problems(q, k, v)
    providers["packkit_triton"] = (
        (lambda q_, k_, v_: flash_varlen.flash_varlen_attention(q_, k_, v_, cu, max_seqlen, causal=True, scale=scale))
        if problems["triton"] is None else problems["triton"])
    if problems["flash_attn"] is None:
        flash_fn, _ = attention._flash_attn_varlen_func()
        providers["flash_attn"] = lambda q_, k_, v_: flash_fn(q_, k_, v_, cu, cu, max_seqlen, max_seqlen,
                                                              softmax_scale=scale, causal=True)
    else:
        providers["flash_attn"] = problems["flash_attn"]
    if problems["torch"] is None:
        providers["torch_varlen"] = lambda q_, k_, v_: attention._torch_backend(q_, k_, v_, cu, max_seqlen, True, scale)
    else:
        providers["torch_varlen"] = problems["torch"]
    providers["padded_sdpa"] = padded_sdpa
    if args.cpu_smoke:
        providers["reference"] = lambda q_, k_, v_: attention.reference_varlen_attention(
            q_, k_, v_, cu, max_seqlen, causal=True, scale=scale)

    # -- measure --
    fwd_flops = causal_attention_flops(docs, nheads, headdim)
    results = []
    baseline_out = None
    for name, fn in providers.items():
        if isinstance(fn, str):
            results.append(dict(provider=name, skipped=fn))
            continue
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]

        def fwd():
            with torch.no_grad():
                return fn(q, k, v)

        def fwd_bwd():
            out = fn(*leaves)
            return torch.autograd.grad(out, leaves, grad_out)

        out = fwd().float()
        if baseline_out is None:
            baseline_out = out
        t_fwd = median_time(fwd, warmup=warmup, reps=reps, device=device)
        t_fwd_bwd = median_time(fwd_bwd, warmup=warmup, reps=reps, device=device)
        results.append(dict(
            provider=name, fwd_ms=t_fwd * 1e3, fwd_bwd_ms=t_fwd_bwd * 1e3,
            fwd_tflops=fwd_flops / t_fwd / 1e12, fwd_bwd_tflops=3.5 * fwd_flops / t_fwd_bwd / 1e12,
            max_diff_vs_first=(out - baseline_out).abs().max().item(),
        ))

    # -- targets: Triton >= 0.8x the best native varlen backend; packed >= 2x padded (fwd+bwd) --
    timed = {r["provider"]: r for r in results if "fwd_bwd_ms" in r}
    natives = [timed[n]["fwd_bwd_ms"] for n in ("flash_attn", "torch_varlen") if n in timed]
    packed = [timed[n]["fwd_bwd_ms"] for n in ("packkit_triton", "flash_attn", "torch_varlen") if n in timed]
    summary = dict(
        triton_vs_best_native=(min(natives) / timed["packkit_triton"]["fwd_bwd_ms"]
                               if natives and "packkit_triton" in timed else None),
        packed_vs_padded=(timed["padded_sdpa"]["fwd_bwd_ms"] / min(packed)
                          if packed and "padded_sdpa" in timed else None),
    )
    setup = dict(
        device=torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        smoke=args.cpu_smoke, dtype=str(dtype), windows=num_windows, window=window, docs=len(docs),
        tokens=total, fill=total / (window * num_windows), max_seqlen=max_seqlen, nheads=nheads,
        nheads_kv=nheads_kv, headdim=headdim, torch=torch.__version__,
        triton=__import__("triton").__version__, date=time.strftime("%Y-%m-%d"),
    )
    print(json.dumps(dict(bench="attention", versions=versions("triton", "flash-attn"), setup=setup, results=results, summary=summary)))

    print(f"\nvarlen attention, causal: {len(docs)} documents, {total} tokens in {num_windows} x {window} "
          f"(fill {setup['fill']:.1%}), max_seqlen {max_seqlen}, {dtype}, {nheads}/{nheads_kv} heads, "
          f"d={headdim}, {setup['device']}")
    print(f"{'provider':<16}{'fwd ms':>10}{'fwd TF/s':>10}{'f+b ms':>10}{'f+b TF/s':>10}{'max diff':>11}")
    for r in results:
        if "skipped" in r:
            print(f"{r['provider']:<16}skipped: {r['skipped']}")
        else:
            print(f"{r['provider']:<16}{r['fwd_ms']:>10.3f}{r['fwd_tflops']:>10.2f}{r['fwd_bwd_ms']:>10.3f}"
                  f"{r['fwd_bwd_tflops']:>10.2f}{r['max_diff_vs_first']:>11.2e}")
    fmt = lambda x: "n/a" if x is None else f"{x:.2f}x"  # noqa: E731
    print(f"packkit_triton vs best native (fwd+bwd, target >= 0.80x): {fmt(summary['triton_vs_best_native'])}")
    print(f"packed (best) vs padded SDPA (fwd+bwd, target >= 2.00x): {fmt(summary['packed_vs_padded'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
