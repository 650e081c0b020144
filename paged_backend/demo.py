"""An embedded default: a tiny random-weight model and a tokenizer trained offline in a second, so the engine
runs anywhere with no download and no GPU (``paged-backend demo``). Tests build their models with the same
helpers."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

CORPUS = [
    "The paged KV cache stores keys and values in fixed-size blocks, like pages of virtual memory.",
    "Continuous batching lets new requests join a running batch at every decoding step.",
    "A block table maps each sequence's logical blocks to physical blocks in the cache.",
    "Prefix caching reuses the blocks of a shared prompt instead of computing them again.",
    "When memory runs out, the newest request is preempted and recomputed later.",
    "Hello world! How are you today? I am fine, thank you. What a lovely day it is.",
    "Once upon a time there was a little model that generated text one token at a time.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in text too, as do symbols: + - * / = ( ) [ ] { }.",
    "Unicode text: café, naïve, Straße, 東京, 😀 should decode without broken characters.",
]

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}</s>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Tiny configs: the attention shapes that matter (GQA, sliding window, learned positions) at toy sizes.
_DECODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(_DECODER, model_type="llama"),
    "mistral": dict(_DECODER, model_type="mistral", sliding_window=7),
    # layer 0 full attention, layer 1 sliding window
    "qwen2": dict(_DECODER, model_type="qwen2", use_sliding_window=True, sliding_window=9, max_window_layers=1),
    "qwen3": dict(_DECODER, model_type="qwen3", num_key_value_heads=1, head_dim=32),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=512),
    # attention logit softcapping, query_pre_attn_scalar scaling, alternating sliding/full layers
    "gemma2": dict(
        _DECODER, model_type="gemma2", head_dim=16, sliding_window=5, attn_logit_softcapping=5.0,
        final_logit_softcapping=30.0, query_pre_attn_scalar=24,
    ),
    "gemma3": dict(
        _DECODER, model_type="gemma3_text", num_hidden_layers=3, head_dim=16, sliding_window=5,
        query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    "phi3": dict(_DECODER, model_type="phi3"),
    "opt": dict(
        model_type="opt", hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=512, word_embed_proj_dim=64,
    ),
    "gpt_neox": dict(
        model_type="gpt_neox", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=512,
    ),
    "mixtral": dict(_DECODER, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
}  # fmt: skip


def build_tiny_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on ``CORPUS`` with <s>/</s>/<pad> and a chat template; adds BOS to prompts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(arch: str = "llama", vocab_size: int = 512, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A random-weight fp32 model of the named architecture (one of ``TINY_CONFIGS``, with ``overrides`` of its
    config's fields), in eval mode."""
    from transformers import AutoConfig

    if arch not in TINY_CONFIGS:
        raise ValueError(f"arch must be one of {sorted(TINY_CONFIGS)}, got {arch!r}")
    kwargs = dict(TINY_CONFIGS[arch], **overrides)
    model_type = kwargs.pop("model_type")
    config = AutoConfig.for_model(
        model_type, vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0, **kwargs
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger-than-default weights so greedy outputs vary instead of repeating one token
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.25)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return model.eval()


# Larger than the tests' models so that the batch's work, not Python, sets the pace; still seconds on a laptop.
DEMO_CONFIG = dict(
    hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8, max_position_embeddings=2048
)
DEMO_FOLDER = "demo-llama"


def default_cache_dir() -> Path:
    """``$PAGED_BACKEND_CACHE``, else ``$XDG_CACHE_HOME/paged-backend``, else ``~/.cache/paged-backend``."""
    if os.environ.get("PAGED_BACKEND_CACHE"):
        return Path(os.environ["PAGED_BACKEND_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "paged-backend"


def demo_checkpoint(cache_dir: Path) -> Path:
    """The demo's checkpoint folder, built on first use (written beside it, then renamed: a run cut short
    leaves no half checkpoint behind)."""
    path = cache_dir / DEMO_FOLDER
    if (path / "config.json").exists():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    logger.info("building the demo checkpoint in %s (once)", path)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model("llama", vocab_size=len(tokenizer), **DEMO_CONFIG)
    staging = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".building-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(path)
        except OSError:  # another process built it meanwhile
            if not (path / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def model_or_demo(model: str | None) -> str:
    """``model`` when given, else the demo checkpoint's path: examples run the same code on both."""
    return model or str(demo_checkpoint(default_cache_dir()))
