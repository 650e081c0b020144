"""W1 with every request under a JSON schema, beside the same engine unconstrained and HF ``generate``, and the
compile time of a schema no cache has seen.

Model: the Llama-3-8B shape of docs/benchmarks.md, random normal(0, 0.02) bf16 weights. Structured outputs read
the vocabulary's text, which the benchmark model lacks: a byte-level BPE of 32,000 tokens is trained offline
(``structured_backends.build_tokenizer``) and covers the model's first 32,000 ids (a grammar never allows the
rest). Workload: W1 (256 prompts, lengths uniform in [64, 1024], 256 new tokens, greedy, ``ignore_eos``). The
schema, an array of at least 64 objects (an integer id, a bounded name, up to three enum tags), cannot close
before 256 tokens, so constrained and unconstrained requests generate alike. Modes, interleaved, three
repetitions each on prompts no other run has seen (a prefix-cache hit raises):
  paged       ``LLM.generate``, no format
  paged_json  ``LLM.generate``, every request ``structured_outputs=StructuredOutputsParams(json=SCHEMA)``
  hf          HF ``generate`` unconstrained, batches of 64 (HF has no grammar of its own), once per repetition
Compile: ``GrammarCompiler.compile`` of 20 schemas of that shape with fresh property names (no cache hit), and
of the same schema again (the cache).

    python benchmarks/structured_throughput.py --json benchmarks/results/h200_structured.json \\
        --plot docs/images/h200_structured.png
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.structured_backends import build_tokenizer  # noqa: E402
from benchmarks.throughput import (  # noqa: E402
    HF_BATCH,
    PrefixCacheHitError,
    build_model,
    release_engine,
    run_hf,
    timed,
    tokens_per_second,
    versions,
    w1_prompts,
    write_json,
)
from paged_backend import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

logger = logging.getLogger("benchmarks.structured_throughput")
TOKENIZER_VOCAB = 32000


def schema(suffix: str = "") -> dict[str, Any]:
    """A list of records; ``suffix`` renames the properties (a schema no cache has seen)."""
    record = {
        "type": "object",
        "properties": {
            f"id{suffix}": {"type": "integer", "minimum": 0, "maximum": 99999},
            f"name{suffix}": {"type": "string", "maxLength": 12},
            f"tags{suffix}": {"type": "array", "items": {"enum": ["cache", "block", "page"]}, "maxItems": 3},
        },
        "required": [f"id{suffix}", f"name{suffix}"],
        "additionalProperties": False,
    }
    return {"type": "array", "items": record, "minItems": 64}


def run(llm: LLM, prompts: list[list[int]], max_tokens: int, structured: bool) -> tuple[list[list[int]], float]:
    """Timed ``generate``, with or without the format; refuses prefix-cache hits as ``throughput.run_paged``."""
    fmt = StructuredOutputsParams(json=schema()) if structured else None
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=fmt)
    cached = llm.stats().get("num_prompt_tokens_cached", 0)
    outs, seconds = timed(lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    if llm.stats().get("num_prompt_tokens_cached", 0) != cached:
        raise PrefixCacheHitError("prompt tokens came from the prefix cache: use prompts no run has seen")
    return [list(o.outputs[0].token_ids) for o in outs], seconds


def compile_times(llm: LLM, count: int) -> dict[str, float]:
    compiler = llm.llm_engine.input_processor.grammar_compiler()
    fresh = []
    for i in range(count):
        start = time.perf_counter()
        compiler.compile(StructuredOutputsParams(json=schema(f"_{i}")))
        fresh.append(time.perf_counter() - start)
    start = time.perf_counter()
    compiler.compile(StructuredOutputsParams(json=schema("_0")))
    cached = time.perf_counter() - start
    return {"median_ms": 1e3 * statistics.median(fresh), "max_ms": 1e3 * max(fresh), "cached_ms": 1e3 * cached}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in ("paged", "paged_json", "hf") if m in results["w1"]]
    values = [results["w1"][m] for m in modes]
    fig, ax = plt.subplots(figsize=(6, 4))
    bars = ax.bar(modes, values, color=["#2a7", "#2a7", "#888"][: len(modes)])
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylabel("output tok/s (median of runs)")
    ax.set_title(f"{results['machine']}, 8B shape, W1: JSON schema vs none")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=None, help="fewer layers for a quick try (the model: 32)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true", help="leave out HF generate (not for a recorded figure)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    tokenizer = build_tokenizer(TOKENIZER_VOCAB)
    model = build_model(args.num_layers)
    vocab = model.config.vocab_size
    results: dict[str, Any] = {
        "machine": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "versions": versions(),
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d"),
        "schema": schema(),
        "w1": {},
        "runs": {},
        "mean_output_tokens": {},
    }
    llm, results["paged_startup_s"] = timed(lambda: LLM(model, tokenizer=tokenizer))
    results["compile"] = compile_times(llm, 20)
    logger.info("compile: %s", results["compile"])
    # Warm-ups on prompts no timed run uses (seed 1): kernels, graphs, the schema's compile.
    warm = w1_prompts(TOKENIZER_VOCAB, HF_BATCH, seed=1)
    run(llm, warm, 8, structured=False)
    run(llm, w1_prompts(TOKENIZER_VOCAB, HF_BATCH, seed=2), 8, structured=True)
    for repetition in range(args.repeats):
        for mode, structured in (("paged", False), ("paged_json", True)):
            # Prompt tokens below the tokenizer's size: a grammar's text is the tokenizer's, the prompt's needn't be.
            seed = 100 + 2 * repetition + structured
            outs, seconds = run(llm, w1_prompts(TOKENIZER_VOCAB, args.num_prompts, seed), args.max_tokens, structured)
            rate = tokens_per_second(outs, seconds)
            results["runs"].setdefault(mode, []).append(rate)
            results["mean_output_tokens"][mode] = statistics.fmean(len(o) for o in outs)
            results["w1"][mode] = statistics.median(results["runs"][mode])
            logger.info("%s: %.0f tok/s (%.2f s)", mode, rate, seconds)
            write_json(args.json, results)
    results["json_over_unconstrained"] = results["w1"]["paged_json"] / results["w1"]["paged"]
    del llm
    release_engine("paged")
    if not args.skip_hf:
        run_hf(model, w1_prompts(vocab, HF_BATCH, seed=1), 8)  # warm-up
        for repetition in range(args.repeats):
            outs, seconds = run_hf(model, w1_prompts(vocab, args.num_prompts, 200 + repetition), args.max_tokens)
            results["runs"].setdefault("hf", []).append(tokens_per_second(outs, seconds))
            results["w1"]["hf"] = statistics.median(results["runs"]["hf"])
            write_json(args.json, results)
    write_json(args.json, results)
    if args.plot is not None:
        plot(results, args.plot)
    logger.info("W1 tok/s %s; JSON / unconstrained %.3f", results["w1"], results["json_over_unconstrained"])
    return results


if __name__ == "__main__":
    main()
