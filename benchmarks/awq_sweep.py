"""Launch shapes of the fused AWQ int4 GEMMs on one GPU: for the 8B shape's fused q/k/v, o, gate/up and down
projections at 1, 4, 64 and 256 rows (``--rows``), every launch (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps,
stages) of a small grid (BLOCK_M below 16: the GEMV kernel, 4 warps; above 16 rows also tall, narrow tiles with 8
warps or one stage, the shapes GemLite's tuned H100 configs take for int4 at 128-256 rows), fastest first with
their largest difference from the twin, beside the bf16 GEMM (cuBLAS) on the same shape and the heuristic's own
choice; at 256 rows also the whole-weight dequantize of the
large-batch path, torch twin against Triton. Bandwidth counts the packed weights, zeros and scales read once. What
``kernels/awq_gemm.py``'s ``_launch_shape`` picks from. ``--cold`` times over enough copies of the weights that
none stays in L2.

    python benchmarks/awq_sweep.py
    python benchmarks/awq_sweep.py --rows 128 256 --cold --json awq_sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paged_backend.kernels.awq_format import dequantize  # noqa: E402
from paged_backend.kernels.awq_gemm import (  # noqa: E402
    FUSED_MAX_M,
    Launch,
    awq_dequantize_triton,
    awq_gemm,
    awq_gemm_torch,
    awq_gemm_triton,
)
from paged_backend.quantization.rtn import pack_linear  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import run_header, write_json  # noqa: E402

logger = logging.getLogger("benchmarks.awq_sweep")
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (in, out)


def grid(m: int) -> Iterable[tuple[int, int, int, int] | Launch]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K) to try. BLOCK_M below 16 is the GEMV kernel: all rows in one program,
    or one row a program (BLOCK_M 1); its tiles hold one, two or four packs a thread (BLOCK_N / 8 x BLOCK_K packs
    over the 128 threads of 4 warps)."""
    if m <= 4:  # the GEMV only: the tl.dot kernel never came near it at these rows
        tiles = ((64, 16), (128, 8), (256, 4), (256, 8), (256, 16))
        splits = (4, 8, 16, 32)
        rows = sorted({1, triton.next_power_of_2(m)})
        return ((bm, bn, bk, split_k) for bm, (bn, bk), split_k in itertools.product(rows, tiles, splits))
    if m <= 16:
        return itertools.product((16,), (64, 128, 256), (64, 128), (1, 4))
    tiles = itertools.product((64, 128, 256), (32, 64, 128), (64, 128))  # 256: each weight made once
    tunings = ((4, 3), (4, 1), (8, 1), (8, 3))  # (warps, stages)
    return (Launch(bm, bn, bk, 1, w, s) for (bm, bn, bk), (w, s) in itertools.product(tiles, tunings))


def bench_us(fn: Callable[[], object], rep: int = 50, graph: bool = True) -> float:
    """Mean time of ``fn`` replayed from a CUDA graph, as decode steps run: a launch from Python (tens of µs for a
    Triton kernel) would hide a kernel this short. ``graph=False`` for the torch twin, which cannot be captured."""
    import triton.testing

    fn()  # compile outside the graph
    if not graph:
        return triton.testing.do_bench(fn, rep=rep) * 1e3
    return triton.testing.do_bench_cudagraph(fn, rep=rep) * 1e3


L2_BYTES = 50e6  # an H200's L2 cache


def per_call_us(fn: Callable[..., object], weights: list[tuple], rep: int = 50) -> float:
    """``bench_us`` of one graph calling ``fn`` on each set of weights in turn, divided by their number: with
    sets that together exceed the L2 cache, every call reads its weights from HBM, as the engine's layers do."""
    return bench_us(lambda: [fn(*w) for w in weights], rep=rep) / len(weights)


@torch.no_grad()
def sweep(name: str, k: int, n: int, m: int, sweep_grid: bool = True, cold: bool = False) -> dict[str, Any]:
    """One projection at ``m`` rows: the bf16 GEMM, the heuristic's launch, then the grid's four fastest. With
    ``cold``, each is timed over copies of the weights four times the L2's size (otherwise the same weights
    again and again: a small projection's then partly stay in L2)."""
    qweight, qzeros, scales = pack_linear(torch.randn(n, k, device="cuda") * 0.02, 128)
    read = qweight.numel() * 4 + qzeros.numel() * 4 + scales.numel() * 2
    copies = min(32, max(1, round(4 * L2_BYTES / read))) if cold else 1
    first = (qweight, qzeros, scales)
    packed = [first] + [tuple(t.clone() for t in first) for _ in range(1, copies)]
    denses = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    fused = partial(awq_gemm_triton, x, qweight, qzeros, scales)
    error = (fused().float() - awq_gemm_torch(x.float(), qweight, qzeros, scales)).abs().max().item()
    bf16_us = per_call_us(lambda dense: x @ dense, [(d,) for d in denses])
    default_us = per_call_us(partial(awq_gemm_triton, x), packed)
    found: dict[str, Any] = {"bf16_us": bf16_us, "heuristic_us": default_us, "heuristic_error": error}
    if m > FUSED_MAX_M:  # the engine's path here: one dequantize pass (the twin makes several), then cuBLAS
        twin_us = bench_us(lambda: dequantize(qweight, qzeros, scales, x.dtype), graph=False)
        triton_us = bench_us(lambda: awq_dequantize_triton(qweight, qzeros, scales, x.dtype))
        path_us = bench_us(lambda: awq_gemm(x, qweight, qzeros, scales))
        found["dequantize_cublas_us"] = path_us
        logger.info(
            "%s m=%d: dequantize whole, torch twin %.1f us, Triton %.1f us; Triton + cuBLAS %.1f us",
            *(name, m, twin_us, triton_us, path_us),
        )
    logger.info(
        "%s m=%d: bf16 %.1f us; fused, heuristic's launch: %.1f us (%.2f TB/s), max |error| vs twin %.3g",
        name,
        m,
        bf16_us,
        default_us,
        read / default_us / 1e6,
        error,
    )
    rows = []
    for launch in grid(m) if sweep_grid else ():
        try:
            us = per_call_us(lambda *w, launch=launch: awq_gemm_triton(x, *w, launch), packed, 20)
        except Exception as exc:  # noqa: BLE001 - a shape the compiler refuses is skipped
            logger.info("  %s: %s", launch, type(exc).__name__)
            continue
        rows.append((us, launch))
    twin = awq_gemm_torch(x.float(), qweight, qzeros, scales)
    found["fastest"] = []
    for us, launch in sorted(rows)[:4]:
        err = (awq_gemm_triton(x, qweight, qzeros, scales, launch).float() - twin).abs().max().item()
        logger.info("  %.1f us (%.2f TB/s) %s, max |error| vs twin %.3g", us, read / us / 1e6, Launch(*launch), err)
        found["fastest"].append({"us": us, "launch": list(launch), "error": err})
    return found


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-grid", action="store_true", help="only bf16, the heuristic's launch and the paths")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 64, 256], help="rows of x (M) to time")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES), help="projections")
    parser.add_argument("--cold", action="store_true", help="weights from HBM at every call, as in the engine")
    parser.add_argument("--json", type=Path, default=None, help="each projection and row count's figures")
    args = parser.parse_args()
    results: dict[str, Any] = {**run_header(None), "sweeps": {}}
    for name in args.shapes:
        k, n = SHAPES[name]
        for m in args.rows:
            results["sweeps"][f"{name}_{m}"] = sweep(name, k, n, m, sweep_grid=not args.no_grid, cold=args.cold)
            write_json(args.json, results)


if __name__ == "__main__":
    main()
