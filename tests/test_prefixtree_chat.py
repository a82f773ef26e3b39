"""Multi-turn chat trained turn by turn, through the real Qwen3 chat template, as one prefix tree a conversation.

Qwen3's template (TRL ships it: ``trl/chat_templates/qwen3.jinja``, read from the installed package, nothing
downloaded) drops the reasoning of earlier assistant turns and keeps the last turn's, so every assistant turn is a
sample of its own. The reference is the template itself: sample ``t`` must be exactly
``apply_chat_template(messages[:t + 1])`` with its loss on what follows ``apply_chat_template(messages[:t],
add_generation_prompt=True)``; the tree must forward one token a distinct prefix (the nested-loop trie) and give
each sample's log-probabilities as the sample alone does.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from packkit.errors import DataError
from packkit.prefixtree import chat_tree, tree_batch, turn_rows
from packkit.preference import token_logps

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
pytest.importorskip("tokenizers")

from test_prefixtree import reference_trie  # noqa: E402
from testlib import tiny_causal_lm  # noqa: E402

QWEN3 = os.path.join(os.path.dirname(trl.__file__), "chat_templates", "qwen3.jinja")
SPECIAL = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
WORDS = ("user assistant system hello there hi friend how are you fine thanks what is two plus three five be brief ok "
         "let me think sum first then answer").split()
VOCAB = {w: i for i, w in enumerate(SPECIAL + WORDS)}


def qwen3_tokenizer():
    """One token a whitespace-separated word, Qwen3's special tokens split out first, Qwen3's real template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>",
                                               eos_token="<|im_end|>", additional_special_tokens=SPECIAL[2:])
    with open(QWEN3) as f:
        tok.chat_template = f.read()
    return tok


def msg(role, content, reasoning=None):
    return {"role": role, "content": content, **({"reasoning_content": reasoning} if reasoning else {})}


CONVERSATIONS = [
    [msg("user", "what is two plus three"), msg("assistant", "five", "let me think sum first"),
     msg("user", "how are you"), msg("assistant", "fine thanks", "then answer"),
     msg("user", "be brief"), msg("assistant", "ok")],
    [msg("system", "be brief"), msg("user", "hello there"), msg("assistant", "hi friend", "hello first")],
]


def test_turn_samples_are_what_the_template_renders():
    tok = qwen3_tokenizer()
    tree = chat_tree(CONVERSATIONS, tok)
    rows, conv = turn_rows(CONVERSATIONS)
    assert conv.tolist() == [0, 0, 0, 1]
    off = tree.sample_ptr
    for s, row in enumerate(rows):
        full = tok.apply_chat_template(row["prompt"] + row["completion"], tokenize=True, return_dict=True)["input_ids"]
        prompt = tok.apply_chat_template(row["prompt"], tokenize=True, return_dict=True,
                                         add_generation_prompt=True)["input_ids"]
        got = tree.input_ids[tree.path[off[s]:off[s + 1]]].tolist()
        assert got == list(full)
        assert full[:len(prompt)] == list(prompt)
        scored = tree.score_target[tree.score_sample == s]
        assert scored.tolist() == tree.path[off[s] + len(prompt):off[s + 1]].tolist()  # the turn, all of it
    # the removed reasoning is what the template removes: an earlier turn's reasoning is in its own sample only
    text = [tok.decode(tree.input_ids[tree.path[off[s]:off[s + 1]]]) for s in range(len(rows))]
    assert "let me think sum first" in text[0] and "let me think sum first" not in text[1] + text[2]
    assert "then answer" in text[1] and "then answer" not in text[2]
    assert "five" in text[1] and "fine thanks" in text[2]  # the replies stay in the history
    # one token forwarded a distinct prefix, conversation by conversation
    samples = [(tree.input_ids[tree.path[off[s]:off[s + 1]]].tolist(), None, int(conv[s])) for s in range(len(rows))]
    count, _ = reference_trie(samples, groups=conv)
    assert tree.num_nodes == count < tree.num_sample_tokens
    print(f"4 turns of 2 conversations: {tree.num_sample_tokens} tokens a turn, {tree.num_nodes} forwarded")


def test_turn_log_probs_equal_each_turn_alone():
    tok = qwen3_tokenizer()
    tree = chat_tree(CONVERSATIONS, tok)
    model = tiny_causal_lm("qwen3", dtype=torch.float64, attn_implementation="sdpa", vocab_size=len(VOCAB),
                           max_position_embeddings=256).eval()
    batch = tree_batch(tree, window=int(tree.tree_sizes.max()))
    with torch.no_grad():
        got = token_logps(model(**batch.model_inputs(model)).logits, batch)
        ref = []
        for s in range(tree.sample_ptr.size - 1):
            x = torch.from_numpy(tree.input_ids[tree.path[tree.sample_ptr[s]:tree.sample_ptr[s + 1]]])[None]
            logp = model(input_ids=x).logits[0, :-1].log_softmax(-1).gather(1, x[0, 1:, None])[:, 0]
            ref.append(logp[-int(tree.num_tokens[s]):])
    d = (got - torch.cat(ref)).abs().max().item()
    print(f"turn by turn, tree against each turn alone: max |diff| {d:.1e}")
    assert d < 1e-10


@pytest.mark.parametrize("conversations, match", [
    ([[msg("user", "hello")]], "conversation 0 has no assistant message"),
    ([[msg("user", "hi"), msg("assistant", "ok")], [msg("assistant", "hi"), msg("user", "hello")]],
     "conversation 1 starts with an assistant message"),
])
def test_conversations_without_a_trainable_turn_are_refused(conversations, match):
    with pytest.raises(DataError, match=match):
        turn_rows(conversations)


def test_an_opening_assistant_message_is_history_of_the_later_turns():
    """Regression: a conversation that opens with an assistant message (6,222 of ShareGPT's 17,392 trainable ones:
    its split conversations) was refused ("drop that message"), and the benchmark dropped the message, so every
    later turn lost it from its history (ShareGPT's per-turn samples 1.3M tokens shorter). Now it is history, as
    the data has it, not trained itself (no prompt precedes it), and a ChatWarning counts it."""
    from packkit.chat import ChatWarning

    convs = [[msg("assistant", "hi friend"), msg("user", "how are you"), msg("assistant", "fine thanks"),
              msg("user", "be brief"), msg("assistant", "ok")], CONVERSATIONS[1]]
    with pytest.warns(ChatWarning, match=r"^1 assistant messages open their conversation \(the first in conversation "
                                         r"0\).*not trained themselves"):
        rows, conv = turn_rows(convs)
    assert [r["prompt"] for r in rows[:2]] == [convs[0][:2], convs[0][:4]] and conv.tolist() == [0, 0, 1]
    tok = qwen3_tokenizer()
    with pytest.warns(ChatWarning):
        tree = chat_tree(convs, tok)
    off = tree.sample_ptr
    for s, row in enumerate(rows):  # each turn's sample is the template's rendering of its whole history
        full = tok.apply_chat_template(row["prompt"] + row["completion"], tokenize=True, return_dict=True)["input_ids"]
        assert tree.input_ids[tree.path[off[s]:off[s + 1]]].tolist() == list(full)
    assert "hi friend" in tok.decode(tree.input_ids[tree.path[off[1]:off[2]]])


def test_waste_turns_reports_tokens_with_and_without_sharing(tmp_path, capsys):
    """``packkit waste FILE --turns --tokenizer TOK``: the figures chat_tree gives, as a line and as JSON."""
    import json

    from packkit.cli import main

    tok_dir = tmp_path / "qwen3-words"
    qwen3_tokenizer().save_pretrained(str(tok_dir))
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    tree = chat_tree(CONVERSATIONS, qwen3_tokenizer())
    assert main(["waste", str(data), "--turns", "--tokenizer", str(tok_dir), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["turns"], got["turn_tokens"], got["tree_tokens"]) == (4, tree.num_sample_tokens, tree.num_nodes)
    assert main(["waste", str(data), "--turns", "--tokenizer", str(tok_dir)]) == 0
    out = capsys.readouterr().out
    assert f"{tree.num_nodes:,}" in out and f"{tree.num_sample_tokens / tree.num_nodes:.2f}x fewer" in out
    assert main(["waste", str(data), "--turns"]) != 0  # no tokenizer: one line naming --tokenizer
    assert "--tokenizer" in capsys.readouterr().err


def test_waste_turns_names_the_fix_for_sharegpt_rows(tmp_path, capsys):
    """ShareGPT rows (``conversations`` of ``from``/``value`` turns, as the real ShareGPT file has them) are refused
    in one line that says what to write instead: ``messages`` of ``role``/``content``, human -> user, gpt ->
    assistant (the error named neither the column found nor the fix)."""
    import json

    from packkit.cli import main

    tok_dir = tmp_path / "qwen3-words"
    qwen3_tokenizer().save_pretrained(str(tok_dir))
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps([{"id": "0", "conversations": [{"from": "human", "value": "hi"},
                                                              {"from": "gpt", "value": "hello"}]}]))
    assert main(["waste", str(data), "--turns", "--tokenizer", str(tok_dir)]) != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'conversations'" in err and "'messages'" in err
    assert "'human' -> 'user'" in err and "'gpt' -> 'assistant'" in err
