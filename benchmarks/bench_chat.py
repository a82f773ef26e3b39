"""Chat data through a chat template: packkit's ``tokenize_chat`` against TRL's ``SFTTrainer`` preparation.

The data is conversations built from CPython's own help topics (``pydoc_data.topics``, as
``packkit/data/make_sample.py`` reads them): the user asks "Explain NAME.", the assistant answers with
the section's text, one to three turns a conversation. The tokenizer is a byte-level BPE trained here on
that text, saved with a ChatML template whose assistant replies sit inside ``{% generation %}``. Nothing
is downloaded.

Providers, each on the same ``datasets.Dataset`` with assistant-only loss:

* ``packkit.chat.tokenize_chat``: batches of conversations rendered and tokenized in one call each,
  masks with numpy;
* TRL's ``SFTTrainer._prepare_dataset`` (``assistant_only_loss=True``, ``max_length=None``): what
  ``SFTTrainer(train_dataset=...)`` runs before training, one example at a time through ``Dataset.map``;
* one ``apply_chat_template`` call per example (the tokenizing step alone, as TRL calls it).

The labels must agree exactly (checked). With ``--num-proc 1,2`` packkit (``tokenize_chat(num_proc=N)``) and
TRL (``SFTConfig(dataset_num_proc=N)``) are measured at each process count, and each result checked
identical to the one-process labels. Prints a table, then one JSON line.

    python benchmarks/bench_chat.py [--conversations 4000] [--repeat 3] [--num-proc 1,2]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import warnings

from benchlib import best_of, versions

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n"
            "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def corpus() -> list[tuple[str, str]]:
    import pydoc_data.topics

    from packkit.data.make_sample import topic_sections

    return topic_sections(pydoc_data.topics.topics)


def conversations(sections, n: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        conv = []
        for _ in range(rng.randint(1, 3)):
            title, body = rng.choice(sections)
            conv += [{"role": "user", "content": f"Explain {title}."}, {"role": "assistant", "content": body}]
        out.append(conv)
    return out


def tokenizer(sections, folder: str):
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk.train_from_iterator([b for _, b in sections], trainers.BpeTrainer(vocab_size=8192, special_tokens=special,
                                                                          show_progress=False))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                               additional_special_tokens=special[1:])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(folder)


def labels_of(ids, masks):
    return [[t if m else -100 for t, m in zip(i, k)] for i, k in zip(ids, masks)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=4000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--num-proc", default="1", help="comma-separated process counts (default 1)")
    args = p.parse_args()
    procs = [int(x) for x in args.num_proc.split(",")]

    import datasets
    import transformers
    import trl

    from packkit.chat import tokenize_chat

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    sections = corpus()
    convs = conversations(sections, args.conversations)
    folder = tempfile.mkdtemp(prefix="bench_chat_tok_")
    tok = tokenizer(sections, folder)
    ds = datasets.Dataset.from_list([{"messages": c} for c in convs])

    t_packkit, table = best_of(lambda: tokenize_chat(ds, tok), args.repeat)
    ids = table.column("input_ids").to_pylist()
    ours = labels_of(ids, table.column("assistant_masks").to_pylist())
    t_procs = {1: t_packkit}
    for n in procs:
        if n > 1:
            t_procs[n], got = best_of(lambda: tokenize_chat(ds, tok, num_proc=n), args.repeat)
            assert got.equals(table), f"packkit with num_proc={n} differs from one process"
    tokens = sum(len(x) for x in ids)
    loss = sum(sum(x != -100 for x in row) for row in ours)

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2))
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = trl.SFTConfig(output_dir=d, report_to=[], bf16=False, use_cpu=True, max_length=None,
                            assistant_only_loss=True)
        trainer = trl.SFTTrainer(model=model, args=cfg, train_dataset=ds.select(range(8)), processing_class=tok)
        t_trl, prepared = best_of(lambda: trainer._prepare_dataset(ds, tok, cfg, False, None, "train"), args.repeat)
        assert prepared["input_ids"] == ids and prepared["labels"] == ours, "packkit and TRL disagree"
        t_trl_procs = {1: t_trl}
        for n in procs:
            if n > 1:
                cfg_n = trl.SFTConfig(output_dir=d, report_to=[], bf16=False, use_cpu=True, max_length=None,
                                      assistant_only_loss=True, dataset_num_proc=n)
                t_trl_procs[n], prep = best_of(lambda: trainer._prepare_dataset(ds, tok, cfg_n, False, None, "train"),
                                               args.repeat)
                assert prep["input_ids"] == ids and prep["labels"] == ours, f"TRL with {n} processes disagrees"

    def per_example():
        return [tok.apply_chat_template(c, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
                for c in convs]

    t_loop, outs = best_of(per_example, args.repeat)
    assert labels_of([o["input_ids"] for o in outs], [o["assistant_masks"] for o in outs]) == ours

    rows = [("packkit tokenize_chat", t_packkit), ("TRL SFTTrainer._prepare_dataset", t_trl),
            ("apply_chat_template per example", t_loop)]
    for n in procs:
        if n > 1:
            rows += [(f"packkit tokenize_chat, {n} procs", t_procs[n]), (f"TRL _prepare_dataset, {n} procs",
                                                                         t_trl_procs[n])]
    v = versions("transformers", "tokenizers", "trl", "datasets", "pyarrow")
    print(f"chat data: {len(convs):,} conversations, {tokens:,} tokens, {loss:,} loss tokens (assistant replies); "
          f"byte-level BPE (8,192), best of {args.repeat}")
    print(f"{'provider':<34} {'seconds':>8} {'tokens/s':>12} {'vs packkit':>10}")
    for name, t in rows:
        print(f"{name:<34} {t:>8.3f} {tokens / t:>12,.0f} {t / t_packkit:>9.2f}x")
    print("labels identical across every provider and process count: yes")
    speedup = {n: round(t_trl_procs[n] / t_procs[n], 3) for n in procs}
    for n in procs:
        print(f"{n} process(es): packkit {speedup[n]:.2f}x faster than TRL's preparation (target >= 2x: "
              f"{'met' if speedup[n] >= 2 else 'MISSED'})")
    print(json.dumps({"bench": "chat", "conversations": len(convs), "tokens": tokens, "loss_tokens": loss,
                      "seconds": {name: round(t, 4) for name, t in rows}, "speedup_vs_trl": speedup, "versions": v}))


if __name__ == "__main__":
    main()
