"""packkit's collators inside the real trainers: TRL's ``SFTTrainer`` and ``transformers.Trainer``,
two optimiser steps each (two micro-batches a step: the second step's losses follow the first update), on a tiny random Llama (CPU, float64), a tokenizer
built here and generated data.

The reference is TRL's own padding-free path on the same data and seed: ``SFTConfig(padding_free=True)``
for ``SFTTrainer``; TRL's padding-free collator (``DataCollatorForLanguageModeling(padding_free=True)``) as
``data_collator`` for ``Trainer``. The trainer, not the collator, decides how the loss is computed:
SFTTrainer's fused LM head and the model's own loss differ by up to 4e-5 on this data (the fused head's
float32 log-probabilities in train mode, against an exact float64 loss), so each trainer is compared with
itself. The sampler gives every run the same examples in the same micro-batches, so the loss of every
micro-batch must agree within 1e-6 whatever the layout (one ``[1, T]`` row, ``[B, W]`` windows, padded
rows). Packed rows hold several examples a row, so their runs are compared with TRL's padding-free path
fed the *same rows* (its collator reads ``seq_lengths``): packkit's offline rows
(``packkit.offline.pack_dataset``) and TRL's own bfd rows (``trl.pack_dataset``, what ``SFTConfig(packing=True)``
makes; TRL refuses a custom collator together with its own packing, so the rows are packed first).

Inside every run, each batch ``compute_loss`` receives (after accelerate and ``Trainer`` rebuilt it) is
checked against the batch the collator made: same tokens and labels, same exact counts (a row whose last
document has no loss token included, the case a bare view cannot tell from padding).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.slow  # real Trainer and SFTTrainer runs: make test runs it, make test-fast does not

from testlib import tiny_causal_lm  # noqa: E402

from packkit.batch import PackedBatch, real_tokens_and_documents  # noqa: E402
from packkit.collate import FixedWindowCollator, PackedRowsCollator, PaddedCollator, PaddingFreeCollator  # noqa: E402
from packkit.loss import hf_compute_loss_func, token_normalized_loss  # noqa: E402

TOL = 1e-6
VOCAB, WINDOW, STEPS, BATCH, ACCUM = 64, 48, 2, 4, 2
IGNORE = -100


# ----------------------------------------------------------------------------------------------
# the pieces every run shares
# ----------------------------------------------------------------------------------------------


def tokenizer():
    """A word-level tokenizer over ``t0 .. t63``, built here (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t2", unk_token="t1")


def tiny_model():
    return tiny_causal_lm(vocab_size=VOCAB, max_position_embeddings=128, pad_token_id=0, eos_token_id=2,
                          bos_token_id=None)


def examples(n=BATCH * ACCUM * STEPS, seed=0):
    """Prompt/completion-like rows with ``labels`` (-100 on the prompt); every fourth has no loss token at all,
    so that windows end in documents a bare view would take for padding."""
    rng = np.random.default_rng(seed)
    out = []
    for i, length in enumerate(rng.integers(3, 30, n).tolist()):
        ids = rng.integers(3, VOCAB, length).tolist()
        cut = length if i % 4 == 3 else length // 3
        out.append({"input_ids": ids, "labels": [IGNORE] * cut + ids[cut:]})
    return datasets.Dataset.from_list(out)


class Recording:
    """Mixin for a trainer: records the loss of every micro-batch and checks each batch it is given
    against the batch the collator made (found by its tokens: the dataloader runs one batch ahead)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        made = getattr(self.data_collator, "made", None)
        if made is not None:
            assert isinstance(inputs, PackedBatch), type(inputs)
            twin = next(b for b in made if torch.equal(b.input_ids, inputs["input_ids"]))
            assert torch.equal(twin.labels, inputs["labels"])
            got = (inputs.num_loss_tokens, inputs.num_tokens, inputs.num_examples, inputs.num_real_segments)
            assert got == (twin.num_loss_tokens, twin.num_tokens, twin.num_examples, twin.num_real_segments)
            self.checked += 1
            # would the bare view have miscounted (a row ending in a document without loss tokens)?
            guess = real_tokens_and_documents(inputs.cu_seqlens, inputs["labels"])
            self.ambiguous += (int(guess[0]), int(guess[1])) != (twin.num_tokens, twin.num_examples)
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)
        self.losses.append(float((loss[0] if return_outputs else loss).detach()))
        return loss


class RecordingSFT(Recording, trl.SFTTrainer):
    pass


class RecordingTrainer(Recording, transformers.Trainer):
    pass


class PopLabelsTrainer(transformers.Trainer):
    """A custom loss as users write it: pop the labels, run the model, normalise by the step's count."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        assert "labels" not in inputs and inputs.num_loss_tokens == int((labels[..., 1:] != IGNORE).sum())
        outputs = model(**inputs)
        return token_normalized_loss(outputs.logits, labels, num_loss_tokens=num_items_in_batch)


class RecordingPopLabels(Recording, PopLabelsTrainer):
    pass


class Made:
    """Wraps a collator and keeps every batch it made (num_workers=0: it runs in this process)."""

    def __init__(self, collator):
        self.collator, self.made = collator, []

    def __call__(self, features):
        batch = self.collator(features)
        self.made.append(batch)
        return batch


def common_args(tmp_path):
    return dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", max_steps=STEPS,
                per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUM, learning_rate=1e-2,
                lr_scheduler_type="constant", logging_steps=1, seed=0, disable_tqdm=True, dataloader_num_workers=0)


def watched(collator):
    """packkit's collators are wrapped to keep their batches; others (the references) run as they are."""
    return Made(collator) if type(collator).__module__.startswith("packkit.") else collator


def sft(tmp_path, dataset, collator=None, trainer_cls=RecordingSFT, **config):
    args = trl.SFTConfig(**common_args(tmp_path), **config)
    trainer = trainer_cls(model=tiny_model(), args=args, train_dataset=dataset, processing_class=tokenizer(),
                          data_collator=None if collator is None else watched(collator))
    return finish(trainer)


def hf(tmp_path, dataset, collator, trainer_cls=RecordingTrainer, **kwargs):
    args = transformers.TrainingArguments(**common_args(tmp_path), **kwargs.pop("args", {}))
    trainer = trainer_cls(model=tiny_model(), args=args, train_dataset=dataset, data_collator=watched(collator),
                          **kwargs)
    return finish(trainer)


def finish(trainer):
    trainer.losses, trainer.checked, trainer.ambiguous = [], 0, 0
    trainer.train()
    assert trainer.state.global_step == STEPS
    return trainer


def assert_same_losses(got, ref, name):
    diff = max(abs(a - b) for a, b in zip(got.losses, ref.losses))
    print(f"{name}: {len(got.losses)} micro-batch losses, max abs diff {diff:.2e} against TRL's padding-free path")
    assert len(got.losses) == len(ref.losses) == STEPS * ACCUM
    assert diff < TOL
    if isinstance(got.data_collator, Made):
        assert got.checked == STEPS * ACCUM  # every batch was checked after the trainer's rebuild
        print(f"{name}: {got.ambiguous} of {got.checked} batches end a row in a document without loss tokens")


def trl_collator():
    return trl.trainer.sft_trainer.DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)


# ----------------------------------------------------------------------------------------------
# references: TRL's own padding-free path
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("trainers")


@pytest.fixture(scope="module")
def data():
    return examples()


@pytest.fixture(scope="module")
def sft_reference(work, data):
    return sft(work / "sft-ref", data, padding_free=True, max_length=None)


@pytest.fixture(scope="module")
def trainer_reference(work, data):
    return hf(work / "hf-ref", data, trl_collator())


@pytest.fixture(scope="module")
def packkit_rows():
    """packkit's offline rows (about 2.5 examples a row): enough for every micro-batch of the run."""
    from packkit.offline import pack_dataset

    rows = pack_dataset(examples(4 * BATCH * ACCUM * STEPS, seed=1), window=WINDOW)
    assert set(rows.column_names) == {"input_ids", "labels", "seq_lengths"} and len(rows) >= BATCH * ACCUM * STEPS
    return rows


# ----------------------------------------------------------------------------------------------
# TRL SFTTrainer
# ----------------------------------------------------------------------------------------------

SAME_EXAMPLES = {
    "padding_free": PaddingFreeCollator,
    "fixed_window": lambda: FixedWindowCollator(window=WINDOW),
    "fixed_window_static": lambda: FixedWindowCollator(window=WINDOW, num_windows=BATCH, static_shape=True,
                                                       max_segments=4 * BATCH),
    "padded": PaddedCollator,
}


@pytest.mark.parametrize("name", list(SAME_EXAMPLES))
def test_sft_trainer_each_collator_matches_trl_padding_free(work, data, sft_reference, name):
    """Before the fix, SFTTrainer crashed on inputs["use_cache"] = False. Same examples a micro-batch as TRL's
    padding-free path, laid out by each collator: the same loss at every micro-batch."""
    got = sft(work / f"sft-{name}", data, SAME_EXAMPLES[name](), max_length=None)
    assert_same_losses(got, sft_reference, f"SFTTrainer + {name}")
    # TRL logs num_tokens from attention_mask.sum(), else position_ids.size(1): right for [1, T] rows
    # (padding-free) and padded rows, W a micro-batch for [B, W] windows (the README says so, and which to use)
    logged = [h["num_tokens"] for h in got.state.log_history if "num_tokens" in h]
    want = [h["num_tokens"] for h in sft_reference.state.log_history if "num_tokens" in h]
    print(f"SFTTrainer + {name}: TRL logs {logged[-1]:,} tokens, its padding-free path {want[-1]:,}")
    if name in ("padding_free", "padded"):
        assert logged == want
    else:  # W per micro-batch, B windows in it: fewer than trained (documented in the README)
        assert logged[-1] < want[-1]


def test_sft_trainer_packed_rows_packkit_offline(work, packkit_rows):
    """PackedRowsCollator over packkit's offline rows against TRL's padding-free collator over the same rows."""
    ref = sft(work / "sft-rows-ref", packkit_rows, padding_free=True, max_length=None)
    got = sft(work / "sft-rows", packkit_rows, PackedRowsCollator(window=WINDOW), max_length=None)
    assert_same_losses(got, ref, "SFTTrainer + PackedRowsCollator (packkit rows)")


def test_sft_trainer_packed_rows_trl_bfd(work):
    """PackedRowsCollator over TRL's bfd rows against TRL's own packing (SFTConfig(packing=True)) of the same data."""
    data = examples(4 * BATCH * ACCUM * STEPS, seed=1)
    ref = sft(work / "sft-bfd-ref", data, packing=True, packing_strategy="bfd", max_length=WINDOW)
    rows = trl.pack_dataset(data.select_columns(["input_ids", "labels"]), WINDOW, "bfd")
    assert "seq_lengths" in rows.column_names
    got = sft(work / "sft-bfd", rows, PackedRowsCollator(window=WINDOW), max_length=None)
    assert_same_losses(got, ref, "SFTTrainer + PackedRowsCollator (TRL bfd rows)")


def test_sft_trainer_compute_loss_func(work, data):
    """SFTTrainer hands compute_loss_func the model's outputs and the labels: packkit's loss, same as TRL's path."""
    with_func = dict(trainer_cls=lambda **kw: RecordingSFT(**kw, compute_loss_func=hf_compute_loss_func))
    ref = sft(work / "sft-func-ref", data, padding_free=True, max_length=None, **with_func)
    got = sft(work / "sft-func", data, PaddingFreeCollator(), max_length=None, **with_func)
    assert_same_losses(got, ref, "SFTTrainer + compute_loss_func")


# ----------------------------------------------------------------------------------------------
# transformers.Trainer
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SAME_EXAMPLES))
def test_trainer_each_collator_matches_trl_padding_free(work, data, trainer_reference, name):
    """Trainer with its default arguments (remove_unused_columns=True keeps input_ids and labels)."""
    got = hf(work / f"hf-{name}", data, SAME_EXAMPLES[name]())
    assert_same_losses(got, trainer_reference, f"Trainer + {name}")


def test_trainer_packed_rows_packkit_offline(work, packkit_rows):
    """Packed rows carry ``seq_lengths``, a column the model's forward does not name: Trainer drops it
    under its default remove_unused_columns=True, so rows need remove_unused_columns=False."""
    keep = {"remove_unused_columns": False}
    ref = hf(work / "hf-rows-ref", packkit_rows, trl_collator(), args=keep)
    got = hf(work / "hf-rows", packkit_rows, PackedRowsCollator(window=WINDOW), args=keep)
    assert_same_losses(got, ref, "Trainer + PackedRowsCollator (packkit rows)")


@pytest.mark.parametrize("how", ["compute_loss pops labels", "compute_loss_func"])
def test_trainer_custom_loss_that_pops_labels(work, data, trainer_reference, how):
    """A compute_loss that pops labels (PackedBatch was read-only), and Trainer's compute_loss_func path,
    which pops them itself."""
    if how == "compute_loss_func":
        got = hf(work / "hf-loss-func", data, PaddingFreeCollator(), compute_loss_func=hf_compute_loss_func)
    else:
        got = hf(work / "hf-pop", data, PaddingFreeCollator(), trainer_cls=RecordingPopLabels)
    assert_same_losses(got, trainer_reference, f"Trainer, {how}")
