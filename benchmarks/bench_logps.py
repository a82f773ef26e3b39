"""Peak memory of packed DPO and GRPO log-probabilities against TRL's unpacked trainers, same batch, same run.

Each variant runs one loss step (forward of the policy, and of the reference for DPO, then the backward) in a
fresh subprocess of its own, variants alternated round after round (the order reversed every other round). The
child builds its models and batch, collects garbage, resets its peak resident set (``/proc/self/clear_refs``: 5)
and reads ``VmRSS``; the step's peak is ``VmHWM`` after the step minus that ``VmRSS`` (torch's CPU tensors are
plain mallocs that tracemalloc cannot see; ``MALLOC_MMAP_THRESHOLD_`` is fixed at 128 KiB so that every tensor is
its own mapping, returned when freed). Also its CPU time (``time.process_time``), with the load average beside it.

Variants (``dpo:`` a batch of ``--pairs`` pairs; ``grpo:`` ``--groups`` prompts with ``--k`` completions each):

* ``dpo:trl``: TRL 1.16's ``DPOTrainer.compute_loss`` on its own collator's padded batch (chosen and rejected rows
  padded to the longest; its fused LM head, TRL's chunked log-probabilities: no ``[tokens, vocab]`` logits).
* ``dpo:packkit-pairs`` / ``dpo:packkit-tree``: ``PackedDPOMixin`` + ``DPOTrainer`` on ``PreferenceCollator``'s
  ``[1, T]`` row (pairs: each completion with its prompt; tree: the prompt once) through ``forward_logps``.
* ``dpo:packkit-before``: the packed path as it was (the model's ``[1, T, V]`` logits, then ``log_softmax`` over the
  scored rows), to show what the issue measured.
* ``grpo:trl``: what ``GRPOTrainer`` runs for the policy's log-probabilities: prompts left-padded, completions
  right-padded, ``model(..., labels=labels, fused_lm_head=True)`` (TRL's ``add_fused_lm_head``, log-probs only),
  the sum of the completion tokens' log-probabilities backwards.
* ``grpo:packkit-tree`` / ``grpo:packkit-pairs`` / ``grpo:packkit-before``: ``GroupCollator`` and
  ``forward_logps`` (before: the full logits), the same sum backwards.

Lengths: completions from real ShareGPT conversation lengths (``benchlib.chat_lengths``), prompts the histories of
real ShareGPT turns (``benchlib.chat_turns``; before, a synthetic lognormal of median 100), both clipped to ``--cap``; token ids random. The model: a Llama from a
config (``--vocab`` 151,936 as Qwen's, hidden ``--hidden``, 2 layers, tied embeddings), ``--dtype`` float32.

Target: packed peak <= unpacked peak (``dpo:packkit-*`` <= ``dpo:trl``, ``grpo:packkit-*`` <= ``grpo:trl``).
Usage: ``python benchmarks/bench_logps.py [--rounds 3] [--vocab 151936] [--pairs 8] [--dtype float32] [--before]``
(``--before``: the ``packkit-before`` variants too).
Prints a table last, then one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time

import numpy as np

from benchlib import chat_lengths, chat_turns, emit_json, loadavg, ratio_spread, spread_text, versions

VARIANTS = ["trl", "packkit-pairs", "packkit-tree"]


# ----------------------------------------------------------------------------------------------
# the child: one variant, one step
# ----------------------------------------------------------------------------------------------


def _status() -> dict:
    text = open("/proc/self/status").read()
    return {k: int(re.search(k + r":\s+(\d+)", text).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}


def lengths(args, n: int, seed: int):
    """``(prompts, completions)``, (n,) each, clipped to ``--cap``: real ShareGPT turns (``benchlib.chat_turns``), a
    turn's history the prompt, and real conversation lengths as completions (``benchlib.chat_lengths``)."""
    turns, loss = chat_turns(n, seed=seed)
    prompt = np.clip(turns - loss, 8, args.cap)
    return prompt, np.clip(chat_lengths(n, seed=seed + 1), 4, args.cap)


def tiny_llama(args, seed: int):
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=4 * args.cap, tie_word_embeddings=True,
                                      pad_token_id=0, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa",
                                                      dtype=getattr(torch, args.dtype))


def word_tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>", "a", "b"])},
                                    unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>",
                                                unk_token="<unk>")


def dpo_step(args, who: str):
    """The step of a DPO variant, as a callable, after its trainer and batch are built."""
    import datasets
    import torch
    import trl

    from packkit.preference import PackedDPOMixin, PreferenceCollator, SequenceLogps, dpo_loss

    class PackedDPOTrainer(PackedDPOMixin, trl.DPOTrainer):
        pass

    class BeforeDPOTrainer(PackedDPOTrainer):  # the packed path as it was: full logits, then log_softmax
        def _packed_dpo_loss(self, model, ref_model, inputs, *, beta):
            def logps(m):
                logits = m(**inputs.model_inputs(m)).logits
                rows = logits.reshape(-1, logits.shape[-1])[inputs.score_source]
                tok = rows.log_softmax(-1).gather(1, inputs.input_ids.reshape(-1)[inputs.score_target][:, None])[:, 0]
                return SequenceLogps.of_tokens(tok, inputs), None

            policy, _ = logps(model)
            with torch.no_grad():
                reference, _ = logps(ref_model)
            return dpo_loss(policy, reference, beta=beta), None, policy, reference

    prompt, comp = lengths(args, 2 * args.pairs, seed=0)
    rng = np.random.default_rng(1)
    rows = [{"prompt_ids": rng.integers(10, args.vocab, int(prompt[i])).tolist(),
             "chosen_ids": rng.integers(10, args.vocab, int(comp[2 * i])).tolist(),
             "rejected_ids": rng.integers(10, args.vocab, int(comp[2 * i + 1])).tolist()} for i in range(args.pairs)]
    cls = {"trl": trl.DPOTrainer, "packkit-before": BeforeDPOTrainer}.get(who, PackedDPOTrainer)
    collator = None if who == "trl" else PreferenceCollator(layout=who.split("-")[1] if who != "packkit-before"
                                                            else "pairs")
    config = trl.DPOConfig(output_dir=args.tmp, use_cpu=True, report_to=[], max_length=None, beta=0.1,
                           per_device_train_batch_size=args.pairs, disable_tqdm=True, bf16=False)
    trainer = cls(model=tiny_llama(args, 0), ref_model=tiny_llama(args, 1), args=config, processing_class=word_tokenizer(),
                  train_dataset=datasets.Dataset.from_list([{"prompt": "a ", "chosen": "b", "rejected": "a"}] * 2),
                  data_collator=collator)
    batch = trainer.data_collator(rows)
    tokens = int(batch["input_ids"].numel())
    return (lambda: trainer.compute_loss(trainer.model, batch).backward()), tokens


def grpo_step(args, who: str):
    """The step of a GRPO variant: the policy's completion log-probabilities summed, backwards."""
    import torch
    from trl.trainer.utils import add_fused_lm_head

    from packkit.preference import GroupCollator, forward_logps

    prompt, comp = lengths(args, args.groups * args.k, seed=2)
    rng = np.random.default_rng(3)
    groups = [{"prompt_ids": rng.integers(10, args.vocab, int(prompt[g])).tolist(),
               "completion_ids": [rng.integers(10, args.vocab, int(comp[g * args.k + j])).tolist()
                                  for j in range(args.k)]} for g in range(args.groups)]
    model = tiny_llama(args, 0)
    if who == "trl":
        add_fused_lm_head(model, outputs=("log_probs",))
        p_max = max(len(g["prompt_ids"]) for g in groups)
        c_max = max(len(c) for g in groups for c in g["completion_ids"])
        ids, mask = [], []
        for g in groups:
            p = g["prompt_ids"]
            for c in g["completion_ids"]:
                ids.append([0] * (p_max - len(p)) + p + c + [0] * (c_max - len(c)))
                mask.append([0] * (p_max - len(p)) + [1] * (len(p) + len(c)) + [0] * (c_max - len(c)))
        ids, mask = torch.tensor(ids), torch.tensor(mask)
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :p_max] = -100  # only the completion tokens are scored (logits_to_keep = c_max)

        def step():
            out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
            out.log_probs[:, -c_max:].sum().backward()

        return step, int(ids.numel())
    batch = GroupCollator(layout="pairs" if who == "packkit-before" else who.split("-")[1])(groups)
    if who == "packkit-before":
        def step():
            logits = model(**batch.model_inputs(model)).logits
            rows = logits.reshape(-1, logits.shape[-1])[batch.score_source]
            rows.log_softmax(-1).gather(1, batch.input_ids.reshape(-1)[batch.score_target][:, None]).sum().backward()
    else:
        def step():
            forward_logps(model, batch)[0].sum.sum().backward()
    return step, int(batch.input_ids.numel())


def child(args) -> None:
    kind, who = args.child.split(":")
    step, tokens = (dpo_step if kind == "dpo" else grpo_step)(args, who)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status()["VmRSS"]
    cpu = time.process_time()
    step()
    cpu = time.process_time() - cpu
    print(json.dumps({"variant": args.child, "peak_mb": (_status()["VmHWM"] - before) / 2**20, "cpu_s": cpu,
                      "tokens": tokens, "load": loadavg()}))


# ----------------------------------------------------------------------------------------------
# the parent: fresh processes, alternated
# ----------------------------------------------------------------------------------------------


def run_variant(args, name: str) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name] + [
        f"--{k}={getattr(args, k)}" for k in ("vocab", "hidden", "pairs", "groups", "k", "cap", "dtype", "tmp")]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--cap", type=int, default=512)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--only", default="dpo,grpo")
    ap.add_argument("--before", action="store_true", help="also the packed path as it was (full logits: "
                    "tens of GB at a 150k vocabulary and thousands of tokens; use small batches)")
    ap.add_argument("--tmp", default="/tmp/bench_logps")
    ap.add_argument("--child", default=None)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.child:
        return child(args)
    kinds = args.only.split(",")
    names = [f"{k}:{w}" for k in kinds for w in VARIANTS + ["packkit-before"] * args.before]
    results: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            got = run_variant(args, name)
            results[name].append(got)
            print(f"round {r}: {name:22s} peak {got['peak_mb']:8.1f} MB  cpu {got['cpu_s']:6.2f} s  "
                  f"tokens {got['tokens']:6,}  load {got['load']:.1f}", flush=True)
    print(f"\n{versions('transformers', 'trl')}")
    print(f"vocab {args.vocab:,}, hidden {args.hidden}, {args.dtype}; DPO {args.pairs} pairs, GRPO {args.groups} x "
          f"{args.k}; lengths clipped to {args.cap}; {args.rounds} rounds alternated")
    print(f"{'variant':22s} {'tokens':>7s} {'peak MB (median)':>17s} {'range':>17s} {'vs trl, pair ratios':>40s} "
          f"{'cpu s':>6s} {'load':>5s}")
    record = {"versions": versions("transformers", "trl"), "args": vars(args), "variants": {}}
    for name in names:
        peaks = [x["peak_mb"] for x in results[name]]
        base = [x["peak_mb"] for x in results[name.split(":")[0] + ":trl"]]
        pairs = ratio_spread(peaks, base)
        cpu = statistics.median(x["cpu_s"] for x in results[name])
        load = statistics.median(x["load"] for x in results[name])
        print(f"{name:22s} {results[name][0]['tokens']:7,} {statistics.median(peaks):17.1f} "
              f"{min(peaks):8.1f}-{max(peaks):8.1f} {spread_text(pairs):>40} {cpu:6.2f} {load:5.1f}")
        record["variants"][name] = {"peak_mb": peaks, "ratio_to_trl": [a / b for a, b in zip(peaks, base)],
                                    "ratio_to_trl_spread": pairs, "cpu_s_median": cpu, "load": load,
                                    "tokens": results[name][0]["tokens"]}
    met = all(max(v["ratio_to_trl"]) <= 1.0 for n, v in record["variants"].items()
              if n.split(":")[1] in ("packkit-pairs", "packkit-tree"))
    print(f"target (packed peak <= TRL's unpacked, every round): {'met' if met else 'MISSED'}")
    record["target_met"] = met
    emit_json(record, args.json_out)


if __name__ == "__main__":
    main()
