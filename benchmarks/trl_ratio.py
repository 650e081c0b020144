"""TRL's GRPO importance-sampling ratio with this engine as TRL's generator (``integrations.trl.use_paged_backend``,
TRL's vLLM path): per completion token, the ratio TRL's correction computes between the trainer's no-grad
("old") logprob and the engine's sampled one, with ``batch_invariant=True`` (parity) and without. With parity
every ratio should be exactly 1.0 and the two logprobs equal to the bit; without, TRL's correction sees the
engine's and the trainer's arithmetic differ.

    python benchmarks/trl_ratio.py --json benchmarks/results/trl_ratio_<card>_<commit>.json \
        --plot docs/images/trl_ratio_<card>_<commit>.png

The policy is SmolLM2-135M's shape with random normal(0, 0.02) weights in bf16 (a word-level tokenizer over its
whole vocabulary, as in ``trl_rollouts.py``; the ratio is a property of the arithmetic, not of the weights),
trained ``--steps`` GRPO steps on random 64-word prompts, sampled at temperature 1 (``token_truncate``
correction). ``--tiny`` runs a two-layer model on any device, to check the script.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import add_plot_arguments, replotted, run_header, write_json  # noqa: E402
from trl_rollouts import build_policy, word_tokenizer  # noqa: E402

from paged_backend.integrations.trl import use_paged_backend  # noqa: E402

logger = logging.getLogger("trl_ratio")

POLICY = dict(  # SmolLM2-135M's shape
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
)  # fmt: skip
TINY = dict(POLICY, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)  # fmt: skip


def ratios(args: argparse.Namespace, shape: dict[str, Any], device: torch.device, parity: bool) -> dict[str, Any]:
    """One fresh policy trained ``args.steps`` GRPO steps on the engine; the ratios TRL's scoring handed the loss."""
    import datasets
    import trl

    tokenizer = word_tokenizer(shape["vocab_size"])
    rng = random.Random(0)
    prompts = [" ".join(f"w{rng.randrange(3, shape['vocab_size'])}" for _ in range(64)) for _ in range(256)]
    config = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.batch, num_generations=args.generations,
        max_completion_length=args.max_tokens, max_steps=args.steps, learning_rate=1e-5, report_to=[],
        save_strategy="no", logging_steps=1, use_cpu=device.type != "cuda", bf16=device.type == "cuda",
        temperature=1.0, vllm_importance_sampling_mode="token_truncate",
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model=build_policy(shape, device),
        reward_funcs=lambda completions, **kwargs: [float(len(c)) for c in completions],
        args=config,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
    )
    engine = dict(gpu_memory_utilization=args.gpu_memory_utilization) if device.type == "cuda" else {}
    llm = use_paged_backend(trainer, batch_invariant=parity, **engine)
    scored: list[dict[str, torch.Tensor]] = []
    score = trainer._generate_and_score_completions

    def recorded(*a: Any, **k: Any) -> Any:
        out = score(*a, **k)
        scored.append(out)
        return out

    trainer._generate_and_score_completions = recorded  # type: ignore[method-assign]
    trainer.train()
    llm.shutdown()
    masks = [out["completion_mask"].bool() for out in scored]
    ratio = torch.cat([out["importance_sampling_ratio"][m].float() for out, m in zip(scored, masks)])
    old = torch.cat([out["old_per_token_logps"][m] for out, m in zip(scored, masks)])
    sampled = torch.cat([out["sampling_per_token_logps"][m] for out, m in zip(scored, masks)])
    result = {
        "steps": len(scored),
        "tokens": int(ratio.numel()),
        "ratio_exactly_one_share": float((ratio == 1.0).float().mean()),
        "max_abs_ratio_minus_one": float((ratio - 1).abs().max()),
        "logprobs_equal_share": float((old == sampled).float().mean()),
        "max_abs_logprob_diff": float((old - sampled).abs().max()),
    }
    logger.info("%s: %s", "parity" if parity else "default", result)
    return result


def plot(results: dict[str, Any], path: Path) -> None:
    """The share of completion tokens whose ratio is exactly 1, per engine, labelled with the largest |ratio - 1|."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results["ratios"])
    fig, ax = plt.subplots(figsize=(5, 3.6))
    shares = [100 * results["ratios"][m]["ratio_exactly_one_share"] for m in modes]
    bars = ax.bar(modes, shares, color=["tab:green" if m == "batch_invariant=True" else "tab:gray" for m in modes])
    for bar, mode in zip(bars, modes):
        r = results["ratios"][mode]
        label = f"{r['tokens']} tokens\nmax |ratio - 1| {r['max_abs_ratio_minus_one']:.2g}"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("tokens with ratio exactly 1.0 (%)")
    ax.set_ylim(0, 125)
    ax.set_title(f"TRL GRPO importance ratio, SmolLM2 shape, bf16\n{results['machine']}, {results['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps per engine")
    parser.add_argument("--batch", type=int, default=16, help="per_device_train_batch_size (completions a step)")
    parser.add_argument("--generations", type=int, default=4, help="num_generations (completions per prompt)")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_completion_length")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="the engine's share of the GPU")
    parser.add_argument("--tiny", action="store_true", help="a two-layer model: check the script on any device")
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    add_plot_arguments(parser, "the shares")
    args = parser.parse_args(argv)
    if (loaded := replotted(parser, args, plot)) is not None:
        return loaded
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = TINY if args.tiny else POLICY
    results: dict[str, Any] = {**run_header(argv), "policy": shape, "ratios": {}}
    for name, parity in (("batch_invariant=True", True), ("default", False)):
        results["ratios"][name] = ratios(args, shape, device, parity)
        write_json(args.json, results)
    if args.plot is not None:
        plot(results, args.plot)
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main()
