"""Profiling aids for the decode step on the GPU (numbers feed docs/benchmarks.md, not tests).

1. Decode attention: achieved KV bandwidth of the Triton kernel at W1's decode shape (256 sequences, contexts
   64..1,280, Llama-3-8B heads, bf16) and W2's (one sequence), over a sweep of tile sizes and launch settings.
2. The decode step's GEMMs at 1, 2, 4 and 256 rows (cuBLAS through ``F.linear``): whether a batch of one is
   worth its own CUDA graph, and the weight-read floor.
3. The few-row Triton GEMM (``kernels/small_gemm.py``) against cuBLAS on the same shapes, over tile sizes.

Run: ``python benchmarks/kernel_sweep.py`` on a CUDA machine.
"""

from __future__ import annotations

import itertools
import logging
import random

import torch
import torch.nn.functional as F

from paged_backend.kernels.paged_attention import paged_attention_triton
from paged_backend.kernels.small_gemm import linear_triton

logger = logging.getLogger("kernel_sweep")
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
LAYER_SHAPES = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]


def gpu_ms(fn, repeats: int = 20) -> float:
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


def decode_batch(context_lens: list[int]) -> dict:
    blocks = [-(-c // BLOCK_SIZE) for c in context_lens]
    order = torch.randperm(sum(blocks), device="cuda", dtype=torch.int32)
    tables = torch.zeros(len(blocks), max(blocks), dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[used : used + n]
        used += n
    shape = (sum(blocks), BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return dict(
        query=torch.randn(len(blocks), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
        k_cache=torch.randn(shape, device="cuda", dtype=torch.bfloat16),
        v_cache=torch.randn(shape, device="cuda", dtype=torch.bfloat16),
        block_tables=tables,
        cu_seqlens_q=torch.arange(len(blocks) + 1, dtype=torch.int32, device="cuda"),
        context_lens=torch.tensor(context_lens, device="cuda"),
    )


def attention_sweep() -> None:
    rng = random.Random(0)
    cases = {
        "w1 (256 seqs)": [rng.randint(64, 1024) + rng.randint(0, 256) for _ in range(256)],
        "w2 (1 seq, 256)": [256],
    }
    for name, ctx in cases.items():
        batch = decode_batch(ctx)
        gbytes = sum(ctx) * KV_HEADS * HEAD_DIM * 2 * 2 / 1e9
        rows = []
        for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 4)):
            launch = dict(block_n=block_n, num_warps=warps, num_stages=stages)
            try:
                ms = gpu_ms(lambda: paged_attention_triton(**batch, scale=0.088, launch=launch))  # noqa: B023
            except Exception as exc:  # noqa: BLE001 - out of shared memory etc.
                logger.info("%s %s failed: %s", name, launch, type(exc).__name__)
                continue
            rows.append((ms, launch))
        rows.sort(key=lambda r: r[0])
        default = gpu_ms(lambda: paged_attention_triton(**batch, scale=0.088))  # noqa: B023
        logger.info("%s: %.3f GB of KV; default %.3f ms (%.0f GB/s)", name, gbytes, default, gbytes / default * 1e3)
        for ms, launch in rows[:5]:
            logger.info("   %.3f ms (%.0f GB/s) %s", ms, gbytes / ms * 1e3, launch)


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


def small_gemm_sweep() -> None:
    """Per-layer time of the 7 projections (and the LM head) with the Triton few-row GEMM vs cuBLAS, each timed
    inside a CUDA graph as it would run in a decode step."""
    weights = [torch.randn(o, i, device="cuda", dtype=torch.bfloat16) * 0.02 for o, i in LAYER_SHAPES]
    lm_head = torch.randn(128256, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    layer_bytes = sum(w.numel() * 2 for w in weights)
    for rows in (1, 2, 4):
        x = {i: torch.randn(rows, i, device="cuda", dtype=torch.bfloat16) for i in (4096, 14336)}
        cublas = sum(graph_ms(lambda w=w, x=x: F.linear(x[w.shape[1]], w)) for w in weights)
        logger.info("%d rows: cuBLAS %.3f ms per layer (%.0f GB/s)", rows, cublas, layer_bytes / cublas / 1e6)
        for block_n, block_k in itertools.product((32, 64, 128), (64, 128, 256)):
            try:
                ms = sum(
                    graph_ms(lambda w=w, x=x: linear_triton(x[w.shape[1]], w, block_n=block_n, block_k=block_k))  # noqa: B023
                    for w in weights
                )
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                logger.info("   block_n=%d block_k=%d failed: %s", block_n, block_k, type(exc).__name__)
                continue
            logger.info(
                "   triton block_n=%d block_k=%d: %.3f ms (%.0f GB/s)", block_n, block_k, ms, layer_bytes / ms / 1e6
            )
        head = graph_ms(lambda x=x: F.linear(x[4096], lm_head))
        head_triton = graph_ms(lambda x=x: linear_triton(x[4096], lm_head))
        logger.info("   LM head: cuBLAS %.3f ms, triton %.3f ms", head, head_triton)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    attention_sweep()
    gemm_floor()
    small_gemm_sweep()
