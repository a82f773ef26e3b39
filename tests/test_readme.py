"""The code blocks of the README and of the documentation pages (docs/*.md), run as a user would paste them
(tiny models; real text and real lengths where a block is about real data).

If one of these fails, the page is wrong: fix the page or the API, not this test.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

transformers = pytest.importorskip("transformers")

from testlib import tiny_causal_lm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def tiny_model():
    return tiny_causal_lm(dtype=torch.float32, max_position_embeddings=256)


def dataset(n=24, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for length in rng.integers(3, 40, n).tolist():
        ids = rng.integers(1, 101, length).tolist()
        out.append({"input_ids": ids, "labels": [-100] * (length // 3) + ids[length // 3:]})
    return out


def hf_rows(n=24, seed=0):
    """:func:`dataset` as a ``datasets.Dataset`` with a ``completion_mask`` (what the quickstart's ``ds`` holds)."""
    datasets = pytest.importorskip("datasets")
    return datasets.Dataset.from_list([dict(input_ids=x["input_ids"],
                                            completion_mask=[int(v != -100) for v in x["labels"]])
                                       for x in dataset(n, seed)])


def your_training_arguments(*args, **kwargs):
    """The README's ``TrainingArguments(..., remove_unused_columns=False)``: ``...`` stands for the reader's own
    arguments; here an output folder, no reports, the CPU."""
    assert args in ((), (Ellipsis,)), args
    return transformers.TrainingArguments(output_dir="out", report_to=[], use_cpu=True, **kwargs)


def test_quickstart_collate_fn(tmp_path, monkeypatch):
    """The collate page's first block, as pasted: the loader's batches reach the model, the static-shape collator gives [8, 2048],
    the Trainer takes the collator, and ColumnarDataset feeds two workers."""
    ds, model = hf_rows(), tiny_model()
    scope = run_doc("docs/collate.md", "## The DataLoader or the Hugging Face `Trainer`", 0, tmp_path, monkeypatch, ds=ds, model=model,
                       Trainer=transformers.Trainer, TrainingArguments=your_training_arguments)
    assert torch.isfinite(scope["loss"])
    assert tuple(scope["collate"](list(ds)[:8]).input_ids.shape) == (8, 2048)
    batches = list(scope["loader"])
    assert sum(b.num_examples for b in batches) == len(ds)
    assert sum(b.num_loss_tokens for b in batches) == sum(sum(m[1:]) for m in ds["completion_mask"])


def test_quickstart_sampler(tmp_path, monkeypatch):
    """The samplers page's block, as pasted: every example once an epoch, in [4, 2048] windows."""
    ds = dataset(60)
    scope = run_doc("docs/samplers.md", "# Batch samplers", 0, tmp_path, monkeypatch, ds=ds, DataLoader=DataLoader, epochs=2,
                       lengths=[len(x["input_ids"]) for x in ds])
    batches = list(scope["loader"])
    assert {tuple(b.input_ids.shape) for b in batches} == {(4, 2048)}
    assert sum(b.num_examples for b in batches) == len(ds) and scope["sampler"].state_dict()


def test_quickstart_columnar_dataset():
    datasets = pytest.importorskip("datasets")
    from packkit.collate import PaddingFreeCollator
    from packkit.columnar import ColumnarDataset

    rows = [{"input_ids": x["input_ids"], "completion_mask": [0 if v == -100 else 1 for v in x["labels"]]}
            for x in dataset()]
    ds = datasets.Dataset.from_list(rows)
    loader = DataLoader(ColumnarDataset(ds), batch_size=32, shuffle=True, num_workers=2,
                        collate_fn=PaddingFreeCollator(loss_mask="required"))
    batches = list(loader)
    assert sum(b.num_examples for b in batches) == len(rows)
    assert sum(b.num_loss_tokens for b in batches) == sum(sum(r["completion_mask"][1:]) for r in rows)


def test_quickstart_offline_datasets(tmp_path, monkeypatch):
    """The offline page's first block, as pasted: the parquet it writes reads back with PackedRowsCollator."""
    pq = pytest.importorskip("pyarrow.parquet")
    from packkit.collate import PackedRowsCollator

    ds = hf_rows(50)
    scope = run_doc("docs/offline.md", "## One machine: `pack_dataset`", 0, tmp_path, monkeypatch, ds=ds)
    assert set(scope["packed"].column_names) == {"input_ids", "labels", "seq_lengths"}
    rows = pq.read_table(tmp_path / "packed.parquet").to_pylist()
    batch = PackedRowsCollator(window=2048)(rows)
    assert batch.num_tokens == sum(map(len, ds["input_ids"]))


def test_quickstart_loss_under_accumulation(tmp_path, monkeypatch):
    from packkit.collate import PaddingFreeCollator

    model = tiny_model()
    micro_batches = [PaddingFreeCollator()(dataset()[i:i + 6]) for i in range(0, 24, 6)]
    before = [p.detach().clone() for p in model.parameters()]
    scope = run_doc("docs/collate.md", "## Exact loss under gradient accumulation", 0, tmp_path, monkeypatch, micro_batches=micro_batches, model=model,
                       optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert scope["step"].num_loss_tokens == sum(mb.num_loss_tokens for mb in micro_batches)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the step was taken


def test_quickstart_attention(tmp_path, monkeypatch):
    from packkit.collate import FixedWindowCollator

    batch = FixedWindowCollator(window=64, num_windows=2, static_shape=True, max_segments=16)(dataset(8))
    q = torch.randn(batch.input_ids.numel(), 4, 16)
    k = v = torch.randn(batch.input_ids.numel(), 2, 16)
    scope = run_doc("docs/collate.md", "## Varlen attention, any backend", 0, tmp_path, monkeypatch, q=q, k=k, v=v, batch=batch)
    assert scope["out"].shape == q.shape and torch.isfinite(scope["out"]).all()


def test_quickstart_engine(tmp_path, monkeypatch):
    """The engine's block, as pasted, on lengths that fit the window (its first line packs with overflow="error"),
    and the error its text block shows, word for word but the figures, on one that does not."""
    from packkit.binpack import pack

    lengths = np.random.default_rng(0).integers(1, 2049, 500)
    scope = run_doc("docs/collate.md", "## The engine", 0, tmp_path, monkeypatch, lengths=lengths)
    plan = scope["plan"]
    assert plan.num_windows >= plan.lower_bound and 0 < plan.fill <= 1
    assert scope["seg_lengths"].sum() <= 2048
    shown = next(line for line in page_section("docs/collate.md", "## The engine").splitlines()
                 if line.startswith("packkit.errors."))  # the text block under the code
    with pytest.raises(ValueError) as e:
        pack([5, 9_310], window=8192)
    assert f"{type(e.value).__module__}.{type(e.value).__name__}: {e.value}" == shown.replace("example 812", "example 1")


def page_section(page: str, heading: str) -> str:
    """The section of ``page`` (``"README.md"``, ``"docs/trl.md"``) under the line ``heading`` (``"## With TRL"``),
    that line included, up to the next heading of the same or a higher level (a ``#`` line inside a fence is
    code, not a heading)."""
    level = len(heading) - len(heading.lstrip("#"))
    out, fence = None, False
    for line in (ROOT / page).read_text().splitlines():
        if out is None:
            if line.strip() == heading:
                out = [line]
            continue
        fence ^= line.startswith("```")
        hashes = len(line) - len(line.lstrip("#"))
        if not fence and 0 < hashes <= level and line[hashes:hashes + 1] == " ":
            break
        out.append(line)
    assert out is not None, f"{page} has no heading {heading!r}"
    return "\n".join(out) + "\n"


def doc_code(page: str, heading: str, lang: str = "bash", index: int = 0) -> str:
    """The text of the ``index``-th ``lang`` code block of ``page``'s section under ``heading``."""
    section = page_section(page, heading)
    start = -1
    for _ in range(index + 1):
        start = section.index(f"```{lang}\n", start + 1)
    start += len(lang) + 4
    return section[start: section.index("```", start)]


def doc_lines(page: str, heading: str, lang: str = "bash", index: int = 0) -> list[str]:
    """The non-blank lines of that block."""
    return [line for line in doc_code(page, heading, lang, index).splitlines() if line.strip()]


@pytest.mark.slow
def test_command_line_lines_work_as_pasted(tmp_path):
    """Before the fix, the documented `packkit plan` line failed as pasted on data longer than the window (plan
    and pack defaulted to overflow=error, waste to truncate). Each line of the command-line page's
    block runs here in a shell, as pasted, on data with examples longer than the window; each exits 0
    and says what it did with them."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    pytest.importorskip("matplotlib")
    exe = Path(sys.executable).parent / "packkit"
    if not exe.exists() or not shutil.which("bash"):
        pytest.skip("the packkit command is not installed next to this interpreter")
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(5, 1500, 300), [5000, 9000]])
    rows = [rng.integers(0, 1000, n).tolist() for n in lengths]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    pq.write_table(pa.table({"input_ids": rows}), tmp_path / "data.parquet")
    np.save(tmp_path / "lengths.npy", lengths)
    env = dict(os.environ, PATH=f"{exe.parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("PACKKIT_DEBUG", None)
    lines = doc_lines("docs/cli.md", "# The command line")
    assert [line.split()[:2] for line in lines] == [["packkit", "waste"], ["packkit", "waste"],
                                                   ["packkit", "pack"], ["packkit", "plan"]]
    for line in lines:
        proc = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, (line, proc.stderr)
        assert "Traceback" not in proc.stderr
        if " plan " in line:
            assert "--overflow split: 2 of 302 examples longer than the window split" in proc.stdout
        if " pack " in line:
            assert json.loads(proc.stdout)["overflow_examples"] == 2
    assert (tmp_path / "waste.png").read_bytes()[:4] == b"\x89PNG"
    assert pq.read_table(tmp_path / "packed.parquet").num_rows > 0


def pydoc_chat(path: Path, every: int = 1) -> int:
    """Conversations of real text, one a line: every ``every``-th of Python's documentation topics (by name) as
    the assistant's reply (what the getting-started page builds, ``every=1``); returns how many."""
    import json

    from pydoc_data.topics import topics

    with open(path, "w") as f:
        for name, text in sorted(topics.items())[::every]:
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Explain {name} in Python."},
                                             {"role": "assistant", "content": text.strip()}]}) + "\n")
    return len(sorted(topics)[::every])


@pytest.mark.slow  # three packkit processes, then a tiny model over every packed row
def test_readme_quickstart_as_pasted(tmp_path, monkeypatch):
    """The README's quickstart, both blocks as pasted and in order, on real text (a third of Python's
    documentation topics as chat rows: real lengths, one longer than the window) through a local chat tokenizer saved as
    ./my-tokenizer: tokenize, waste and pack exit 0, the packed rows hold every conversation's tokens, and
    the loop runs the model on every batch of them."""
    import os
    import shutil
    import subprocess
    import sys

    pq = pytest.importorskip("pyarrow.parquet")
    pytest.importorskip("datasets")
    from test_chat import VOCAB, make_tokenizer

    exe = Path(sys.executable).parent / "packkit"
    if not exe.exists() or not shutil.which("bash"):
        pytest.skip("the packkit command is not installed next to this interpreter")
    n = pydoc_chat(tmp_path / "chat.jsonl", every=3)  # 27 of the 79: 20k words, one of them past the window
    make_tokenizer(bos=True).save_pretrained(str(tmp_path / "my-tokenizer"))
    env = dict(os.environ, PATH=f"{exe.parent}{os.pathsep}{os.environ['PATH']}", HF_HUB_OFFLINE="1")
    env.pop("PACKKIT_DEBUG", None)
    proc = subprocess.run(["bash", "-eo", "pipefail", "-c", doc_code("README.md", "## Quickstart")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    tokens = pq.read_table(tmp_path / "tokens.parquet")
    lengths = [len(ids) for ids in tokens.column("input_ids").to_pylist()]
    assert len(lengths) == n and max(lengths) > 4096  # real lengths: the longest topics exceed the window
    packed = pq.read_table(tmp_path / "packed.parquet").to_pylist()
    assert sum(map(sum, (r["seq_lengths"] for r in packed))) == sum(lengths)  # every token, none loss-free
    assert "packed: best fit decreasing" in proc.stdout  # waste's table
    model, losses = tiny_causal_lm(dtype=torch.float32, vocab_size=len(VOCAB), max_position_embeddings=4096), []

    def counted(**batch):
        out = model(**batch)
        losses.append(float(out.loss.detach()))
        return out

    run_doc("README.md", "## Quickstart", 0, tmp_path, monkeypatch, model=counted)
    assert len(losses) == -(-len(packed) // 4) and all(np.isfinite(losses))


# ----------------------------------------------------------------------------------------------
# "With TRL" and "With Trainer": each code block run as pasted, on a tiny model and local tokenizer
# ----------------------------------------------------------------------------------------------


def word_tokenizer():
    """A word-level tokenizer over ``t0 .. t100`` (``t0`` pads, ``t2`` ends), built here: nothing downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(101)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t2", unk_token="t1")


def masked_dataset(n=24, seed=0):
    """Tokenized rows with a ``completion_mask`` (prompt: the first third)."""
    datasets = pytest.importorskip("datasets")
    rows = [dict(input_ids=ex["input_ids"], completion_mask=[int(x != -100) for x in ex["labels"]])
            for ex in dataset(n, seed)]
    return datasets.Dataset.from_list(rows)


def run_doc(page, heading, index, tmp_path, monkeypatch, **names):
    """Run ``page``'s ``index``-th python block under ``heading`` as pasted (in a fresh folder), with ``names``
    defined; returns its names.

    TRL's ``SFTConfig`` defaults to ``bf16=True``, which transformers refuses on a machine without a GPU:
    there the test gives it ``bf16=False`` (what the TRL page tells CPU users), the block's text unchanged.
    """
    import functools

    monkeypatch.chdir(tmp_path)
    try:
        import trl
    except ImportError:
        trl = None
    if trl is not None and not torch.cuda.is_available():
        monkeypatch.setattr(trl, "SFTConfig", functools.partial(trl.SFTConfig, bf16=False))
    scope = dict(names)
    exec(compile(doc_code(page, heading, "python", index), f"{page} {heading} block {index}", "exec"), scope)
    return scope


@pytest.mark.slow
def test_with_trl_as_pasted(tmp_path, monkeypatch):
    """TRL tokenizes prompt/completion text, masks the prompts into labels, and the collator packs them."""
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(0)
    words = lambda n: " ".join(f"t{i}" for i in rng.integers(3, 101, n))  # noqa: E731
    data = datasets.Dataset.from_list([{"prompt": words(int(rng.integers(2, 12))),
                                        "completion": " " + words(int(rng.integers(1, 12))) + " t2"}
                                       for _ in range(8)])
    scope = run_doc("docs/trl.md", "## With TRL", 0, tmp_path, monkeypatch, model=tiny_model(), tokenizer=word_tokenizer(),
                       dataset=data)
    trainer = scope["trainer"]
    assert trainer.state.global_step == 3  # 3 epochs of 8 examples, 8 a step
    assert all(np.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)
    # the prompts carry no loss: labels as TRL prepared them, packed with every document's first label masked
    rows = [trainer.train_dataset[i] for i in range(8)]
    batch = trainer.data_collator(rows)
    assert all(row["labels"][0] == -100 for row in rows)
    assert batch.num_loss_tokens == sum(sum(x != -100 for x in row["labels"][1:]) for row in rows)
    assert batch.num_loss_tokens < sum(len(row["input_ids"]) - 1 for row in rows)


@pytest.mark.slow
def test_with_trl_packed_rows_as_pasted(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    tokenized = masked_dataset(48)
    scope = run_doc("docs/trl.md", "## With TRL", 1, tmp_path, monkeypatch, model=tiny_model(), tokenizer=word_tokenizer(),
                       tokenized=tokenized)
    rows, trainer = scope["rows"], scope["trainer"]
    assert set(rows.column_names) == {"input_ids", "labels", "seq_lengths"}
    assert trainer.state.global_step == 3 * -(-len(rows) // 2)
    masked = sum(m.count(0) for m in tokenized["completion_mask"])
    assert sum(x == -100 for row in rows["labels"] for x in row) >= masked  # prompts masked (and first labels)


@pytest.mark.slow
def test_with_trainer_as_pasted(tmp_path, monkeypatch):
    tokenized = masked_dataset(8)
    scope = run_doc("docs/trl.md", "## With Trainer", 0, tmp_path, monkeypatch, model=tiny_model(), tokenized=tokenized)
    trainer = scope["trainer"]
    assert trainer.state.global_step == 3  # 3 epochs of 8 examples, 8 a step
    assert all(np.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)
    # what remove_unused_columns=False is for: without it the mask column never reaches the collator
    code = doc_code("docs/trl.md", "## With Trainer", "python")
    assert "remove_unused_columns=False" in code
    monkeypatch.chdir(tmp_path)
    scope = dict(model=tiny_model(), tokenized=tokenized)
    with pytest.raises(ValueError, match="remove_unused_columns=False"):
        exec(code.replace("remove_unused_columns=False", ""), scope)


# ----------------------------------------------------------------------------------------------
# "Vision-language models": a tiny Qwen2-VL trained by Trainer with default arguments on packed documents
# ----------------------------------------------------------------------------------------------


def test_vision_language_as_pasted(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    from testlib import tiny_vl_model, vl_example

    g = torch.Generator().manual_seed(0)
    grids = ([(1, 4, 4)], [], [(1, 2, 4), (1, 4, 2)], [(1, 4, 4)])
    examples = [vl_example(g, 3 + i % 5, grids[i % 4]) for i in range(8)]
    rows = [{k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in ex.items()} for ex in examples]
    dataset = datasets.Dataset.from_list(rows)  # as a processor's map leaves it: lists, None where no image
    scope = run_doc("docs/vl.md", VL, 0, tmp_path, monkeypatch, model=tiny_vl_model(dtype=torch.float32),
                       dataset=dataset)
    trainer = scope["trainer"]
    assert trainer.state.global_step == 3  # 3 epochs of 8 examples, 8 a step
    assert all(np.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)
    batch = scope["collate"]([dataset[i] for i in range(8)])
    assert batch["position_ids"].shape == (4, *batch.input_ids.shape)
    assert batch["image_grid_thw"].shape == (sum(len(grids[i % 4]) for i in range(8)), 3)


def test_hybrid_models_as_pasted(tmp_path, monkeypatch):
    scope = run_doc("docs/vl.md", VL, 1, tmp_path, monkeypatch)
    batch = scope["collate"](dataset(4))
    lengths = [len(x["input_ids"]) for x in dataset(4)]
    assert batch["seq_idx"].tolist() == [np.repeat(np.arange(4), lengths).tolist()]
    assert batch["cu_seq_lens_q"].tolist() == [0, *np.cumsum(lengths).tolist()]


VL = "# Vision-language and hybrid models"
MANY_GPUS = "# Many GPUs"


@pytest.mark.slow  # DataLoader worker processes, a few thousand real conversations
def test_many_gpus_balance_and_elastic_resume_as_pasted(tmp_path, monkeypatch):
    """The section's three blocks as pasted on real ShareGPT lengths (2,000 drawn from benchmarks/data/, a
    third of them longer than the window): the balanced sampler and its loader with two workers, the loop
    killed inside the epoch after a random number of batches, then a restart that loads the state the
    loop saved and runs the loop again. Before the fix the block failed on these lengths (its advice,
    overflow='split', was refused by the sampler), and the state the loop saved behind the workers
    skipped the batches they had prefetched."""
    from resume_testlib import KillAfter, Killed, sharegpt, TokenRows

    lengths = sharegpt(2000, seed=0)
    dataset = TokenRows(lengths)
    scope = run_doc("docs/many-gpus.md", MANY_GPUS, 0, tmp_path, monkeypatch, lengths=lengths, dataset=dataset)
    sampler, stats = scope["sampler"], scope["stats"]
    assert sampler.accumulation_steps == 32 and stats.compute_imbalance >= 1.0
    assert stats.cut_tokens == int(np.maximum(lengths - 2048, 0).sum()) > 0
    total = sampler.batches_per_epoch
    stop = int(np.random.default_rng(1).integers(1, total))
    head = KillAfter(scope["loader"], stop)
    with pytest.raises(Killed):
        run_doc("docs/many-gpus.md", MANY_GPUS, 1, tmp_path, monkeypatch, sampler=sampler, loader=head, epochs=1)
    state = head.scope_state
    assert state["batches_yielded"] == stop
    scope = run_doc("docs/many-gpus.md", MANY_GPUS, 0, tmp_path, monkeypatch, lengths=lengths, dataset=dataset)  # the restart
    run_doc("docs/many-gpus.md", MANY_GPUS, 2, tmp_path, monkeypatch, sampler=scope["sampler"], state=state)
    rest = KillAfter(scope["loader"], None)
    run_doc("docs/many-gpus.md", MANY_GPUS, 1, tmp_path, monkeypatch, sampler=scope["sampler"], loader=rest, epochs=1)
    seen = np.bincount(np.concatenate(head.examples + rest.examples), minlength=lengths.size)
    assert (seen == 1).all(), (np.flatnonzero(seen == 0)[:5], np.flatnonzero(seen > 1)[:5])


def test_many_gpus_error_advice_is_what_the_sampler_takes():
    """The sampler's refusal of long examples names the fixes it accepts (it advised overflow='split', which
    it then refused), and the step_batches refusal names the values that load the same state."""
    from packkit.sampler import PackedBatchSampler

    code = doc_code("docs/many-gpus.md", MANY_GPUS, "python", 0)
    assert code.count('overflow="truncate"') == 2  # the sampler and the collator
    lengths = np.array([10, 3000, 20])
    with pytest.raises(ValueError, match=r"example 1 has 3,000 tokens > window=2048; pass overflow='truncate' "
                                         r"or 'drop' \(and the same overflow to the collator\), or raise window"):
        PackedBatchSampler(lengths, window=2048, rank=0, world_size=1)
    PackedBatchSampler(lengths, window=2048, overflow="truncate", rank=0, world_size=1)  # the advice works
    with pytest.raises(ValueError, match=r"pass step_batches=30 or 33 \(a state saved with another step_batches"):
        PackedBatchSampler(lengths, window=2048, overflow="truncate", step_batches=32, rank=0, world_size=3)
    assert "pass step_batches=30 or 33" in page_section("docs/many-gpus.md", MANY_GPUS)

# ----------------------------------------------------------------------------------------------
# "DPO with TRL": DPOTrainer on packed trees, your own loop, RL groups
# ----------------------------------------------------------------------------------------------


def preference_pairs(n=16, seed=0):
    rng = np.random.default_rng(seed)
    words = lambda k: " ".join(f"t{i}" for i in rng.integers(3, 101, k))  # noqa: E731
    return [{"prompt": words(int(rng.integers(2, 10))) + " ", "chosen": words(int(rng.integers(1, 8))),
             "rejected": words(int(rng.integers(1, 8)))} for _ in range(n)]


@pytest.mark.slow
def test_dpo_with_trl_as_pasted(tmp_path, monkeypatch):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    import functools

    from packkit.preference import SequenceBatch
    from testlib import tiny_causal_lm

    if not torch.cuda.is_available():
        monkeypatch.setattr(trl, "DPOConfig", functools.partial(trl.DPOConfig, bf16=False))
    pairs = datasets.Dataset.from_list(preference_pairs(8))
    scope = run_doc("docs/dpo.md", "## DPO with TRL", 0, tmp_path, monkeypatch, model=tiny_model(), tokenizer=word_tokenizer(),
                       ref_model=tiny_causal_lm(dtype=torch.float32, max_position_embeddings=256, seed=1),
                       pairs=pairs)
    trainer = scope["trainer"]
    assert trainer.state.global_step == 3  # 3 epochs of 8 pairs, 8 a step
    final = trainer.state.log_history[-1]
    assert np.isfinite(final["train_loss"]) and "rewards/margins" in final
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    assert isinstance(batch, SequenceBatch) and batch.layout == "tree" and batch.num_groups == 8


def test_dpo_own_loop_as_pasted(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    from testlib import tiny_causal_lm

    model = tiny_model()
    scope = run_doc("docs/dpo.md", "## DPO with TRL", 1, tmp_path, monkeypatch, model=model, tokenizer=word_tokenizer(),
                       ref_model=tiny_causal_lm(dtype=torch.float32, max_position_embeddings=256, seed=1),
                       pairs=preference_pairs())
    assert torch.isfinite(scope["loss"]) and scope["policy"].chosen.shape == (8,)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_rl_groups_as_pasted(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    rollouts = [(rng.integers(3, 101, int(rng.integers(2, 9))).tolist(),
                 [rng.integers(3, 101, int(rng.integers(1, 9))).tolist() for _ in range(4)],
                 rng.normal(size=4).tolist()) for _ in range(16)]
    tokens = [len(p) + sum(map(len, c)) for p, c, _ in rollouts]
    scope = run_doc("docs/dpo.md", "## RL groups", 0, tmp_path, monkeypatch, model=tiny_model(), rollouts=rollouts,
                       tokens_per_group=tokens, rank=3)
    assert scope["logps"].sum.shape == (64,) and torch.isfinite(scope["loss"])
    assert scope["micro_batches"] and all(mb.size for mb in scope["micro_batches"])


# ----------------------------------------------------------------------------------------------
# every code block of the README and the pages is run by a test, as pasted, or named here with the reason it is not
# ----------------------------------------------------------------------------------------------

#: ``(section heading, language, index in the section)`` -> the test that runs that README block as pasted
#: (``file::test``), or ``"not run: why"``. A block added to the README without an entry fails
#: :func:`test_every_readme_block_is_run_or_says_why`; so does an entry whose test is gone.
README_BLOCKS = {
    ("packkit", "bash", 0): "not run: make waste and make test create .venv and install from the package registry "
                            "(CI runs make test from a fresh clone: .ci/run); test_newcomer.py checks the extras",
    ("packkit", "bash", 1): "not run: the same two without make (they install from the registry); "
                            "test_newcomer.py::test_readme_test_command_without_make_is_make_test checks them",
    ("Quickstart", "bash", 0): "test_readme.py::test_readme_quickstart_as_pasted",
    ("Quickstart", "python", 0): "test_readme.py::test_readme_quickstart_as_pasted",
}


def page_blocks(page: str = "README.md") -> list:
    """``(heading, language, index, code)`` of every fenced code block of ``page`` (the README or a page of
    ``docs/``), in order: the nearest heading above it (without its ``#``), the fence's language (``""`` for a
    plain block), its index under that heading, its text."""
    import re

    lines = (Path(__file__).resolve().parents[1] / page).read_text().splitlines()
    out, heading, seen, fence = [], None, {}, None
    for line in lines:
        if fence is not None:
            if line.startswith("```"):
                out[-1] = (*out[-1][:3], "".join(fence))
                fence = None
            else:
                fence.append(line + "\n")
            continue
        m = re.match(r"^```(\w*)\s*$", line)
        if m:
            key = (heading, m.group(1))
            seen[key] = seen.get(key, -1) + 1
            out.append((heading, m.group(1), seen[key], ""))
            fence = []
        elif line.startswith("#"):
            heading = line.lstrip("#").strip()
    return out


def readme_blocks() -> list:
    """``(heading, language, index)`` of every fenced code block of the README (:func:`page_blocks`)."""
    return [block[:3] for block in page_blocks()]


#: The same table for the pages of ``docs/``: ``(page, heading, language, index)`` -> the test that runs the
#: block as pasted, or ``"not run: why"``.
DOCS_BLOCKS = {
    **{("docs/getting-started.md", heading, lang, i): "test_docs.py::test_getting_started_runs_as_pasted"
       for heading, lang, i in [("1. A real tokenizer and raw chat rows", "bash", 0),
                                ("1. A real tokenizer and raw chat rows", "python", 0),
                                ("2. Tokenize once", "bash", 0), ("3. Measure before training", "bash", 0),
                                ("3. Measure before training", "bash", 1), ("4. Pack", "bash", 0),
                                ("5. Train with TRL", "python", 0)]},
    ("docs/collate.md", "The DataLoader or the Hugging Face `Trainer`", "python", 0):
        "test_readme.py::test_quickstart_collate_fn",
    ("docs/collate.md", "Exact loss under gradient accumulation", "python", 0):
        "test_readme.py::test_quickstart_loss_under_accumulation",
    ("docs/collate.md", "Varlen attention, any backend", "python", 0): "test_readme.py::test_quickstart_attention",
    ("docs/collate.md", "The engine", "python", 0): "test_readme.py::test_quickstart_engine",
    ("docs/collate.md", "The engine", "", 0): "test_readme.py::test_quickstart_engine",  # the error, word for word
    ("docs/samplers.md", "Batch samplers", "python", 0): "test_readme.py::test_quickstart_sampler",
    ("docs/offline.md", "One machine: `pack_dataset`", "python", 0): "test_readme.py::test_quickstart_offline_datasets",
    ("docs/offline.md", "A cluster: Ray Data", "python", 0):
        "not run: it needs a Ray cluster's address and an object store; test_raydata.py runs the same "
        "pack_dataset on a local Ray",
    ("docs/offline.md", "Streams", "python", 0): "test_stream_resume.py::test_the_streaming_snippet_runs_as_pasted",
    ("docs/offline.md", "Other stacks, and index-only plans", "python", 0):
        "test_formats.py::test_offline_formats_snippet_runs_as_pasted",
    ("docs/cli.md", "The command line", "bash", 0): "test_readme.py::test_command_line_lines_work_as_pasted",
    ("docs/trl.md", "With TRL", "python", 0): "test_readme.py::test_with_trl_as_pasted",
    ("docs/trl.md", "With TRL", "python", 1): "test_readme.py::test_with_trl_packed_rows_as_pasted",
    ("docs/trl.md", "With Trainer", "python", 0): "test_readme.py::test_with_trainer_as_pasted",
    **{("docs/many-gpus.md", "Many GPUs", "python", i):
       "test_readme.py::test_many_gpus_balance_and_elastic_resume_as_pasted" for i in (0, 1, 2)},
    ("docs/dpo.md", "DPO with TRL", "python", 0): "test_readme.py::test_dpo_with_trl_as_pasted",
    ("docs/dpo.md", "DPO with TRL", "python", 1): "test_readme.py::test_dpo_own_loop_as_pasted",
    ("docs/dpo.md", "RL groups", "python", 0): "test_readme.py::test_rl_groups_as_pasted",
    ("docs/vl.md", "Vision-language and hybrid models", "python", 0): "test_readme.py::test_vision_language_as_pasted",
    ("docs/vl.md", "Vision-language and hybrid models", "python", 1): "test_readme.py::test_hybrid_models_as_pasted",
    ("docs/cp.md", "Context parallelism", "python", 0): "test_cp_readme.py::test_hf_block_as_pasted",
    ("docs/cp.md", "Context parallelism", "python", 1): "test_cp_readme.py::test_megatron_and_ring_flash_attn_blocks_as_pasted",
    ("docs/cp.md", "Context parallelism", "python", 2): "test_cp_readme.py::test_megatron_and_ring_flash_attn_blocks_as_pasted",
    ("docs/cp.md", "Context parallelism", "python", 3): "test_cp_readme.py::test_alst_block_as_pasted",
    ("docs/cp.md", "Context parallelism", "python", 4): "test_cp_readme.py::test_weighted_block_as_pasted",
    ("docs/contributing.md", "Running the tests", "bash", 0):
        "not run: the make targets run the suite itself (make test is CI's command)",
    ("docs/vl.md", "More model families", "python", 0): "test_vl_families.py::test_docs_block_trains_as_pasted",
}


def test_every_readme_block_is_run_or_says_why():
    """Every code block of the README and of the docs pages is run by a test as pasted, or named with the reason it cannot
    be (a cluster, the package registry). Before, the quickstart's blocks 1, 2, 3, 5, 6 and 7 were copied by
    hand into tests (the copies ran; the README's text did not)."""
    blocks = readme_blocks()
    assert len(blocks) == len(set(blocks))
    missing = [b for b in blocks if b not in README_BLOCKS]
    assert not missing, f"README blocks with no test and no reason: {missing}"
    gone = [b for b in README_BLOCKS if b not in blocks]
    assert not gone, f"README_BLOCKS names blocks the README no longer has: {gone}"
    here = Path(__file__).resolve().parent
    pages = [p.relative_to(here.parent).as_posix() for p in sorted((here.parent / "docs").glob("*.md"))]
    in_docs = [(page, *b[:3]) for page in pages for b in page_blocks(page)]
    missing = [b for b in in_docs if b not in DOCS_BLOCKS]
    assert not missing, f"docs blocks with no test and no reason: {missing}"
    gone = [b for b in DOCS_BLOCKS if b not in in_docs]
    assert not gone, f"DOCS_BLOCKS names blocks the pages no longer have: {gone}"
    for block, runner in {**README_BLOCKS, **DOCS_BLOCKS}.items():
        if runner.startswith("not run: "):
            continue
        file, test = runner.split("::")
        assert f"def {test}(" in (here / file).read_text(), f"{block}: {runner} does not exist"
