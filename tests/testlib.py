"""What many test files share (not a test module): tiny models built from a config, with random weights.

Nothing is downloaded: every model here is a few thousand parameters, seeded, on the CPU.
"""

from __future__ import annotations

import torch

# The shape every tiny transformer shares: 2 layers, hidden 32, 4 query heads over 2 kv heads (GQA).
TINY = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)

# family -> (model class, config class), as named in transformers.
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "mistral": ("MistralForCausalLM", "MistralConfig"),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config"),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig"),
    "phi3": ("Phi3ForCausalLM", "Phi3Config"),
}


def tiny_config(family: str = "llama", **overrides):
    """The config of a tiny ``family`` model: :data:`TINY` with ``overrides`` on top.

    ``tiny_config(vocab_size=64).num_hidden_layers -> 2``
    """
    import transformers  # here, not at the top: the files that need no model need no transformers

    return getattr(transformers, FAMILIES[family][1])(**{**TINY, **overrides})


def tiny_causal_lm(family: str = "llama", *, dtype: torch.dtype = torch.float64, attn_implementation: str = "sdpa",
                   seed: int = 0, config=None, **overrides):
    """A tiny causal LM with random weights (``torch.manual_seed(seed)`` first), from :func:`tiny_config`
    (or from ``config``, a config object built by the caller), in train mode.

    ``tiny_causal_lm(vocab_size=64, dtype=torch.float32)`` -> a 2-layer LlamaForCausalLM, fp32, sdpa.
    """
    import transformers

    config = tiny_config(family, **overrides) if config is None else config
    cls = getattr(transformers, FAMILIES[family][0])
    torch.manual_seed(seed)
    return cls._from_config(config, attn_implementation=attn_implementation, dtype=dtype)


def tiny_token_lm(vocab: int, width: int, *, seed: int = 0) -> torch.nn.Module:
    """A per-token causal "LM" in float64: embedding -> tanh -> linear to the vocabulary; for loss tests,
    where attention is beside the point. ``tiny_token_lm(13, 6)(torch.tensor([[1, 2]])).shape -> (1, 2, 13)``.
    """
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(vocab, width), torch.nn.Tanh(), torch.nn.Linear(width, vocab)).double()
