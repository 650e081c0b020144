"""The engine on CPU stepped from the caller's thread (``direct``: ``LLM.generate``) against the same engine
stepped by the engine-loop thread, built on the caller's thread (``loop``: ``patch()`` and the framework adapters
on a model the caller loaded) or on a thread that has ended (``served``: as the server builds it), beside HF
``generate``, on the demo's random-weight Llama or a checkpoint folder (``--model``); ``--modes`` picks the ways to
run (``direct hf`` compares trees of the engine itself).

Each (tree, mode) runs in a fresh process: OpenMP teams live for a thread's life, so a process that ever ran the
loop is no longer a clean "direct" process. Every repetition draws new prompts (nothing for the prefix cache),
after a warm-up on prompts the measured ones never contain.

    git archive <base commit> paged_backend | tar -x -C .old      # the baseline tree, beside this one
    taskset -c 0,1 python benchmarks/cpu_engine_loop.py --trees current=. before=.old \\
        --commits current=<sha> before=<base sha> --repeats 5 \\
        --json benchmarks/results/cpu_engine_loop.json --plot docs/images/cpu_engine_loop.png
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("benchmarks.cpu_engine_loop")
HERE = Path(__file__).resolve().parent
MODES = ("direct", "loop", "served", "hf")
WORKLOADS = {"batch16": (16, 64), "single": (1, 128)}  # name -> (prompts, new tokens each)


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(64)] for _ in range(count)]


def measure(mode: str, workload: str, repeats: int, checkpoint: str) -> list[float]:
    """Output tokens per second of each repetition, in this process (``checkpoint``: a folder, or "" for the demo
    checkpoint)."""
    import torch
    from transformers import AutoModelForCausalLM

    from paged_backend import LLM, SamplingParams
    from paged_backend.demo_checkpoint import default_cache_dir, demo_checkpoint

    path = checkpoint or str(demo_checkpoint(default_cache_dir()))
    count, new = WORKLOADS[workload]
    if mode == "hf":
        model = AutoModelForCausalLM.from_pretrained(path).eval()

        def run(batch: list[list[int]]) -> None:
            with torch.no_grad():
                model.generate(torch.tensor(batch), max_new_tokens=new, min_new_tokens=new, do_sample=False)

    else:
        if mode == "served":
            from paged_backend.engine.fresh_thread import call_in_fresh_thread

            llm = call_in_fresh_thread(lambda: LLM(path, max_model_len=512, device="cpu"))
        else:
            llm = LLM(path, max_model_len=512, device="cpu")
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)

        def run(batch: list[list[int]]) -> None:
            inputs = [{"prompt_token_ids": p} for p in batch]
            if mode == "direct":
                llm.generate(inputs, params, use_tqdm=False)
            else:
                llm.run_on_loop(inputs, params)

    run(prompts(count, seed=10_000))  # warm-up, on prompts no repetition uses
    rates = []
    for r in range(repeats):
        batch = prompts(count, seed=r)
        start = time.perf_counter()
        run(batch)
        rates.append(count * new / (time.perf_counter() - start))
    return rates


def run_tree(tree: str, mode: str, workload: str, repeats: int, checkpoint: str) -> list[float]:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{HERE.parent}"}
    command = [sys.executable, __file__, "--inner", mode, workload, str(repeats), checkpoint]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return [float(x) for x in out.split()[-1].split(",")]


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(WORKLOADS), figsize=(5 * len(WORKLOADS), 3.5))
    for ax, workload in zip(axes, WORKLOADS):
        labels, values, spreads = [], [], []
        for key, rates in result["runs"][workload].items():
            labels.append(key)
            values.append(statistics.median(rates))
            spreads.append([[statistics.median(rates) - min(rates)], [max(rates) - statistics.median(rates)]])
        ax.bar(range(len(values)), values)
        for i, spread in enumerate(spreads):
            ax.errorbar(i, values[i], yerr=spread, color="black", capsize=3)
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{workload}: output tok/s (median, min-max)")
    model = Path(result.get("model", "the demo checkpoint")).name  # results from before --model name none
    fig.suptitle(f"CPU, {result['cpus']} cores, {model}: the engine stepped directly or by its loop, HF generate")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs="+", default=["current=."], help="label=path of a tree holding paged_backend")
    parser.add_argument("--commits", nargs="+", default=[], help="label=sha: the commit each tree was cut from")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="where to write the result (required)")
    parser.add_argument("--plot", default=None)
    parser.add_argument("--model", default="", help="a checkpoint folder (default: the demo's random-weight Llama)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="which of the ways to run")
    parser.add_argument("--inner", nargs=4, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        mode, workload, repeats, checkpoint = args.inner
        print(",".join(f"{r:.3f}" for r in measure(mode, workload, int(repeats), checkpoint)))
        return
    if args.json is None:
        parser.error("--json is required")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    trees = dict(item.split("=", 1) for item in args.trees)
    runs: dict[str, dict[str, list[float]]] = {}
    for workload in WORKLOADS:
        runs[workload] = {}
        for label, tree in trees.items():
            for mode in args.modes:
                if mode == "hf" and label != next(iter(trees)):
                    continue  # HF's figure does not depend on our tree
                if mode == "served" and not (Path(tree) / "paged_backend/engine/engine_loop.py").read_text().count(
                    "def call_in_fresh_thread"
                ):
                    continue  # a tree from before the served path existed
                key = "hf generate" if mode == "hf" else f"{label} {mode}"
                runs[workload][key] = run_tree(tree, mode, workload, args.repeats, args.model)
                logger.info("%s %s: %s tok/s", workload, key, [round(r, 1) for r in runs[workload][key]])
    result = {
        "command": " ".join(sys.argv),
        "cpus": len(os.sched_getaffinity(0)),
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "model": args.model or "the demo checkpoint",
        "trees": trees,
        "commits": dict(item.split("=", 1) for item in args.commits),
        "workloads": {k: {"prompts": c, "prompt_tokens": 64, "new_tokens": n} for k, (c, n) in WORKLOADS.items()},
        "runs": runs,
        "medians": {w: {k: statistics.median(v) for k, v in r.items()} for w, r in runs.items()},
    }
    Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
