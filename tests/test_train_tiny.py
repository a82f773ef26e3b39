"""examples/train_tiny.py: the whole hand-written loop runs, logs its figures, and learns."""

import importlib.util
import json
import math
import pathlib

import numpy as np
import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_tiny.py"


def load_example():
    spec = importlib.util.spec_from_file_location("train_tiny", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def expected_steps(mod, *, examples, window, windows_per_batch, accumulation, steps, seed=0):
    """Per-step (tokens, loss tokens, examples) from the sampler's indices and the raw examples."""
    from packkit.sampler import PackedBatchSampler

    data = mod.make_dataset(examples, window=window, seed=seed)
    lengths = np.array([len(x["input_ids"]) for x in data])
    loss = np.array([int((x["labels"][1:] != -100).sum()) for x in data])  # the model's shift
    sampler = PackedBatchSampler(lengths, window=window, windows_per_batch=windows_per_batch, seed=seed)
    sampler.set_epoch(0)
    batches = list(sampler)
    assert len(batches) >= steps * accumulation
    out = []
    for s in range(steps):
        idx = np.concatenate([batches[s * accumulation + m] for m in range(accumulation)])
        out.append((int(lengths[idx].sum()), int(loss[idx].sum()), int(idx.size)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("padding_free", [False, True])
def test_runs_logs_and_counts_every_step_exactly(capsys, padding_free):
    mod = load_example()
    argv = ["--steps", "4", "--examples", "300", "--window", "256", "--accumulation", "2", "--json"]
    log = mod.main(argv + (["--padding-free"] if padding_free else []))
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4] and lines == json.loads(json.dumps(log))
    want = expected_steps(mod, examples=300, window=256, windows_per_batch=2, accumulation=2, steps=4)
    for r, (tokens, loss_tokens, examples) in zip(log, want):
        assert math.isfinite(r["loss"]) and r["micro_batches"] == 2
        assert (r["tokens_per_step"], r["loss_tokens_per_step"], r["examples_per_step"]) == (tokens, loss_tokens, examples)
        if padding_free:
            assert r["padding_fraction"] == 0.0  # one [1, T] row: every slot is a real token
        else:  # 2 micro-batches of 2 windows of 256 slots
            assert r["padding_fraction"] == pytest.approx(1 - tokens / (2 * 2 * 256))
    assert log[-1]["loss"] < log[0]["loss"]  # it learns the completion rule


def test_bad_arguments():
    mod = load_example()
    with pytest.raises(SystemExit):
        mod.main(["--steps", "0"])
