"""Varlen attention: packkit's Triton kernels vs torch's varlen_attn (vs flash-attn) vs padded SDPA.

Every provider computes the same causal attention over the same documents, through the public
``packkit.attention.varlen_attention(..., backend=name)`` (padded SDPA aside, which is what a user
without varlen attention would run):

    triton          backend="triton" (deterministic backward: a dq kernel)
    triton_atomic   backend="triton", deterministic=False (FlashAttention-2's atomic dq accumulation)
    torch           backend="torch": torch.nn.attention.varlen.varlen_attn, k and v with their own heads
                    when it takes grouped heads (decided once: see packkit.attention.torch_varlen_call)
    flash_attn      backend="flash_attn" (when installed)
    padded_sdpa     each document its own row, right-padded to the longest, F.scaled_dot_product_attention
                    (is_causal; padding keys sit after every real query); the pad and unpad copies count

Problems (bf16, causal, 32 query heads over 8 kv heads): head dims 64 and 128 x windows of 4,096 and
8,192 tokens, each 32,768 tokens of real chat documents (``--lengths chat``, the default: ShareGPT conversations
under Qwen3's tokenizer, those that fit the window; ``--lengths sft-like``: the synthetic lognormal, median 250,
clipped to the window) packed first-fit. ``--rounds`` rounds rotate the providers (each first in turn), garbage
collected outside the clock; each round times ``--reps`` calls of each (the median of CUDA-event timings), and the
ratios are medians of the round-by-round pair ratios (packed / padded with its spread). Written without a GPU at
hand: checked on the CPU by ``--cpu-smoke`` only. Times are medians of CUDA-event timings; the phase columns (forward,
preprocess, dk/dv, dq) are device times of each provider's kernels from torch.profiler, per call.

FLOPs (causal, useful work only, the same for every provider): a document of L tokens has L(L+1)/2
query-key pairs per head; the forward does two matmuls over them (Q K^T and P V), 2 FLOPs per
multiply-add, so forward = 4 * headdim * nheads * sum_L L(L+1)/2; forward+backward = 3.5x that.

Targets (issue 15): Triton forward >= 0.9x and forward+backward >= 0.8x torch's varlen_attn; packed
(the best varlen provider) >= 2x padded SDPA. Prints per problem one table and one JSON line, then a
summary table and JSON line; --json-out appends the JSON lines to a file. Exits 2 without CUDA unless
--cpu-smoke: tiny sizes on the CPU, Triton under its interpreter, and fakes with the signatures of
flash-attn's flash_attn_varlen_func and torch 2.11's varlen_attn standing in for the CUDA-only ones, so
that every call path runs (tests/test_bench_attention.py runs it in CI); it measures nothing.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import numpy as np
from benchlib import (add_lengths_option, bench_lengths, device_name, emit_json, median_time, ratio_spread,
                      smoke_or_cuda, spread_text, verdict, versions)

TARGETS = {"triton_fwd_vs_torch": 0.9, "triton_fwd_bwd_vs_torch": 0.8, "packed_vs_padded": 2.0}
# Kernel-name fragments -> phase, for the profiler's device events (Triton's, then flash-attn's inside torch).
PHASES = [("attn_fwd_kernel", "forward"), ("attn_bwd_preprocess_kernel", "preprocess"),
          ("attn_bwd_dkdv_kernel", "dk/dv"), ("attn_bwd_dq_kernel", "dq"),
          ("flash_fwd", "forward"), ("dot_do_o", "preprocess"), ("dq_dk_dv", "dk/dv"), ("convert_dq", "dq")]
PHASE_NAMES = ("forward", "preprocess", "dk/dv", "dq", "other")


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


def phase_of(kernel_name: str) -> str:
    """``"attn_bwd_dkdv_kernel" -> "dk/dv"``; kernels of no listed phase are "other"."""
    return next((phase for fragment, phase in PHASES if fragment in kernel_name), "other")


def phase_times(fn, *, reps: int, device: str) -> dict[str, float] | str:
    """Device milliseconds per call of fn() in each phase (forward, preprocess, dk/dv, dq, other), from
    torch.profiler's kernel events; a string saying why when there are none (the CPU: no kernels)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(reps):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
    totals = dict.fromkeys(PHASE_NAMES, 0.0)
    seen = False
    for event in prof.key_averages():
        if str(getattr(event, "device_type", "")).endswith("CUDA"):
            self_us = getattr(event, "self_device_time_total", None)
            if self_us is None:
                self_us = event.self_cuda_time_total
            if self_us > 0:
                totals[phase_of(event.key)] += self_us / 1e3 / reps
                seen = True
    return totals if seen else f"no device kernel events on {device}"


def run_problem(problem: dict, *, device: str, dtype, seed: int, warmup: int, reps: int, profile_reps: int,
                smoke: bool, lengths: str = "chat", rounds: int = 5) -> dict:
    """Time every provider on one packed batch, ``rounds`` rounds rotating the providers (each first in turn), each
    round the median of ``reps`` calls, garbage collected outside the clock; return the problem's record (setup,
    rows with the round medians' median, ratios: the median pair ratios and the spread of packed / padded)."""
    import torch
    import torch.nn.functional as F

    from packkit import attention
    from packkit.attention import varlen_attention
    from packkit.segments import lengths_to_cu_seqlens, lengths_to_position_ids, lengths_to_seq_idx

    window, num_windows, nheads, nheads_kv, headdim = (problem[k] for k in
                                                        ("window", "windows", "nheads", "nheads_kv", "headdim"))
    lengths = bench_lengths(lengths, 40 * num_windows * window // 250 + 8, seed=seed, median=problem["median"],
                            high=window)
    docs = [n for w in pack_first_fit(lengths, window, num_windows) for n in w]
    total, max_seqlen = sum(docs), max(docs)
    cu = torch.from_numpy(lengths_to_cu_seqlens(docs)).to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(total, nheads, headdim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(total, nheads_kv, headdim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(total, nheads_kv, headdim, device=device, dtype=dtype, generator=gen)
    grad_out = torch.randn(total, nheads, headdim, device=device, dtype=dtype, generator=gen)

    # -- padded layout for SDPA: (num_docs, heads, max_len, d), right padding: token t sits in row
    # seq_idx[t] (its document), column position_ids[t] (its place in the document) --
    row = torch.from_numpy(lengths_to_seq_idx(docs)).to(device=device, dtype=torch.long)
    col = torch.from_numpy(lengths_to_position_ids(docs)).to(device)

    def padded_sdpa(q_, k_, v_):
        def pad(t):
            out = t.new_zeros(len(docs), max_seqlen, t.shape[1], headdim)
            out[row, col] = t
            return out.transpose(1, 2)
        o = F.scaled_dot_product_attention(pad(q_), pad(k_), pad(v_), is_causal=True, enable_gqa=nheads != nheads_kv)
        return o.transpose(1, 2)[row, col]

    def varlen(backend, **options):
        return lambda q_, k_, v_: varlen_attention(q_, k_, v_, cu, max_seqlen, causal=True, backend=backend,
                                                   num_segments=len(docs), **options)

    problems = attention.backend_problems(q, k, v)
    providers = {
        "triton": varlen("triton", deterministic=True),
        "triton_atomic": varlen("triton", deterministic=False),
        "torch": varlen("torch"),
        "flash_attn": varlen("flash_attn"),
        "padded_sdpa": padded_sdpa,
    }
    skipped = {"triton": problems["triton"], "triton_atomic": problems["triton"], "torch": problems["torch"],
               "flash_attn": problems["flash_attn"]}
    if smoke:
        providers["reference"] = varlen("reference")

    # -- measure: every provider's warm-up and check first, then rounds rotating the providers --
    fwd_flops = causal_attention_flops(docs, nheads, headdim)
    rows, baseline, calls = [], None, {}
    for name, fn in providers.items():
        if skipped.get(name):
            rows.append(dict(provider=name, skipped=skipped[name]))
            continue
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]

        def fwd(fn=fn):
            with torch.no_grad():
                return fn(q, k, v)

        def fwd_bwd(fn=fn, leaves=leaves):
            out = fn(*leaves)
            return torch.autograd.grad(out, leaves, grad_out)

        try:
            out = fwd().float()
            baseline = out if baseline is None else baseline
            median_time(fwd, warmup=warmup, reps=1, device=device)
            median_time(fwd_bwd, warmup=warmup, reps=1, device=device)
            calls[name] = (fwd, fwd_bwd, (out - baseline).abs().max().item())
        except Exception as err:  # a failing provider is reported, and the others still run
            rows.append(dict(provider=name, error=f"{type(err).__name__}: {err}"[:500]))
    times = {name: {"fwd_ms": [], "fwd_bwd_ms": []} for name in calls}
    for r in range(rounds):
        names = list(times)
        for name in names[r % len(names):] + names[:r % len(names)] if names else []:
            fwd, fwd_bwd, _ = calls[name]
            gc.collect()
            gc.disable()
            try:
                times[name]["fwd_ms"].append(1e3 * median_time(fwd, warmup=0, reps=reps, device=device))
                times[name]["fwd_bwd_ms"].append(1e3 * median_time(fwd_bwd, warmup=0, reps=reps, device=device))
            except Exception as err:  # a provider failing in a later round is dropped from the comparison
                rows.append(dict(provider=name, error=f"{type(err).__name__}: {err}"[:500]))
                del times[name]
            finally:
                gc.enable()
    for name, t in times.items():
        fwd, fwd_bwd, diff = calls[name]
        try:
            phases = phase_times(fwd_bwd, reps=profile_reps, device=device)
        except Exception as err:  # the profiler's view is extra: its failure is noted, not fatal
            phases = f"profiler failed: {type(err).__name__}: {err}"[:200]
        t_fwd, t_fwd_bwd = statistics.median(t["fwd_ms"]) / 1e3, statistics.median(t["fwd_bwd_ms"]) / 1e3
        rows.append(dict(
            provider=name, fwd_ms=t_fwd * 1e3, fwd_bwd_ms=t_fwd_bwd * 1e3,
            fwd_tflops=fwd_flops / t_fwd / 1e12, fwd_bwd_tflops=3.5 * fwd_flops / t_fwd_bwd / 1e12,
            max_diff_vs_triton=diff, rounds_ms=t,
            phases_ms=phases if isinstance(phases, dict) else None,
            phases_note=None if isinstance(phases, dict) else phases,
        ))
    order = list(providers)
    rows.sort(key=lambda r: order.index(r["provider"]))

    timed = {r["provider"]: r for r in rows if "fwd_ms" in r}

    def ratio(slow, fast, key):
        """The median pair ratio ``slow / fast`` over the rounds (``None`` unless both were timed)."""
        return ratio_spread(times[slow][key], times[fast][key])["median"] if slow in timed and fast in timed else None

    packed = [n for n in ("triton", "triton_atomic", "torch", "flash_attn") if n in timed]
    best = min(packed, key=lambda n: timed[n]["fwd_bwd_ms"]) if packed else None
    ratios = dict(
        triton_fwd_vs_torch=ratio("torch", "triton", "fwd_ms"),
        triton_fwd_bwd_vs_torch=max(filter(None, [ratio("torch", "triton", "fwd_bwd_ms"),
                                                  ratio("torch", "triton_atomic", "fwd_bwd_ms")]), default=None),
        packed_vs_padded=ratio("padded_sdpa", best, "fwd_bwd_ms") if best else None,
        packed_vs_padded_fwd=ratio("padded_sdpa", best, "fwd_ms") if best else None,
        best_packed=best,
        packed_vs_padded_spread=(ratio_spread(times["padded_sdpa"]["fwd_bwd_ms"], times[best]["fwd_bwd_ms"])
                                 if best and "padded_sdpa" in timed else None),
    )
    setup = dict(problem["name"] and dict(name=problem["name"]), dtype=str(dtype).replace("torch.", ""), causal=True,
                 window=window, windows=num_windows, docs=len(docs), tokens=total,
                 fill=round(total / (window * num_windows), 4), max_seqlen=max_seqlen, nheads=nheads,
                 nheads_kv=nheads_kv, headdim=headdim)
    return dict(setup=setup, results=rows, ratios=ratios)


def print_problem(record: dict) -> None:
    s = record["setup"]
    print(f"\n{s['name']}: {s['docs']} documents, {s['tokens']} tokens in {s['windows']} x {s['window']} "
          f"(fill {s['fill']:.1%}), max_seqlen {s['max_seqlen']}, {s['dtype']}, {s['nheads']}/{s['nheads_kv']} heads, "
          f"d={s['headdim']}, causal")
    print(f"{'provider':<15}{'fwd ms':>9}{'TF/s':>7}{'f+b ms':>9}{'TF/s':>7}  "
          f"{'fwd':>7}{'prep':>7}{'dk/dv':>7}{'dq':>7}{'other':>7}  (device ms per call){'max diff':>10}")
    for r in record["results"]:
        if "fwd_ms" not in r:
            print(f"{r['provider']:<15}{'skipped' if 'skipped' in r else 'FAILED'}: {r.get('skipped') or r.get('error')}")
            continue
        ph = r["phases_ms"]
        cols = "".join(f"{ph[p]:>7.3f}" for p in PHASE_NAMES) if ph else f"  {r['phases_note']:<33}"
        print(f"{r['provider']:<15}{r['fwd_ms']:>9.3f}{r['fwd_tflops']:>7.1f}{r['fwd_bwd_ms']:>9.3f}"
              f"{r['fwd_bwd_tflops']:>7.1f}  {cols}{'':20}{r['max_diff_vs_triton']:>10.2e}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny sizes on the CPU, Triton interpreted, CUDA-only backends faked: checks every call path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reps", type=int, default=20, help="calls timed a round (their median is the round's)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds rotating the providers")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--windows", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--json-out", help="append the JSON lines to this file too")
    add_lengths_option(parser)
    args = parser.parse_args()

    device = smoke_or_cuda("bench_attention.py", smoke=args.cpu_smoke)
    if device is None:
        return 2
    import torch

    dtype = torch.bfloat16
    if args.cpu_smoke:
        tokens, nheads, nheads_kv, median = 64, 2, 1, 12
        head_dims, windows, warmup, reps, profile_reps = [16], [64], 0, 1, 1
    else:
        tokens, nheads, nheads_kv, median = 32768, 32, 8, 250
        head_dims, windows, warmup, reps, profile_reps = args.head_dims, args.windows, 3, args.reps, 5

    from packkit import attention

    fn, err = attention.kernel("torch")
    probe_q = torch.zeros(1, nheads, head_dims[0], device=device, dtype=dtype)
    if fn is None:
        torch_call = f"torch.nn.attention.varlen.varlen_attn: unavailable ({err})"
    else:
        plan = attention.torch_varlen_call(probe_q)
        torch_call = (f"torch.nn.attention.varlen.varlen_attn{plan.signature}\n  called with "
                      f"{plan.causal_arg}, grouped heads: "
                      f"{ {'enable_gqa': 'enable_gqa=True', 'native': 'k, v passed with their own heads (probed once)', 'repeat': 'k, v repeated to q heads'}[plan.gqa] }")
    print(torch_call)

    records = []
    for headdim in head_dims:
        for window in windows:
            problem = dict(name=f"d{headdim}-w{window}", window=window, windows=max(1, tokens // window),
                           nheads=nheads, nheads_kv=nheads_kv, headdim=headdim, median=median)
            record = run_problem(problem, device=device, dtype=dtype, seed=args.seed, warmup=warmup, reps=reps,
                                 profile_reps=profile_reps, smoke=args.cpu_smoke, lengths=args.lengths,
                                 rounds=2 if args.cpu_smoke else args.rounds)
            records.append(record)
            print_problem(record)
            emit_json(dict(bench="attention", part="problem", smoke=args.cpu_smoke, **record), args.json_out)

    # -- summary: every problem against the targets --
    print(f"\n{'problem':<12}{'triton fwd / torch':>30}{'triton f+b / torch':>30}{'packed / padded (f+b)':>32}")
    for r in records:
        x = r["ratios"]
        cells = [verdict(x[key], TARGETS[key], smoke=args.cpu_smoke) for key in TARGETS]
        spread = x["packed_vs_padded_spread"]
        print(f"{r['setup']['name']:<12}{cells[0]:>30}{cells[1]:>30}{cells[2]:>32}"
              + (f"  pair ratios {spread_text(spread)}" if spread else ""))
    missed = [] if args.cpu_smoke else sorted({k for r in records for k, target in TARGETS.items()
                                               if r["ratios"][k] is not None and r["ratios"][k] < target})
    summary = dict(bench="attention", part="summary", smoke=args.cpu_smoke, versions=versions("triton", "flash-attn", "transformers"),
                   device=device_name(device),
                   torch_varlen_call=torch_call, date=time.strftime("%Y-%m-%d"), targets=TARGETS, missed=missed,
                   ratios={r["setup"]["name"]: r["ratios"] for r in records})
    emit_json(summary, args.json_out)
    failed = [r["provider"] for rec in records for r in rec["results"] if "error" in r]
    if failed:
        print(f"providers that failed: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
