"""Compiling a request's ``StructuredOutputsParams`` into xgrammar's grammar, once per engine and schema, and a
matcher per sample that follows its tokens.

xgrammar over llguidance, by measurement (``benchmarks/structured_backends.py``, docs/benchmarks.md: a 32k-token
BPE vocabulary and a nested schema, one CPU thread): the token mask, made for every constrained row of every
step, takes 5 µs median against 24 µs (p90 18 against 81); compiling takes longer (13 ms against 0.7 ms), but
once per schema.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from paged_backend.config import FieldError
from paged_backend.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

# xgrammar (0.2.9) writes the characters of a JSON string with a length bound as [^"\\\r\n], which lets raw
# control characters through (its unbounded strings exclude them, as JSON requires): the schema's grammar is
# rewritten with JSON's class before it is compiled.
_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"
_CACHE_LIMIT_BYTES = 512 * 2**20  # the compiled grammars kept, by their size (vLLM's bound for xgrammar's cache)

# What a compile depends on: the params' kind, its text (a schema as JSON text, a regex, the choices as a JSON list,
# a grammar) and, for a schema, whether any whitespace is allowed. Plain strings, so a worker process can take it.
GrammarKey = tuple[str, str, bool]


def grammar_key(params: StructuredOutputsParams) -> GrammarKey:
    """The key of ``params``, made once per params object: a large schema's text takes milliseconds to write, and
    the server's budget check, its compile and the engine's lookup all ask for it."""
    made: GrammarKey | None = params.__dict__.get("_grammar_key")
    if made is None:
        made = _make_key(params)
        object.__setattr__(params, "_grammar_key", made)  # a cache beside the frozen fields, not one of them
    return made


def _make_key(params: StructuredOutputsParams) -> GrammarKey:
    kind = params.kind
    if kind in ("json", "json_object"):  # json_object: any object (xgrammar's built-in JSON takes arrays)
        schema = params.json if kind == "json" else {"type": "object"}
        text = schema if isinstance(schema, str) else json.dumps(schema)  # its property order kept
        return kind, text, not params.disable_any_whitespace
    if kind == "choice":
        return kind, json.dumps(params.choice), False
    return kind, str(params.regex if kind == "regex" else params.grammar), False


def build(compiler: xgrammar.GrammarCompiler, key: GrammarKey) -> xgrammar.CompiledGrammar:
    """Compile ``key`` with ``compiler`` (this process's or a compile worker's); a grammar xgrammar refuses, or one
    that no output can satisfy, raises a RuntimeError or ValueError (see ``refusal``)."""
    kind, text, any_whitespace = key
    xgr = xgrammar_module()
    if kind in ("json", "json_object"):
        ebnf = str(xgr.Grammar.from_json_schema(text, any_whitespace=any_whitespace))
        compiled = compiler.compile_grammar(ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))
    elif kind == "regex":
        compiled = compiler.compile_regex(text)
    elif kind == "choice":
        compiled = compiler.compile_grammar("root ::= " + " | ".join(map(ebnf_literal, json.loads(text))))
    else:
        compiled = compiler.compile_grammar(text)
    # A grammar whose first step allows no token (``root ::= root``) would leave the sampler nothing to choose.
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    if not bool(bitmask.any()) and not matcher.is_terminated():
        raise ValueError("no output satisfies it: no token can begin one")
    return compiled


def refusal(kind: str, reason: str) -> FieldError:
    """xgrammar's error for a grammar it cannot compile, as a ``FieldError`` naming the params' field."""
    reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", reason).strip()  # less xgrammar's time and source line
    return FieldError(f"structured_outputs.{kind}", f"structured_outputs.{kind} is not usable: {reason}")


def xgrammar_module() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise ImportError("structured outputs need xgrammar: pip install 'paged-backend[structured]'") from None
    return xgrammar


class GrammarCompiler:
    """One engine's compiler: the tokenizer's vocabulary read once; each grammar compiled once and kept, the
    least recently used dropped once the kept ones pass ``_CACHE_LIMIT_BYTES`` (a grammar compiled elsewhere, by
    a compile worker, joins through ``store``)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        xgr = xgrammar_module()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        hidden = hidden_special_ids(tokenizer) - set(stop_token_ids) - set(self.info.special_token_ids)
        if hidden:
            # xgrammar reads an added special token (<pad>, <s>, a chat marker) as its literal text, so a JSON
            # string could take it, and the output's text (special tokens skipped) would then break the schema.
            # A token whose text is empty is one xgrammar never allows: the vocabulary as xgrammar reads it
            # (``get_vocab``), those tokens emptied.
            encoded = [""] * vocab_size
            for token, index in tokenizer.get_vocab().items():
                if index < vocab_size and index not in hidden:
                    encoded[index] = token
            self.info = xgr.TokenizerInfo(
                encoded,
                vocab_type=self.info.vocab_type,
                vocab_size=vocab_size,
                stop_token_ids=stop_token_ids,
                add_prefix_space=self.info.add_prefix_space,
            )
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.vocab_size = vocab_size
        self._kept: OrderedDict[GrammarKey, xgrammar.CompiledGrammar] = OrderedDict()
        self._kept_bytes = 0
        self._lock = threading.Lock()  # requests compile on callers' threads and on the engine's

    def compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """The grammar of ``params``; a grammar xgrammar refuses is a ValueError naming the field."""
        key = grammar_key(params)
        compiled = self.kept(key)
        if compiled is None:
            try:
                compiled = build(self.compiler, key)
            except (RuntimeError, ValueError) as exc:
                raise refusal(params.kind, str(exc)) from None
            self.store(key, compiled)
        return compiled

    def kept(self, key: GrammarKey) -> xgrammar.CompiledGrammar | None:
        with self._lock:
            compiled = self._kept.get(key)
            if compiled is not None:
                self._kept.move_to_end(key)
            return compiled

    def store(self, key: GrammarKey, compiled: xgrammar.CompiledGrammar) -> None:
        with self._lock:
            if key in self._kept:
                return
            self._kept[key] = compiled
            self._kept_bytes += compiled.memory_size_bytes
            while self._kept_bytes > _CACHE_LIMIT_BYTES and len(self._kept) > 1:
                _, dropped = self._kept.popitem(last=False)
                self._kept_bytes -= dropped.memory_size_bytes

    def matcher(self, grammar: xgrammar.CompiledGrammar) -> xgrammar.GrammarMatcher:
        """A fresh matcher: one per sample, as each sample's tokens differ."""
        return xgrammar_module().GrammarMatcher(grammar)


def hidden_special_ids(tokenizer: Any) -> set[int]:
    """The tokens a decode with ``skip_special_tokens`` leaves out: the named special tokens and every added token
    marked special."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(index for index, token in decoder.items() if getattr(token, "special", False))
    return ids


def ebnf_literal(text: str) -> str:
    """``text`` as an EBNF string literal (JSON's escapes, which xgrammar's EBNF reads)."""
    return json.dumps(text, ensure_ascii=False)
