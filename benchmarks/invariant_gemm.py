"""The linear layers of a ``batch_invariant=True`` prefill step on a GPU, by the ways a row's product can be made
independent of its batch, against the plain product the default engine runs. Per projection of the 8B shape at
``--tokens`` rows (eager calls, as the mode makes them; ``triton.testing.do_bench``, ms):

- ``mm``: one cuBLAS product over all rows (not invariant: its kernel follows the row count);
- ``blocks``: 256-row blocks one after another;
- ``mode``: ``product_in_blocks``, what the mode runs: the whole blocks as one product where that was found to give
  each row its block's bits (``invariant_products.ONE_PRODUCT``, whose verdicts are logged), else blocks;
- ``streams_S``: the same blocks spread over S CUDA streams, so that small products run side by side;
- ``triton_BMxBN``: one Triton product over all rows with fixed tiles and no split of K.

Each way's rows are then compared, bit for bit, with the same rows computed in a batch of 256 by that way.

    python benchmarks/invariant_gemm.py --json invariant_gemm.json

A diagnostic for work on the mode, not a figure.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paged_backend.kernels import tl, triton  # noqa: E402
from paged_backend.worker.batch_invariant import GPU_ROWS  # noqa: E402
from paged_backend.worker.invariant_products import ONE_PRODUCT, product_in_blocks  # noqa: E402

logger = logging.getLogger("invariant_gemm")

SHAPES = {  # (in, out)
    "q": (4096, 4096),
    "k": (4096, 1024),
    "o": (4096, 4096),
    "gate": (4096, 14336),
    "down": (14336, 4096),
    "qkv": (4096, 6144),
    "gate_up": (4096, 28672),
}
PER_LAYER = {"q": 1, "k": 2, "o": 1, "gate": 2, "down": 1}  # k and v; gate and up

if triton is not None:

    @triton.jit
    def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """c [M, N] = a [M, K] @ b [N, K].T; K summed in BK chunks in order; tiles grouped 8 along M for L2."""
        pid = tl.program_id(0)
        num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
        group = pid // (8 * num_n)
        first_m = group * 8
        size_m = min(num_m - first_m, 8)
        pid_m = first_m + (pid % (8 * num_n)) % size_m
        pid_n = (pid % (8 * num_n)) // size_m
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k in range(0, K, BK):
            a = tl.load(a_ptr + rm[:, None].to(tl.int64) * K + (k + rk)[None, :], mask=rm[:, None] < M, other=0.0)
            b = tl.load(b_ptr + rn[None, :].to(tl.int64) * K + (k + rk)[:, None], mask=rn[None, :] < N, other=0.0)
            acc = tl.dot(a, b, acc)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(c_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)


def triton_mm(x: torch.Tensor, weight: torch.Tensor, bm: int, bn: int, warps: int, stages: int) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _matmul_kernel[grid](x, weight, out, m, n, k, BM=bm, BN=bn, BK=64, num_warps=warps, num_stages=stages)
    return out


def streams_product(x: torch.Tensor, matrix: torch.Tensor, streams: list[torch.cuda.Stream]) -> torch.Tensor:
    """256-row blocks one after another, block i on stream i % S (x's rows a multiple of the block here)."""
    out = torch.empty(x.shape[0], matrix.shape[1], dtype=x.dtype, device=x.device)
    ready = torch.cuda.current_stream()
    for stream in streams:
        stream.wait_stream(ready)
    for i, (rows, rows_out) in enumerate(zip(x.split(GPU_ROWS), out.split(GPU_ROWS))):
        with torch.cuda.stream(streams[i % len(streams)]):
            torch.mm(rows, matrix, out=rows_out)
    for stream in streams:
        ready.wait_stream(stream)
    return out


def ways(num_streams: tuple[int, ...]) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    found: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "mm": lambda x, w: x @ w.t(),
        "blocks": lambda x, w: streams_product(x, w.t(), [torch.cuda.current_stream()]),
        "mode": lambda x, w: product_in_blocks(x, w.t(), None, GPU_ROWS),
    }
    for s in num_streams:
        streams = [torch.cuda.Stream() for _ in range(s)]
        found[f"streams_{s}"] = lambda x, w, streams=streams: streams_product(x, w.t(), streams)
    for bm, bn, warps, stages in ((128, 256, 8, 3), (128, 128, 8, 3), (64, 128, 4, 4), (64, 256, 8, 3), (64, 64, 4, 4)):
        found[f"triton_{bm}x{bn}_w{warps}s{stages}"] = lambda x, w, c=(bm, bn, warps, stages): triton_mm(x, w, *c)
    return found


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict[str, object]:
    import triton.testing

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="rows of the prefill step")
    parser.add_argument("--streams", default="", help="stream counts to try (comma list)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    results: dict[str, dict[str, object]] = {}
    all_ways = ways(tuple(int(s) for s in args.streams.split(",") if s))
    for name, (k, n) in SHAPES.items():
        x = torch.randn(args.tokens, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        row = results.setdefault(name, {})
        for way, fn in all_ways.items():
            full = fn(x, w)
            alone = fn(x[:GPU_ROWS].clone(), w)
            row[way] = triton.testing.do_bench(lambda fn=fn, x=x, w=w: fn(x, w), rep=100)
            row[f"{way}_tflops"] = 2 * args.tokens * k * n / row[way] / 1e9
            row[f"{way}_invariant"] = bool(torch.equal(full[:GPU_ROWS], alone))
            row[f"{way}_max_err"] = float((full.float() - (x.float() @ w.float().t())).abs().max())
        times = " ".join(f"{way}={row[way]:.3f}" for way in all_ways)
        varying = [way for way in all_ways if not row[f"{way}_invariant"]]
        logger.info("%d rows, %s, ms: %s; rows varying with the batch: %s", args.tokens, name, times, varying)
    layer = {way: sum(results[p][way] * c for p, c in PER_LAYER.items()) for way in all_ways}  # type: ignore[misc]
    logger.info("one layer's seven linears, ms: %s", json.dumps({k: round(v, 3) for k, v in layer.items()}))
    verdicts = {str(key[1]) + " @ " + str(key[2][0]): one for key, one in ONE_PRODUCT.items()}
    logger.info("one product over whole blocks gives each row its block's bits: %s", verdicts)
    out = {"tokens": args.tokens, "projections": results, "layer_ms": layer, "one_product": verdicts}
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    main()
