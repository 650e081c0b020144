"""The embedded demo checkpoint: a small random-weight Llama and a byte-level BPE tokenizer trained offline in a
second, built once into a cache folder, so that ``paged-backend demo`` and every script in ``examples/`` run
anywhere with no download and no GPU."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

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

# The tokenizer's special tokens, in the order it is trained with them.
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

# A Llama large enough that the batch's work, not Python, sets the pace; still seconds on a laptop.
DEMO_CONFIG: dict[str, int] = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)
DEMO_FOLDER = "demo-llama"

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}</s>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


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
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def random_weight_model(model_type: str, vocab_size: int, seed: int = 0, **fields: object) -> PreTrainedModel:
    """A random-weight fp32 model of ``model_type`` (its config's ``fields`` over transformers' defaults) whose
    special tokens are ``build_tiny_tokenizer``'s, in eval mode. Weights are drawn larger than the architecture's
    own init, so that greedy outputs vary instead of repeating one token."""
    config = AutoConfig.for_model(
        model_type, vocab_size=vocab_size, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, **fields
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.25)
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    return model.eval()


def default_cache_dir() -> Path:
    """``$PAGED_BACKEND_CACHE``, else ``$XDG_CACHE_HOME/paged-backend``, else ``~/.cache/paged-backend``."""
    if os.environ.get("PAGED_BACKEND_CACHE"):
        return Path(os.environ["PAGED_BACKEND_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "paged-backend"


def build_once(path: Path, build: Callable[[Path], None], what: str) -> Path:
    """``path``, made by ``build(folder)`` on first use: written beside it, then renamed, so a run cut short leaves
    no half checkpoint behind and two processes building at once both end with a whole one."""
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building %s in %s (once)", what, path)
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=".building-"))
    try:
        build(staging)
        try:
            staging.rename(path)
        except OSError:  # another process built it meanwhile
            if not (path / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def demo_checkpoint(cache_dir: Path) -> Path:
    """The demo's random-weight checkpoint folder, built on first use."""

    def build(folder: Path) -> None:
        tokenizer = build_tiny_tokenizer()
        random_weight_model("llama", len(tokenizer), **DEMO_CONFIG).save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    return build_once(cache_dir / DEMO_FOLDER, build, "the demo checkpoint")


def model_or_demo(model: str | None) -> str:
    """``model`` when given, else the demo checkpoint's path: examples run the same code on both."""
    return model or str(demo_checkpoint(default_cache_dir()))
