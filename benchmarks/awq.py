"""AWQ int4 on one GPU: the decode GEMMs as the engine runs them, against their twin and cuBLAS bf16 (graph-timed),
then W1 and W2 on the Llama-3-8B shape quantized in the AWQ layout and as a compressed-tensors W4A16 checkpoint
(``ct_w4a16.py``; both group 128, round to nearest: quality is irrelevant to speed), beside the same engine in
bf16 and HF ``generate`` in bf16.

Weights: the architecture's own random init (normal(0, 0.02)) in bf16, made on the GPU; the AWQ checkpoint is
written from them (``write_checkpoint``) and loaded back through the engine's AWQ loader.

    python benchmarks/awq.py --json benchmarks/results/h200_awq.json --plot docs/images/h200_awq.png

W1 and W2 run ``--repeats`` times, each time on prompts no earlier run or warm-up used; a figure is the median, the
runs kept beside it. ``--replot`` draws the chart again from a results file.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.throughput import (  # noqa: E402
    add_plot_arguments,
    benchmark_config,
    one_prompt,
    profile_kernels,
    release_engine,
    replotted,
    run_hf,
    run_paged,
    tokens_per_second,
    versions,
    w1_prompts,
    write_json,
)
from paged_backend import LLM  # noqa: E402
from paged_backend.kernels.awq_gemm import awq_gemm, awq_gemm_torch  # noqa: E402
from paged_backend.model_loader.dummy import dummy_model  # noqa: E402
from paged_backend.quantization.awq_quantize import write_checkpoint  # noqa: E402
from paged_backend.quantization.rtn import pack_linear  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ct_w4a16 import write_ct_w4a16  # noqa: E402

logger = logging.getLogger("benchmarks.awq")

H200_COPY_TBPS = 4.27
GROUP = 128
# The 8B shape's decode GEMMs: (in, out) of the fused q/k/v, o, gate/up and down projections.
GEMMS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def weight_bytes(model: torch.nn.Module) -> int:
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def linear_weight_gb(model: torch.nn.Module) -> dict[str, float]:
    """The decoder's linears alone (what AWQ quantizes; the embedding and LM head stay 16-bit): bytes held, and
    what the same layers take in bf16."""
    from paged_backend.quantization.awq import AWQLinear

    held = bf16 = 0
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, AWQLinear)) and module is not model.get_output_embeddings():
            held += sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
            bf16 += module.in_features * module.out_features * 2
    return {"linears_gb": held / 1e9, "linears_bf16_gb": bf16 / 1e9}


@torch.no_grad()
def kernel(rows: tuple[int, ...] = (1, 2, 4, 16, 64, 256)) -> list[dict[str, Any]]:
    """Each decode GEMM as the engine runs it (``awq_gemm``: the GEMV, the ``tl.dot`` kernel, or dequantize +
    cuBLAS above ``FUSED_MAX_M`` rows), replayed from a CUDA graph as decode steps run it (``awq_sweep.bench_us``):
    error against the twin and time per call; bandwidth counts the packed weights, zeros and scales read."""
    from benchmarks.awq_sweep import bench_us

    results = []
    for name, (k, n) in GEMMS.items():
        qweight, qzeros, scales = pack_linear(torch.randn(n, k, device="cuda") * 0.02, GROUP)
        dense = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        read = qweight.numel() * 4 + qzeros.numel() * 4 + scales.numel() * 2
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = awq_gemm_torch(x.float(), qweight, qzeros, scales)
            err = (awq_gemm(x, qweight, qzeros, scales).float() - ref).abs().max().item()
            awq_us = bench_us(lambda x=x, w=(qweight, qzeros, scales): awq_gemm(x, *w))
            bf16_us = bench_us(lambda x=x, dense=dense: x @ dense)
            row = {
                "gemm": name,
                "m": m,
                "max_abs_err_vs_twin": err,
                "awq_us": awq_us,
                "bf16_us": bf16_us,
                "awq_weight_tb_s": read / awq_us / 1e6,
                "share_of_copy_bandwidth": read / awq_us / 1e6 / H200_COPY_TBPS,
            }
            results.append(row)
            logger.info("kernel %s", row)
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=256, help="W1 prompts (the workload: 256)")
    parser.add_argument("--max-tokens", type=int, default=256, help="new tokens per prompt (the workload: 256)")
    parser.add_argument("--num-layers", type=int, default=None, help="fewer layers for a quick try")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each workload (median reported)")
    parser.add_argument("--skip-kernel", action="store_true", help="skip the kernel table")
    parser.add_argument("--profile", action="store_true", help="W2: each engine's GPU kernels per step")
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    add_plot_arguments(parser, "a bar chart")
    args = parser.parse_args(argv)
    if (loaded := replotted(parser, args, plot)) is not None:
        return loaded
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    results: dict[str, Any] = {
        "machine": torch.cuda.get_device_name(0),
        "versions": versions(),
        "command": "python benchmarks/awq.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }

    def save() -> None:
        write_json(args.json, results)

    if not args.skip_kernel:
        results["kernel"] = kernel()
        save()
    config = benchmark_config(num_layers=args.num_layers)

    def w1(repetition: int) -> list[list[int]]:  # each repetition's prompts new to the engine (no prefix-cache hit)
        return w1_prompts(config.vocab_size, args.num_prompts, seed=0 if repetition == 0 else 100 + repetition)

    def w2(repetition: int) -> list[list[int]]:
        return [one_prompt(config.vocab_size, 128, seed=1 if repetition == 0 else 100 + repetition)]

    with tempfile.TemporaryDirectory() as tmp:
        dense_dir, awq_dir, ct_dir = Path(tmp) / "bf16", Path(tmp) / "awq", Path(tmp) / "ct_w4a16"
        config.save_pretrained(dense_dir)
        model = dummy_model(config, torch.bfloat16, torch.device("cuda"), seed=0)
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        run_hf(model, w2(0), 4)
        hf_runs = [tokens_per_second(*run_hf(model, w2(r), args.max_tokens)) for r in range(args.repeats)]
        results["hf_generate_bf16_w2"], results["hf_generate_bf16_w2_runs"] = statistics.median(hf_runs), hf_runs
        write_checkpoint(model, str(awq_dir), GROUP)
        write_ct_w4a16(model, ct_dir, GROUP)
        del model
        release_engine("HF")
        for name, path, kwargs in (
            ("paged_bf16", dense_dir, {"load_format": "dummy"}),
            ("paged_awq", awq_dir, {"quantization": "awq", "dtype": "bfloat16"}),
            ("paged_ct_w4a16", ct_dir, {"dtype": "bfloat16"}),  # detected from its config, like AWQ's
        ):
            llm = LLM(str(path), skip_tokenizer_init=True, **kwargs)
            entry: dict[str, Any] = {"weight_gb": weight_bytes(llm.llm_engine.model) / 1e9}
            regions = llm.llm_engine.executor.model_runner.regions  # None when running eagerly
            entry["fused_sibling_groups"] = 0 if regions is None else regions.num_fused_groups
            entry.update(linear_weight_gb(llm.llm_engine.model))
            run_paged(llm, [one_prompt(config.vocab_size, 128, seed=2)], args.max_tokens)  # warm-up, another prompt
            entry["w2_runs"] = [tokens_per_second(*run_paged(llm, w2(r), args.max_tokens)) for r in range(args.repeats)]
            entry["w2"] = statistics.median(entry["w2_runs"])
            if args.profile:
                entry["w2_profile"] = profile_kernels(llm, [one_prompt(config.vocab_size, 128, seed=9)], 64)
                logger.info("%s W2 kernels per step: %s", name, json.dumps(entry["w2_profile"], indent=1))
            run_paged(llm, w1_prompts(config.vocab_size, 64, seed=1), 8)  # warm-up sharing no prefix with W1
            entry["w1_runs"] = [tokens_per_second(*run_paged(llm, w1(r), args.max_tokens)) for r in range(args.repeats)]
            entry["w1"] = statistics.median(entry["w1_runs"])
            results[name] = entry
            logger.info("%s: %s", name, entry)
            llm.llm_engine.shutdown()
            del llm
            release_engine(name)
            save()
    dense, quantized, ct = results["paged_bf16"], results["paged_awq"], results["paged_ct_w4a16"]
    results["ratios"] = {
        "w2_ct_w4a16_over_awq": ct["w2"] / quantized["w2"],
        "w1_ct_w4a16_over_awq": ct["w1"] / quantized["w1"],
        "w2_awq_over_bf16": quantized["w2"] / dense["w2"],
        "w1_awq_over_bf16": quantized["w1"] / dense["w1"],
        "weight_memory_awq_over_bf16": quantized["weight_gb"] / dense["weight_gb"],
        "linear_weights_awq_over_bf16": quantized["linears_gb"] / quantized["linears_bf16_gb"],
    }
    save()
    if args.plot:
        plot(results, args.plot)
    logger.info("%s", json.dumps({k: v for k, v in results.items() if k not in ("versions", "kernel")}, indent=2))
    return results


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    engines = {"paged bf16": "paged_bf16", "paged AWQ": "paged_awq", "paged CT\nW4A16": "paged_ct_w4a16"}

    def of(key: str) -> dict[str, float]:
        return {label: results[name][key] for label, name in engines.items() if name in results}

    panels = [
        ("W1, output tok/s", of("w1")),
        ("W2, tok/s", {"hf generate\nbf16": results["hf_generate_bf16_w2"], **of("w2")}),
        ("weights, GB", of("weight_gb")),
    ]
    for ax, (title, values) in zip(axes, panels):
        colors = ["#888" if n.startswith("hf") else "#4c72b0" if "bf16" in n else "#dd8452" for n in values]
        colors = [c if "CT" not in n else "#55a868" for c, n in zip(colors, values)]
        bars = ax.bar(list(values), list(values.values()), color=colors)
        ax.bar_label(bars, fmt="%.1f")
        ax.set_title(title, fontsize=10)
    runs = (
        f", median of {len(results['paged_bf16']['w1_runs'])} runs"
        if "w1_runs" in results.get("paged_bf16", {})
        else ""
    )
    title = f"{results['machine']}, Llama-3-8B shape, int4 (group {GROUP}, AWQ and compressed-tensors) vs bf16{runs}"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
