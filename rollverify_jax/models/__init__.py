"""Qwen3 policy models (Flax NNX), HF checkpoint import/export and the tokenizer."""

from rollverify_jax.models.hf import load_pretrained, save_pretrained
from rollverify_jax.models.qwen3 import (
    PRESETS,
    Qwen3Config,
    Qwen3ForCausalLM,
    init_model,
    model_config,
    token_logprobs,
)
from rollverify_jax.models.tokenizer import Tokenizer, build_char_tokenizer, load_tokenizer

__all__ = [
    "PRESETS",
    "Tokenizer",
    "build_char_tokenizer",
    "load_tokenizer",
    "Qwen3Config",
    "Qwen3ForCausalLM",
    "init_model",
    "load_pretrained",
    "model_config",
    "save_pretrained",
    "token_logprobs",
]
