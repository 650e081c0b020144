"""Host time of the engine's step loop alone: the model forward is replaced by a stub that returns fixed logits,
so what is timed is scheduling, input building, greedy token choice and bookkeeping. Runs on CPU.

    python benchmarks/host_overhead.py                       # 256 sequences, multi-step 8 vs 1
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from pathlib import Path

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for steps in (1, 8):
        ms = ms_per_decode_step(args.num_seqs, args.max_tokens, steps)
        logger.info(
            "num_scheduler_steps=%d: %.2f ms of host time per decode step of %d sequences", steps, ms, args.num_seqs
        )


if __name__ == "__main__":
    main()
