"""The whole loop, as a user writes it: packed windows, exact loss under accumulation, on the CPU.

A tiny randomly initialised Llama (hidden 64, 2 layers) learns a synthetic SFT task: a random prompt,
then a completion that follows a fixed rule (each token is ``(3 * previous + 1) mod vocab``), with the
loss on the completion only. packkit supplies the three pieces:

* ``PackedBatchSampler``: best-fit windows of ``--window`` tokens over the whole dataset,
  ``--windows-per-batch`` per micro-batch, in a seeded random order;
* ``FixedWindowCollator(strategy="next_fit")``: rebuilds exactly those windows as a ``PackedBatch``
  (``[B, W]``, positions reset per document, first label of every document -100) -- or
  ``PaddingFreeCollator`` with ``--padding-free`` (one ``[1, T]`` row);
* ``accumulation_step``: counts the loss tokens of the optimiser step once, so that the accumulated
  gradient is that of the mean over every loss token of the step.

Each optimiser step logs the loss, tokens and loss tokens per step, examples per step and the
padding fraction::

    python examples/train_tiny.py --steps 20
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch
from torch.utils.data import DataLoader

from packkit.budget import synthetic_sft_lengths
from packkit.collate import FixedWindowCollator, PaddingFreeCollator
from packkit.loss import accumulation_step
from packkit.sampler import PackedBatchSampler

VOCAB = 64


def make_dataset(n: int, *, window: int, seed: int) -> list[dict]:
    """``n`` SFT-like examples (dicts with ``input_ids`` and ``labels``), none longer than ``window``."""
    lengths, loss_lengths = synthetic_sft_lengths(n, seed=seed, max_length=window)
    rng = np.random.default_rng(seed)
    data = []
    for n_tok, n_loss in zip(lengths.tolist(), loss_lengths.tolist()):
        prompt = rng.integers(1, VOCAB, n_tok - n_loss)
        completion = np.empty(n_loss, np.int64)
        prev = int(prompt[-1])
        for j in range(n_loss):  # tiny data generation, not the training path
            prev = (3 * prev + 1) % VOCAB
            completion[j] = prev
        ids = np.concatenate([prompt, completion])
        labels = ids.copy()
        labels[: n_tok - n_loss] = -100  # loss on the completion only
        data.append({"input_ids": ids, "labels": labels})
    return data


def tiny_llama(window: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=window)
    # sdpa finds document boundaries from the reset position_ids (no attention_mask, no cache)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="optimiser steps (default 20)")
    p.add_argument("--accumulation", type=int, default=4, help="micro-batches per optimiser step")
    p.add_argument("--window", type=int, default=512, help="tokens per window")
    p.add_argument("--windows-per-batch", type=int, default=2, help="windows per micro-batch")
    p.add_argument("--examples", type=int, default=1500, help="size of the generated dataset")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--padding-free", action="store_true", help="one [1, T] row per micro-batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON line per step instead of text")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.steps < 1 or args.accumulation < 1:
        raise SystemExit("--steps and --accumulation must be >= 1")
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    data = make_dataset(args.examples, window=args.window, seed=args.seed)
    lengths = [len(x["input_ids"]) for x in data]

    sampler = PackedBatchSampler(lengths, window=args.window, windows_per_batch=args.windows_per_batch,
                                 seed=args.seed)
    collate = (PaddingFreeCollator() if args.padding_free else
               FixedWindowCollator(window=args.window, strategy="next_fit", num_windows=args.windows_per_batch))
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=collate)

    model = tiny_llama(args.window, args.seed).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    def micro_batches():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    stream = micro_batches()
    log = []
    for step_idx in range(args.steps):
        t0 = time.perf_counter()
        mbs = [next(stream) for _ in range(args.accumulation)]
        step = accumulation_step(mbs)  # counts the loss tokens of the whole step once
        step_loss = torch.zeros(())
        for mb in mbs:
            inputs = {k: v for k, v in mb.hf_kwargs().items() if k != "labels"}  # the loss is ours
            logits = model(**inputs).logits
            loss = step.loss(logits, mb)  # summed CE / loss tokens of the step
            loss.backward()
            step_loss += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        slots = sum(mb.input_ids.numel() for mb in mbs)
        record = {
            "step": step_idx + 1,
            "loss": step.mean_loss(step_loss),
            **step.as_dict(),
            "padding_fraction": 1.0 - step.num_tokens / slots,
            "grad_norm": float(grad_norm),
            "seconds": time.perf_counter() - t0,
        }
        if not math.isfinite(record["loss"]):
            raise FloatingPointError(f"step {step_idx + 1}: the loss is {record['loss']}")
        log.append(record)
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            print(f"step {record['step']:3d}  loss {record['loss']:.4f}  tokens/step {record['tokens_per_step']:6,d}  "
                  f"loss tokens/step {record['loss_tokens_per_step']:6,d}  examples/step "
                  f"{record['examples_per_step']:3d}  padding {100 * record['padding_fraction']:4.1f}%  "
                  f"({record['seconds']:.2f}s)", flush=True)
    return log


if __name__ == "__main__":
    main()
