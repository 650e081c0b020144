"""Rollout throughput of TRL's ``GRPOTrainer`` on a Llama-3.2-1B-shaped policy (random normal(0, 0.02) bf16;
its EOS, the tokenizer's, is one id among 128,256, so completions nearly always run to ``max_completion_length``),
generating three ways in this one process:

  trl       TRL's default: transformers ``generate`` on the policy
  trl_cb    TRL's ``use_transformers_continuous_batching=True`` (transformers' ``generate_batch``)
  paged     this engine: ``paged_backend.patch(model)``, which TRL's call to ``generate`` then runs on

Each backend trains a fresh policy with the same weights (seed 0) on the same prompts (random words, 128 tokens
each) for ``--steps`` GRPO steps. Rollout tokens/s: the completion tokens generated, divided by the seconds spent
inside TRL's generation call (timed around ``generate`` / ``generate_batch``, the GPU synchronised on both
sides), over the steps after the first (its call compiles and captures graphs: a warm-up on the same kind of
prompts, never counted). Each step's rollouts come from that step's weights (the engine reads the parameters
the optimizer updates in place; ``tests/test_trl.py`` checks it on a CPU).

    python benchmarks/trl_rollouts.py --json benchmarks/results/h200_trl.json --plot docs/images/h200_trl.png

``--tiny`` runs a two-layer, small-vocabulary model on any device, to check the script.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import random_normal, versions, write_json  # noqa: E402

import paged_backend  # noqa: E402

logger = logging.getLogger("trl_rollouts")

POLICY = dict(  # Llama-3.2-1B's shape
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=True,
)  # fmt: skip
TINY = dict(POLICY, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)  # fmt: skip
BACKENDS = ("trl", "trl_cb", "paged")


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the policy's whole vocabulary ("w0" ... ): any sampled id decodes, offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(words, unk_token="w1"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w1", pad_token="w0", eos_token="w2")
    tokenizer.padding_side = "left"  # TRL pads prompts on the left
    return tokenizer


def build_policy(shape: dict[str, Any], device: torch.device) -> LlamaForCausalLM:
    """Random normal(0, 0.02) weights (norms stay 1), seed 0, bf16 on a GPU; no EOS id in the generation config."""
    config = LlamaConfig(**shape)
    config.eos_token_id = config.bos_token_id = None
    config.pad_token_id = 0
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    if device.type == "cuda":
        model = model.to(torch.bfloat16)
    return random_normal(model)


class RolloutClock:
    """Times each call of a generation method (the GPU synchronised on both sides) and counts the completion
    tokens it returned."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, float]] = []  # (completion tokens, seconds) per call

    def wrap(self, method: Callable[..., Any], count: Callable[[Any, Any], int]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = method(*args, **kwargs)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.calls.append((count(out, kwargs), time.perf_counter() - start))
            return out

        return timed


def generated_tokens(out: Any, kwargs: dict[str, Any]) -> int:
    """Completion tokens of a ``generate`` call: each row past the prompt's width, up to its first EOS (TRL gives
    the tokenizer's EOS to the generation config; the padding after it is not counted)."""
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    new = sequences[:, kwargs["input_ids"].shape[1] :]
    config = kwargs.get("generation_config")
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return int(new.numel())
    hits = torch.isin(new, torch.tensor(eos, device=new.device).view(-1)).int()
    return int(((hits.cumsum(1) - hits) == 0).sum())  # tokens before and at the first EOS


def batch_tokens(out: Any, kwargs: dict[str, Any]) -> int:
    """Completion tokens of a ``generate_batch`` call (a dict of request id -> output with ``generated_tokens``)."""
    return sum(len(o.generated_tokens) for o in out.values())


def run_backend(backend: str, args: argparse.Namespace, shape: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """One fresh policy trained ``args.steps`` GRPO steps with rollouts from ``backend``."""
    import datasets
    import trl

    tokenizer = word_tokenizer(shape["vocab_size"])
    model = build_policy(shape, device)
    clock = RolloutClock()
    handle = None
    if backend == "paged":
        engine = dict(gpu_memory_utilization=args.gpu_memory_utilization) if device.type == "cuda" else {}
        handle = paged_backend.patch(model, tokenizer, fallback="error", device=device.type, **engine)
    model.generate = clock.wrap(model.generate, generated_tokens)  # what TRL calls on the model it unwraps
    model.generate_batch = clock.wrap(model.generate_batch, batch_tokens)
    rng = random.Random(0)
    prompts = [" ".join(f"w{rng.randrange(3, shape['vocab_size'])}" for _ in range(128)) for _ in range(512)]
    config = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.batch, num_generations=args.generations,
        max_completion_length=args.max_tokens, max_steps=args.steps, learning_rate=1e-6, report_to=[],
        save_strategy="no", logging_steps=1, use_cpu=device.type != "cuda", bf16=device.type == "cuda",
        use_transformers_continuous_batching=backend == "trl_cb", temperature=1.0,
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kwargs: [float(len(c)) for c in completions],
        args=config,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
    )
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start
    timed = clock.calls[1:]  # the first call warms up
    result = {
        "calls": len(clock.calls),
        "rollout_tok_s": sum(n for n, _ in timed) / sum(s for _, s in timed) if timed else None,
        "per_call_tok_s": [n / s for n, s in timed],
        "first_call_s": clock.calls[0][1] if clock.calls else None,
        "train_s": train_s,
    }
    if result["per_call_tok_s"]:
        result["median_call_tok_s"] = statistics.median(result["per_call_tok_s"])
    if handle is not None:
        result["engine_generated_tokens"] = handle.engine.stats()["num_generated_tokens"]
        paged_backend.unpatch(model)
    del trainer, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    logger.info("%s: %s", backend, {k: v for k, v in result.items() if k != "per_call_tok_s"})
    return result


def plot(results: dict[str, Any], path: Path) -> None:
    """Rollout tokens/s per backend (calls after the first), each bar labelled with its ratio to TRL's default."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rollouts = {name: r["rollout_tok_s"] for name, r in results["rollouts"].items()}
    fig, ax = plt.subplots(figsize=(5, 3.8))
    bars = ax.bar(list(rollouts), list(rollouts.values()), color=["#888", "#bbb", "#2a7"][: len(rollouts)])
    base = rollouts.get("trl")
    ax.bar_label(bars, labels=[f"{v:,.0f}" + (f" ({v / base:.1f}x)" if base else "") for v in rollouts.values()])
    ax.set_ylabel("rollout tokens/s")
    ax.margins(y=0.12)
    ax.set_title(f"GRPO rollouts, Llama-3.2-1B shape, bf16\n{results['machine']}, {results['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default=",".join(BACKENDS), help=f"comma list of {', '.join(BACKENDS)}")
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per backend (the first is a warm-up)")
    parser.add_argument("--batch", type=int, default=64, help="per_device_train_batch_size (completions a step)")
    parser.add_argument("--generations", type=int, default=8, help="num_generations (completions per prompt)")
    parser.add_argument("--max-tokens", type=int, default=256, help="max_completion_length")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="the engine's share of the GPU")
    parser.add_argument("--tiny", action="store_true", help="a two-layer model: check the script on any device")
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    parser.add_argument("--plot", type=Path, default=None, help="draw the rollout figures here")
    parser.add_argument("--replot", type=Path, default=None, help="only draw --plot from this results file")
    args = parser.parse_args(argv)
    if args.replot is not None:
        loaded: dict[str, Any] = json.loads(args.replot.read_text())
        if args.plot is not None:
            plot(loaded, args.plot)
        return loaded
    backends = args.backends.split(",")
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        parser.error(f"unknown backends {unknown}: choose from {list(BACKENDS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = TINY if args.tiny else POLICY
    results: dict[str, Any] = {
        "machine": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "versions": versions(),
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d"),
        "policy": shape,
        "rollouts": {},
    }
    for backend in backends:
        try:
            results["rollouts"][backend] = run_backend(backend, args, shape, device)
        except Exception as exc:  # noqa: BLE001 - reported; the other backends still run
            logger.exception("%s failed", backend)
            results.setdefault("errors", {})[backend] = f"{type(exc).__name__}: {exc}"
        write_json(args.json, results)
    if args.plot is not None:
        plot(results, args.plot)
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main()
