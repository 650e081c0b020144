"""Logprob parity for RL on a GPU: the sampled tokens' logprobs the engine reports (``SamplingParams(logprobs=0)``)
against the trainer's own forward over each finished sequence (one HF forward a sequence, the same bf16 model),
for the default engine and ``batch_invariant=True``. What an RL trainer's importance ratio sees: per token,
``exp(engine - trainer)`` should be 1.

    python benchmarks/logprob_parity.py --json benchmarks/results/h200_logprob_parity.json

Sampled rollouts (temperature 1, a seed per request), W1-like prompts that no other run here uses.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import build_model, release_engine, versions, w1_prompts, write_json  # noqa: E402

from paged_backend import LLM, SamplingParams  # noqa: E402

logger = logging.getLogger("logprob_parity")


@torch.inference_mode()
def trainer_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    """The completion's tokens' logprobs from one forward over prompt + completion (fp32 log-softmax of the
    model's logits, as trainers compute them)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + tokens], device=device)
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    picked = logits.log_softmax(-1).gather(1, torch.tensor(tokens, device=device)[:, None])
    return picked[:, 0].tolist()


def parity(llm: LLM, model: torch.nn.Module, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """The engine's sampled logprobs against ``trainer_logprobs``, over every generated token."""
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
        for i in range(len(prompts))
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    diffs: list[float] = []
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        ours = [entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs)]
        theirs = trainer_logprobs(model, prompt, list(completion.token_ids))
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=None, help="fewer layers for a quick try (the model: 32)")
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    args = parser.parse_args(argv)
    model = build_model(args.num_layers)
    vocab = model.config.vocab_size
    results: dict[str, Any] = {
        "machine": torch.cuda.get_device_name(),
        "versions": versions(),
        "command": "python " + " ".join(sys.argv),
    }
    for name, invariant in (("paged", False), ("paged_invariant", True)):
        llm = LLM(model, batch_invariant=invariant)
        results[name] = parity(llm, model, w1_prompts(vocab, args.num_prompts, seed=300), args.max_tokens)
        logger.info("%s: %s", name, results[name])
        write_json(args.json, results)
        llm.llm_engine.shutdown()
        del llm
        release_engine(name)
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main()
