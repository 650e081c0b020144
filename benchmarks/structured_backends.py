"""xgrammar against llguidance, the two grammar engines structured outputs could use: compile time of a JSON
schema and the time to compute one token mask, on the host (where the mask is made at every step).

Vocabulary: a 32,000-token byte-level BPE trained offline on generated text (words, numbers, JSON), so that the
mask covers a vocabulary of a real model's order. Schema: a nested object (bounded string, integer range, array
of enums, object with a pattern, boolean, anyOf). Masks are timed along random walks through the grammar (each
step takes a random allowed token), 300 steps, 3 walks; compile times over 5 schemas that differ only in
trailing whitespace (so no engine's cache serves them). One CPU thread each.

    pip install xgrammar llguidance
    python benchmarks/structured_backends.py --json benchmarks/results/structured_backends.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import statistics
import string
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("benchmarks.structured_backends")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ccc"]}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
        "active": {"type": "boolean"},
        "score": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    },
    "required": ["name", "age", "tags", "address", "active"],
}


def corpus(n: int = 20000, seed: int = 0) -> Iterator[str]:
    rng = random.Random(seed)
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 10))) for _ in range(8000)]
    for _ in range(n):
        if rng.random() < 0.5:
            yield " ".join(rng.choice(words) for _ in range(rng.randint(5, 30))) + "."
        else:
            values = [rng.randint(-1000, 100000), rng.choice(words), True, None, [1, 2.5]]
            record = {rng.choice(words): rng.choice(values) for _ in range(rng.randint(1, 6))}
            yield json.dumps(record, indent=rng.choice([None, 2]))


def build_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")


class Engine:
    """One grammar library behind the four calls the measurement makes."""

    def __init__(
        self,
        setup: Callable[[], Any],
        compile_: Callable[[Any, str], Any],
        matcher: Callable[[Any, Any], Any],
        fill: Callable[[Any, torch.Tensor], None],
        accept: Callable[[Any, int], bool],
        done: Callable[[Any], bool],
    ) -> None:
        self.setup, self.compile, self.matcher, self.fill, self.accept, self.done = (
            setup, compile_, matcher, fill, accept, done
        )  # fmt: skip


def engines(tokenizer: Any, vocab: int) -> dict[str, Engine]:
    import llguidance
    import llguidance.hf
    import llguidance.torch
    import xgrammar as xgr

    def llguidance_compile(tok: Any, schema: str) -> str:
        """llguidance compiles when a matcher is made: the schema's grammar and a first matcher."""
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        llguidance.LLMatcher(tok, grammar)
        return str(grammar)

    return {
        "xgrammar": Engine(
            lambda: xgr.GrammarCompiler(
                xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab), max_threads=1, cache_enabled=False
            ),  # fmt: skip
            lambda compiler, schema: compiler.compile_json_schema(schema),
            lambda compiler, grammar: xgr.GrammarMatcher(grammar),
            lambda m, bitmask: m.fill_next_token_bitmask(bitmask, 0),
            lambda m, token: m.accept_token(token),
            lambda m: m.is_terminated(),
        ),
        "llguidance": Engine(
            lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab),
            llguidance_compile,
            lambda tok, grammar: llguidance.LLMatcher(tok, grammar),
            lambda m, bitmask: llguidance.torch.fill_next_token_bitmask(m, bitmask, 0),
            lambda m, token: m.consume_token(token),
            lambda m: m.is_stopped(),
        ),
    }


def measure(engine: Engine, vocab: int, steps: int, walks: int, seed: int) -> dict[str, Any]:
    start = time.perf_counter()
    context = engine.setup()
    setup_s = time.perf_counter() - start
    schema = json.dumps(SCHEMA)
    compile_s = []
    grammar = None
    for pad in range(5):
        start = time.perf_counter()
        grammar = engine.compile(context, schema + " " * pad)
        compile_s.append(time.perf_counter() - start)
    rng = random.Random(seed)
    mask_s: list[float] = []
    bitmask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    for _ in range(walks):
        matcher = engine.matcher(context, grammar)
        for _ in range(steps):
            start = time.perf_counter()
            engine.fill(matcher, bitmask)
            mask_s.append(time.perf_counter() - start)
            bits = bitmask[0].tolist()
            allowed = [t for t in range(vocab) if (bits[t // 32] >> (t % 32)) & 1]
            if not allowed or not engine.accept(matcher, rng.choice(allowed)) or engine.done(matcher):
                break
    mask_s.sort()
    return {
        "tokenizer_setup_ms": 1e3 * setup_s,
        "compile_ms_runs": [1e3 * s for s in compile_s],
        "compile_ms_median": 1e3 * statistics.median(compile_s),
        "mask_us_median": 1e6 * statistics.median(mask_s),
        "mask_us_p90": 1e6 * mask_s[int(0.9 * len(mask_s))],
        "masks": len(mask_s),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--walks", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    tokenizer = build_tokenizer(args.vocab_size)
    vocab = len(tokenizer)
    from importlib.metadata import version

    results: dict[str, Any] = {
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "machine": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
        "versions": {name: version(name) for name in ("xgrammar", "llguidance", "torch", "transformers")},
        "vocab": vocab,
        "schema": SCHEMA,
    }
    for name, engine in engines(tokenizer, vocab).items():
        results[name] = measure(engine, vocab, args.steps, args.walks, seed=1)
        logger.info("%s: %s", name, {k: v for k, v in results[name].items() if k != "compile_ms_runs"})
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    main()
