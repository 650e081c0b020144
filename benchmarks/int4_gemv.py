"""A decode step's rows through an int4 projection, weights cold in HBM: bf16 cuBLAS (``F.linear``, as a bf16
model runs it), this library's fused kernel (``awq_gemm_triton``, the launch the engine picks: the GEMV at one row)
and, above ``FUSED_MAX_M`` rows, the engine's route there (``awq_gemm``: the weight dequantized, then cuBLAS) and,
where the optional ``gemlite`` package imports on the device, GemLite's kernels on the same int4 values, for the 8B
shape's fused q/k/v, o, fused gate/up and down projections. Up to four rows GemLite runs its one-row kernel
(``GEMV_REVSPLITK``) twice: adding its parts of K in fp32 (left out where it is off by more than 2% of the largest
output), and with its sm90 default of bf16 atomic adds (timed whatever its error, which is recorded beside it);
above, the kernel its own rule picks for the row count (``GEMM`` from 64 rows, with its tuned configs where the
card has them).

    python benchmarks/int4_gemv.py --json benchmarks/results/int4_gemv_<card>_<commit>.json

The weights are random normal (std 0.02), rounded to int4 with a zero point and a bf16 scale per group of
``--group-size`` inputs (``quantization/rtn.py``); GemLite gets the same integers, zeros and scales in its HQQ
layout (``W = (W_q - zeros) * scales``, output by input). Every kernel is replayed from a CUDA graph, as decode
steps run it, over enough copies of its weights that none stays in L2 (four times 50 MB). Each figure is the
median of ``--repetitions`` timings (the spread beside it); the speed-up is bf16's time over the kernel's.
Outputs are compared against the dequantized weights' fp32 product before anything is timed.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import add_plot_arguments, replotted  # noqa: E402

from paged_backend.kernels.awq_format import dequantize, unpack  # noqa: E402
from paged_backend.kernels.awq_gemm import FUSED_MAX_M, awq_gemm, awq_gemm_triton  # noqa: E402
from paged_backend.quantization.rtn import pack_linear  # noqa: E402

logger = logging.getLogger("benchmarks.int4_gemv")
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (in, out)
L2_BYTES = 50e6  # an H100's and H200's L2 cache


def graph_us(calls: list[Callable[[], torch.Tensor]], repetitions: int) -> list[float]:
    """Mean µs a call of one CUDA graph that makes every call in turn, ``repetitions`` times."""
    import triton.testing

    for call in calls:  # compile and tune outside the graph
        call()
    torch.cuda.synchronize()
    return [
        triton.testing.do_bench_cudagraph(lambda: [c() for c in calls], rep=100) * 1e3 / len(calls)
        for _ in range(repetitions)
    ]


def hqq_layout(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same int4 weights as GemLite's ``pack`` takes them: integers [out, in] uint8, scales and zeros
    [out, in / G] in ``dtype`` (the activations')."""
    ints = unpack(qweight).T.contiguous().to(torch.uint8)
    return ints, scales.T.contiguous().to(dtype), unpack(qzeros).T.contiguous().to(dtype)


# GemLite's GEMV_REVSPLITK adds the parts of K into the output with atomics. On sm90 its default adds them in bf16
# (``native_atomic_bf16``): every add rounds to bf16's 8 bits, and down's K = 14,336 takes dozens of adds an
# output. With it off, the parts add in fp32 and one more kernel casts the result, as our GEMV's fp32 parts do.
GEMLITE_VARIANTS = {"gemlite_gemv_revsplitk": False, "gemlite_gemv_revsplitk_bf16_atomics": True}
GEMLITE_GEMV_MAX_ROWS = 4  # above, GemLite's own choice of kernel (``gemlite.core.get_matmul_type``)


def gemlite_layer(
    k: int, n: int, group: int, weights: tuple[torch.Tensor, ...], native_atomic_bf16: bool, gemv: bool = True
) -> Callable[[torch.Tensor], torch.Tensor]:
    import gemlite  # type: ignore[import-not-found]

    layer = gemlite.GemLiteLinear(
        4, group_size=group, in_features=k, out_features=n, input_dtype=gemlite.DType.BF16,
        output_dtype=gemlite.DType.BF16,
    )  # fmt: skip
    qweight, qzeros, scales = weights
    w_q, group_scales, zeros = hqq_layout(qweight, qzeros, scales, torch.bfloat16)
    layer.pack(w_q, group_scales, zeros, None)

    def forward(x: torch.Tensor) -> torch.Tensor:  # the setting is global, read as each call launches
        gemlite.set_native_atomic_bfp16(native_atomic_bf16)
        return layer.forward_manual(x, matmul_type="GEMV_REVSPLITK") if gemv else layer(x)

    return forward


def figure(times: list[float], bf16: list[float] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"us": statistics.median(times), "runs_us": times}
    if bf16 is not None:
        out["speedup_over_bf16"] = statistics.median(bf16) / out["us"]
    return out


@torch.no_grad()
def projection(name: str, rows: int, group: int, repetitions: int, with_gemlite: bool) -> dict[str, Any]:
    k, n = SHAPES[name]
    weight = torch.randn(n, k, device="cuda") * 0.02
    packed = pack_linear(weight, group)
    int4_bytes = sum(t.numel() * t.element_size() for t in packed)
    copies = max(1, min(32, round(4 * L2_BYTES / int4_bytes)))
    int4_sets = [packed] + [tuple(t.clone() for t in packed) for _ in range(copies - 1)]
    dense_copies = max(1, min(32, round(4 * L2_BYTES / (n * k * 2))))
    denses = [dequantize(*packed, torch.bfloat16).T.contiguous() for _ in range(dense_copies)]  # [out, in]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    truth = x.float() @ dequantize(*packed, torch.float32)
    scale = truth.abs().max().item()
    kernels: dict[str, list[Callable[[], torch.Tensor]]] = {
        "bf16_cublas": [functools.partial(F.linear, x, d) for d in denses],
        "awq_gemv": [functools.partial(awq_gemm_triton, x, *w) for w in int4_sets],
    }
    if rows > FUSED_MAX_M:
        kernels["awq_engine"] = [functools.partial(awq_gemm, x, *w) for w in int4_sets]
    gemv = rows <= GEMLITE_GEMV_MAX_ROWS
    variants = GEMLITE_VARIANTS if gemv else {"gemlite": False}
    for variant, native_atomic_bf16 in variants.items() if with_gemlite else ():
        try:
            layers = [gemlite_layer(k, n, group, w, native_atomic_bf16, gemv) for w in int4_sets]
            layers[0](x)
        except Exception as exc:  # noqa: BLE001 - another library's failure leaves its column out, not the run
            logger.info("%s: GemLite failed (%s: %s); %s is left out", name, type(exc).__name__, exc, variant)
        else:
            kernels[variant] = [functools.partial(f, x) for f in layers]
    result: dict[str, Any] = {"in": k, "out": n, "rows": rows, "int4_bytes": int4_bytes}
    for kernel, calls in kernels.items():
        error = (calls[0]().float() - truth).abs().max().item() / scale
        if error > 2e-2 and kernel in ("gemlite_gemv_revsplitk", "gemlite"):
            logger.info("%s: GemLite's output is off by %.3g of the largest value; left out", name, error)
            continue
        if error > 2e-2 and kernel != "gemlite_gemv_revsplitk_bf16_atomics":  # that one is timed, its error kept
            raise SystemExit(f"{name}: {kernel}'s output is off by {error:.3g} of the largest value")
        times = graph_us(calls, repetitions)
        result[kernel] = {**figure(times, result.get("bf16_cublas", {}).get("runs_us")), "max_rel_error": error}
        tb_s = (n * k * 2 if kernel == "bf16_cublas" else int4_bytes) / result[kernel]["us"] / 1e6
        logger.info("%-8s %-24s %7.1f us  %.2f TB/s  error %.1e", name, kernel, result[kernel]["us"], tb_s, error)
    return result


KERNELS = ("bf16_cublas", "awq_gemv", "awq_engine", *GEMLITE_VARIANTS, "gemlite")


def plot(results: dict[str, Any], path: Path) -> None:
    """Microseconds a call for each projection, one bar a kernel (those a run left out are absent)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    projections = results["projections"]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.8 / len(KERNELS)
    for i, kernel in enumerate(KERNELS):
        places = [p for p, r in enumerate(projections.values()) if kernel in r]
        times = [r[kernel]["us"] for r in projections.values() if kernel in r]
        if times:
            bars = ax.bar([p + i * width for p in places], times, width, label=kernel)
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks([p + width * (len(KERNELS) - 1) / 2 for p in range(len(projections))], list(projections))
    ax.set_ylabel("µs a call (CUDA graph, weights cold)")
    ax.legend(fontsize=8)
    rows = results.get("rows", 1)
    ax.set_title(f"{results['card']}: {rows} row{'s' * (rows > 1)}, int4 group {results['group_size']} against bf16",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1, help="rows of x (a decode step's batch)")
    parser.add_argument("--group-size", type=int, default=128, choices=(32, 64, 128))
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--no-gemlite", action="store_true", help="leave GemLite out even where it imports")
    parser.add_argument("--json", type=Path, default=None)
    add_plot_arguments(parser, "a bar chart of the run")
    args = parser.parse_args()
    if replotted(parser, args, plot) is not None:
        return
    torch.manual_seed(0)
    with_gemlite = not args.no_gemlite
    if with_gemlite:
        try:
            import gemlite
        except ImportError as exc:
            logger.info("gemlite does not import (%s): its column is left out", exc)
            with_gemlite = False
    results: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/int4_gemv.py", *sys.argv[1:]]),
        "card": torch.cuda.get_device_name(),
        "versions": {
            "torch": torch.__version__,
            "triton": __import__("triton").__version__,
            "gemlite": getattr(gemlite, "__version__", "?") if with_gemlite else None,
        },  # fmt: skip
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "rows": args.rows,
        "group_size": args.group_size,
        "projections": {
            name: projection(name, args.rows, args.group_size, args.repetitions, with_gemlite) for name in args.shapes
        },
    }
    columns = [k for k in KERNELS[1:] if any(k in r for r in results["projections"].values())]
    logger.info("%-8s %10s" + " %20s" * len(columns), "", "bf16 us", *columns)
    for name, r in results["projections"].items():
        cells = [f"{r[k]['us']:.1f} ({r[k]['speedup_over_bf16']:.2f}x)" if k in r else "-" for k in columns]
        logger.info("%-8s %10.1f" + " %20s" * len(cells), name, r["bf16_cublas"]["us"], *cells)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if args.plot is not None:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
