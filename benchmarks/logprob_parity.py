"""Logprob parity for RL on a GPU: the sampled tokens' logprobs the engine reports (``SamplingParams(logprobs=0)``)
against the trainer's own no-grad forward over the finished sequences (``--trainer-batch`` sequences a forward, the
same bf16 model: right-padded rows with their attention mask, or packed into one row): the default engine and
``batch_invariant=True`` against HF's plain forward, and ``batch_invariant=True`` against the forward under
``batch_invariant_forward`` (``paged_invariant_trainer_parity``: equal to the bit is the goal). What an RL trainer's
importance ratio sees: per token, ``exp(engine - trainer)`` should be 1. Also the trainer's forwards' wall time,
plain and under ``batch_invariant_forward`` (entered once for a pass's forwards, as the TRL integration's scoring
does).

    python benchmarks/logprob_parity.py --json benchmarks/results/logprob_parity_<card>_<commit>.json
    python benchmarks/logprob_parity.py --model smollm2 --json benchmarks/results/logprob_parity_smollm2_<card>.json

Sampled rollouts (temperature 1, a seed per request), W1-like prompts that no other run here uses.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import (  # noqa: E402
    add_plot_arguments,
    build_model,
    release_engine,
    replotted,
    run_header,
    trained_model,
    w1_prompts,
    write_json,
)

from paged_backend import LLM, SamplingParams, batch_invariant_forward  # noqa: E402
from paged_backend.worker.trainer_forward import pack_sequences  # noqa: E402

logger = logging.getLogger("logprob_parity")


Rollout = tuple[list[int], list[int], list[float]]  # prompt, sampled tokens, the engine's logprob of each


@torch.inference_mode()
def trainer_logprobs(model: torch.nn.Module, done: list[Rollout], exact: bool, size: int) -> list[list[float]]:
    """Each completion's tokens' logprobs from the trainer's no-grad forwards over ``size`` sequences at a time
    (fp32 log-softmax of the model's logits, as trainers compute them): right-padded rows with their attention
    mask, or, ``exact``, each batch packed into one row, every forward inside one ``batch_invariant_forward`` (as
    ``integrations.trl.parity_logprobs`` scores a TRL batch)."""
    with batch_invariant_forward(model) if exact else contextlib.nullcontext():
        return [logps for batch in batches(done, size) for logps in _batch_logprobs(model, batch, exact)]


def _batch_logprobs(model: torch.nn.Module, batch: list[Rollout], exact: bool) -> list[list[float]]:
    """One forward over ``batch``'s sequences; each completion's tokens' logprobs."""
    device = next(model.parameters()).device
    sequences = [torch.tensor(prompt + tokens, device=device) for prompt, tokens, _ in batch]
    if exact:
        logits = model(**pack_sequences(sequences)).logits[0]
        starts = [0, *itertools.accumulate(len(s) for s in sequences)]
        rows = [logits[start : start + len(s)] for start, s in zip(starts, sequences)]
    else:
        ids = torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True)
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(s) for s in sequences], batch_first=True)
        logits = model(input_ids=ids, attention_mask=mask).logits
        rows = [logits[i, : len(s)] for i, s in enumerate(sequences)]
    picked = []
    for row, (prompt, tokens, _) in zip(rows, batch):
        log_probs = row[len(prompt) - 1 : -1].float().log_softmax(-1)
        picked.append(log_probs.gather(1, torch.tensor(tokens, device=device)[:, None])[:, 0].tolist())
    return picked


def batches(done: list[Rollout], size: int) -> list[list[Rollout]]:
    return [done[i : i + size] for i in range(0, len(done), size)]


def rollouts(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[Rollout]:
    """(prompt, sampled tokens, the engine's logprob of each) per request: temperature 1, a seed a request."""
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
        for i in range(len(prompts))
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    done = []
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        done.append((prompt, list(completion.token_ids),
                     [entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs)]))  # fmt: skip
    return done


def parity(model: torch.nn.Module, done: list[Rollout], exact: bool, batch: int) -> dict[str, Any]:
    """The engine's sampled logprobs against ``trainer_logprobs``, over every generated token."""
    diffs: list[float] = []
    for (_, _, ours), theirs in zip(done, trainer_logprobs(model, done, exact, batch)):
        diffs += [a - b for a, b in zip(ours, theirs)]
    magnitudes = sorted(abs(d) for d in diffs)
    return {
        "tokens": len(diffs),
        "equal_share": sum(d == 0 for d in diffs) / len(diffs),
        "mean_abs": statistics.fmean(magnitudes),
        "p99_abs": magnitudes[int(0.99 * (len(magnitudes) - 1))],
        "max_abs": magnitudes[-1],
        "mean": statistics.fmean(diffs),
    }


def trainer_seconds(
    model: torch.nn.Module, done: list[Rollout], batch: int, repetitions: int
) -> dict[str, list[float]]:
    """Wall seconds of the trainer's no-grad forwards over every finished sequence, plain (``default``) and under
    ``batch_invariant_forward``: the two in turn, ``repetitions`` times (one pass of each untimed first), so that
    a drift in the host's speed reaches both alike."""
    times: dict[str, list[float]] = {"default": [], "batch_invariant_forward": []}
    for rep in range(repetitions + 1):
        for mode, exact in (("default", False), ("batch_invariant_forward", True)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            trainer_logprobs(model, done, exact, batch)
            torch.cuda.synchronize()
            if rep:
                times[mode].append(time.perf_counter() - start)
    return times


def plot(results: dict[str, Any], path: Path) -> None:
    """The share of sampled tokens whose logprob equals the trainer's, per pairing, and the trainer's forward
    seconds plain and under ``batch_invariant_forward`` (median, the spread as a bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = {
        "default → HF": "paged",
        "invariant → HF": "paged_invariant",
        "invariant → parity": "paged_invariant_trainer_parity",
    }
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8))
    shown = {label: results[key] for label, key in pairs.items() if key in results}
    bars = left.bar(list(shown), [100 * r["equal_share"] for r in shown.values()], color="tab:green")
    left.bar_label(bars, labels=[f"max |Δ| {r['max_abs']:.2g}" for r in shown.values()], fontsize=8)
    left.set_ylabel("sampled tokens, logprob equal (%)")
    left.set_ylim(0, 115)
    seconds = results.get("trainer_seconds", {})
    medians = [statistics.median(seconds[m]) for m in seconds]
    spread = [
        [m - min(seconds[k]) for m, k in zip(medians, seconds)],
        [max(seconds[k]) - m for m, k in zip(medians, seconds)],
    ]
    bars = right.bar(list(seconds), medians, yerr=spread, capsize=4, color=["tab:gray", "tab:green"][: len(seconds)])
    right.bar_label(bars, fmt="%.3f s", fontsize=8)
    right.set_ylabel("trainer's forwards, seconds")
    if len(medians) == 2:
        right.set_title(f"parity / plain: {medians[1] / medians[0]:.2f}×", fontsize=9)
    fig.suptitle(f"{results.get('model', '')} {results['machine']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("8b", "smollm2"), default="8b",
                        help="8b: the benchmark's random Llama-3-8B shape; smollm2: the demo's real model")  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=None, help="fewer layers for a quick try (the model: 32)")
    parser.add_argument("--repetitions", type=int, default=5, help="timed passes of the trainer's forwards")
    parser.add_argument("--trainer-batch", type=int, default=8, help="sequences in one trainer forward")
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    add_plot_arguments(parser, "the shares and the trainer's times")
    args = parser.parse_args(argv)
    if (loaded := replotted(parser, args, plot)) is not None:
        return loaded
    model = build_model(args.num_layers) if args.model == "8b" else trained_model(args.model)
    vocab = model.config.vocab_size
    results: dict[str, Any] = {"model": "8B shape, random normal" if args.model == "8b" else "SmolLM2-135M-Instruct"}
    results.update(run_header(argv))
    prompts = w1_prompts(vocab, args.num_prompts, seed=300)
    for name, invariant in (("paged", False), ("paged_invariant", True)):
        llm = LLM(model, batch_invariant=invariant, skip_tokenizer_init=True)
        done = rollouts(llm, prompts, args.max_tokens)
        llm.llm_engine.shutdown()  # the trainer's forwards get the memory (the model stays packed as it was left)
        del llm
        release_engine(name)
        results[name] = parity(model, done, False, args.trainer_batch)
        if invariant:  # the trainer under batch_invariant_forward, and what that costs it
            results[name + "_trainer_parity"] = parity(model, done, True, args.trainer_batch)
            results["trainer_seconds"] = trainer_seconds(model, done, args.trainer_batch, args.repetitions)
        logger.info("%s: %s", name, {k: v for k, v in results.items() if k.startswith(name) or k == "trainer_seconds"})
        write_json(args.json, results)
    if args.plot is not None:
        plot(results, args.plot)
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main()
