"""Scoring W1's prompts (prompt logprobs, no generation) beside their plain prefill, and beside Hugging Face.

Model: the Llama-3-8B shape of docs/benchmarks.md, random normal(0, 0.02) bf16 weights. Workload: W1's 256
prompts (lengths uniform in [64, 1024], ``random.Random(0)``). Modes:
  paged_prefill  ``LLM.generate`` with ``max_tokens=1``: the prompts' prefill and one sampled token
  paged_scoring  ``LLM.generate`` with ``prompt_logprobs=1, max_tokens=0``: every prompt token's logprob and rank
                 plus the top 1, as lm-eval's loglikelihood requests ask for them; reading every prompt
                 token's logprob from the outputs is timed too
  hf_scoring     HF forward over length-sorted batches of 8 (right padded), float32 log-softmax, each prompt
                 token's logprob gathered: what lm-eval's HF backend does
  hf_prefill     HF ``generate`` with one new token, batches of 64 (left padded)
  hf_cb          HF ``generate_batch`` with one new token (transformers' continuous batching)
Every timed run gets prompts of W1's lengths with tokens no other run has seen (the paged engine caches
prefixes; a prefill run refuses any prefix-cache hit), after untimed warm-ups on other prompts. Peak memory is
``torch.cuda.max_memory_allocated`` over the run, and what it adds to what was allocated before it.
Before timing, the engine's prompt logprobs are checked against HF's forward on 4 prompts.

    python benchmarks/scoring.py --json benchmarks/results/h200_scoring.json --plot docs/images/h200_scoring.png
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.throughput import (  # noqa: E402
    build_model,
    release_engine,
    run_hf,
    run_hf_cb,
    run_paged,
    timed,
    versions,
    write_json,
)
from paged_backend import LLM, SamplingParams  # noqa: E402

logger = logging.getLogger("benchmarks.scoring")
HF_SCORING_BATCH = 8
SCORING = SamplingParams(prompt_logprobs=1, max_tokens=0)


def w1_lengths(num_prompts: int) -> list[int]:
    """W1's prompt lengths (the same draw as ``throughput.w1_prompts``)."""
    rng = random.Random(0)
    return [rng.randint(64, 1024) for _ in range(num_prompts)]


def prompts_of(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    """Prompts of the given lengths whose tokens come from ``seed``: each run has its own, so none is cached."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def run_scoring(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[float]], float]:
    """Timed scoring, reading of each prompt's per-token logprobs included (the first token has none)."""

    def go() -> list[list[float]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SCORING, use_tqdm=False)
        scores = []
        for prompt, out in zip(prompts, outs):
            rows = out.prompt_logprobs
            assert rows is not None and len(rows) == len(prompt) and rows[0] is None and not out.outputs[0].token_ids
            scores.append([row[token].logprob for row, token in zip(rows[1:], prompt[1:])])  # type: ignore[index]
        return scores

    return timed(go)


@torch.no_grad()
def run_hf_scoring(model, prompts: list[list[int]]) -> tuple[list[list[float]], float]:
    def go() -> list[list[float]]:
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        scores: list[list[float]] = [[] for _ in prompts]
        for start in range(0, len(order), HF_SCORING_BATCH):
            batch = order[start : start + HF_SCORING_BATCH]
            width = len(prompts[batch[0]])
            ids = torch.tensor([prompts[i] + [0] * (width - len(prompts[i])) for i in batch], device="cuda")
            mask = torch.tensor([[1] * len(prompts[i]) + [0] * (width - len(prompts[i])) for i in batch], device="cuda")
            logprobs = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), dim=-1)
            chosen = logprobs.gather(2, ids[:, 1:, None])[..., 0]
            for row, i in enumerate(batch):
                scores[i] = chosen[row, : len(prompts[i]) - 1].tolist()
        return scores

    return timed(go)


def agreement(llm: LLM, model, vocab: int) -> dict[str, float]:
    """The engine's prompt logprobs against HF's forward on 4 prompts (bf16: kernels round differently)."""
    prompts = prompts_of([17, 200, 513, 1000], vocab, seed=7)
    ours, _ = run_scoring(llm, prompts)
    theirs = [run_hf_scoring(model, [p])[0][0] for p in prompts]
    diffs = [abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x, y)]
    sums = [abs(sum(x) - sum(y)) / len(x) for x, y in zip(ours, theirs)]
    return {"max_abs_token": max(diffs), "mean_abs_token": statistics.fmean(diffs), "max_abs_sum_per_token": max(sums)}


class Measure:
    """Timed repetitions of each mode, their peak memory, written to JSON after each."""

    def __init__(self, results: dict[str, Any], lengths: list[int], vocab: int, path: Path | None) -> None:
        self.results, self.lengths, self.vocab, self.path = results, lengths, vocab, path
        self.seed = 1000

    def __call__(self, mode: str, run: Callable[[list[list[int]]], tuple[Any, float]]) -> None:
        self.seed += 1
        prompts = prompts_of(self.lengths, self.vocab, self.seed)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _, seconds = run(prompts)
        peak = torch.cuda.max_memory_allocated()
        entry = self.results.setdefault("modes", {}).setdefault(mode, {"seconds": [], "peak_gib": [], "added_gib": []})
        entry["seconds"].append(seconds)
        entry["peak_gib"].append(peak / 2**30)
        entry["added_gib"].append((peak - before) / 2**30)
        entry["median_s"] = statistics.median(entry["seconds"])
        entry["prompt_tok_per_s"] = sum(self.lengths) / entry["median_s"]
        logger.info("%s: %.3f s, peak %.1f GiB (+%.2f)", mode, seconds, peak / 2**30, (peak - before) / 2**30)
        write_json(self.path, self.results)


def measure_paged(model, measure: Measure, repeats: int) -> None:
    """The engine's prefill and scoring, interleaved (drift in the machine touches both alike)."""
    results, lengths, vocab = measure.results, measure.lengths, measure.vocab
    llm, results["paged_startup_s"] = timed(lambda: LLM(model))
    results["agreement_with_hf"] = agreement(llm, model, vocab)
    logger.info("prompt logprobs vs HF: %s", results["agreement_with_hf"])
    run_paged(llm, prompts_of(lengths[:64], vocab, seed=1), 1)  # warm-ups: compiles, allocator growth
    run_scoring(llm, prompts_of(lengths[:64], vocab, seed=2))
    for _ in range(repeats):
        measure("paged_prefill", lambda prompts: run_paged(llm, prompts, 1))
        measure("paged_scoring", lambda prompts: run_scoring(llm, prompts))
    modes = results["modes"]
    results["scoring_over_prefill"] = modes["paged_scoring"]["median_s"] / modes["paged_prefill"]["median_s"]
    logger.info("scoring / prefill: %.3f", results["scoring_over_prefill"])
    write_json(measure.path, results)
    llm.llm_engine.shutdown()


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = results["modes"]
    names = list(modes)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    colors = ["#2a7" if n.startswith("paged") else "#888" for n in names]
    bars = left.bar(names, [modes[n]["median_s"] for n in names], color=colors)
    for name, x in zip(names, range(len(names))):
        left.plot([x] * len(modes[name]["seconds"]), modes[name]["seconds"], "k.", ms=4)
    left.bar_label(bars, fmt="%.2f")
    left.set_title(f"W1's {results['num_prompts']} prompts ({results['prompt_tokens']:,} tokens): seconds", fontsize=10)
    bars = right.bar(names, [max(modes[n]["added_gib"]) for n in names], color=colors)
    right.bar_label(bars, fmt="%.2f")
    right.set_title("GiB added over the run's start (peak)", fontsize=10)
    for ax in (left, right):
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.suptitle(f"{results['machine']}, Llama-3-8B shape, bf16: scoring vs prefill", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=256, help="W1 prompts (the workload: 256)")
    parser.add_argument("--num-layers", type=int, default=None, help="fewer layers for a quick try (the model: 32)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per mode, each on its own prompts")
    parser.add_argument("--skip-hf", action="store_true", help="measure the paged engine only")
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    parser.add_argument("--plot", type=Path, default=None, help="write a bar chart here")
    args = parser.parse_args(argv)

    model = build_model(args.num_layers)
    vocab = model.config.vocab_size
    lengths = w1_lengths(args.num_prompts)
    results: dict[str, Any] = {
        "machine": torch.cuda.get_device_name(),
        "versions": versions(),
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d"),
        "num_prompts": len(lengths),
        "prompt_tokens": sum(lengths),
    }
    measure = Measure(results, lengths, vocab, args.json)

    measure_paged(model, measure, args.repeats)
    release_engine("paged engine")

    if not args.skip_hf:
        warm = prompts_of(lengths[:64], vocab, seed=1)
        run_hf_scoring(model, warm[:HF_SCORING_BATCH])
        run_hf(model, warm, 1)
        run_hf_cb(model, warm, 1)
        for _ in range(args.repeats):
            measure("hf_scoring", lambda prompts: run_hf_scoring(model, prompts))
            measure("hf_prefill", lambda prompts: run_hf(model, prompts, 1))
            measure("hf_cb", lambda prompts: run_hf_cb(model, prompts, 1))
    if args.plot is not None:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(results, args.plot)
    logger.info("%s", json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    main()
