"""A collated batch that holds no loss token (every label -100) is said in one line, a ``LossFreeBatchWarning``.

Regression (found by a user walk-through, silent before): examples whose completion was all masked, or a window of
prompts only, made a batch without a single loss token, and nothing said so. ``model(**batch).loss`` of a Hugging Face
model is then a mean over zero tokens, NaN, and a NaN loss backpropagated makes every weight NaN (packkit.loss and
Trainer's ``num_items_in_batch`` count it as 0). Every collator of :mod:`packkit.collate` finishes its batch in one
place (``_Collator._finish``) and warns there; Python's default filter shows it once a process, and a DataLoader
worker (its own process) prints its own to stderr, which is what the user sees.
"""

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from testlib import tiny_causal_lm

from packkit.collate import (FixedWindowCollator, LossFreeBatchWarning, PackedRowsCollator, PaddedCollator,
                             PaddingFreeCollator)
from packkit.loss import hf_compute_loss_func
from packkit.model_inputs import HybridCollator

ROOT = Path(__file__).resolve().parents[1]

COLLATORS = {
    "padding_free": lambda: PaddingFreeCollator(),
    "padding_free_preshifted": lambda: PaddingFreeCollator(mask_first_label=False),
    "fixed_window": lambda: FixedWindowCollator(window=8),
    "fixed_window_static": lambda: FixedWindowCollator(window=8, num_windows=2, static_shape=True, max_segments=8),
    "padded": lambda: PaddedCollator(),
    "hybrid": lambda: HybridCollator(PaddingFreeCollator()),
}


def examples(loss_at=(), *, labels=False):
    """Two examples of 3 and 2 tokens, their completion masks all 0 except at the (example, token) pairs
    ``loss_at`` (with ``labels``: their labels all -100 but there, as pre-shifted labels need)."""
    masks = [[0, 0, 0], [0, 0]]
    for i, t in loss_at:
        masks[i][t] = 1
    ids = [[5, 6, 7], [8, 9]]
    if labels:
        return [{"input_ids": x, "labels": [v if m else -100 for v, m in zip(x, mask)]} for x, mask in zip(ids, masks)]
    return [{"input_ids": x, "completion_mask": mask} for x, mask in zip(ids, masks)]


def packed_row(loss_at=()):
    """One packed row of both examples (``seq_lengths``), its labels all -100 but at the tokens ``loss_at``."""
    labels = [-100] * 5
    for t in loss_at:
        labels[t] = 7
    return [{"input_ids": [5, 6, 7, 8, 9], "labels": labels, "seq_lengths": [3, 2]}]


def loss_free_warnings(collate, batch_of):
    """``(batch, [LossFreeBatchWarning messages])`` of one call, every warning recorded."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = collate(batch_of)
    return batch, [str(w.message) for w in caught if issubclass(w.category, LossFreeBatchWarning)]


@pytest.mark.parametrize("name", [*COLLATORS, "packed_rows"])
def test_every_collator_says_a_batch_without_a_loss_token(name):
    """Completions all masked: the batch holds no loss token, and the collator says so in one line with the fix."""
    if name == "packed_rows":
        batch, said = loss_free_warnings(PackedRowsCollator(window=8), packed_row())
    else:
        batch, said = loss_free_warnings(COLLATORS[name](), examples(labels="preshifted" in name))
    assert batch.num_loss_tokens == 0
    assert len(said) == 1, said
    print(said[0])
    assert "\n" not in said[0]
    for part in ("no loss token", "NaN", "packkit.loss", "num_items_in_batch", "drop_loss_free", "loss mask"):
        assert part in said[0], part


@pytest.mark.parametrize("name", [*COLLATORS, "packed_rows"])
def test_a_batch_with_one_loss_token_does_not_warn(name):
    if name == "packed_rows":
        batch, said = loss_free_warnings(PackedRowsCollator(window=8), packed_row(loss_at=[4]))
    else:
        batch, said = loss_free_warnings(COLLATORS[name](), examples(loss_at=[(1, 1)], labels="preshifted" in name))
    assert batch.num_loss_tokens == 1
    assert said == []


@pytest.mark.parametrize("name", ["padding_free", "fixed_window", "padded"])
def test_a_batch_without_labels_or_mask_does_not_warn(name):
    """No labels asked for (``loss_mask="none"``: every token a target): loss tokens, no warning; and a batch built
    by hand, or rebuilt by a trainer from a mapping without labels, is not a collator's and says nothing."""
    data = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]
    collate = {"padding_free": PaddingFreeCollator, "fixed_window": lambda **kw: FixedWindowCollator(window=8, **kw),
               "padded": PaddedCollator}[name](loss_mask="none")
    batch, said = loss_free_warnings(collate, data)
    assert batch.num_loss_tokens == 3 and said == []
    rebuilt, said = loss_free_warnings(type(batch), {k: v for k, v in batch.items() if k != "labels"})
    assert "labels" not in rebuilt and said == []


def test_the_plain_loop_sees_the_warning_before_the_nan():
    """The README's hand-written loop: the model's own mean loss over the loss-free batch is NaN (what the warning
    says), packkit's loss with the batch's count is 0 (what the fix says); the collate warned first."""
    model = tiny_causal_lm(vocab_size=16, dtype=torch.float32)
    with pytest.warns(LossFreeBatchWarning, match="NaN"):
        batch = PaddingFreeCollator()(examples())
    out = model(**batch)
    assert torch.isnan(out.loss)
    fixed = hf_compute_loss_func(out, batch["labels"], num_items_in_batch=batch.num_loss_tokens)
    assert float(fixed.detach()) == 0.0


WORKERS_SCRIPT = textwrap.dedent("""
    from torch.utils.data import DataLoader
    from packkit.collate import FixedWindowCollator

    # 12 examples, batches of 2: batches 0-2 hold loss tokens, 3-5 none (completions all masked)
    data = [{"input_ids": [5, 6, 7, 8], "completion_mask": [0, 0, 1, 1] if i < 6 else [0, 0, 0, 0]} for i in range(12)]
    loader = DataLoader(data, batch_size=2, num_workers=2, collate_fn=FixedWindowCollator(window=8), timeout=120)
    print([b.num_loss_tokens for b in loader])
""")


def test_a_dataloader_worker_prints_it_to_stderr_once():
    """``num_workers=2``: the warning is raised in a worker process, whose default filter prints it to the stderr
    the user sees, once a worker (batches 3 and 5 go to one worker, 4 to the other: 2 lines, not 3)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("PYTHONWARNINGS", None)
    done = subprocess.run([sys.executable, "-c", WORKERS_SCRIPT], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)
    print(done.stderr)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[4, 4, 4, 0, 0, 0]"
    lines = [line for line in done.stderr.splitlines() if ": LossFreeBatchWarning: " in line]
    assert len(lines) == 2, done.stderr
    assert all("this batch holds no loss token" in line and "drop_loss_free" in line for line in lines)
