"""Memory features on the benchmark model of docs/benchmarks.md: prefix caching, KV waste, samples that share a prefill.

prefix   64 requests, each one 2,000-token system prompt + its own 50-token question, 64 new tokens each,
         submitted at once after one request has put the system prompt in the cache (a server's steady
         state): mean time to first token and output tok/s with ``enable_prefix_caching`` on and off; beside
         them HF ``generate`` on the same 64 prompts in one left-padded batch (its time to first token is one
         batched forward over the full prompts, ``max_new_tokens=1``).
waste    W1 (256 prompts of 64..1,024 tokens, 256 new each): the peak of ``stats()["kv_waste_fraction"]``,
         sampled every step; beside it, computed from the same lengths, the share of KV slots that hold no
         token in HF ``generate``'s batches of 64 (left padded to the longest prompt) and in a static
         reservation of the workload's longest sequence (1,280 tokens) per request.
samples  W1's first 64 prompts, 64 new tokens, temperature 1: n=4, best_of=8 (one prefill, 8 forked samples)
         against the same prompts as 512 independent requests: output tok/s (tokens returned) and the peak of
         KV blocks in use.

  python benchmarks/memory.py --json benchmarks/results/h200_memory.json --plot docs/images/h200_memory.png
  python benchmarks/memory.py --tiny                                          # smoke run on CPU, tiny model
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from benchmarks.throughput import HF_BATCH, build_model, release_engine, timed, versions, w1_prompts
from paged_backend import LLM, SamplingParams
from tests.fixtures.tiny_models import build_tiny_model

logger = logging.getLogger("benchmarks.memory")


class Run(NamedTuple):
    outputs: list[Any]
    seconds: float
    peak_used_blocks: int
    peak_kv_waste: float  # only sampled when asked for: stats() walks every block table


def drive(llm: LLM, prompts: list[list[int]], params: SamplingParams, tag: str, sample_waste: bool = False) -> Run:
    """Submit every prompt at once and step to the end, tracking the peak of blocks in use (and of KV waste)."""
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
    done, peak_blocks, peak_waste = {}, 0, 0.0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step(finished_only=True):
            done[out.request_id] = out
        peak_blocks = max(peak_blocks, engine.scheduler.block_manager.num_used_blocks)
        if sample_waste:
            peak_waste = max(peak_waste, engine.stats()["kv_waste_fraction"])
    seconds = time.perf_counter() - start
    return Run([done[f"{tag}-{i}"] for i in range(len(prompts))], seconds, peak_blocks, peak_waste)


def output_tokens(outputs: list[Any]) -> int:
    return sum(len(c.token_ids) for out in outputs for c in out.outputs)


def prefix_workload(make_llm: Callable[..., LLM], model, vocab: int, sizes: dict[str, int]) -> dict[str, Any]:
    rng = random.Random(1)
    system = [rng.randrange(vocab) for _ in range(sizes["system"])]
    prompts = [system + [rng.randrange(vocab) for _ in range(sizes["question"])] for _ in range(64)]
    params = SamplingParams(temperature=0, max_tokens=sizes["new"], ignore_eos=True)
    result: dict[str, Any] = {}
    for caching in (True, False):
        llm = make_llm(enable_prefix_caching=caching)
        drive(llm, [system + [1]], SamplingParams(temperature=0, max_tokens=1), "warm")  # the system prompt
        run = drive(llm, prompts, params, "prefix")
        ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in run.outputs]
        name = "paged_caching_on" if caching else "paged_caching_off"
        result[name] = {
            "mean_ttft_ms": 1e3 * statistics.mean(ttft),
            "output_tok_s": output_tokens(run.outputs) / run.seconds,
            "hit_rate": llm.stats()["prefix_cache_hit_rate"],
        }
        logger.info("prefix %s: %s", name, result[name])
        del llm
        release_engine(name)
    ids = torch.tensor(prompts, device=model.device)  # equal lengths: no padding needed
    with torch.no_grad():
        model.generate(ids[:2], max_new_tokens=2, do_sample=False)  # warm-up
        _, first = timed(lambda: model.generate(ids, max_new_tokens=1, do_sample=False))
        _, whole = timed(lambda: model.generate(ids, max_new_tokens=sizes["new"], min_new_tokens=sizes["new"]))
    result["hf"] = {"mean_ttft_ms": 1e3 * first, "output_tok_s": 64 * sizes["new"] / whole}
    logger.info("prefix hf: %s", result["hf"])
    on, off = result["paged_caching_on"]["mean_ttft_ms"], result["paged_caching_off"]["mean_ttft_ms"]
    result["ttft_speedup_from_caching"] = off / on
    return result


def w1_like(vocab: int, num_prompts: int, sizes: dict[str, int]) -> list[list[int]]:
    """W1's prompts (cut to ``max_prompt`` tokens for the tiny model)."""
    return [p[: sizes["max_prompt"]] for p in w1_prompts(vocab, num_prompts)]


def waste_workload(make_llm: Callable[..., LLM], vocab: int, sizes: dict[str, int]) -> dict[str, Any]:
    prompts = w1_like(vocab, sizes["w1_prompts"], sizes)
    new = sizes["w1_new"]
    llm = make_llm()
    run = drive(llm, prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True), "w1", sample_waste=True)
    del llm
    release_engine("waste")
    lengths = [len(p) for p in prompts]
    padded = used = 0
    for i in range(0, len(lengths), HF_BATCH):
        batch = lengths[i : i + HF_BATCH]
        padded += len(batch) * (max(batch) + new)
        used += sum(n + new for n in batch)
    longest = max(lengths) + new
    result = {
        "paged_peak_kv_waste_fraction": run.peak_kv_waste,
        "paged_peak_used_blocks": run.peak_used_blocks,
        "hf_padded_batches_waste_fraction": 1 - used / padded,
        "static_reservation_waste_fraction": 1 - sum(n + new for n in lengths) / (len(lengths) * longest),
    }
    logger.info("waste: %s", result)
    return result


def samples_workload(make_llm: Callable[..., LLM], vocab: int, sizes: dict[str, int]) -> dict[str, Any]:
    prompts = w1_like(vocab, sizes["samples_prompts"], sizes)
    result: dict[str, Any] = {}
    runs = {
        "n4_best_of8": (prompts, SamplingParams(n=4, best_of=8, temperature=1.0, max_tokens=64, ignore_eos=True)),
        "independent_512": (
            [p for p in prompts for _ in range(8)],
            SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True),
        ),
    }
    for name, (batch, params) in runs.items():
        llm = make_llm()
        run = drive(llm, batch, params, name)
        computed = llm.stats()["num_generated_tokens"]  # best_of computes 8 samples, returns 4
        result[name] = {
            "returned_tok_s": output_tokens(run.outputs) / run.seconds,
            "computed_tok_s": computed / run.seconds,
            "peak_used_blocks": run.peak_used_blocks,
        }
        logger.info("samples %s: %s", name, result[name])
        del llm
        release_engine(name)
    return result


def plot(results: dict[str, Any], path: Path) -> None:
    """Three panels: prefix caching's TTFT, peak KV waste, and shared samples' peak KV blocks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13.5, 3.8))
    panels = []
    if "prefix" in results:
        prefix = results["prefix"]
        bars = {"paged, cache on": prefix["paged_caching_on"], "paged, cache off": prefix["paged_caching_off"]}
        bars["hf generate"] = prefix["hf"]
        panels.append(
            ("64 requests, shared 2,000-token prefix:\nmean TTFT (ms)", {k: v["mean_ttft_ms"] for k, v in bars.items()})
        )
    if "waste" in results:
        waste = results["waste"]
        shares = {
            "paged (peak)": waste["paged_peak_kv_waste_fraction"],
            "hf padded batches": waste["hf_padded_batches_waste_fraction"],
            "static reservation": waste["static_reservation_waste_fraction"],
        }
        panels.append(("W1: KV slots holding no token (%)", {k: 100 * v for k, v in shares.items()}))
    if "samples" in results:
        samples = results["samples"]
        blocks = {"n=4, best_of=8": samples["n4_best_of8"], "512 independent": samples["independent_512"]}
        panels.append(("64 prompts x 8 samples: peak KV blocks", {k: v["peak_used_blocks"] for k, v in blocks.items()}))
    for ax, (title, values) in zip(axes, panels):
        bars = ax.bar(list(values), list(values.values()), color=["tab:blue", "tab:orange", "tab:gray"][: len(values)])
        ax.bar_label(bars, fmt="%.4g")
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    for ax in axes[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"Memory features - {results['machine']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="prefix,waste,samples", help="comma list of prefix, waste, samples")
    parser.add_argument("--tiny", action="store_true", help="tiny random Llama on CPU, workloads scaled down")
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    parser.add_argument("--plot", type=Path, default=None, help="write a plot here")
    args = parser.parse_args(argv)
    workloads = set(args.workload.split(","))
    if args.tiny:
        model = build_tiny_model("llama", vocab_size=512)
        model.generation_config.eos_token_id = None
        sizes = dict(system=200, question=10, new=8, w1_prompts=16, w1_new=16, samples_prompts=4, max_prompt=400)
        kwargs = dict(block_size=16, num_kv_blocks=2048, max_model_len=512)
    else:
        model = build_model(None)
        sizes = dict(system=2000, question=50, new=64, w1_prompts=256, w1_new=256, samples_prompts=64, max_prompt=1024)
        kwargs = {}
    vocab = model.config.vocab_size

    def make_llm(**extra: Any) -> LLM:
        return LLM(model, **kwargs, **extra)

    results: dict[str, Any] = {
        "machine": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "versions": versions(),
        "command": "python benchmarks/memory.py " + " ".join(argv if argv is not None else []),
        "date": time.strftime("%Y-%m-%d"),
    }
    if "prefix" in workloads:
        results["prefix"] = prefix_workload(make_llm, model, vocab, sizes)
    if "waste" in workloads:
        results["waste"] = waste_workload(make_llm, vocab, sizes)
    if "samples" in workloads:
        results["samples"] = samples_workload(make_llm, vocab, sizes)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if args.plot is not None:
        plot(results, args.plot)
    logger.info("%s", json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    import sys

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    main(sys.argv[1:])
