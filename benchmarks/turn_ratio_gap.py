"""The multi-turn ratio against issue 30's accounting (2.74x): the real template's, token by token (2.75x; 2.65x before
the opening assistant messages were trained).

Every real ShareGPT conversation (``fetch_chat_data.sh``) that has an assistant message is rendered message by
message twice: through TRL's prefix-preserving ``qwen3_training.jinja`` (what ``make_turn_lengths.py --template``
renders) and as bare ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``, the issue's accounting), each piece
tokenized with Qwen3's tokenizer split at its special tokens (``make_turn_lengths.CachedTokenizer``). Pieces
concatenate to the whole render (checked per conversation: the template puts nothing between messages), and no
BPE merge crosses a piece (each ends ``<|im_end|>\\n`` before the next's ``<|im_start|>``), so a sample's tokens
are the sum of its messages' pieces and each sample is a prefix of its conversation's next one. Then, with
``P(k)`` the tokens up to and including message ``k``:

* tokens per turn = sum of ``P(k)`` over the assistant messages ``k`` (each a turn: ``turn_rows``; one that
  opens its conversation is the message alone, ``P(0)``, as ``opening_turns`` tokenizes it);
* tokens forwarded = trie nodes of the samples; one chain per conversation, so ``P(last assistant k)`` per
  conversation (checked against ``build_tree`` on real ids, and the per-sample lengths against
  ``benchmarks/data/sharegpt_qwen3_training_turns.npz``).

Beside ours: before (the opening assistant messages history only, not trained, and the conversations that have
only those left out), and the issue's accounting (ours with the template's own tokens out: bare ChatML); what the
trie finds across conversations (``build_tree`` without ``groups``): over the whole set, and within batches of
conversations drawn in random order (seeded) of about ``--batch-tokens`` forwarded tokens; and the prefix
recomputed when a conversation's tree is cut at a window (``split_trees``).

    python benchmarks/turn_ratio_gap.py --sharegpt DIR/sharegpt.json --tokenizer DIR/qwen3/tokenizer.json
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from benchlib import loadavg
from make_chat_lengths import ROLES, conversations
from make_turn_lengths import CachedTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
TRAINING_TURNS = os.path.join(HERE, "data", "sharegpt_qwen3_training_turns.npz")


def ratio(num: int, den: int) -> str:
    return f"{num:>12,} {den:>12,} {num / den:6.4f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sharegpt", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--template", default=None, help="default: TRL's qwen3_training.jinja")
    parser.add_argument("--batch-tokens", default="8192,65536,1048576")
    parser.add_argument("--windows", default="8192,32768")
    args = parser.parse_args()

    import trl
    from transformers import PreTrainedTokenizerFast

    from packkit.integrations.transformers import jinja_compiler
    from packkit.prefixtree import build_tree, split_trees

    t0 = time.time()
    path = args.template or os.path.join(os.path.dirname(trl.__file__), "chat_templates", "qwen3_training.jinja")
    render = jinja_compiler()(open(path).read()).render
    tok = PreTrainedTokenizerFast(tokenizer_file=args.tokenizer)
    special = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
    convs = []
    for turns in conversations(args.sharegpt):
        m = [{"role": ROLES.get(t["from"], t["from"]), "content": t["value"]} for t in turns]
        if any(x["role"] == "assistant" for x in m):
            convs.append(m)
    pieces, chatml, role, conv = [], [], [], []
    for c, m in enumerate(convs):
        ps = [render(messages=m[:1], add_generation_prompt=False, **special)]
        for k in range(1, len(m)):  # a message's piece: what rendering it adds (prefix-preserving template)
            ps.append(render(messages=[{"role": "user", "content": ""}, m[k]], add_generation_prompt=False,
                             **special)[len("<|im_start|>user\n<|im_end|>\n"):])
        whole = render(messages=m, add_generation_prompt=False, **special)
        assert "".join(ps) == whole, c
        pieces += ps
        chatml += [f"<|im_start|>{x['role']}\n{x['content']}<|im_end|>\n" for x in m]
        role += [x["role"] for x in m]
        conv += [c] * len(m)
    enc = CachedTokenizer(tok)
    ids = enc(pieces)
    n_tmpl = np.array([len(x) for x in ids], np.int64)
    n_chatml = np.array([len(x) for x in enc(chatml)], np.int64)
    conv, asst = np.array(conv), np.array(role) == "assistant"
    first = np.r_[True, conv[1:] != conv[:-1]]
    # an opening assistant message: every message before it in its conversation is an assistant's
    non_asst = ~asst
    seen = np.cumsum(non_asst) - np.repeat(np.cumsum(non_asst)[first] - non_asst[first], np.bincount(conv))
    opening = asst & (seen == 0)
    trained = asst & ~opening
    has_trained = np.bincount(conv, weights=trained, minlength=len(convs)) > 0
    print(f"{len(convs):,} conversations with an assistant message ({has_trained.sum():,} with a trained turn), "
          f"{len(role):,} messages, {asst.sum():,} assistant ({opening.sum():,} opening), rendered and tokenized in "
          f"{time.time() - t0:.0f} s", flush=True)

    def account(n, turns, keep):
        """(tokens per turn, tokens forwarded): turns at messages ``turns`` of conversations ``keep``."""
        start = np.r_[0, np.cumsum(np.bincount(conv, weights=n, minlength=len(convs)))[:-1]].astype(np.int64)
        P = np.cumsum(n) - np.repeat(start, np.bincount(conv, minlength=len(convs)))  # tokens up to message k
        turns = turns & keep[conv]
        last = np.zeros(len(convs), np.int64)
        np.maximum.at(last, conv[turns], P[turns])
        return int(P[turns].sum()), int(last.sum()), P

    all_convs = np.ones(len(convs), bool)
    ours = account(n_tmpl, asst, all_convs)
    rows = [(f"ours: qwen3_training.jinja, all {asst.sum():,} assistant messages of {len(convs):,} conversations",
             ours[:2]),
            (f"before: the {opening.sum():,} opening ones history only, {has_trained.sum():,} conversations",
             account(n_tmpl, trained, has_trained)[:2]),
            ("ours, the template's own tokens out (bare ChatML): the issue's accounting",
             account(n_chatml, asst, all_convs)[:2])]

    # checks: the shipped file's samples, and the trie of the real ids
    data = np.load(TRAINING_TURNS)
    P = ours[2]
    assert np.array_equal(P[asst], data["length"].astype(np.int64)), "lengths differ"
    flat = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    msg_off = np.r_[0, np.cumsum(n_tmpl)]
    conv_start = msg_off[:-1][first]
    t_idx = np.flatnonzero(asst)
    lengths = P[t_idx]
    starts = conv_start[conv[t_idx]]
    take = np.concatenate([np.arange(s, s + n) for s, n in zip(starts.tolist(), lengths.tolist())])
    groups = conv[t_idx]
    tree = build_tree(flat[take], lengths, groups=groups)
    assert (tree.num_sample_tokens, tree.num_nodes) == ours[:2], ((tree.num_sample_tokens, tree.num_nodes), ours[:2])
    # across conversations: the last sample of each holds all its nodes
    last_of = np.r_[groups[1:] != groups[:-1], True]
    ends = np.flatnonzero(last_of)
    ids_last = np.concatenate([np.arange(s, s + n) for s, n in zip(starts[ends].tolist(), lengths[ends].tolist())])
    whole = build_tree(flat[ids_last], lengths[ends]).num_nodes
    rows.append(("ours, one trie over every conversation (no groups)", (ours[0], whole)))
    rng = np.random.default_rng(0)
    for budget in map(int, args.batch_tokens.split(",")):
        order = rng.permutation(ends.size)
        cum = np.cumsum(lengths[ends][order])
        batch = cum // budget
        nodes = 0
        for b in np.unique(batch):
            sel = np.sort(order[batch == b])
            sel_ids = np.concatenate([np.arange(s, s + n) for s, n in zip(starts[ends][sel].tolist(),
                                                                          lengths[ends][sel].tolist())])
            nodes += build_tree(flat[sel_ids], lengths[ends][sel]).num_nodes
        rows.append((f"ours, conversations drawn into batches of ~{budget:,} tokens, one trie a batch",
                     (ours[0], nodes)))
    for window in map(int, args.windows.split(",")):
        # a conversation with a sample over the window cannot be trained at it (split_trees refuses): left out
        keep = (np.bincount(groups, weights=lengths > window, minlength=len(convs)) == 0)[groups]
        tree_w = build_tree(flat[take][np.repeat(keep, lengths)], lengths[keep], groups=groups[keep])
        _, recomputed = split_trees(tree_w, window=window)
        rows.append((f"conversations whose samples fit window {window:,} ({np.unique(groups[keep]).size:,}), whole",
                     (tree_w.num_sample_tokens, tree_w.num_nodes)))
        rows.append((f"  the same, trees cut at the window ({recomputed:,} tokens recomputed)",
                     (tree_w.num_sample_tokens, tree_w.num_nodes + recomputed)))
    print(f"\nload {loadavg():.1f}; checked: the shipped file's {t_idx.size:,} sample lengths, and build_tree's "
          "counts on the real ids")
    print(f"{'accounting':80s} {'per turn':>12s} {'forwarded':>12s}  ratio")
    for name, (a, b) in rows:
        print(f"{name:80s} {ratio(a, b)}")
    extra = n_tmpl - n_chatml
    print(f"\nthe template's tokens beyond ChatML, by role: " + ", ".join(
        f"{r} {int(extra[np.array(role) == r].sum()):,} over {int((np.array(role) == r).sum()):,} messages "
        f"(per message {np.unique(extra[np.array(role) == r])[:6].tolist()})" for r in sorted(set(role))))


if __name__ == "__main__":
    main()
