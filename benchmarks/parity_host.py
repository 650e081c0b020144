"""Where a small model's trainer forward under ``batch_invariant_forward`` spends its time on a GPU (a diagnostic):
a SmolLM2-135M-shaped Llama (random normal bf16, put through a default engine and then a ``batch_invariant=True``
one, as ``logprob_parity.py``'s model is) scores 32 rollouts of W1-like prompts plus 128 sampled tokens, 8
sequences a forward, as ``logprob_parity.py`` times it: plain HF (padded rows), under parity, and under parity with
one part replaced by a stand-in of nearly no cost (wrong numbers, right shapes), so that each part's share shows:

- ``norm kernel``: the RMSNorm kernel's launch returns its input;
- ``attention kernel``: the paged attention kernel's launch returns an empty tensor (the cache layout is kept);
- ``attention``: the whole attention (layout, caches, kernel) returns its query;
- ``products``: every linear product is one ``x @ w`` (no blocks, no verdicts);
- ``plain in an empty mode``: the plain forward inside a ``TorchFunctionMode`` that only passes calls on.

    python benchmarks/parity_host.py --json parity_host.json

No model file is needed (the real model's shape, not its weights: the host's work does not depend on them).
``--profile`` adds torch.profiler's tables of the parity pass (the host's and the GPU's top operations).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))

from logprob_parity import rollouts, trainer_logprobs  # noqa: E402
from throughput import random_normal, release_engine, run_header, w1_prompts, write_json  # noqa: E402

from paged_backend import LLM  # noqa: E402
from paged_backend.worker import batch_invariant, trainer_forward  # noqa: E402

logger = logging.getLogger("parity_host")

SMOLLM2 = dict(  # SmolLM2-135M's shape
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192,
)  # fmt: skip


class PassThrough(TorchFunctionMode):
    """A mode that computes nothing its own way: what any torch function mode costs the host."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


@contextmanager
def replaced(module: Any, name: str, stand_in: Callable[..., Any]) -> Iterator[None]:
    kept = getattr(module, name)
    setattr(module, name, stand_in)
    try:
        yield
    finally:
        setattr(module, name, kept)


STAND_INS: dict[str, tuple[Any, str, Callable[..., Any]]] = {
    "norm kernel": (batch_invariant, "rms_norm_triton", lambda x, weight, eps: x),
    "attention kernel": (trainer_forward, "paged_attention_triton", lambda q, *a, **k: torch.empty_like(q)),
    "attention": (trainer_forward, "_causal_attention_gpu", lambda q, k, v, cu, *rest: q.transpose(1, 2)),
    "products": (batch_invariant, "product_in_blocks", lambda x, m, b, block: x @ m if b is None else x @ m + b),
}


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def seconds(model: torch.nn.Module, done: list[Any], exact: bool, repetitions: int) -> float:
    """The median wall time of ``repetitions`` scoring passes (one untimed first)."""
    times = []
    for rep in range(repetitions + 1):
        synchronize()
        start = time.perf_counter()
        trainer_logprobs(model, done, exact, 8)
        synchronize()
        if rep:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--num-layers", type=int, default=SMOLLM2["num_hidden_layers"], help="fewer: a quick try")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--profile", action="store_true", help="also torch.profiler's tables of the parity pass")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    with torch.device("cuda" if cuda else "cpu"):
        model = LlamaForCausalLM(LlamaConfig(**dict(SMOLLM2, num_hidden_layers=args.num_layers)))
    model = random_normal(model.to(torch.bfloat16) if cuda else model).eval()
    prompts = w1_prompts(SMOLLM2["vocab_size"], args.num_prompts, seed=300)
    # the model goes through what logprob_parity.py puts it through first: a default engine (compiled, its
    # siblings packed), then a batch-invariant one, whose rollouts are scored
    for name, invariant in (("paged", False), ("paged_invariant", True)):
        llm = LLM(model, batch_invariant=invariant, skip_tokenizer_init=True)
        done = rollouts(llm, prompts, args.max_tokens)
        llm.llm_engine.shutdown()
        del llm
        release_engine(name)
    results: dict[str, Any] = {**run_header(argv), "seconds": {}}
    figures: dict[str, float] = results["seconds"]
    figures["plain"] = seconds(model, done, False, args.repetitions)
    figures["parity"] = seconds(model, done, True, args.repetitions)
    with PassThrough():
        figures["plain in an empty mode"] = seconds(model, done, False, args.repetitions)
    for name, (module, attribute, stand_in) in STAND_INS.items():
        with replaced(module, attribute, stand_in):
            figures[f"parity, {name} stood in"] = seconds(model, done, True, args.repetitions)
    for name, value in figures.items():
        logger.info("%-36s %7.1f ms  %.2fx plain", name, 1e3 * value, value / figures["plain"])
    write_json(args.json, results)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            trainer_logprobs(model, done, True, 8)
            torch.cuda.synchronize()
        for key in ("self_cpu_time_total", "self_cuda_time_total"):
            print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main()
