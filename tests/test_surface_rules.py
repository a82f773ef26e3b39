"""The rules of :mod:`packkit.rules` on the surfaces added after the SFT paths: lengths (``pack``,
``waste``, ``shard_groups``), cost models, CP ``restore``, preference pairs and RL groups. One fault a test,
each failing on the code before the fix (the old behaviour is in the docstring), through the public API and,
where one exists, its real consumer (the command line, a DataLoader with workers, TRL's DPOTrainer); every test
reads the message, which names the example (or group, part, option) and the fix, in one line.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from packkit.balance import CostModel, compute_imbalance, cost_model
from packkit.binpack import pack
from packkit.collate import FixedWindowCollator, PaddingFreeCollator
from packkit.model_inputs import VisionLanguageCollator
from packkit.cp import restore, shard
from packkit.errors import ArgumentError
from packkit.preference import shard_groups
from packkit.sampler import PackedBatchSampler
from packkit.waste import measure_waste


def one_line(exc) -> str:
    msg = str(exc.value if hasattr(exc, "value") else exc)
    assert "\n" not in msg, msg
    return msg


# ----------------------------------------------------------------------------------------------
# lengths: values past int64, NaN, fractions
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lengths, shown", [
    (np.array([3, 2**64 - 1, 5], np.uint64), "18446744073709551615 (uint64)"),
    ([3, 2**64 - 1, 5], "18446744073709551615 (int)"),
    ([3, 2**70, 5], "1180591620717411303424 (int)"),
    (np.array([3.0, 1e20, 5.0]), "1e+20 (float64)"),
])
def test_a_length_past_int64_is_named_as_given_not_as_minus_one(lengths, shown):
    """Before: ``example 1 has length -1`` (uint64 cast to int64), or a large negative for 1e20."""
    for call in (lambda: pack(lengths, window=8), lambda: measure_waste(lengths, window=8)):
        with pytest.raises(ValueError) as info:
            call()
        assert one_line(info).startswith(f"example 1 has length {shown} in lengths, beyond int64"), str(info.value)


def test_a_uint64_length_file_through_the_command_line(tmp_path, capsys):
    from packkit.cli import main

    path = tmp_path / "lengths.npy"
    np.save(path, np.array([3, 2**64 - 1, 5], np.uint64))
    for command in (["waste", str(path)], ["plan", str(path), "-w", "8"]):
        assert main(command) == 3
        err = capsys.readouterr().err.strip()
        assert "example 1 has length 18446744073709551615 (uint64) in " in err and path.name in err
        assert "beyond int64" in err
        assert "-1" not in err.replace(str(path), "").replace("2**63 - 1", "") and len(err.splitlines()) == 1


@pytest.mark.parametrize("tokens, words", [
    ([3, float("nan")], "group_tokens[1] = nan is not a whole number of tokens; pass integer token counts"),
    ([3, float("inf")], "group_tokens[1] = inf is not a whole number of tokens"),
    ([3, 2.5], "group_tokens[1] = 2.5 is not a whole number of tokens"),
    ([3, 0], "group 1 has length 0: every group needs at least 1 token"),
    (np.array([3, 2**64 - 1], np.uint64), "group 1 has length 18446744073709551615 (uint64) in group_tokens, beyond"),
])
def test_shard_groups_reads_group_tokens_by_the_length_rule(tokens, words):
    """Before: NaN and inf raised numpy's 'cannot convert float NaN to integer' (naming no group), 2.5 became 2."""
    with pytest.raises(ValueError) as info:
        shard_groups(tokens, world_size=1, max_tokens=8)
    assert words in one_line(info)
    assert [m.tolist() for m in shard_groups([3.0, 2.0], world_size=1, max_tokens=8)[0]] == [[0, 1]]


# ----------------------------------------------------------------------------------------------
# cost models
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("linear", [float("inf"), float("-inf"), float("nan"), 0.0, -1])
def test_cost_must_be_a_finite_positive_weight(linear):
    """Before: cost=inf was accepted, and a balanced sampler then reported its imbalance as 1.0 (perfect)."""
    want = f"cost must be a finite positive number (the per-token weight), got {linear!r}"
    for call in (lambda: CostModel(linear=linear), lambda: cost_model(linear),
                 lambda: PackedBatchSampler([5, 3, 4, 2] * 8, window=8, world_size=2, rank=0, balance="compute",
                                            cost=linear)):
        with pytest.raises(ArgumentError) as info:
            call()
        assert one_line(info) == want


def test_compute_imbalance_refuses_a_cost_that_is_not_finite():
    """Before: ``[[nan, 1]]`` gave 1.0 (NaN compares False), ``[[inf, inf]]`` NaN."""
    for bad, at in (([[1.0, 2.0], [np.nan, 1.0]], "rank_cost[1, 0] = nan"), ([[np.inf, np.inf]], "rank_cost[0, 0] = inf"),
                    ([[1.0, -2.0]], "rank_cost[0, 1] = -2.0")):
        with pytest.raises(ValueError) as info:
            compute_imbalance(bad)
        assert one_line(info).startswith(at + ": a rank's cost is a finite number >= 0")
    assert compute_imbalance([[3, 1], [2, 2]]) == 1.25


# ----------------------------------------------------------------------------------------------
# CP restore: any array of the ranks' outputs
# ----------------------------------------------------------------------------------------------


def test_restore_takes_numpy_arrays_and_lists_and_names_a_bad_part():
    """Before: numpy arrays and lists raised ``AttributeError: 'numpy.ndarray' object has no attribute 'dim'``."""
    batch = PaddingFreeCollator(loss_mask="none")([{"input_ids": [1, 2, 3, 4, 5]}, {"input_ids": [6, 7, 8]}])
    shards = [shard(batch, cp_size=2, rank=r, cp_layout="zigzag") for r in range(2)]
    plan = shards[0].plan
    want = batch.input_ids.reshape(-1)
    for parts in ([s.input_ids.numpy() for s in shards], [s.input_ids.tolist() for s in shards],
                  [s.input_ids[0].tolist() for s in shards], np.stack([s.input_ids[0].numpy() for s in shards]),
                  tuple(s.input_ids for s in shards)):
        assert torch.equal(restore(parts, plan=plan), want)
    ids = [s.input_ids for s in shards]
    n = plan.local_len
    for parts, words in (
            ([ids[0], ids[1][:, :-1]], f"restore: part 1 (rank 1) has shape (1, {n - 1}); every part holds the rank's "
                                       f"local_len={n} tokens"),
            ([ids[0].numpy(), [["a"] * n]], "restore: part 1 (rank 1) is a list of <U1 values, not numbers"),
            ([ids[0], [[1, 2], [3]]], "restore: part 1 (rank 1) is a list of object values, not numbers"),
            ([ids[0], ids[1].float()], f"restore: part 1 (rank 1) is ({n},) torch.float32 and part 0 ({n},) torch.int64"),
            (3, "restore takes a list of 2 parts (one per rank, in rank order), got int"),
            ([ids[0]], "restore needs one part per rank (2), got 1")):
        with pytest.raises((TypeError, ValueError)) as info:
            restore(parts, plan=plan)
        assert one_line(info).startswith(words), str(info.value)
    assert torch.equal(restore(ids, plan=plan, shape=batch.input_ids.shape), batch.input_ids)
    for shape in ((2, 5), (8, 0.5)):  # before: torch's "shape '[2, 5]' is invalid for input of size 8"
        with pytest.raises(ValueError) as info:
            restore(ids, plan=plan, shape=shape)
        assert one_line(info) == (f"restore: shape={shape} for the batch's 8 tokens; pass the batch's own "
                                  "input_ids.shape (or no shape, for the flat order)")


# ----------------------------------------------------------------------------------------------
# preference pairs and RL groups: token ids, something to score, per-example values
# ----------------------------------------------------------------------------------------------

from packkit.errors import DataError  # noqa: E402
from packkit.preference import GroupCollator, PreferenceCollator, tokenize_preference  # noqa: E402

PAIR = {"prompt_ids": [1, 2], "chosen_ids": [3, 4], "rejected_ids": [5]}
GROUP = {"prompt_ids": [1, 2], "completion_ids": [[3, 4], [5]]}


@pytest.mark.parametrize("collate, examples, words", [
    (PreferenceCollator(), [PAIR, dict(PAIR, prompt_ids=[], chosen_ids=[3], rejected_ids=[5])],
     "example 1 has an empty 'prompt_ids' and 1 token in 'chosen_ids': nothing to score (a sequence's first token "
     "has no token before it to be predicted from); give it a prompt (a BOS token) or filter it out"),
    (PreferenceCollator(layout="tree", window=8), [dict(PAIR, prompt_ids=[], chosen_ids=[3, 4], rejected_ids=[5])],
     "example 0 has an empty 'prompt_ids' and 1 token in 'rejected_ids': nothing to score"),
    (GroupCollator(), [GROUP, {"prompt_ids": [], "completion_ids": [[3, 4], [5]]}],
     "example 1 has an empty 'prompt_ids' and 1 token in 'completion_ids' (completion 1): nothing to score"),
    (GroupCollator(), [GROUP, {"prompt_ids": [1], "completion_ids": [[3, 4], []]}],
     "example 1 has an empty 'completion_ids' (completion 1): nothing to score; filter such examples out first"),
    (PreferenceCollator(), [dict(PAIR, rejected_ids=[])],
     "example 0 has an empty 'rejected_ids': nothing to score; filter such examples out first"),
    (PreferenceCollator(), [PAIR, dict(PAIR, chosen_ids=[3, -4])],
     "example 1 has token id -4 in 'chosen_ids'; token ids are integers >= 0"),
    (PreferenceCollator(), [dict(PAIR, prompt_ids=np.array([1, -2]))],
     "example 0 has token id -2 in 'prompt_ids'; token ids are integers >= 0"),
    (PreferenceCollator(), [dict(PAIR, rejected_ids=torch.tensor([-1]))],
     "example 0 has token id -1 in 'rejected_ids'; token ids are integers >= 0"),
    (GroupCollator(), [GROUP, {"prompt_ids": [1], "completion_ids": [[3], [4], [5, -6]]}],
     "example 1 has token id -6 in 'completion_ids' (completion 2); token ids are integers >= 0"),
    (GroupCollator(), [GROUP, {"prompt_ids": [1], "completion_ids": [[3], [4.5]]}],
     "example 1 has 4.5 (float) in 'completion_ids' (completion 1); token ids are integers >= 0"),
    (GroupCollator(), [GROUP, {"prompt_ids": [1], "completion_ids": [3, 4]}],
     "example 1 has 3 (int) as completion 0 of 'completion_ids'; an RL group is prompt_ids with completion_ids (a list "
     "of token lists) (one per completion: [[3, 4], [5]], not [3, 4, 5])"),
    (GroupCollator(), [{"prompt_ids": [-1], "completion_ids": [[3]]}],
     "example 0 has token id -1 in 'prompt_ids'; token ids are integers >= 0"),
    (GroupCollator(), [{"prompt_ids": [1], "completion_ids": [[2**64 - 1]]}],
     "example 0 has 18446744073709551615 (int) in 'completion_ids' (completion 0), beyond int64"),
])
def test_pairs_and_groups_follow_the_token_rules(collate, examples, words):
    """Before: all accepted (a sequence with no scored token gave sum 0 and mean 0 to the DPO loss; negative ids
    reached the embedding), but for the empty reply (own wording) and the float (named by its flat completion)."""
    with pytest.raises(DataError) as info:
        collate(examples)
    assert one_line(info).startswith(words), str(info.value)


ADVANTAGES = [
    ([[1.0, float("nan")], [0.5]], "example 0 has nan (float) in 'advantages' (completion 1); advantages are finite "
                                   "numbers, one per completion: fix or drop the example"),
    ([[1.0, 2.0], np.array([np.inf])], "example 1 has inf (float) in 'advantages' (completion 0)"),
    ([[1.0, 2.0], torch.tensor([-np.inf])], "example 1 has -inf (float) in 'advantages' (completion 0)"),
    ([[1.0, 2.0], None], "example 1 has no 'advantages' while example 0 has them; advantages are finite numbers, one "
                         "per completion, on every example or on none (a batch cannot be trained with some): fill it "
                         "in or drop the column"),
    ([None, [1.0]], "example 0 has no 'advantages' while example 1 has them"),
    ([[[1.0], [2.0, 3.0]], [1.0]], "example 0 has a nested list in 'advantages' (ragged); advantages are finite "
                                   "numbers, one per completion: pass one flat list per example"),
    ([[[1.0], [2.0]], [1.0]], "example 0 has a nested list in 'advantages' (shape [2, 1])"),
    ([["high", "low"], [1.0]], "example 0 has 'high' (str) in 'advantages' (completion 0); advantages are finite "
                               "numbers, one per completion"),
    (["0.5", [1.0]], "example 0 has '0.5' (str) in 'advantages'"),
    ([[1.0, None], [1.0]], "example 0 has a null in 'advantages' (completion 1)"),
    ([[1.0, True], [1.0]], "example 0 has True (bool) in 'advantages' (completion 1)"),
    ([[1.0], [1.0]], "example 0 has 1 'advantages' for 2 completions; give one per completion"),
]


@pytest.mark.parametrize("values, words", ADVANTAGES, ids=[w[:40] for _, w in ADVANTAGES])
def test_advantages_are_finite_and_on_every_example_or_none(values, words):
    """Before: NaN and inf kept in ``sequence_values``; a batch where one example lacked them dropped the column
    for all (nothing said); ragged or text values ended in numpy's 'setting an array element with a sequence' or
    'could not convert string to float', naming no example; a bool read as 1.0."""
    groups = [dict(GROUP, advantages=values[0]), {"prompt_ids": [7], "completion_ids": [[8]], "advantages": values[1]}]
    with pytest.raises(DataError) as info:
        GroupCollator()([{k: v for k, v in g.items() if v is not None} for g in groups])
    assert one_line(info).startswith(words), str(info.value)


def test_good_advantages_ride_along_and_errors_cross_dataloader_workers():
    groups = [dict(GROUP, advantages=torch.tensor([0.5, -1.0])), {"prompt_ids": [7], "completion_ids": [[8]],
                                                                   "advantages": 2}]
    assert GroupCollator()(groups).sequence_values["advantages"].tolist() == [0.5, -1.0, 2.0]
    assert GroupCollator()([GROUP]).sequence_values == {}  # on none: no column
    bad = groups * 3 + [dict(GROUP, advantages=[1.0, float("nan")])]
    loader = torch.utils.data.DataLoader(bad, batch_size=7, num_workers=2, collate_fn=GroupCollator(layout="tree"))
    with pytest.raises(DataError, match=r"example 6 has nan \(float\) in 'advantages' \(completion 1\)"):
        list(loader)
    pairs = [PAIR, dict(PAIR, chosen_ids=[-3])]
    loader = torch.utils.data.DataLoader(pairs, batch_size=2, num_workers=2, collate_fn=PreferenceCollator())
    with pytest.raises(DataError, match="example 1 has token id -3 in 'chosen_ids'; token ids are integers >= 0"):
        list(loader)


def word_tokenizer(eos_token):
    from tokenizers import Tokenizer, models, pre_tokenizers
    transformers = pytest.importorskip("transformers")

    words = ["<pad>", "<unk>", "</s>", "a", "b", "c", "d"]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=eos_token, pad_token="<pad>",
                                                unk_token="<unk>")


def test_a_tokenizer_without_eos_is_refused_for_text_pairs():
    """Before: ``eos_token or ""`` appended nothing, and the replies ended without an EOS (TRL appends one)."""
    rows = [{"prompt": "a b ", "chosen": "c", "rejected": "d"}]
    assert tokenize_preference(rows, word_tokenizer("</s>")) == [{"prompt_ids": [3, 4], "chosen_ids": [5, 2],
                                                                 "rejected_ids": [6, 2]}]
    with pytest.raises(DataError) as info:  # before: "example 1 has no 'rejected'", no fix
        tokenize_preference(rows + [{"prompt": "a", "chosen": "b"}], word_tokenizer("</s>"))
    assert one_line(info) == ("example 1 has no 'rejected'; a preference pair is 'prompt', 'chosen' and 'rejected', "
                              "text or conversations (or their tokenized prompt_ids, chosen_ids and rejected_ids)")
    for collate in (lambda: tokenize_preference(rows, word_tokenizer(None)),
                    lambda: PreferenceCollator(tokenizer=word_tokenizer(None))(rows)):
        with pytest.raises(ArgumentError) as info:
            collate()
        assert one_line(info) == (
            "example 0 is text and the tokenizer has no EOS token (eos_token is None): TRL's DPOTrainer ends every "
            "text reply with it, so the replies would end without one; set tokenizer.eos_token to the model's "
            "end-of-turn token, or pass conversations (the chat template ends them)")


@pytest.mark.slow  # a real DPOTrainer (22 s at load 7): make test runs it, make test-fast does not
def test_dpo_trainer_with_packed_pairs_refuses_a_pair_with_nothing_to_score(tmp_path):
    """The real consumer: TRL's DPOTrainer with packkit's PackedDPOMixin and PreferenceCollator. A text pair whose
    prompt is empty and whose chosen reply is the EOS alone tokenizes (as DPOTrainer does) to no prompt token and a
    1-token reply. Before: trained, that sequence's log-probability a sum over no token (0) in the DPO loss."""
    pytest.importorskip("trl")
    from test_preference import PackedDPOTrainer, dpo_trainer, preference_rows

    rows = preference_rows(4, 0, conversational=False)
    rows[2] = {"prompt": "", "chosen": "</s>", "rejected": rows[2]["rejected"]}
    trainer = dpo_trainer(tmp_path, rows, cls=PackedDPOTrainer, max_steps=1,
                          collator=PreferenceCollator(layout="tree", window=64))
    assert trainer.train_dataset[2]["prompt_ids"] == [] and len(trainer.train_dataset[2]["chosen_ids"]) == 1
    with pytest.raises(DataError) as info:
        trainer.train()
    assert "has an empty 'prompt_ids' and 1 token in 'chosen_ids': nothing to score" in one_line(info)


# ----------------------------------------------------------------------------------------------
# vision-language documents: images against their grids and their placeholder tokens
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vl():
    """A tiny random Qwen2-VL (2x2 patches merged into one token) and what its processor would give: document 0
    with a (1, 4, 4) image (16 patch rows, 4 placeholder tokens), 1 with a (1, 2, 4) image (8 rows, 2 tokens),
    2 with a (2, 4, 4) video (32 rows, 8 tokens), 3 text only."""
    pytest.importorskip("transformers")
    from testlib import tiny_vl_model, vl_example

    g = torch.Generator().manual_seed(0)
    docs = [vl_example(g, 3, images=[(1, 4, 4)]), vl_example(g, 2, images=[(1, 2, 4)]),
            vl_example(g, 2, videos=[(2, 4, 4)]), vl_example(g, 5)]
    return tiny_vl_model(), docs


def _without(ex, drop: int, token: int) -> dict:
    """``ex`` with ``drop`` of its ``token`` placeholders removed (ids, types, labels alike); ``drop < 0`` adds them."""
    keep = list(range(len(ex["input_ids"])))
    at = [j for j in keep if ex["input_ids"][j] == token]
    if drop >= 0:
        keep = [j for j in keep if j not in at[:drop]]
    else:
        keep = keep[:at[-1] + 1] + [at[-1]] * -drop + keep[at[-1] + 1:]
    return dict(ex, **{k: [ex[k][j] for j in keep] for k in ("input_ids", "mm_token_type_ids", "labels")})


def _vl_case(name, docs):
    """The documents of one hostile case (each keeps the batch's totals of patches and tokens where it can, so
    the model's own check, which reads totals, passes)."""
    a, b, v, t = (dict(d) for d in docs)
    if name == "patches_moved":  # 4 patch rows of document 0's image given to document 1's
        a["pixel_values"], b["pixel_values"] = docs[0]["pixel_values"][:12], torch.cat(
            [docs[0]["pixel_values"][12:], docs[1]["pixel_values"]])
    elif name == "tokens_moved":  # 2 placeholder tokens moved from document 0 to document 1
        a, b = _without(a, 2, 120), _without(b, -2, 120)
    elif name == "tokens_without_image":  # document 1's 2 placeholder tokens moved into the text-only document
        b = _without(b, 2, 120)
        t = dict(t, input_ids=t["input_ids"][:1] + [120] * 2 + t["input_ids"][1:], mm_token_type_ids=[0, 1, 1] + [0] * 4,
                 labels=t["labels"][:1] + [-100] * 2 + t["labels"][1:])
    elif name == "two_number_grid":
        a["image_grid_thw"] = torch.tensor([[4, 4]])
    elif name == "video_patches":
        v["pixel_values_videos"] = docs[2]["pixel_values_videos"][:24]
    elif name == "unmergeable_grid":  # 1 x 3 x 4 = 12 patch rows, but 3 rows of patches cannot merge 2 by 2
        b["image_grid_thw"], b["pixel_values"] = torch.tensor([[1, 3, 4]]), docs[1]["pixel_values"][:6].repeat(2, 1)
    elif name == "patch_width":
        b["pixel_values"] = docs[1]["pixel_values"][:, :12]
    elif name == "types_disagree":
        a["mm_token_type_ids"] = [0] * len(a["input_ids"])
    elif name == "seconds":
        v["second_per_grid_ts"] = [1.0, 2.0]
    return [t, a, b, v]  # the text document first: errors name examples 1-3 by their place here


VL_CASES = [
    ("patches_moved", "example 1 has 'pixel_values' of shape [12, 24] for image_grid_thw [[1, 4, 4]], which needs 16 "
                      "patch rows (t*h*w summed); keep the pixel_values and image_grid_thw the processor returned for "
                      "this example together"),
    ("tokens_moved", "example 1 has 2 image placeholder tokens (image_token_id=120) in 'input_ids' for image_grid_thw "
                     "[[1, 4, 4]], which the model turns into 4 (t*h*w / spatial_merge_size**2 = 16 / 4); keep the "
                     "text and the images the processor returned together"),
    ("tokens_without_image", "example 0 has 2 image placeholder tokens (image_token_id=120) in 'input_ids' but no "
                             "'pixel_values'; they would take another document's image features"),
    ("two_number_grid", "example 1 has image_grid_thw of shape [1, 2]; a grid is one (t, h, w) row per image, as the "
                        "processor returns it"),
    ("video_patches", "example 3 has 'pixel_values_videos' of shape [24, 24] for video_grid_thw [[2, 4, 4]], which "
                      "needs 32 patch rows"),
    ("unmergeable_grid", "example 2 has image_grid_thw [1, 3, 4] (image 0), whose h and w are not multiples of the "
                         "model's spatial_merge_size=2"),
    ("patch_width", "example 2 has 'pixel_values' rows of 12 values and example 1 of 24; every image of a batch comes "
                    "from the same processor"),
    ("types_disagree", "example 1 has 0 image tokens marked 1 in 'mm_token_type_ids' for 4 image placeholder tokens "
                       "in 'input_ids'; keep the mm_token_type_ids the processor returned"),
    ("seconds", "example 3 has 2 'second_per_grid_ts' for 1 videos; give one per video"),
]


@pytest.mark.parametrize("name, words", VL_CASES, ids=[c[0] for c in VL_CASES])
def test_vision_language_documents_are_checked_against_their_grids(vl, name, words):
    """Before (positions stored, as a dataset holds them): patches or placeholder tokens moved between documents,
    mm_token_type_ids that disagree with the tokens, and a second_per_grid_ts too many were collated and the model
    ran (it checks the batch's totals only), training documents on another's image, silently; the others ended in
    torch's or transformers' errors naming no example ("Sizes of tensors must match", "shape '[1, 2, 2, 2]' is
    invalid")."""
    model, docs = vl
    examples = _vl_case(name, docs)
    rope = None if name == "two_number_grid" else model.model.get_rope_index
    for collate in (VisionLanguageCollator(PaddingFreeCollator(), config=model.config),
                    VisionLanguageCollator(PaddingFreeCollator(), rope_index=rope, config=model.config),
                    VisionLanguageCollator(FixedWindowCollator(window=64), rope_index=model.model.get_rope_index)):
        stored = [dict(ex, position_ids=np.broadcast_to(np.arange(len(ex["input_ids"])), (3, len(ex["input_ids"]))))
                  for ex in examples] if collate.rope_index is None else examples
        with pytest.raises(DataError) as info:
            collate(stored)
        assert one_line(info).startswith(words), str(info.value)


def test_vision_checks_pass_real_documents_and_cross_dataloader_workers(vl):
    model, docs = vl
    collate = VisionLanguageCollator(FixedWindowCollator(window=64, num_windows=2), rope_index=model.model.get_rope_index)
    batch = collate(docs)
    with torch.no_grad():
        model(**batch)  # the model takes what passed the checks
    loader = torch.utils.data.DataLoader(_vl_case("patches_moved", docs), batch_size=4, num_workers=2,
                                         collate_fn=VisionLanguageCollator(PaddingFreeCollator(),
                                                                           rope_index=model.model.get_rope_index))
    with pytest.raises(DataError, match=r"example 1 has 'pixel_values' of shape \[12, 24\]"):
        list(loader)
    with pytest.raises(TypeError, match="config must be the vision-language model's config .* this LlamaConfig has no "
                                        "image_token_id, video_token_id, vision_config.spatial_merge_size"):
        VisionLanguageCollator(PaddingFreeCollator(), config=transformers_config("LlamaConfig"))


def transformers_config(name):
    import transformers

    return getattr(transformers, name)()


# ----------------------------------------------------------------------------------------------
# the rest of the rules' messages, each read once
# ----------------------------------------------------------------------------------------------


def test_build_groups_applies_the_rules_itself():
    """The collators' builder, public: the same rules, with the same wording, for its own callers."""
    from packkit.preference import build_groups

    cases = [
        (lambda: build_groups([1], [1], [2, -3], [1, 1], [2], keys=("chosen_ids", "rejected_ids")), DataError,
         "example 0 has token id -3 in 'rejected_ids'; token ids are integers >= 0"),
        (lambda: build_groups([1, 2], [1, 1], [2, 3, -4], [1, 2], [1, 1]), DataError,
         "example 1 has token id -4 in 'completion_ids' (completion 0); token ids are integers >= 0"),
        (lambda: build_groups([-1], [1], [2], [1], [1]), DataError,
         "example 0 has token id -1 in 'prompt_ids'; token ids are integers >= 0"),
        (lambda: build_groups([1], [1], [2], [1], [0]), DataError, None),  # sizes that do not describe the groups
        (lambda: build_groups([1, 2], [1, 1], [2], [1], [1, 0]), DataError,
         "example 1 has no completion; a group needs at least one"),
        (lambda: build_groups([1], [1], [2, 3], [1, 1], [2], values={"w": [1.0]}), ValueError,
         "values['w'] has shape [1] for 2 completions; pass one number per completion, group after group"),
        (lambda: build_groups([1], [1], [2, 3], [1, 1], [2], values={"w": [1.0, np.nan]}), DataError,
         "example 0 has nan (float) in 'w' (completion 1); w are finite numbers, one per completion"),
    ]
    for call, cls, words in cases:
        with pytest.raises(ValueError) as info:
            call()
        if words is None:
            assert "do not describe the same groups" in one_line(info)
            continue
        assert isinstance(info.value, cls) and one_line(info).startswith(words), str(info.value)
    with pytest.raises(DataError, match="example 1 has no completion; a group needs at least one"):
        GroupCollator()([GROUP, {"prompt_ids": [1], "completion_ids": []}])


def test_sequence_logps_dpo_loss_and_group_collator_arguments():
    from packkit.errors import ArgumentTypeError
    from packkit.preference import SequenceLogps, dpo_loss, sequence_logps

    batch = GroupCollator()([GROUP])
    logits = torch.zeros(1, batch.num_real_tokens, 9)
    assert torch.equal(sequence_logps(logits, batch, temperature=0.5).num_tokens, torch.tensor([2, 1]))
    for t in (0, -1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ArgumentError) as info:
            sequence_logps(logits, batch, temperature=t)
        assert one_line(info) == f"temperature must be a finite number > 0, got {t!r}"
    with pytest.raises(TypeError) as info:
        sequence_logps(logits, dict(batch))
    assert one_line(info) == ("batch must be the SequenceBatch the logits were computed from (a PreferenceCollator or "
                              "GroupCollator batch), got dict")
    four, two = (SequenceLogps(sum=torch.zeros(n), mean=torch.zeros(n), num_tokens=torch.ones(n)) for n in (4, 2))
    with pytest.raises(ValueError) as info:
        dpo_loss(four, two)  # before: broadcast when one side had a single pair, or torch's size error
    assert one_line(info) == "policy has 4 sequences and reference 2: compute both from the same batch"
    with pytest.raises(ArgumentTypeError) as info:
        GroupCollator(sequence_keys="advantages")  # before: the keys 'a', 'd', 'v', ...: the values dropped silently
    assert one_line(info) == "sequence_keys must be a list of keys, got 'advantages'; pass sequence_keys=('advantages',)"


@pytest.mark.parametrize("grid, words", [
    ([[1, 2.5, 4]], "example 0 has 2.5 (float) in image_grid_thw (image 0); a grid holds integers >= 1"),
    ([[1, 4, 4], [0, 2, 2]], "example 0 has image_grid_thw [0, 2, 2] (image 1); a grid holds integers >= 1"),
    ([["1", "4", "4"]], "example 0 has '1' (str) in image_grid_thw (image 0)"),
    ([[1, 4, 4], [1, 4]], "example 0 has image_grid_thw of ragged rows; a grid is one (t, h, w) row per image"),
    ([1, 4, 4], "example 0 has image_grid_thw of shape [3]; a grid is one (t, h, w) row per image"),
])
def test_grid_rule(grid, words):
    from packkit.rules import grid_rows

    with pytest.raises(DataError) as info:
        grid_rows(grid, 0, key="image_grid_thw", merge=2)
    assert one_line(info).startswith(words), str(info.value)
    assert grid_rows(np.array([[1.0, 4.0, 2.0]]), 0, key="video_grid_thw", merge=2).tolist() == [[1, 4, 2]]


def test_mm_token_type_ids_of_another_length_are_refused(vl):
    model, docs = vl
    bad = dict(docs[0], mm_token_type_ids=docs[0]["mm_token_type_ids"][:-1])
    with pytest.raises(DataError) as info:
        VisionLanguageCollator(PaddingFreeCollator(), rope_index=model.model.get_rope_index)([docs[3], bad])
    assert one_line(info) == (f"example 1 has {len(bad['input_ids']) - 1} 'mm_token_type_ids' for "
                              f"{len(bad['input_ids'])} 'input_ids'; they must match token for token")


def test_example_positions_checks_the_grids_before_the_model_reads_them(vl):
    """Before: a two-number grid or surplus patches reached get_rope_index, whose errors name no example (or,
    for patches, none was raised: positions need the grid only)."""
    from packkit.model_inputs import example_positions

    model, docs = vl
    rope = model.model.get_rope_index
    assert example_positions(docs[0], rope_index=rope).shape == (3, len(docs[0]["input_ids"]))
    for bad, words in ((dict(docs[0], image_grid_thw=torch.tensor([[4, 4]])),
                        "example 5 has image_grid_thw of shape [1, 2]; a grid is one (t, h, w) row per image"),
                       (dict(docs[0], pixel_values=docs[0]["pixel_values"][:12]),
                        "example 5 has 'pixel_values' of shape [12, 24] for image_grid_thw [[1, 4, 4]], which needs 16")):
        with pytest.raises(DataError) as info:
            example_positions(bad, rope_index=rope, where=5)
        assert one_line(info).startswith(words), str(info.value)


def test_cost_model_from_config_sizes_are_integers():
    """Before: ``hidden_size=inf`` raised ``OverflowError: cannot convert float infinity to integer``, and 2.5 was
    read as 2."""
    from packkit.errors import ArgumentTypeError

    for kw, cls, words in ((dict(hidden_size=float("inf")), ArgumentTypeError, "hidden_size must be an integer, got inf"),
                           (dict(hidden_size=64, intermediate_size=2.5), ArgumentTypeError,
                            "intermediate_size must be an integer, got 2.5 (float)"),
                           (dict(hidden_size=-4), ArgumentError, "hidden_size must be at least 1, got -4")):
        with pytest.raises(cls) as info:
            CostModel.from_config(**kw)
        assert one_line(info).startswith(words)
    assert CostModel.from_config(hidden_size=4096, intermediate_size=11008).linear == 49408


# ----------------------------------------------------------------------------------------------
# the group and per-example value rules against nested-loop references
# ----------------------------------------------------------------------------------------------

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@given(st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 3), max_size=3)), min_size=1, max_size=6))
def test_check_groups_against_a_loop(groups):
    """The first group (in order) with no completion, or with a completion with no scored token (empty, or one
    token after an empty prompt), is the one named; any other batch passes."""
    from packkit.rules import check_groups

    want = None
    for g, (p, comps) in enumerate(groups):
        if not comps:
            want = f"example {g} has no completion"
            break
        j = next((j for j, c in enumerate(comps) if c == 0 or (c == 1 and p == 0)), None)
        if j is not None:
            want = f"example {g} has an empty {'prompt_ids' if comps[j] else 'completion_ids'!r}"
            want += f" and 1 token in 'completion_ids' (completion {j})" if comps[j] else f" (completion {j})"
            break
    args = ([p for p, _ in groups], [c for _, cs in groups for c in cs], [len(cs) for _, cs in groups])
    if want is None:
        check_groups(*args)
        return
    with pytest.raises(DataError) as info:
        check_groups(*args)
    assert one_line(info).startswith(want), (str(info.value), want)


@given(st.lists(st.one_of(st.none(), st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                                                       st.integers(-5, 5)), min_size=1, max_size=3)),
                min_size=1, max_size=5))
def test_example_values_against_a_loop(values):
    """Values one per completion (each example's count its own list's length): refused at the first missing
    example when some have them, else at the first value that is not finite; else laid end to end."""
    from packkit.rules import example_values

    sizes = [1 if v is None else len(v) for v in values]
    present = [v is not None for v in values]
    if not any(present):
        assert example_values(values, sizes, key="advantages") is None
        return
    if not all(present):
        want = f"example {present.index(False)} has no 'advantages' while example {present.index(True)} has them"
    else:
        bad = [(i, j) for i, v in enumerate(values) for j, x in enumerate(v) if not np.isfinite(x)]
        want = f"example {bad[0][0]} has " if bad else None
    if want is None:
        got = example_values(values, sizes, key="advantages")
        assert got.dtype == np.float64 and got.tolist() == [float(x) for v in values for x in v]
        return
    with pytest.raises(DataError) as info:
        example_values(values, sizes, key="advantages")
    assert one_line(info).startswith(want), (str(info.value), want)
    if all(present):
        assert f"(completion {bad[0][1]})" in str(info.value)
