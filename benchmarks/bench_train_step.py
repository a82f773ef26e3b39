"""One training step of a Llama-shaped model: packkit's packed batches vs padded batches, same examples.

A ~150M-parameter LlamaForCausalLM built from a config (random weights: nothing is downloaded; vocab
32,000, hidden 768, 16 layers, 12 query / 4 kv heads of 64, bf16 weights, AdamW) trains on 64 chat-like
real chat examples (``--lengths chat``, the default: ShareGPT conversations under Qwen3's tokenizer of at most
4,096 tokens; ``--lengths sft-like``: the synthetic lognormal, median 250, clipped to 4,096; random token ids). Every
provider is built and warmed first, then ``--rounds`` rounds rotate them (each first in turn), garbage collected outside
the clock, each round the median of ``--reps`` steps; the speed-ups are medians of the round-by-round pair ratios,
printed with their spread (written without a GPU at hand: checked on the CPU by ``--cpu-smoke`` only; the peak is
now the first step's above what is resident, the other providers' models included). A step is forward,
backward and optimizer step; every provider starts from the same weights and sees the same examples:

    packed_torch    PaddingFreeCollator ([1, T] row, cu_seq_lens) + packkit's HF attention function
                    (packkit.attention.register_hf_attention) on torch's varlen_attn
    packed_triton   the same on packkit's Triton kernels
    packed_sdpa     the same packed batch on transformers' sdpa (it finds documents from position_ids and
                    builds a block-diagonal mask): what a user without a varlen kernel gets from packing
    padded_sdpa     PaddedCollator ([B, L] rows padded to the longest, attention_mask) on sdpa: the baseline

Prints a table (median step ms, real tokens/s, speedup over padded_sdpa, first-step loss and its
difference from padded_sdpa's) and one JSON line; --json-out appends it to a file. The issue-15 target:
packed >= 2x padded in the training step. Exits 2 without CUDA unless --cpu-smoke (a tiny model in bf16
on the CPU, Triton interpreted, torch's varlen_attn faked with its 2.11 signature: checks the call
paths, measures nothing).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

from benchlib import (add_lengths_option, bench_lengths, device_name, emit_json, median_time, ratio_spread,
                      smoke_or_cuda, spread_text, verdict, versions)

TARGET_PACKED_VS_PADDED = 2.0


def make_examples(n: int, *, vocab: int, median: int, high: int, seed: int, source: str = "chat") -> list[dict]:
    """n examples of random token ids with ``source`` lengths (``--lengths``) of at most ``high`` tokens."""
    import numpy as np

    rng = np.random.default_rng(seed + 1)
    return [{"input_ids": rng.integers(3, vocab, int(length)).tolist()}
            for length in bench_lengths(source, n, seed=seed, median=median, high=high)]


def step_fn(model, optimizer, batch_kwargs):
    """One optimizer step; returns the loss tensor (not synchronised)."""
    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = model(**batch_kwargs).loss
        loss.backward()
        optimizer.step()
        return loss
    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU: checks the call paths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5, help="steps timed a round (their median is the round's)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds rotating the providers")
    parser.add_argument("--json-out", help="append the JSON line to this file too")
    add_lengths_option(parser)
    args = parser.parse_args()
    device = smoke_or_cuda("bench_train_step.py", smoke=args.cpu_smoke)
    if device is None:
        return 2
    import torch
    import transformers

    from packkit import attention
    from packkit.collate import PaddedCollator, PaddingFreeCollator

    dtype = torch.bfloat16
    if args.cpu_smoke:
        warmup, reps, n_examples, rounds = 0, 1, 4, 2
        shape = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, median=6, high=16)
    else:
        warmup, reps, n_examples, rounds = 2, args.reps, args.examples, args.rounds
        shape = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=16,
                     num_attention_heads=12, num_key_value_heads=4, median=250, high=4096)
    median, high = shape.pop("median"), shape.pop("high")
    config = transformers.LlamaConfig(**shape, max_position_embeddings=max(high, 64), attention_dropout=0.0)
    torch.manual_seed(args.seed)
    base = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=dtype)
    params = sum(p.numel() for p in base.parameters())
    state = {k: v.clone() for k, v in base.state_dict().items()}
    del base

    examples = make_examples(n_examples, vocab=shape["vocab_size"], median=median, high=high, seed=args.seed,
                             source=args.lengths)
    packed = PaddingFreeCollator()(examples)
    padded = PaddedCollator()(examples)
    real_tokens = packed.num_tokens

    packed_batch = packed.to(device)
    varlen_kwargs = dict(packed_batch.hf_kwargs(), num_segments=packed.num_real_segments)
    providers = {
        "packed_torch": (attention.register_hf_attention("packkit_varlen_torch", backend="torch"), varlen_kwargs),
        "packed_triton": (attention.register_hf_attention("packkit_varlen_triton", backend="triton"), varlen_kwargs),
        "packed_sdpa": ("sdpa", dict(packed_batch)),
        "padded_sdpa": ("sdpa", dict(padded.to(device))),
    }
    rows, steps = [], {}
    for name, (implementation, kwargs) in providers.items():  # every provider built, checked and warmed first
        try:
            torch.manual_seed(args.seed)
            model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=implementation, dtype=dtype)
            model.load_state_dict(state)
            model.to(device).train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if device == "cuda" else {}))
            step = step_fn(model, optimizer, kwargs)
            if device == "cuda":  # the first step's peak above what is resident (the other providers' models too)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                resident = torch.cuda.memory_allocated()
            first_loss = step().item()  # from the shared initial weights
            peak = (torch.cuda.max_memory_allocated() - resident) / 2**30 if device == "cuda" else None
            median_time(step, warmup=warmup, reps=1, device=device)
            steps[name] = step
            rows.append(dict(provider=name, attn_implementation=implementation, first_loss=first_loss,
                             batch_shape=list(kwargs["input_ids"].shape), peak_gib=peak))
        except Exception as err:  # one failing provider is reported; the others still run
            rows.append(dict(provider=name, attn_implementation=implementation, error=f"{type(err).__name__}: {err}"[:500]))
    times = {name: [] for name in steps}
    for r in range(rounds):  # the providers rotated every round (each first in turn), GC outside the clock
        names = list(times)
        for name in names[r % len(names):] + names[:r % len(names)] if names else []:
            gc.collect()
            gc.disable()
            try:
                times[name].append(median_time(steps[name], warmup=0, reps=reps, device=device))
            except Exception as err:  # a provider failing in a later round is dropped from the comparison
                next(x for x in rows if x["provider"] == name)["error"] = f"{type(err).__name__}: {err}"[:500]
                del times[name]
            finally:
                gc.enable()
    for row in rows:
        if row["provider"] in times:
            seconds = statistics.median(times[row["provider"]])
            row.update(step_ms=seconds * 1e3, tokens_per_s=real_tokens / seconds,
                       rounds_ms=[t * 1e3 for t in times[row["provider"]]])

    timed = {r["provider"]: r for r in rows if "step_ms" in r}
    padded_row = timed.get("padded_sdpa")
    for name, r in timed.items():
        if padded_row:
            r["vs_padded"] = ratio_spread(times["padded_sdpa"], times[name])
            r["speedup_vs_padded"] = r["vs_padded"]["median"]
            r["loss_diff_vs_padded"] = abs(r["first_loss"] - padded_row["first_loss"])
    best = max((r for n, r in timed.items() if n in ("packed_torch", "packed_triton")),
               key=lambda r: r.get("speedup_vs_padded", 0), default=None)
    best_speedup = best.get("speedup_vs_padded") if best else None
    setup = dict(params=params, examples=len(examples), real_tokens=real_tokens, padded_tokens=padded.input_ids.numel(),
                 max_len=int(packed.max_seqlen), dtype=str(dtype).replace("torch.", ""), layers=shape["num_hidden_layers"],
                 hidden=shape["hidden_size"], heads=shape["num_attention_heads"], kv_heads=shape["num_key_value_heads"])
    print(f"\ntraining step, {params / 1e6:.0f}M-parameter Llama ({setup['layers']} layers, hidden {setup['hidden']}, "
          f"{setup['heads']}/{setup['kv_heads']} heads), {len(examples)} examples, {real_tokens} real tokens "
          f"({setup['padded_tokens']} when padded), {setup['dtype']}, {device}")
    print(f"{'provider':<15}{'batch':>14}{'step ms':>10}{'tokens/s':>12}{'vs padded':>11}{'loss':>9}{'|diff|':>9}{'peak GiB':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['provider']:<15}FAILED: {r['error']}")
            continue
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        print(f"{r['provider']:<15}{str(r['batch_shape']):>14}{r['step_ms']:>10.1f}{r['tokens_per_s']:>12.0f}"
              f"{r.get('speedup_vs_padded', float('nan')):>10.2f}x{r['first_loss']:>9.4f}"
              f"{r.get('loss_diff_vs_padded', float('nan')):>9.4f}{peak:>10}")
    print(f"packed varlen (best: {best['provider'] if best else 'none timed'}) vs padded SDPA, training step: "
          f"{verdict(best_speedup, TARGET_PACKED_VS_PADDED, smoke=args.cpu_smoke)}"
          + (f"; padded / packed pair ratios {spread_text(best['vs_padded'])}" if best and "vs_padded" in best else ""))
    emit_json(dict(bench="train_step", smoke=args.cpu_smoke, versions=versions("triton", "transformers"),
                   device=device_name(device), date=time.strftime("%Y-%m-%d"), setup=setup, results=rows,
                   packed_vs_padded=None if args.cpu_smoke else best_speedup, target=TARGET_PACKED_VS_PADDED),
              args.json_out)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
