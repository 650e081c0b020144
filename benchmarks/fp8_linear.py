"""FP8 linear calls as the engine makes them, against bf16, on the 8B shape's projections (a diagnostic): per
call, replayed from a CUDA graph as decode steps run them (``triton.testing.do_bench_cudagraph``), µs:

- ``bf16``: ``F.linear`` in bf16;
- ``fp8``: ``fp8_linear`` (the quantization kernel, then ``torch._scaled_mm``);
- ``fp8_torch_quant``: torch's eight-kernel quantization, then ``torch._scaled_mm`` (the path before the kernels).

    python benchmarks/fp8_linear.py --rows 1 4 256 --json fp8_linear.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paged_backend.kernels.fp8_quant import quantize_per_row_triton  # noqa: E402
from paged_backend.quantization.fp8 import fp8_linear, quantize_per_row  # noqa: E402

logger = logging.getLogger("fp8_linear")
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (in, out)


def scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, kernel: bool) -> torch.Tensor:
    q, scale = quantize_per_row_triton(x) if kernel else quantize_per_row(x)
    return torch._scaled_mm(q, weight.T, scale_a=scale, scale_b=weight_scale[None, :], out_dtype=x.dtype)


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    import triton.testing

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 256])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    results: dict[str, dict[str, float]] = {}
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q_w, s_w = quantize_per_row(w)
        s_w = s_w[:, 0]
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            err = (fp8_linear(x, q_w, s_w, True).float() - F.linear(x, w).float()).abs().max().item()
            ways = {
                "bf16": lambda x=x, w=w: F.linear(x, w),
                "fp8": lambda x=x, q_w=q_w, s_w=s_w: fp8_linear(x, q_w, s_w, True),
                "fp8_torch_quant": lambda x=x, q_w=q_w, s_w=s_w: scaled_mm(x, q_w, s_w, False),
            }
            row = {way: triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3 for way, fn in ways.items()}
            row["max_err_vs_bf16"] = err
            results[f"{name}_{rows}"] = row
            logger.info("%s, %d rows, µs: %s", name, rows, json.dumps({k: round(v, 2) for k, v in row.items()}))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    main()
