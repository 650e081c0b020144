"""Profiling aids for the decode step on the GPU (numbers feed docs/benchmarks.md, not tests).

1. Decode attention: achieved KV bandwidth of the Triton kernel at W1's decode shape (256 sequences, contexts
   64..1,280, Llama-3-8B heads, bf16 and fp8 caches) and W2's (one sequence), over a sweep of tile sizes and
   launch settings.
   W2's decode attention over the shortest context slice a program takes; prefill attention over tile sizes.
   ``--layouts`` times decode attention on other cache layouts too (blocks of 32 or 64 tokens; a sequence's blocks
   in order instead of scattered): whether the kernel waits on its block-table lookups more than on bytes, the
   question for an fp8 cache, which reads half the bytes in as many lookups.
   The library's launcher takes no such settings (it picks its own: ``_tiles`` and ``MIN_SPLIT_TOKENS`` in
   ``kernels/paged_attention.py``), so ``launch`` below is this script's copy of it with every setting exposed:
   keep the two in step when the kernel's arguments change.
2. The decode step's GEMMs at 1, 2, 4 and 256 rows (cuBLAS through ``F.linear``): whether a batch of one is
   worth its own CUDA graph, and the weight-read floor.

W1 and W2 are the workloads of docs/benchmarks.md. Run: ``python benchmarks/kernel_sweep.py`` on a CUDA machine
(``--parts`` picks parts, ``--defaults-only`` times the library's own settings without the sweep).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import random
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from paged_backend.kernels.arrival import arrival_counters
from paged_backend.kernels.attention_twin import paged_attention_torch
from paged_backend.kernels.cache_write import new_kv_cache, values_transposed
from paged_backend.kernels.paged_attention import (
    MAX_SPLITS,
    MIN_SPLIT_TOKENS,
    _next_pow2,
    _paged_attention_kernel,
    _tiles,
    choose_num_splits,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import add_plot_arguments, replotted, run_header, write_json  # noqa: E402

logger = logging.getLogger("kernel_sweep")
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
LAYER_SHAPES = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]


def gpu_ms(fn, repeats: int = 20, warm_ms: float = 50.0) -> float:
    """GPU time of one ``fn``, after ``warm_ms`` of it untimed: a launch timed first in a run, right after its
    compile and the batch's set-up, read slower than the same launch timed later in the same process
    (docs/benchmarks.md, "KV caches stored head-major")."""
    fn()  # compiles
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    for _ in range(min(1000, int(warm_ms / max(start.elapsed_time(end), 1e-3)))):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def graph_ms(fn, repeats: int = 10) -> float:
    """GPU time of ``fn`` replayed from a CUDA graph of ``repeats`` calls: no launch gaps, as in a decode step."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def launch(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    rows: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    min_split_tokens: int = MIN_SPLIT_TOKENS,
    k_scale: torch.Tensor | None = None,  # [Hkv] fp32, fp8 caches only
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_attention_triton`` (no window, no softcap) with its launch settings given: the library's choice for
    each one left None."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs, num_kv_heads = block_tables.shape[0], k_cache.shape[2]
    g_pad = _next_pow2(num_heads // num_kv_heads)
    fp16_dots = k_scale is not None and query.dtype == torch.bfloat16  # the caches then go in as 16-bit words
    block_q, default_n, tuning = _tiles(num_tokens == num_seqs, g_pad, _next_pow2(head_dim), fp16_dots)
    block_q = max(1, rows // g_pad) if rows is not None else block_q
    tuning |= {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}
    num_splits = choose_num_splits(num_seqs, num_tokens, num_kv_heads, query.device)
    out = torch.empty_like(query)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    if num_splits > 1:
        target = torch.empty((num_splits, *query.shape), dtype=torch.float32, device=query.device)
        lse = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32, device=query.device)
        strides = (target.stride(0), target.stride(1), target.stride(2), lse.stride(0), lse.stride(1))
    else:
        target, lse = out, out
        strides = (0, out.stride(0), out.stride(1), 0, 0)
    transposed = values_transposed(v_cache)
    values = v_cache.permute(0, 2, 3, 1) if transposed else v_cache
    caches = (k_cache.view(torch.int16), values.view(torch.int16)) if fp16_dots else (k_cache, v_cache)
    _paged_attention_kernel[grid](
        target, lse, out, arrival_counters(query.device, grid[0] * grid[1]),
        query, *caches,
        context_lens if k_scale is None else k_scale, context_lens if v_scale is None else v_scale,
        block_tables, cu_seqlens_q, context_lens,
        num_seqs, num_splits, float(scale), 0.0, 0,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), *strides, out.stride(0), out.stride(1),
        QUERIES_PER_KV=num_heads // num_kv_heads, G_PAD=g_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim,
        DIM_PAD=_next_pow2(head_dim), BLOCK_N=block_n or default_n, BLOCK_SIZE=k_cache.shape[1],
        SPLIT=num_splits > 1, SPLITS_PAD=MAX_SPLITS if num_splits > 1 else 1, MIN_SPLIT=min_split_tokens,
        USE_WINDOW=False, USE_SOFTCAP=False, IEEE=query.dtype == torch.float32, SCALED=k_scale is not None,
        FP16_DOTS=fp16_dots, CVT=fp16_dots and query.is_cuda, MASK_ALL=False, VT=transposed,
        **tuning,
    )  # fmt: skip
    return out


def decode_batch(
    context_lens: list[int],
    fp8: bool = False,
    block_size: int = BLOCK_SIZE,
    scattered: bool = True,
    layout: str = "engine",
) -> dict:
    """One decode step's attention inputs; ``fp8``: an fp8 cache (``kv_cache_dtype="fp8"``) with its scales. The
    caches are stored as ``layout`` says (``STORED_AS``). The cache's blocks of ``block_size`` tokens lie in random
    order (a busy cache's), or with ``scattered=False`` each sequence's one after the other (the same table
    lookups, contiguous reads)."""
    blocks = [-(-c // block_size) for c in context_lens]
    order = (
        torch.randperm(sum(blocks), device="cuda", dtype=torch.int32)
        if scattered
        else torch.arange(sum(blocks), device="cuda", dtype=torch.int32)
    )
    tables = torch.zeros(len(blocks), max(blocks), dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[used : used + n]
        used += n
    shape = (sum(blocks), block_size, KV_HEADS, HEAD_DIM)
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    k_cache, v_cache = new_kv_cache(shape, cache_dtype, "cuda", head_major=layout == "engine")
    if layout == "token-major":
        v_cache = torch.empty(shape, dtype=cache_dtype, device="cuda")
    batch = dict(
        query=torch.randn(len(blocks), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
        k_cache=k_cache.copy_(torch.randn(shape, device="cuda").to(cache_dtype)),
        v_cache=v_cache.copy_(torch.randn(shape, device="cuda").to(cache_dtype)),
        block_tables=tables,
        cu_seqlens_q=torch.arange(len(blocks) + 1, dtype=torch.int32, device="cuda"),
        context_lens=torch.tensor(context_lens, device="cuda"),
    )
    if fp8:
        batch |= dict(
            k_scale=torch.full((KV_HEADS,), 0.5, device="cuda"), v_scale=torch.full((KV_HEADS,), 0.5, device="cuda")
        )
    return batch


# how decode_batch stores the caches: "engine" as the engine on a GPU (kernels/cache_write.new_kv_cache: head-major,
# an fp8 cache's values transposed within each block), "keys-token-major" (an fp8 cache's values as the engine's,
# its keys [block, offset, head, dim] contiguous), "token-major" (both caches contiguous)
STORED_AS = ("engine", "keys-token-major", "token-major")
CACHES = {"bf16": ("", False, "engine"), "fp8": (", fp8 cache", True, "engine")}  # name: (label, fp8, layout)
CACHES["bf16_token_major"] = (", token-major", False, "token-major")
CACHES["fp8_keys_token_major"] = (", fp8 cache, keys token-major", True, "keys-token-major")
CACHES["fp8_token_major"] = (", fp8 cache, token-major", True, "token-major")


def attention_sweep(
    sweep: bool = True, layouts: list[tuple[int, bool]] | None = None, caches: list[str] | None = None
) -> dict[str, Any]:
    """Decode attention at W1's and W2's shapes, the ``caches`` of ``CACHES`` (bf16 and fp8, stored as the engine
    stores them or otherwise: ``decode_batch``), for each (block size, scattered) cache layout of ``layouts``
    (default: the engine's 16-token blocks in random order): the library's launch and, with ``sweep``, the five
    fastest settings of the grid. Returns each case's figures."""
    rng = random.Random(0)
    cases = {
        "w1 (256 seqs)": [rng.randint(64, 1024) + rng.randint(0, 256) for _ in range(256)],
        "w2 (1 seq, 256)": [256],
    }
    found: dict[str, Any] = {}
    kinds = [CACHES[name] for name in caches or CACHES]
    for (name, ctx), (cache, fp8, layout), (block_size, scattered) in itertools.product(
        cases.items(), kinds, layouts or [(BLOCK_SIZE, True)]
    ):
        batch = decode_batch(ctx, fp8, block_size, scattered, layout)
        name += cache + f", blocks of {block_size}" + ("" if scattered else " in order")
        gbytes = sum(ctx) * KV_HEADS * HEAD_DIM * 2 * (1 if fp8 else 2) / 1e9
        rows = []
        settings_grid = itertools.product((64, 128, 256), (2, 4, 8), (2, 3, 4, 5)) if sweep else []
        for block_n, warps, stages in settings_grid:
            settings = dict(block_n=block_n, num_warps=warps, num_stages=stages)
            try:
                ms = gpu_ms(lambda: launch(**batch, scale=0.088, **settings))  # noqa: B023
            except Exception as exc:  # noqa: BLE001 - out of shared memory etc.
                logger.info("%s %s failed: %s", name, settings, type(exc).__name__)
                continue
            rows.append((ms, settings))
        rows.sort(key=lambda r: r[0])
        default = gpu_ms(lambda: launch(**batch, scale=0.088))  # noqa: B023
        error = relative_error(batch)
        logger.info(
            "%s: %.3f GB of KV; default %.3f ms (%.0f GB/s), error %.2e", name, gbytes, default, gbytes / default * 1e3,
            error,
        )  # fmt: skip
        for ms, settings in rows[:5]:
            logger.info("   %.3f ms (%.0f GB/s) %s", ms, gbytes / ms * 1e3, settings)
        found[name] = {"kv_gb": gbytes, "default_ms": default, "relative_error": error}
        found[name]["fastest"] = [{"ms": ms, **st} for ms, st in rows[:5]]
    return found


def relative_error(batch: dict) -> float:
    """The library's launch against the fp32 twin over the same cache values: ``|out - ref| / |ref|`` (norms)."""
    out = launch(**batch, scale=0.088).float()
    inputs = dict(batch)
    inputs["query"] = batch["query"].float()
    for name in ("k_cache", "v_cache"):
        inputs[name] = batch[name].float().contiguous()  # the same logical [NB, BS, Hkv, D], token-major
    ref = paged_attention_torch(**inputs, scale=0.088)
    return float((out - ref).norm() / ref.norm())


def min_split_sweep() -> None:
    """W2's decode attention (one sequence, contexts 128..384) inside a CUDA graph, over the shortest slice of
    context one program takes: few sequences leave most SMs idle unless the context splits finely."""
    for ctx in (128, 256, 384):
        batch = decode_batch([ctx, 1])  # the engine pads one sequence to the 2-row graph bucket
        row = []
        for min_split in (16, 32, 64, 128, 256):
            ms = graph_ms(lambda m=min_split: launch(**batch, scale=0.088, min_split_tokens=m))  # noqa: B023
            row.append(f"{min_split}: {1e3 * ms:.1f} us")
        logger.info("w2 attention, context %d, by min split tokens: %s", ctx, ", ".join(row))


def prefill_sweep(sweep: bool = True) -> None:
    """Prefill attention (8 fresh 1,024-token prompts, causal) in TFLOP/s over tile rows and launch settings."""
    lens = [1024] * 8
    batch = decode_batch(lens)
    batch["query"] = torch.randn(sum(lens), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    batch["cu_seqlens_q"] = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    tflop = sum(2 * 2 * n * n / 2 * HEAD_DIM * HEADS for n in lens) / 1e12
    rows = []
    settings_grid = itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)) if sweep else []
    for q_rows, block_n, warps, stages in settings_grid:
        settings = dict(rows=q_rows, block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            ms = gpu_ms(lambda: launch(**batch, scale=0.088, **settings))  # noqa: B023
        except Exception as exc:  # noqa: BLE001 - out of shared memory etc.
            logger.info("prefill %s failed: %s", settings, type(exc).__name__)
            continue
        rows.append((ms, settings))
    rows.sort(key=lambda r: r[0])
    default = gpu_ms(lambda: launch(**batch, scale=0.088))
    logger.info("prefill 8 x 1024: default %.3f ms (%.0f TFLOP/s)", default, tflop / default * 1e3)
    for ms, settings in rows[:6]:
        logger.info("   %.3f ms (%.0f TFLOP/s) %s", ms, tflop / ms * 1e3, settings)


def gemm_floor() -> None:
    weights = [torch.randn(o, i, device="cuda", dtype=torch.bfloat16) * 0.02 for o, i in LAYER_SHAPES]
    lm_head = torch.randn(128256, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    for rows in (1, 2, 4, 256):
        x = {i: torch.randn(rows, i, device="cuda", dtype=torch.bfloat16) for i in (4096, 14336)}
        layer = sum(gpu_ms(lambda w=w, x=x: F.linear(x[w.shape[1]], w)) for w in weights)
        head = gpu_ms(lambda: F.linear(x[4096], lm_head))  # noqa: B023
        logger.info(
            "GEMMs at %3d rows: %.3f ms per layer, step (32 layers + lm_head) %.2f ms", rows, layer, 32 * layer + head
        )


def plot_attention(results: dict[str, Any], path: Path) -> None:
    """Decode attention's cases as bars: the library's launch and, where swept, the fastest setting (ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = results["attention"]
    names = list(cases)
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(names) + 1.5))
    at = range(len(names))
    ax.barh([i + 0.2 for i in at], [cases[n]["default_ms"] for n in names], 0.4, label="the library's launch")
    fastest = [cases[n]["fastest"][0]["ms"] if cases[n]["fastest"] else 0.0 for n in names]
    if any(fastest):
        ax.barh([i - 0.2 for i in at], fastest, 0.4, label="the sweep's fastest")
    ax.set_yticks(list(at), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(f"decode attention, {results.get('machine', '')}, {results.get('date', '')}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="attention,min_split,prefill,gemm", help="comma list of the four parts")
    parser.add_argument(
        "--defaults-only", action="store_true", help="attention and prefill: the library's settings only"
    )
    parser.add_argument(
        "--layouts", nargs="+", default=[f"{BLOCK_SIZE}"],
        help="decode attention's cache layouts: a block size, with ':in-order' for sequences' blocks laid in order",
    )  # fmt: skip
    parser.add_argument(
        "--caches", default=",".join(CACHES), help=f"decode attention's caches, a comma list of {', '.join(CACHES)}"
    )
    parser.add_argument("--json", type=Path, default=None, help="decode attention's figures")
    add_plot_arguments(parser, "decode attention's cases")
    args = parser.parse_args()
    if replotted(parser, args, plot_attention) is not None:
        return
    parts = args.parts.split(",")
    if "attention" in parts:
        layouts = [(int(entry.split(":")[0]), not entry.endswith(":in-order")) for entry in args.layouts]
        caches = args.caches.split(",")
        if unknown := [name for name in caches if name not in CACHES]:
            parser.error(f"--caches: {', '.join(unknown)} not among {', '.join(CACHES)}")
        found = attention_sweep(sweep=not args.defaults_only, layouts=layouts, caches=caches)
        results = {**run_header(None), "attention": found}
        write_json(args.json, results)
        if args.plot is not None:
            plot_attention(results, args.plot)
    if "min_split" in parts:
        min_split_sweep()
    if "prefill" in parts:
        prefill_sweep(sweep=not args.defaults_only)
    if "gemm" in parts:
        gemm_floor()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
