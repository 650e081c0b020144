"""Host time of the engine's step loop alone: the model forward is replaced by a stub that returns fixed logits,
so what is timed is scheduling, input building, greedy token choice and bookkeeping. Runs on CPU.

    python benchmarks/host_overhead.py                       # 256 sequences, multi-step 8 vs 1
    python benchmarks/host_overhead.py --spec --repeats 3    # a verifying step of prompt lookup, k = 8

With ``--spec``, one sequence speculates with prompt lookup over a long context (a 1,500-token prompt, 2,000 new
tokens); the stub's greedy choice continues the prompt's cycle of tokens, so every proposal is taken and every
step verifies 8 of them: the host time of a verifying step, which a GPU's verifying step waits on.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: tests.fixtures

from paged_backend import LLM, SamplingParams  # noqa: E402
from tests.fixtures.tiny_models import build_tiny_model  # noqa: E402

logger = logging.getLogger("benchmarks.host_overhead")


def ms_per_decode_step(num_seqs: int, max_tokens: int, num_scheduler_steps: int) -> float:
    vocab = 1000
    llm = LLM(
        build_tiny_model("llama", vocab_size=vocab),
        num_kv_blocks=20000,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=8192,
        num_scheduler_steps=num_scheduler_steps,
    )
    logits = torch.zeros(num_seqs, vocab)
    llm.llm_engine.executor.model_runner.run = lambda inputs, *args: logits[: inputs.logits_indices.shape[0]]
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(64, 250))]} for _ in range(num_seqs)
    ]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return 1e3 * (time.perf_counter() - start) / max_tokens


def ms_per_verifying_step(k: int = 8, cycle_length: int = 50, vocab: int = 1000) -> float:
    cycle = list(range(10, 10 + cycle_length))
    successor = torch.arange(vocab)
    successor[cycle] = torch.tensor(cycle[1:] + cycle[:1])

    def stub(inputs: Any, input_ids: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        ids = inputs.input_ids if input_ids is None else input_ids
        rows = inputs.logits_indices
        logits = torch.zeros(rows.shape[0], vocab)
        logits[torch.arange(rows.shape[0]), successor[ids[rows]]] = 1.0
        return logits

    model = build_tiny_model("llama", vocab_size=vocab, max_position_embeddings=4096)
    llm = LLM(model, num_kv_blocks=4000, max_model_len=4096,
              speculative_config={"method": "ngram", "num_speculative_tokens": k})  # fmt: skip
    runner = llm.llm_engine.executor.model_runner
    runner.run = stub
    # a lookup round's forwards (worker/lookup_round.py) come with their inputs on the device
    runner.forward_device = lambda input_ids, positions, metadata, rows, *args: stub(
        SimpleNamespace(input_ids=input_ids, logits_indices=rows)
    )
    prompt = {"prompt_token_ids": (cycle * (1500 // cycle_length + 1))[:1500]}
    params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
    llm.generate(prompt, params, use_tqdm=False)  # warm-up
    drafts = llm.stats()["spec_decode_num_drafts"]
    start = time.perf_counter()
    llm.generate(prompt, params, use_tqdm=False)
    return 1e3 * (time.perf_counter() - start) / (llm.stats()["spec_decode_num_drafts"] - drafts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--spec", action="store_true", help="a verifying step of prompt lookup instead")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.spec:
        times = [ms_per_verifying_step() for _ in range(args.repeats)]
        logger.info("%s ms of host time per verifying step (k = 8, every proposal taken)", [round(t, 3) for t in times])
        return
    for steps in (1, 8):
        ms = ms_per_decode_step(args.num_seqs, args.max_tokens, steps)
        logger.info(
            "num_scheduler_steps=%d: %.2f ms of host time per decode step of %d sequences", steps, ms, args.num_seqs
        )


if __name__ == "__main__":
    main()
