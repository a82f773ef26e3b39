"""Each framework integration is pinned to the versions it declares and to the hooks it uses.

``packkit.integrations.transformers`` declares ``SUPPORTED``; here the installed transformers must lie in it (a
newer one fails here, in one place, until the hooks below pass on it and the range is widened), and the hooks
packkit relies on must exist as it calls them: ``AttentionInterface.register(key, value)``, and a model's
attention layer calling a registered function as ``fn(module, query, key, value, attention_mask, scaling=...,
dropout=..., **kwargs)`` with the ``model(...)`` keywords a packed batch (``cu_seq_lens_q``, ``max_length_q``)
and a CP shard (``cp_seq_idx``, ``cp_position_ids``) carry, the tensors in the layout ``read_call`` assumes.
Before, the registry and these keywords were read in ``attention.py`` and ``cp.py`` each.
``packkit.integrations.trl`` and ``packkit.integrations.accelerate`` are pinned the same way, below; and no module
outside ``packkit/integrations/`` uses a private surface of the three (:data:`PRIVATE`).
"""

import ast
import inspect
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from packkit import attention, cp  # noqa: E402
from packkit.collate import PaddingFreeCollator  # noqa: E402
from packkit.integrations import transformers as hf  # noqa: E402
from testlib import tiny_causal_lm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_is_supported_reads_major_minor_against_the_range():
    first, past = hf.SUPPORTED
    assert hf.is_supported(".".join(map(str, first)) + ".0")
    assert hf.is_supported(f"{first[0]}.{first[1]}.0.dev0")
    assert not hf.is_supported(".".join(map(str, past)) + ".0")
    assert not hf.is_supported("4.45.2")


def test_the_installed_transformers_is_in_the_supported_range():
    version = hf.installed_version()
    assert version == transformers.__version__
    assert hf.is_supported(version), (
        f"transformers {version} is installed; packkit.integrations.transformers declares {hf.SUPPORTED}: run "
        "this file on it and widen SUPPORTED when its hooks pass")


def test_attention_interface_register_takes_a_key_and_a_function():
    params = list(inspect.signature(transformers.AttentionInterface.register).parameters)
    assert params == ["key", "value"], params


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_models_attention_layer_calls_a_registered_function_as_read_call_reads_it(family):
    """A spy registered through ``hf.register`` sees each layer's call: the positional layout, the packed batch's
    and a CP shard's keywords, passed through ``model(...)`` untouched; it then runs packkit's own function."""
    calls = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        calls.append((module, query.shape, key.shape, attention_mask, dict(kwargs)))
        kwargs = {k: v for k, v in kwargs.items() if not k.startswith("cp_")}
        return attention.hf_varlen_attention(module, query, key, value, attention_mask, backend="reference",
                                             **kwargs)

    name = hf.register(f"packkit_spy_{family}", spy)
    model = tiny_causal_lm(family, dtype=torch.float32, attn_implementation=name)
    batch = PaddingFreeCollator(loss_mask="none")([{"input_ids": list(range(1, 1 + n))} for n in (5, 3, 7)])
    marker = torch.arange(15)
    out = model(**batch.hf_kwargs(), cp_seq_idx=marker, cp_position_ids=marker)
    assert out.logits.shape[:2] == (1, 15)
    assert len(calls) == model.config.num_hidden_layers
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    head_dim = model.config.hidden_size // heads
    for module, q_shape, k_shape, mask, kwargs in calls:
        assert tuple(q_shape) == (1, heads, 15, head_dim) and tuple(k_shape) == (1, kv_heads, 15, head_dim)
        assert mask is None  # a function of our own name gets no mask built for it
        assert {"scaling", "dropout"} <= kwargs.keys()
        assert torch.equal(kwargs["cu_seq_lens_q"], batch.hf_kwargs()["cu_seq_lens_q"])
        assert kwargs["max_length_q"] == 7
        assert kwargs["cp_seq_idx"] is marker and kwargs["cp_position_ids"] is marker
        assert hasattr(module, "is_causal")
        assert not any(kwargs.get(f) is not None or getattr(module, f, None) is not None
                       for f in hf.UNSUPPORTED_FEATURES)


def test_read_call_refuses_a_feature_it_does_not_implement_naming_it():
    q = torch.zeros(1, 2, 4, 8)
    module = torch.nn.Module()
    module.is_causal = True
    with pytest.raises(ValueError, match="packkit_varlen attention does not implement softcap; use"):
        attention.hf_varlen_attention(module, q, q, q, None, cu_seq_lens_q=torch.tensor([0, 4], dtype=torch.int32),
                                      max_length_q=4, softcap=30.0)
    with pytest.raises(ValueError, match="packkit_cp attention needs a CP shard's cp_seq_idx"):
        cp.hf_cp_attention(module, q, q, q, None)
    with pytest.raises(ValueError, match="packkit_cp attention takes no attention_mask: documents come from "
                                         "cp_seq_idx"):
        cp.hf_cp_attention(module, q, q, q, q, cp_seq_idx=q, cp_position_ids=q)


def test_the_chat_template_compiler_is_transformers_own_and_refuses_bad_syntax():
    """packkit.chat compiles a template before any example is rendered, with this private function (a syntax error
    was blamed on example 0 without it)."""
    from jinja2 import TemplateSyntaxError

    compile_ = hf.jinja_compiler()
    assert compile_ is transformers.utils.chat_template_utils._compile_jinja_template
    compile_("{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}")
    with pytest.raises(TemplateSyntaxError):
        compile_("{% if x %}y{% endfi %}")


def test_register_outside_the_range_says_so_in_one_line(monkeypatch):
    monkeypatch.setattr(hf, "SUPPORTED", ((0, 1), (0, 2)))
    with pytest.warns(UserWarning, match=r"checked against transformers >=0\.1,<0\.2; transformers .* is installed"):
        hf.register("packkit_range_check", lambda *a, **k: None)


#: The private surfaces of transformers, TRL and accelerate that packkit touches, each with the one module that may:
#: ``{name: home in packkit/integrations/}``; a name ending in ``.`` is a prefix (transformers' modeling modules).
PRIVATE = {
    "AttentionInterface": "transformers", "_attn_implementation": "transformers",
    "_compile_jinja_template": "transformers", "_normalize_chat_messages": "transformers",
    "_prepare_input": "transformers", "_get_num_items_in_batch": "transformers",
    "_set_signature_columns_if_needed": "transformers", "transformers.models.": "transformers",
    "_compute_loss": "trl",
    "BatchSamplerShard": "accelerate", "DataLoaderShard": "accelerate", "SkipBatchSampler": "accelerate",
}


def code_words(source: str):
    """``(word, lineno)`` for what ``source``'s code names, prose left out. A word is an identifier (a name, an
    attribute, a definition, a parameter, a keyword argument, an imported name or module) or a whole string literal
    (``getattr(config, "_attn_implementation")``, ``type(x).__name__ == "DataLoaderShard"``,
    ``import_module("transformers.models.x")``). Docstrings, comments and words inside a longer string (an error
    message naming a class) are prose: a mention, not a use."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body and \
                isinstance(node.body[0], ast.Expr):
            docstrings.add(id(node.body[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words = [node.id]
        elif isinstance(node, ast.Attribute):
            words = [node.attr]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            words = [node.name]
        elif isinstance(node, (ast.arg, ast.keyword)):
            words = [node.arg]
        elif isinstance(node, ast.alias):
            words = [node.name, node.asname]
        elif isinstance(node, ast.ImportFrom):
            words = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words = [node.value]
        else:
            continue
        yield from ((w, getattr(node, "lineno", 0)) for w in words if w)


def private_uses(source: str) -> list:
    """``(name of PRIVATE, lineno)`` for each use in ``source``'s code."""
    return [(name, line) for word, line in code_words(source) for name in PRIVATE
            if word == name or (name.endswith(".") and word.startswith(name))]


def test_code_words_match_uses_not_mentions():
    source = (
        '"""A docstring naming BatchSamplerShard and _attn_implementation."""\n'
        "# a comment on DataLoaderShard\n"
        "from transformers.models.llava_next import modeling_llava_next\n"
        "def f(config, loader):\n"
        '    """Reads config._attn_implementation."""\n'
        '    impl = getattr(config, "_attn_implementation", None)\n'
        '    shard = type(loader).__name__ == "DataLoaderShard"\n'
        '    raise ValueError(f"accelerate\'s BatchSamplerShard deals {impl}")\n'
        "    return config._compute_loss(hf_compute_loss_func=AttentionInterface)\n")
    assert sorted(private_uses(source)) == [("AttentionInterface", 9), ("DataLoaderShard", 7),
                                            ("_attn_implementation", 6), ("_compute_loss", 9),
                                            ("transformers.models.", 3)]


def test_only_the_integrations_touch_the_private_surfaces():
    """Each name of :data:`PRIVATE` is used in its home module only, and is used there (else the match is broken or
    the name gone: drop it from PRIVATE). Before, ``_attn_implementation`` was read in five places in four modules,
    media imported ``modeling_llava_next`` and resume recognised accelerate's wrappers itself."""
    found = {}
    for path in sorted((ROOT / "packkit").rglob("*.py")):
        where = str(path.relative_to(ROOT))
        for name, line in private_uses(path.read_text()):
            found.setdefault(name, []).append(f"{where}:{line}")
    outside = [f"{place} uses {name!r}: move it into packkit/integrations/{PRIVATE[name]}.py and call that"
               for name, places in sorted(found.items()) for place in places
               if not place.startswith(f"packkit/integrations/{PRIVATE[name]}.py:")]
    assert not outside, "\n".join(outside)
    assert not set(PRIVATE) - set(found), f"no module uses {sorted(set(PRIVATE) - set(found))}"


# -- TRL -------------------------------------------------------------------------------------------------------


def test_the_installed_trl_is_in_the_supported_range():
    trl = pytest.importorskip("trl")
    from packkit.integrations import trl as hooks

    assert hooks.installed_version() == trl.__version__
    assert hooks.is_supported(trl.__version__), (
        f"trl {trl.__version__} is installed; packkit.integrations.trl declares {hooks.SUPPORTED}: run this file "
        "and test_preference's DPOTrainer tests on it and widen SUPPORTED when they pass")
    assert not hooks.is_supported("1.15.2") and not hooks.is_supported("2.0.0")


def test_dpo_trainers_private_loss_hook_has_the_signature_overridden():
    trl = pytest.importorskip("trl")
    params = list(inspect.signature(trl.DPOTrainer._compute_loss).parameters)
    assert params == ["self", "model", "inputs", "return_outputs"], params


@pytest.mark.slow  # a real DPOTrainer
def test_a_dpo_trainer_holds_what_the_hook_reads_and_compute_loss_reaches_it(tmp_path):
    pytest.importorskip("trl")
    from test_preference import PackedDPOTrainer, dpo_trainer, preference_rows, tokenizer

    from packkit.integrations import trl as hooks
    from packkit.preference import PreferenceCollator

    rows = preference_rows(4, 3, conversational=False)
    trainer = dpo_trainer(tmp_path, rows, cls=PackedDPOTrainer, other_ref=True,
                          collator=PreferenceCollator(layout="tree", window=64))
    missing = [a for a in hooks.CONFIG_ATTRIBUTES if not hasattr(trainer, a)]
    assert not missing, f"trl.DPOTrainer no longer holds {missing}"
    assert trainer._packed_dpo_unsupported() is None  # DPOConfig's defaults: the sigmoid loss
    seen = []
    own = trainer._packed_dpo_loss
    trainer._packed_dpo_loss = lambda *a, **k: seen.append(k) or own(*a, **k)
    mode = "train" if trainer.model.training else "eval"
    before = len(trainer._metrics[mode]["rewards/chosen"])
    loss = trainer.compute_loss(trainer.model, PreferenceCollator(tokenizer=tokenizer())(rows))
    assert seen == [{"beta": trainer.beta}] and torch.isfinite(loss)
    assert len(trainer._metrics[mode]["rewards/chosen"]) == before + 1


def test_trainer_prepare_input_rebuild_is_found_and_its_trainer_read():
    """``Trainer._prepare_input`` rebuilds a batch as ``type(data)({k: self._prepare_input(v) ...})``:
    ``prepare_input_caller`` finds that frame from the batch's constructor (the trainer and the batch it copies), and
    nothing from any other construction; ``trains_model_loss`` reads whether the trainer trains its model's own
    loss (no ``compute_loss_func``, a ``compute_loss`` of transformers or TRL)."""
    import sys

    from packkit.batch import PackedBatch

    seen = []

    class Spy(PackedBatch):
        def _rebuild(self, mapping):
            seen.append(hf.prepare_input_caller(sys._getframe(2), dict(mapping).keys()))
            super()._rebuild(mapping)

    class Prepare:  # the attributes Trainer._prepare_input reads, without building a Trainer
        _prepare_input = transformers.Trainer._prepare_input
        is_deepspeed_enabled = False
        args = transformers.TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])

    prepare = Prepare()
    batch = PaddingFreeCollator()([{"input_ids": [1, 2, 3]}])
    spy = dict.__new__(Spy)
    dict.update(spy, batch)
    spy.__dict__.update(batch.__dict__)
    prepare._prepare_input(spy)
    assert seen and seen[0] is not None and seen[0][0] is prepare and seen[0][1] is spy
    seen.clear()
    Spy(dict(batch))  # not Trainer's rebuild
    assert seen == [None]

    class Own(transformers.Trainer):
        def compute_loss(self, *a, **k):
            return super().compute_loss(*a, **k)

    bare = object.__new__(transformers.Trainer)
    bare.compute_loss_func = None
    assert hf.trains_model_loss(bare)
    bare.compute_loss_func = len
    assert not hf.trains_model_loss(bare)
    own = object.__new__(Own)
    own.compute_loss_func = None
    assert not hf.trains_model_loss(own)
    trl = pytest.importorskip("trl")
    sft = object.__new__(trl.SFTTrainer)
    sft.compute_loss_func = None
    assert hf.trains_model_loss(sft)


def test_attn_implementation_reads_the_configs_name_with_the_callers_default():
    """``attn_implementation`` is the one reader of ``config._attn_implementation``: None (or ``default``) where the
    config names none, the name where it does, whatever ``default`` is."""
    unset, eager = transformers.LlamaConfig(), transformers.LlamaConfig(attn_implementation="eager")
    assert unset._attn_implementation is None  # the private attribute read, as the installed transformers keeps it
    assert hf.attn_implementation(unset) is None and hf.attn_implementation(unset, "sdpa") == "sdpa"
    assert hf.attn_implementation(eager) == "eager" and hf.attn_implementation(eager, "sdpa") == "eager"
    assert hf.attn_implementation(object()) is None and hf.attn_implementation(object(), "sdpa") == "sdpa"


def test_llava_next_grids_are_the_unpadded_grids_of_the_models_own_features():
    """``llava_next_grids`` against LLaVA-NeXT's own ``pack_image_features`` (which appends a newline column per row):
    its features per image, less the base tile's and the newlines, are ``height * width`` patches."""
    from transformers.models.llava_next import modeling_llava_next as ml

    config = transformers.LlavaNextConfig(
        vision_config={"model_type": "clip_vision_model", "image_size": 32, "patch_size": 8, "hidden_size": 8,
                       "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2},
        text_config={"model_type": "llama", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 64},
        image_grid_pinpoints=[[32, 64], [64, 32], [64, 64]], vision_feature_select_strategy="default")
    side = config.vision_config.image_size // config.vision_config.patch_size
    model = ml.LlavaNextModel(config).eval()
    sizes = [[30, 50], [64, 20], [40, 40]]
    for size, (height, width) in zip(sizes, hf.llava_next_grids(sizes, config), strict=True):
        rows, cols = ml.get_anyres_image_grid_shape(size, config.image_grid_pinpoints, 32)
        tiles = torch.zeros(1 + rows * cols, side * side, config.text_config.hidden_size)
        with torch.no_grad():
            features, _ = model.pack_image_features([tiles], torch.tensor([size]), "default",
                                                    image_newline=model.image_newline)
        assert features[0].shape[0] == side * side + height * (width + 1), (size, height, width)


# -- accelerate ------------------------------------------------------------------------------------------------


def test_the_installed_accelerate_is_in_the_supported_range():
    accelerate = pytest.importorskip("accelerate")
    from packkit.integrations import accelerate as shards

    assert shards.installed_version() == accelerate.__version__
    assert shards.is_supported(accelerate.__version__), (
        f"accelerate {accelerate.__version__} is installed; packkit.integrations.accelerate declares "
        f"{shards.SUPPORTED}: run this file and tests/test_resume_trainer.py and tests/test_resume_loaders.py on it "
        "and widen SUPPORTED when they pass")
    assert not shards.is_supported("1.15.0") and not shards.is_supported("2.0.0")


def test_accelerates_wrappers_hold_what_is_read_of_them_and_behave_as_read():
    """Each class named in ``CLASSES`` exists in ``accelerate.data_loader`` under that name and holds the attributes
    read; a ``DataLoaderShard`` holds one batch back until its last; ``skip_first_batches`` wraps a
    ``SkipBatchSampler``; a ``BatchSamplerShard`` passes every batch on one process; one dealing a rank's batches
    again is refused."""
    data_loader = pytest.importorskip("accelerate.data_loader")
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

    from packkit.integrations import accelerate as shards

    inner = BatchSampler(SequentialSampler(range(8)), 2, False)
    made = {"BatchSamplerShard": data_loader.BatchSamplerShard(inner, num_processes=1, process_index=0),
            "DataLoaderShard": data_loader.DataLoaderShard(range(8), batch_sampler=inner),
            "SkipBatchSampler": data_loader.skip_first_batches(DataLoader(range(8), batch_sampler=inner),
                                                               1).batch_sampler}
    for name, attributes in shards.CLASSES.items():
        assert type(made[name]).__name__ == name
        assert all(hasattr(made[name], a) for a in attributes), (name, attributes)
    loader = made["DataLoaderShard"]
    assert shards.is_loader_shard(loader) and not shards.is_loader_shard(inner)
    assert [shards.held_back(loader) for _ in loader] == [1, 1, 1, 0] and shards.held_back(None) == 0
    skip = made["SkipBatchSampler"]
    assert shards.skipped_batches(skip) == 1 and list(skip) == list(inner)[1:]
    assert shards.skipped_batches(inner) is None and not shards.is_skipping(inner)
    assert list(made["BatchSamplerShard"]) == list(inner) and shards.draws_from(made["BatchSamplerShard"], inner)
    assert shards.draws_from(skip, inner) and not shards.draws_from(inner, inner)

    class RankSampler(BatchSampler):  # one rank's batches of two
        world_size = 2

    shards.check_not_dealt_twice(made["BatchSamplerShard"])
    again = data_loader.BatchSamplerShard(RankSampler(SequentialSampler(range(8)), 2, False), num_processes=2,
                                          process_index=0)
    with pytest.raises(ValueError, match=r"deals the batches of RankSampler over 2 processes again, but they are "
                                         r"already one rank's of 2"):
        shards.check_not_dealt_twice(again)
