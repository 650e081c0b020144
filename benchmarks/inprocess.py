"""Memory given back, on the GPU: the device memory still allocated after each way of letting go of an engine
(``with patched(model)``, ``unpatch``, ``LLM.shutdown()``, leaving ``with LLM(...)``, ``del llm``) and while it
sleeps, against the weights alone; and how long ``sleep()`` and ``wake_up()`` take. The benchmark model of
``benchmarks/throughput.py`` (Llama-3-8B shape, random normal bf16 weights). Each path first runs a small batch,
so the engine has compiled, captured its graphs and filled some of its cache.

    python benchmarks/inprocess.py --json benchmarks/results/h200_inprocess.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import build_model, versions, w1_prompts, write_json  # noqa: E402

from paged_backend import LLM, SamplingParams  # noqa: E402
from paged_backend.integrations.hf import patch, patched, unpatch  # noqa: E402

logger = logging.getLogger("benchmarks.inprocess")
GIB = 2**30


def allocated_gib() -> float:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated() / GIB


def run_batch(generate: Callable[[list[list[int]]], Any], vocab: int, seed: int) -> None:
    generate(w1_prompts(vocab, 16, seed=seed))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-layers", type=int, default=None, help="fewer layers for a quick try (the model: 32)")
    parser.add_argument("--repeats", type=int, default=3, help="sleep / wake_up cycles timed")
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    args = parser.parse_args(argv)
    model = build_model(args.num_layers)
    vocab = model.config.vocab_size
    weights = allocated_gib()
    results: dict[str, Any] = {
        "machine": torch.cuda.get_device_name(),
        "versions": versions(),
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d"),
        "weights_gib": weights,
        "after_gib": {},
    }
    params = SamplingParams(temperature=0, max_tokens=16)

    def record(path: str, peak: float) -> None:
        after = allocated_gib()
        results["after_gib"][path] = {"in_use_gib": peak, "after_gib": after, "over_weights": after / weights - 1}
        logger.info("%s: %.2f GiB in use, %.2f GiB after (weights %.2f)", path, peak, after, weights)
        write_json(args.json, results)

    def hf_generate(prompts: list[list[int]]) -> None:
        for prompt in prompts:
            model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=16, do_sample=False, pad_token_id=0)

    with patched(model):
        run_batch(hf_generate, vocab, 11)
        peak = torch.cuda.memory_allocated() / GIB
    record("leaving patched()", peak)
    patch(model)
    run_batch(hf_generate, vocab, 12)
    peak = torch.cuda.memory_allocated() / GIB
    unpatch(model)
    record("unpatch(model)", peak)

    def llm_generate(llm: LLM) -> Callable[[list[list[int]]], Any]:
        return lambda prompts: llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    llm = LLM(model)
    run_batch(llm_generate(llm), vocab, 13)
    peak = torch.cuda.memory_allocated() / GIB
    sleeps, wakes, asleep = [], [], []
    for cycle in range(args.repeats):
        start = time.perf_counter()
        llm.sleep()
        torch.cuda.synchronize()
        sleeps.append(time.perf_counter() - start)
        asleep.append(allocated_gib())
        start = time.perf_counter()
        llm.wake_up()
        torch.cuda.synchronize()
        wakes.append(time.perf_counter() - start)
        run_batch(llm_generate(llm), vocab, 20 + cycle)  # it runs again after waking
    results["sleep"] = {"sleep_s": sleeps, "wake_up_s": wakes, "asleep_gib": asleep, "in_use_gib": peak}
    logger.info("sleep: %s", results["sleep"])
    llm.shutdown()
    record("llm.shutdown()", peak)
    with LLM(model) as llm:
        run_batch(llm_generate(llm), vocab, 14)
        peak = torch.cuda.memory_allocated() / GIB
    del llm
    record("leaving with LLM(...)", peak)
    llm = LLM(model)
    run_batch(llm_generate(llm), vocab, 15)
    peak = torch.cuda.memory_allocated() / GIB
    del llm
    record("del llm", peak)
    logger.info("%s", json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    main()
