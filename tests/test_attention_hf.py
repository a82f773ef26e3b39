"""``packkit.attention.hf_varlen_attention``: a Hugging Face model (tiny random LlamaForCausalLM, fp32)
trained on packed batches through packkit's varlen attention, registered with transformers'
``AttentionInterface``, gives the logits and gradients of the same model on sdpa with every document
run alone. The reference backend runs here; the Triton one under the interpreter (and compiled on a GPU
in benchmarks/bench_train_step.py)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before packkit.kernels is imported

transformers = pytest.importorskip("transformers")

from packkit import attention  # noqa: E402
from packkit.collate import FixedWindowCollator, PaddingFreeCollator  # noqa: E402
from packkit.segments import lengths_to_offsets  # noqa: E402
from testlib import tiny_causal_lm  # noqa: E402

TOL = 1e-4  # fp32
LENGTHS = (5, 9, 3, 7, 1, 6)


def make_model(attn_implementation):
    return tiny_causal_lm(dtype=torch.float32, attn_implementation=attn_implementation)


@pytest.fixture(scope="module")
def examples():
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 101, (n,), generator=g).tolist()} for n in LENGTHS]


def alone_logits_and_grads(examples):
    """Logits of each document run alone on sdpa, concatenated, and the gradient of their sum of squares."""
    model = make_model("sdpa")
    logits = torch.cat([model(input_ids=torch.tensor([ex["input_ids"]]), use_cache=False).logits[0]
                        for ex in examples])
    logits.square().sum().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_packed_batch_through_registered_attention_equals_documents_alone(examples, backend):
    name = attention.register_hf_attention(f"packkit_varlen_{backend}", backend=backend)
    model = make_model(name)
    batch = PaddingFreeCollator()(examples)
    if backend == "triton":
        problem = attention.backend_problems(*(torch.zeros(1, 1, 8),) * 3)["triton"]
        if problem is not None:
            pytest.skip(problem)
    out = model(**batch.hf_kwargs(), num_segments=batch.num_real_segments)
    out.logits[0].square().sum().backward()
    ref_logits, ref_grads = alone_logits_and_grads(examples)
    diff = (out.logits[0] - ref_logits).abs().max().item()
    print(f"{backend}: logits max diff {diff:.3e}")
    assert diff < TOL
    for n, p in model.named_parameters():
        scale = ref_grads[n].abs().max().item()
        assert (p.grad - ref_grads[n]).abs().max().item() <= TOL * max(1.0, scale), n


def test_fixed_windows_with_padding_tails(examples):
    """[B, W] windows: padding tails are segments of their own; real tokens equal the documents alone."""
    name = attention.register_hf_attention()
    model = make_model(name)
    batch = FixedWindowCollator(window=12, num_windows=4)(examples)
    with torch.no_grad():
        out = model(**batch.hf_kwargs())
    ref_logits, _ = alone_logits_and_grads(examples)
    flat = out.logits.reshape(-1, out.logits.shape[-1])
    ids = batch.input_ids.reshape(-1).tolist()
    cu = batch.cu_seqlens.tolist()
    by_doc = {tuple(ex["input_ids"]): i for i, ex in enumerate(examples)}
    starts = lengths_to_offsets(LENGTHS).tolist()
    seen = 0
    for a, b in zip(cu, cu[1:]):
        i = by_doc.get(tuple(ids[a:b]))
        if i is not None and b - a == LENGTHS[i]:
            assert (flat[a:b] - ref_logits[starts[i]:starts[i + 1]]).abs().max().item() < TOL
            seen += 1
    assert seen == len(examples)


def test_a_batch_without_cu_seqlens_is_refused(examples):
    """Under its own name transformers builds no mask, so a padded batch would attend to its padding:
    the function refuses a batch that does not say where its documents are."""
    model = make_model(attention.register_hf_attention())
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        model(input_ids=torch.tensor([examples[0]["input_ids"]]), use_cache=False)
