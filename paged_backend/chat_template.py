"""What a chat template is given besides the messages: the arguments the caller sets itself (``LLM.chat``, the
server), which ``chat_template_kwargs`` (vLLM's) may not override, and those extra variables checked."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from paged_backend.config import FieldError

OWN_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tools",
    }
)


# transformers passes the tokenizer's special tokens to every template (``bos_token`` opens most of them): a
# request replacing them would write its own text where the model's markers belong.
SPECIAL_TOKENS = frozenset(
    {
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
        "additional_special_tokens",
    }
)


def chat_template_kwargs(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """``extra`` as template variables; setting one of the caller's own arguments, or one of the tokenizer's
    special tokens, is a ``FieldError``."""
    kwargs = dict(extra or {})
    taken = sorted(set(kwargs) & OWN_ARGUMENTS)
    if taken:
        raise FieldError(
            "chat_template_kwargs", f"chat_template_kwargs may not set {taken}: they are set by the caller"
        )
    special = sorted(set(kwargs) & SPECIAL_TOKENS)
    if special:
        raise FieldError(
            "chat_template_kwargs",
            f"chat_template_kwargs may not set {special}: they are the tokenizer's special tokens",
        )
    return kwargs
