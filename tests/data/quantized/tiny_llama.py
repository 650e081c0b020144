"""The tiny Llama every producer here quantizes (imported by both fixture scripts, each in its own environment)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = LlamaConfig(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def random_model() -> LlamaForCausalLM:
    """fp32, seeded; matrices normal(0, 0.08): large enough that int4 rounding moves greedy choices (so the tests
    comparing against the dequantized weights can fail)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, 0.08)
    return model
