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
QWEN3_TRAINING = os.path.join(os.path.dirname(trl.__file__), "chat_templates", "qwen3_training.jinja")
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
])
def test_conversations_without_a_trainable_turn_are_refused(conversations, match):
    with pytest.raises(DataError, match=match):
        turn_rows(conversations)


OPENING = [[msg("assistant", "hi friend"), msg("user", "how are you"), msg("assistant", "fine thanks"),
            msg("user", "be brief"), msg("assistant", "ok")], CONVERSATIONS[1], [msg("assistant", "hello there")]]


def trl_messages_masks(conversations, tok, tmp_path):
    """Input ids and the assistant mask TRL's own ``SFTTrainer(assistant_only_loss=True)`` gives each conversation
    as a ``messages`` row (its dataset preparation, a tiny random model; no training)."""
    datasets = pytest.importorskip("datasets")
    from test_chat import trl_labels

    tok.save_pretrained(str(tmp_path / "qwen3-words"))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "qwen3-words"))
    ids, labels = trl_labels(datasets.Dataset.from_list([{"messages": c} for c in conversations]), tok,
                             assistant_only_loss=True)
    return ids, [[int(x != -100) for x in row] for row in labels]


def test_trl_trains_an_opening_assistant_message_and_so_do_turns(tmp_path):
    """Regression (the multi-turn ratio's 2.65x against the 2.74x asked): an assistant message that opens its
    conversation (6,358 of ShareGPT's conversations: its split ones) was history of the later turns and not
    trained (a ChatWarning), on the ground that TRL refuses an empty prompt. TRL's own preparation says otherwise
    for the row that holds the conversation: ``SFTTrainer(assistant_only_loss=True)`` on a ``messages`` row with TRL's
    ``qwen3_training.jinja`` puts the assistant mask on the opening message (only a prompt/completion row cannot
    hold it: TRL fails on an empty prompt). So the turn-by-turn path trains it too, as a turn with an empty
    history: the sample is the message alone, scored on the tokens TRL's mask puts on that message in the whole
    conversation; every assistant message is trained once, and the later turns keep it in their history."""
    from test_chat import trl_labels

    from packkit.chat import ChatWarning

    tok = qwen3_tokenizer()
    tok.chat_template = open(QWEN3_TRAINING).read()
    ids, masks = trl_messages_masks(OPENING, tok, tmp_path)
    a0 = tok.apply_chat_template(OPENING[0][:1], tokenize=True, return_dict=True)["input_ids"]
    header = tok.apply_chat_template(OPENING[0][:1], tokenize=False).index("<think>")  # '<|im_start|>assistant\n'
    assert ids[0][:len(a0)] == list(a0)  # the conversation's render starts with the message's own
    trl_a0 = [t for t, m in zip(ids[0][:len(a0)], masks[0]) if m]
    assert tok.decode(trl_a0).split() == "<think> </think> hi friend <|im_end|>".split()  # TRL trains it
    # a prompt/completion row with an empty prompt: TRL cannot read it (IndexError in is_conversational, or
    # transformers' "Cannot apply chat template to an empty conversation")
    with pytest.raises((IndexError, ValueError)):
        trl_labels(pytest.importorskip("datasets").Dataset.from_list([{"prompt": [], "completion": OPENING[0][:1]}]),
                   tok)

    rows, conv = turn_rows(OPENING)
    assert rows[0] == {"prompt": [], "completion": OPENING[0][:1]} and conv.tolist() == [0, 0, 0, 1, 2]
    with pytest.warns(ChatWarning, match=r"^2 conversations open with an assistant message \(the first: conversation "
                                         r"0\): each is trained as a turn of its own, the message alone"):
        tree = chat_tree(OPENING, tok)
    off = tree.sample_ptr
    assert off.size - 1 == sum(m["role"] == "assistant" for c in OPENING for m in c) == 5
    sample = [tree.input_ids[tree.path[off[s]:off[s + 1]]].tolist() for s in range(5)]
    scored = [tree.input_ids[tree.score_target[tree.score_sample == s]].tolist() for s in range(5)]
    assert sample[0] == list(a0) and scored[0] == trl_a0 and len(tok.decode(a0)) > header
    assert sample[4] == list(tok.apply_chat_template(OPENING[2], tokenize=True, return_dict=True)["input_ids"])
    assert scored[4] == [t for t, m in zip(ids[2], masks[2]) if m]  # the lone message: what TRL trains of it
    for s, row in enumerate(rows[1:4], 1):  # the later turns: TRL's prompt/completion rows, the opening one in
        full = tok.apply_chat_template(row["prompt"] + row["completion"], tokenize=True, return_dict=True)["input_ids"]
        assert sample[s] == list(full)
    assert sample[1][:len(a0)] == list(a0)  # the opening turn is the history of the next: forwarded once
    n = tree.num_sample_tokens - sum(map(len, sample[1:]))
    print(f"opening turn {n} tokens, {len(scored[0])} scored; tree {tree.num_nodes} nodes of {tree.num_sample_tokens}")
    assert n == len(a0)


def test_an_opening_message_under_the_tokenizers_own_template_is_rendered_as_trl_trains_it():
    """Qwen3's ``qwen3.jinja`` has no ``{% generation %}`` markers: TRL's SFTTrainer(assistant_only_loss=True) swaps
    its ``qwen3_training.jinja`` in for a messages row, and so does the opening turn (packkit's tokenize_chat, the
    same swap); the later turns stay prompt/completion rows of the template given."""
    from packkit.chat import ChatWarning

    tok = qwen3_tokenizer()
    with pytest.warns(ChatWarning, match="under TRL's training version of"):
        tree = chat_tree(OPENING[:1], tok)
    off = tree.sample_ptr
    want = tok.apply_chat_template(OPENING[0][:1], chat_template=open(QWEN3_TRAINING).read(), tokenize=True,
                                   return_dict=True)["input_ids"]
    assert tree.input_ids[tree.path[off[0]:off[1]]].tolist() == list(want) and off.size - 1 == 3


def test_an_opening_message_a_template_cannot_mask_is_history_only():
    """A template with no ``{% generation %}`` markers that TRL has no training version of cannot say which of the
    message's tokens TRL trains (TRL's assistant_only_loss refuses it): the message stays history of the later
    turns, untrained, and the warning says why; a conversation left with nothing to train is refused."""
    from packkit.chat import ChatWarning

    tok = qwen3_tokenizer()
    tok.chat_template = open(QWEN3).read() + "{#- not TRL's own -#}"
    with pytest.warns(ChatWarning, match=r"^1 conversations open with an assistant message \(the first: conversation "
                                         r"0\): not trained, history for the later turns only, since .*generation"):
        tree = chat_tree(OPENING[:2], tok)
    assert tree.sample_ptr.size - 1 == 3  # the two later turns of conversation 0, and conversation 1's
    assert "hi friend" in tok.decode(tree.input_ids[tree.path[tree.sample_ptr[0]:tree.sample_ptr[1]]])
    with pytest.raises(DataError, match="conversation 2 has no assistant message after another message"):
        chat_tree(OPENING, tok)


def test_opening_turns_through_tree_collator_score_as_each_turn_alone():
    """The turn samples (an opening one among them) through TreeCollator, one group a conversation: the same tree
    as chat_tree's, and each turn's log-probabilities those of the turn alone, the opening turn's included."""
    import warnings

    from packkit.chat import ChatWarning
    from packkit.prefixtree import TreeCollator

    tok = qwen3_tokenizer()
    tok.chat_template = open(QWEN3_TRAINING).read()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ChatWarning)
        tree = chat_tree(OPENING, tok)
        _, conv = turn_rows(OPENING)
    off = tree.sample_ptr
    examples = []
    for s in range(off.size - 1):
        path = tree.path[off[s]:off[s + 1]]
        mask = np.isin(path, tree.score_target[tree.score_sample == s]).astype(np.int8)  # a path's nodes are distinct
        examples.append({"input_ids": tree.input_ids[path].tolist(), "completion_mask": mask.tolist(),
                         "conversation": int(conv[s])})
    batch = TreeCollator(group_key="conversation")(examples)
    assert int(batch.num_tokens.sum()) == tree.score_target.size and batch.num_tokens.numel() == 5
    model = tiny_causal_lm("qwen3", dtype=torch.float64, attn_implementation="sdpa", vocab_size=len(VOCAB),
                           max_position_embeddings=256).eval()
    with torch.no_grad():
        got = token_logps(model(**batch.model_inputs(model)).logits, batch)
        ref = []
        for ex in examples:
            x = torch.tensor(ex["input_ids"])[None]
            logp = model(input_ids=x).logits[0, :-1].log_softmax(-1).gather(1, x[0, 1:, None])[:, 0]
            ref.append(logp[torch.tensor(ex["completion_mask"][1:], dtype=torch.bool)])
    d = (got - torch.cat(ref)).abs().max().item()
    print(f"5 turns, the opening one among them, through TreeCollator: max |diff| {d:.1e}")
    assert d < 1e-10 and ref[0].numel() == int(batch.num_tokens[0]) > 0


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


def test_waste_turns_counts_an_opening_message_as_a_turn(tmp_path, capsys):
    """``packkit waste FILE --turns``: a conversation that opens with an assistant message counts that message as a
    turn (the figures chat_tree gives: before, 3 turns of these 2 conversations, the opening one history only), and
    says so in one line on stderr."""
    import json
    import warnings

    from packkit.chat import ChatWarning
    from packkit.cli import main

    tok_dir = tmp_path / "qwen3-words"
    qwen3_tokenizer().save_pretrained(str(tok_dir))
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in OPENING[:2]))
    tok = qwen3_tokenizer()
    tok.chat_template = open(QWEN3_TRAINING).read()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ChatWarning)
        tree = chat_tree(OPENING[:2], tok)
    assert main(["waste", str(data), "--turns", "--tokenizer", str(tok_dir), "--chat-template", QWEN3_TRAINING,
                 "--json"]) == 0
    out, err = capsys.readouterr()
    got = json.loads(out)
    assert (got["turns"], got["turn_tokens"], got["tree_tokens"]) == (4, tree.num_sample_tokens, tree.num_nodes)
    assert "1 conversations open with an assistant message" in err and "turn of its own" in err
