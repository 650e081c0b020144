"""What an int4 engine's CUDA-graph buckets cost to compile, one after another and side by side: every
specialization of the int4 kernels (``kernels/awq_gemm.py``) that the 8B shape's buckets up to ``FUSED_MAX_M`` rows
launch, compiled for an H100/H200 (sm_90) with the Triton wheel's own tools: no GPU needed. Each mode starts from
an empty Triton cache; ``--workers`` threads compile side by side, as ``kernels/compile_ahead.py`` does at start.

    python benchmarks/compile_ahead.py --workers 1 2 --json benchmarks/results/compile_ahead_cpu_<commit>.json

The specializations are those a launch makes (``awq_gemm._launch_shape`` for every bucket and projection, the
fused q/k/v and gate/up packed side by side): a GEMV per row count (1, 2, 4) and packed row stride, ``tl.dot``
kernels per tile and split; an integer argument specialized on being 1 or a multiple of 16, pointers aligned.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from throughput import add_plot_arguments, replotted, write_json  # noqa: E402

from paged_backend.kernels.awq_gemm import DOT_MIN_M, FUSED_MAX_M, _awq_gemm_kernel, _launch_shape  # noqa: E402
from paged_backend.kernels.awq_gemv import awq_gemv_kernel  # noqa: E402
from paged_backend.worker.cuda_graphs import capture_sizes  # noqa: E402

logger = logging.getLogger("benchmarks.compile_ahead")
# (in, out) of the 8B shape's projections, siblings fused: their packed row stride is the fused width's
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
GROUP, SMS = 128, 132
POINTERS = {"x_ptr": "*bf16", "qweight_ptr": "*i32", "qzeros_ptr": "*i32", "scales_ptr": "*bf16",
            "out_ptr": "*bf16", "partial_ptr": "*fp32", "counters_ptr": "*i32"}  # fmt: skip


Spec = tuple[Any, dict[str, int], dict[str, Any], dict[str, int]]  # kernel, integer arguments, constexprs, options


def specializations(max_num_seqs: int = 256) -> dict[tuple[Any, ...], Spec]:
    """Each distinct specialization the buckets launch."""
    found: dict[tuple[Any, ...], Spec] = {}
    for m in (size for size in capture_sizes(max_num_seqs) if size <= FUSED_MAX_M):
        for k, n in SHAPES.values():
            block_m, block_n, block_k, split_k, warps, stages = _launch_shape(m, n, k, GROUP, SMS)
            step = GROUP if block_m < DOT_MIN_M else block_k
            k_per_split = triton.cdiv(triton.cdiv(k, split_k), step) * step
            split = triton.cdiv(k, k_per_split) > 1
            if block_m < DOT_MIN_M:
                kernel, ints = awq_gemv_kernel, {"M": m, "n_packs": n // 8, "K": k, "k_per_split": k_per_split,
                                                 "magic": 0x4B000000}  # fmt: skip
                constants = dict(ROW_PACKS=n // 8, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                 GROUP_SIZE=GROUP, SPLIT=split)  # fmt: skip
            else:
                kernel, ints = _awq_gemm_kernel, {"M": m, "N": n, "K": k, "group_size": GROUP, "row_packs": n // 8,
                                                  "k_per_split": k_per_split}  # fmt: skip
                constants = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=False, SPLIT=split)
            options = {"num_warps": warps, "num_stages": stages}
            classes = tuple(1 if v == 1 else 16 if v % 16 == 0 else 0 for v in ints.values())
            key = (kernel.fn.__name__, classes, tuple(sorted(constants.items())), tuple(options.items()))
            found.setdefault(key, (kernel, ints, constants, options))
    return found


def compile_one(kernel: Any, ints: dict[str, int], constants: dict[str, Any], options: dict[str, int]) -> None:
    """One specialization's cubin for sm_90, as a launch with these arguments makes it (an integer of 1 becomes a
    constant, one divisible by 16 and every pointer carry the divisibility hint)."""
    signature: dict[str, str] = dict(POINTERS)
    constexprs: dict[str, Any] = {}
    for name, value in ints.items():
        signature[name] = "constexpr" if value == 1 else "i32"
        if value == 1:
            constexprs[name] = 1
    signature |= dict.fromkeys(constants, "constexpr")
    constexprs |= constants
    names = list(signature)
    hinted = [name for name in names if name in POINTERS or (signature[name] == "i32" and ints[name] % 16 == 0)]
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in hinted}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def timed(found: dict[tuple[Any, ...], Spec], workers: int) -> float:
    """Seconds to compile every specialization with ``workers`` threads, from an empty cache."""
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(lambda spec: compile_one(*spec), found.values()))
    return time.perf_counter() - start


def plot(results: dict[str, Any], path: Path) -> None:
    """Seconds to compile every specialization, by threads (the runs as dots beside each median)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seconds = results["seconds"]
    fig, ax = plt.subplots(figsize=(5, 3.4))
    bars = ax.bar(list(seconds), [entry["median"] for entry in seconds.values()], color="#4c72b0")
    ax.bar_label(bars, fmt="%.1f s", fontsize=8)
    for i, entry in enumerate(seconds.values()):
        ax.plot([i] * len(entry["runs"]), entry["runs"], "k.", markersize=4)
    ax.set_xlabel("compiling threads")
    ax.set_ylabel("seconds, every specialization")
    ax.set_title(f"{results['specializations']} int4 specializations for sm_90, {results['cpus']} CPUs", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    add_plot_arguments(parser, "a bar chart of the run")
    args = parser.parse_args()
    if replotted(parser, args, plot) is not None:
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    found = specializations()
    logger.info("%d specializations: %s", len(found), [(key[0], dict(key[2])) for key in found])
    results: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/compile_ahead.py", *sys.argv[1:]]),
        "triton": triton.__version__,
        "cpus": os.cpu_count(),
        "specializations": len(found),
        "seconds": {},
    }
    for workers in args.workers:
        runs = [timed(found, workers) for _ in range(args.repetitions)]
        results["seconds"][str(workers)] = {"median": statistics.median(runs), "runs": runs}
        logger.info("%d workers: %.1f s (%s)", workers, statistics.median(runs), ", ".join(f"{r:.1f}" for r in runs))
    write_json(args.json, results)
    if args.plot is not None:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
