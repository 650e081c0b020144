"""FP8 linear calls as the engine makes them, against bf16, on the 8B shape's projections (a diagnostic): per
call, replayed from a CUDA graph as decode steps run them, over enough copies of the weights that none stays in
L2 (as in the engine, where each layer's weights are read once a step), µs:

- ``bf16``: ``F.linear`` in bf16;
- ``fp8``: ``fp8_linear``, the engine's path: at one row the fp8 GEMV (``kernels/fp8_gemv.py``), above the
  quantization kernel, then the product ``fp8_scaled_mm`` routes (the split-K kernel up to ``KERNEL_MAX_ROWS``
  rows, ``torch._scaled_mm`` above);
- ``fp8_gemm``: the quantization kernel, then ``torch._scaled_mm``, at every row count;
- ``fp8_kernel``: the quantization kernel, then the split-K kernel with per-channel scales (blocks of 1 x K), at
  every row count;
- ``fp8_torch_quant``: torch's eight-kernel quantization, then ``torch._scaled_mm`` (the path before the kernel);
- ``fp8_gemm_fast_accum``: ``fp8_gemm`` with ``use_fast_accum=True`` (Hopper's faster, less exact fp8
  accumulation, which vLLM's fp8 GEMMs use), with its largest difference from bf16 beside it;
- ``gemlite_fp8``: GemLite's fp8 layer (``A8W8_fp8_dynamic``) on the same weights, where ``gemlite`` imports;
- ``fp8_block``: block-wise FP8 (``quant_method: "fp8"``, 128 x 128 weight blocks, activations per token and 128
  inputs) as ``FP8BlockLinear`` runs it eagerly: the quantization kernel, then the product (``kernels/fp8_block_mm.py``
  below ``CUBLAS_MIN_ROWS`` rows, cuBLAS's block-scaled GEMM from there on, on Hopper);
- ``fp8_block_kernel``, ``fp8_block_cublas``: the same with either product at every row count (cuBLAS's on Hopper
  with torch's ``scaled_mm`` only), which places ``CUBLAS_MIN_ROWS``;
- ``bf16_gemv`` (up to 4 rows): the same GEMV kernel over the bf16 weights, no scale (``gemv_triton``), against
  ``bf16``'s cuBLAS, with its largest difference from it beside it (``bf16_gemv_max_err_vs_bf16``).

With ``--sweep``, up to 4 rows also every GEMV launch (BLOCK_N, SPLIT_K, LANES) of a small grid, fastest first
(``gemv_*`` over fp8 weights, ``gemv16_*`` over bf16 ones).

    python benchmarks/fp8_linear.py --rows 1 2 4 256 --sweep --json fp8_linear.json --plot fp8_linear.png
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import add_plot_arguments, replotted  # noqa: E402

from paged_backend.kernels.fp8_block_mm import fp8_block_mm_triton, quantize_per_block, quantize_per_group  # noqa: E402
from paged_backend.kernels.fp8_gemv import GEMV_MAX_M, fp8_gemv_triton, gemv_triton  # noqa: E402
from paged_backend.kernels.fp8_quant import quantize_per_row_triton  # noqa: E402
from paged_backend.quantization.fp8 import fp8_linear, quantize_per_row  # noqa: E402
from paged_backend.quantization.fp8_block import fp8_block_linear, fp8_block_mm_cublas, uses_cublas  # noqa: E402

logger = logging.getLogger("fp8_linear")
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (in, out)
L2_BYTES = 50e6  # an H200's L2 cache


def scaled_mm(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, kernel: bool, fast_accum: bool = False
) -> torch.Tensor:
    q, scale = quantize_per_row_triton(x) if kernel else quantize_per_row(x)
    return torch._scaled_mm(
        q, weight.T, scale_a=scale, scale_b=weight_scale[None, :], out_dtype=x.dtype, use_fast_accum=fast_accum
    )


def channel_product(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """Per-channel FP8 through the split-K kernel (scale blocks of 1 x K), whatever the row count."""
    q, scale = quantize_per_row_triton(x)
    return fp8_block_mm_triton(q, scale, weight, weight_scale[:, None], 1, x.shape[1], x.dtype)


def block_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, cublas: bool) -> torch.Tensor:
    """``fp8_block_linear`` with the product named, whatever the row count."""
    q, q_scale = quantize_per_group(x, 128, kernel=True)
    if cublas:
        return fp8_block_mm_cublas(q, q_scale, weight, scale, x.dtype)
    return fp8_block_mm_triton(q, q_scale, weight, scale, 128, 128, x.dtype)


def copies_of(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """``tensors`` and copies of them, together four times the L2's size."""
    size = sum(t.numel() * t.element_size() for t in tensors)
    return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(1, max(1, round(4 * L2_BYTES / size)))]


def per_call_us(fn: Callable[..., torch.Tensor], weights: list[tuple[torch.Tensor, ...]]) -> float:
    """One CUDA graph calling ``fn`` on each set of weights in turn, timed, divided by their number."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(lambda: [fn(*w) for w in weights], rep=50) * 1e3 / len(weights)


def gemlite_fp8(weight: torch.Tensor, weight_scale: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """GemLite's own fp8 layer (``A8W8_fp8_dynamic``: activations quantized per token, then its Triton GEMM or
    GEMV by row count) over the same fp8 weights and scales, where the optional ``gemlite`` imports; else None."""
    try:
        from gemlite.helper import A8W8_fp8_dynamic  # type: ignore[import-not-found]

        layer = A8W8_fp8_dynamic(device=str(weight.device), dtype=torch.bfloat16).from_weights(
            weight, scales=weight_scale[:, None]
        )
    except Exception as exc:  # noqa: BLE001 - another library's failure leaves its column out, not the run
        logger.info("GemLite's fp8 layer is left out (%s: %s)", type(exc).__name__, exc)
        return None
    return lambda x: layer(x)


PLOTTED = ("bf16", "bf16_gemv", "fp8", "fp8_gemm_fast_accum", "fp8_kernel", "fp8_block_kernel", "fp8_block_cublas")


def plot(results: dict[str, Any], path: Path) -> None:
    """µs a call against rows, a panel a projection, a line a column of ``PLOTTED`` (those a run has)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SHAPES), figsize=(14, 3.6))
    for ax, name in zip(axes, SHAPES):
        rows = sorted(int(key.rsplit("_", 1)[1]) for key in results if key.rsplit("_", 1)[0] == name)
        for column in PLOTTED:
            points = [(r, results[f"{name}_{r}"][column]) for r in rows if column in results[f"{name}_{r}"]]
            if points:
                ax.plot(*zip(*points), marker="o", markersize=3, label=column)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("rows")
    axes[0].set_ylabel("µs a call (CUDA graph, weights cold)")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 256])
    parser.add_argument("--sweep", action="store_true", help="also the GEMV's launches, up to 4 rows")
    parser.add_argument("--json", type=Path, default=None)
    add_plot_arguments(parser, "µs a call against rows, a panel a projection")
    args = parser.parse_args(argv)
    loaded = replotted(parser, args, plot)
    if loaded is not None:
        return loaded
    results: dict[str, dict[str, float]] = {}
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q_w, s_w = quantize_per_row(w)
        s_w = s_w[:, 0]
        dense, quantized, blocks = copies_of(w), copies_of(q_w, s_w), copies_of(*quantize_per_block(w, 128, 128))
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            err = (fp8_linear(x, q_w, s_w, True).float() - F.linear(x, w).float()).abs().max().item()
            fast_err = (scaled_mm(x, q_w, s_w, True, True).float() - F.linear(x, w).float()).abs().max().item()
            row = {
                "bf16": per_call_us(lambda w, x=x: F.linear(x, w), dense),
                "fp8": per_call_us(lambda q, s, x=x: fp8_linear(x, q, s, True), quantized),
                "fp8_gemm": per_call_us(lambda q, s, x=x: scaled_mm(x, q, s, True), quantized),
                "fp8_torch_quant": per_call_us(lambda q, s, x=x: scaled_mm(x, q, s, False), quantized),
                "fp8_gemm_fast_accum": per_call_us(lambda q, s, x=x: scaled_mm(x, q, s, True, True), quantized),
                "fast_accum_max_err_vs_bf16": fast_err,
                "max_err_vs_bf16": err,
                "fp8_block": per_call_us(lambda q, s, x=x: fp8_block_linear(x, q, s, 128, 128), blocks),
                "fp8_block_max_err_vs_bf16": (
                    fp8_block_linear(x, *blocks[0], 128, 128).float() - F.linear(x, w).float()
                )
                .abs()
                .max()
                .item(),
            }
            row["fp8_kernel"] = per_call_us(lambda q, s, x=x: channel_product(x, q, s), quantized)
            row["fp8_block_kernel"] = per_call_us(lambda q, s, x=x: block_product(x, q, s, False), blocks)
            if uses_cublas(x.new_empty(256, k), blocks[0][0], 128, 128):  # Hopper, torch's scaled_mm
                row["fp8_block_cublas"] = per_call_us(lambda q, s, x=x: block_product(x, q, s, True), blocks)
            gemlite = gemlite_fp8(q_w, s_w)
            if gemlite is not None:
                gemlite_layers = [gemlite_fp8(q, s) for q, s in quantized]
                row["gemlite_fp8"] = per_call_us(lambda layer, x=x: layer(x), [(f,) for f in gemlite_layers])
                row["gemlite_max_err_vs_bf16"] = (gemlite(x).float() - F.linear(x, w).float()).abs().max().item()
            if rows <= GEMV_MAX_M:
                row["bf16_gemv"] = per_call_us(lambda w, x=x: gemv_triton(x, w), dense)
                row["bf16_gemv_max_err_vs_bf16"] = (
                    (gemv_triton(x, w).float() - F.linear(x, w).float()).abs().max().item()
                )
            if args.sweep and rows <= GEMV_MAX_M:
                for launch in itertools.product((1, 2, 4, 8), (1, 2, 4), (32, 64, 128)):
                    gemv = lambda q, s, x=x, launch=launch: fp8_gemv_triton(x, q, s, launch)  # noqa: E731
                    row["gemv_{}x{}x{}".format(*launch)] = per_call_us(gemv, quantized)
                    gemv16 = lambda w, x=x, launch=launch: gemv_triton(x, w, launch=launch)  # noqa: E731
                    row["gemv16_{}x{}x{}".format(*launch)] = per_call_us(gemv16, dense)
            results[f"{name}_{rows}"] = row
            best = {p: sorted((v, k) for k, v in row.items() if k.startswith(p))[:3] for p in ("gemv_", "gemv16_")}
            fixed = {key: round(v, 2) for key, v in row.items() if not key.startswith("gemv")}
            logger.info("%s, %d rows, µs: %s; best GEMV launches %s", name, rows, json.dumps(fixed), best)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    if args.plot is not None:
        plot(results, args.plot)
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    main()
