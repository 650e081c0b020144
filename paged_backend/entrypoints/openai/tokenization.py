"""Tokenizing and chat templating for the server, off its event loop, after a bound on the token count that costs
nothing.

Tokenizing a long prompt takes long (a 1 MB text: ~0.5 s on a CPU core); on the event loop it would stall every
other client's stream for that long. So it runs on a worker thread (Hugging Face's fast tokenizers release the GIL
while they encode). One worker: a tokenizer object must not be used from two threads at once (a fast tokenizer
raises "Already borrowed" when one call changes its truncation settings under another), and tokenizing is short
next to generating.

Before that, a text that cannot fit is refused from its length alone: no token of the tokenizer spans more than
``L`` characters of the text, so a text of ``n`` characters has at least ``ceil(n / L)`` tokens, and when that
alone exceeds ``max_model_len`` the request is a 400 without any tokenizing (a 10 MB prompt is answered at once).
``L`` is the longest string in the vocabulary (added tokens included, as they may be matched in the text): in a
byte-level BPE every vocabulary character stands for one byte of UTF-8, and a character of text is at least one
byte; in a SentencePiece-style vocabulary a piece's characters are the text's own (``▁`` for a space, one byte per
``<0x..>`` byte-fallback piece). The bound holds only if the tokenizer never drops or merges text, so ``L`` is
computed only for pipelines known to keep every character (``chars_per_token_bound``); for any other tokenizer
the check is off and every prompt is tokenized (on the worker thread still).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import sys
import unicodedata
from collections.abc import Callable
from functools import cache
from typing import Any, Literal, Protocol, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Pieces of a tokenizers pipeline that keep every character of the text (the rest drop some: ``Whitespace`` and
# ``BertPreTokenizer`` drop spaces, ``Strip`` and ``BertNormalizer`` drop characters, WordPiece maps a whole word
# of unknown characters to one [UNK], ...).
_KEEPING_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend"}
_COMPOSING_NORMALIZERS: dict[str, Literal["NFD", "NFKD"]] = {
    "NFC": "NFD",
    "NFKC": "NFKD",
}  # composition shrinks text, at most as much as the inverse
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts"}


class HFTokenizer(Protocol):
    """What the server needs of a Hugging Face tokenizer."""

    def __call__(self, text: str, add_special_tokens: bool = ...) -> Any: ...

    def get_vocab(self) -> dict[str, int]: ...

    def decode(self, token_ids: list[int]) -> Any: ...

    def convert_ids_to_tokens(self, ids: list[int]) -> Any: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any: ...


class ServerTokenizer:
    """A tokenizer's ``encode`` and chat template on one worker thread, and the length bound before them."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.tokenizer = tokenizer
        self.max_chars_per_token = chars_per_token_bound(tokenizer)
        if self.max_chars_per_token is None:
            logger.info(
                "the tokenizer may drop or merge text: prompts are not bounded by their length before tokenizing"
            )
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="paged-backend-tokenizer")

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``text``'s token count (0 when the tokenizer gives none)."""
        if self.max_chars_per_token is None:
            return 0
        return -(-len(text) // self.max_chars_per_token)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.run(lambda: list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids))

    async def decode(self, ids: list[int]) -> str:
        text = await self.run(lambda: self.tokenizer.decode(ids))
        return text if isinstance(text, str) else "".join(text)

    async def token_strs(self, ids: list[int]) -> list[str]:
        return await self.run(lambda: [str(t) for t in self.tokenizer.convert_ids_to_tokens(ids)])

    async def render_chat(
        self,
        messages: list[dict[str, Any]],
        chat_template: str | None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The chat template's text for ``messages`` (a Jinja template runs as long as its input is big);
        ``template_kwargs`` are more variables for the template (``enable_thinking``, ...)."""
        text = await self.run(
            lambda: self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                **template_kwargs,
            )
        )
        if not isinstance(text, str):
            raise TypeError(f"the chat template gave {type(text).__name__}, not text")
        return text

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the worker thread, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn)


def chars_per_token_bound(tokenizer: object) -> int | None:
    """``L`` such that no token covers more than ``L`` characters of the text it came from, or None when the
    tokenizer's pipeline may drop or merge characters (then no such bound exists: ``Whitespace`` makes a megabyte of
    spaces zero tokens). Known-safe pipelines: a normalizer that only decomposes, lowercases, prepends or replaces a
    string by one at least as long (NFC/NFKC: composing shrinks a text by at most the longest decomposition, 4 or
    18 characters, so ``L`` grows by that factor); a pre-tokenizer that only splits (keeping the pieces) or maps
    bytes; a BPE that cannot lose characters (byte fallback, every byte-level character in its vocabulary, or an
    unknown token that is not fused) or a Unigram with byte fallback; added tokens that swallow no whitespace."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if backend is None or get_vocab is None:
        return None  # a slow (Python) tokenizer: its pipeline is code, not a description
    vocab: dict[str, int] = get_vocab()
    pipeline = json.loads(backend.to_str())
    shrink = _normalizer_shrink(pipeline.get("normalizer"))
    if shrink is None or not _keeps_text(pipeline.get("pre_tokenizer"), _KEEPING_PRE_TOKENIZERS):
        return None
    if not _model_keeps_text(pipeline.get("model") or {}, pipeline.get("pre_tokenizer"), vocab):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in pipeline.get("added_tokens") or []):
        return None  # such a token absorbs any run of whitespace next to it
    return max(len(token) for token in vocab) * shrink


def _normalizer_shrink(normalizer: dict[str, Any] | None) -> int | None:
    """How many characters of text one normalized character stands for at most; None when unbounded."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", []):
            shrink = _normalizer_shrink(part)
            if shrink is None:
                return None
            factor *= shrink
        return factor
    if kind in _KEEPING_NORMALIZERS:
        return 1
    if kind in _COMPOSING_NORMALIZERS:
        return _longest_decomposition(_COMPOSING_NORMALIZERS[kind])
    if kind == "Replace":
        pattern = (normalizer.get("pattern") or {}).get("String")
        return 1 if pattern and len(normalizer.get("content", "")) >= len(pattern) else None
    return None


def _keeps_text(part: dict[str, Any] | None, keeping: set[str]) -> bool:
    if part is None:
        return True
    if part.get("type") == "Sequence":
        return all(_keeps_text(p, keeping) for p in part.get("pretokenizers", []))
    return part.get("type") in keeping and part.get("behavior") != "Removed"


def _model_keeps_text(model: dict[str, Any], pre_tokenizer: dict[str, Any] | None, vocab: dict[str, int]) -> bool:
    if model.get("byte_fallback"):
        return model.get("type") in ("BPE", "Unigram")
    if model.get("type") != "BPE":
        return False
    if _has(pre_tokenizer, "ByteLevel"):
        from tokenizers import pre_tokenizers

        if all(c in vocab for c in pre_tokenizers.ByteLevel.alphabet()):
            return True  # every byte is a token: nothing is unknown
    return model.get("unk_token") is not None and not model.get("fuse_unk")


def _has(part: dict[str, Any] | None, kind: str) -> bool:
    if part is None:
        return False
    if part.get("type") == "Sequence":
        return any(_has(p, kind) for p in part.get("pretokenizers", []))
    return part.get("type") == kind


@cache
def _longest_decomposition(form: Literal["NFD", "NFKD"]) -> int:
    """The most characters one character decomposes into under ``form`` (NFD: 4, NFKD: 18): as a text's
    decomposition is never shorter than the text, composing shrinks it by at most this factor."""
    return max(len(unicodedata.normalize(form, chr(c))) for c in range(sys.maxunicode + 1) if not 0xD800 <= c <= 0xDFFF)
