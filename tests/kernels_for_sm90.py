"""Every Triton kernel of the library compiled for an H100 (sm_90) through its own launcher, on a machine without a
GPU: the suite runs kernels in Triton's interpreter, which compiles nothing, so a kernel that the installed
Triton cannot compile (Triton 3.9 once refused an asynchronous copy of 2-byte words that 3.6 vectorized) would
show only on a GPU. Triton's launch path runs as on a GPU (binder, specializations, compile) under a driver that
names an sm_90 target, and stops before the launch. Run as ``python -m tests.kernels_for_sm90`` without
``TRITON_INTERPRET``; prints one JSON object: each case, "ok" or its error."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def fake_h100() -> None:
    """Triton's active driver made one that names an sm_90 target and launches nothing."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver
    from triton.runtime.jit import JITFunction

    class CompileOnlyDriver(CudaDriver):
        def __init__(self) -> None:  # no libcuda: nothing here talks to a device
            self.utils = None
            self.launcher_cls = None

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

    triton.runtime.driver.set_active(CompileOnlyDriver())
    run = JITFunction.run

    def compile_only(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = compile_only  # type: ignore[method-assign]


def attention(cache_dtype: torch.dtype, q_lens: list[int], contexts: list[int], **options: Any) -> None:
    from paged_backend.kernels.cache_write import new_kv_cache
    from paged_backend.kernels.paged_attention import paged_attention_triton

    k_cache, v_cache = new_kv_cache((64, 16, 8, 128), cache_dtype, "cpu", head_major=True)  # a GPU's storage
    query = torch.zeros(sum(q_lens), 32, 128, dtype=BF16)
    tables = torch.zeros(len(q_lens), 16, dtype=torch.int32)
    cu_seqlens = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    scales = torch.ones(8) if cache_dtype == FP8 else None
    paged_attention_triton(
        query, k_cache, v_cache, tables, cu_seqlens, torch.tensor(contexts, dtype=torch.int32), 0.088,
        k_scale=scales, v_scale=scales, **options,
    )  # fmt: skip


def cache_write(cache_dtype: torch.dtype) -> None:
    from paged_backend.kernels.cache_write import new_kv_cache, write_kv_cache_triton

    k_cache, v_cache = new_kv_cache((64, 16, 8, 128), cache_dtype, "cpu", head_major=True)
    rows = torch.zeros(5, 8, 128, dtype=BF16)
    scales = torch.ones(8) if cache_dtype == FP8 else None
    write_kv_cache_triton(rows, rows, k_cache, v_cache, torch.arange(5), scales, scales)


def awq(rows: int) -> None:
    from paged_backend.kernels.awq_gemm import awq_gemm_triton

    k, n, group = 4096, 4096, 128
    packs = torch.zeros(k, n // 8, dtype=torch.int32)
    zeros = torch.zeros(k // group, n // 8, dtype=torch.int32)
    awq_gemm_triton(torch.zeros(rows, k, dtype=BF16), packs, zeros, torch.ones(k // group, n, dtype=BF16))


def fp8_block(rows: int, block_n: int, block_k: int) -> None:
    from paged_backend.kernels.fp8_block_mm import fp8_block_mm_triton, quantize_per_group

    q, q_scale = quantize_per_group(torch.randn(rows, 4096), block_k)
    scales = torch.ones(-(-1024 // block_n), 4096 // block_k)
    fp8_block_mm_triton(q, q_scale, torch.zeros(1024, 4096, dtype=FP8), scales, block_n, block_k, BF16)


def cases() -> dict[str, Callable[[], Any]]:
    from paged_backend.kernels import greedy, lora, token_rank
    from paged_backend.kernels.awq_gemm import awq_dequantize_triton
    from paged_backend.kernels.fp8_gemv import gemv_triton
    from paged_backend.kernels.fp8_quant import quantize_per_row_triton
    from paged_backend.kernels.rms_norm import rms_norm_triton
    from paged_backend.kernels.row_mean import row_mean_triton

    found: dict[str, Callable[[], Any]] = {
        "attention, bf16 cache, decode": lambda: attention(BF16, [1, 1], [100, 200]),
        "attention, bf16 cache, prefill": lambda: attention(BF16, [64, 1], [64, 200]),
        "attention, bf16 cache, split decode": lambda: attention(BF16, [1], [300], num_splits=4),
        "attention, batch invariant": lambda: attention(BF16, [3, 1], [100, 200], batch_invariant=True),
        "attention, fp8 cache, decode": lambda: attention(FP8, [1, 1], [100, 200]),
        "attention, fp8 cache, prefill": lambda: attention(FP8, [64, 1], [64, 200]),
        "attention, fp8 cache, window": lambda: attention(FP8, [1, 1], [100, 200], sliding_window=32),
        "cache write, bf16": lambda: cache_write(BF16),
        "cache write, fp8": lambda: cache_write(FP8),
        "GEMV, bf16 weights": lambda: gemv_triton(
            torch.zeros(1, 4096, dtype=BF16), torch.zeros(4096, 4096, dtype=BF16)
        ),
        "GEMV, fp8 weights": lambda: gemv_triton(
            torch.zeros(2, 4096, dtype=BF16), torch.zeros(1024, 4096, dtype=FP8), torch.ones(1024)
        ),
        "AWQ dequantize": lambda: awq_dequantize_triton(
            torch.zeros(4096, 512, dtype=torch.int32),
            torch.zeros(32, 512, dtype=torch.int32),
            torch.ones(32, 4096, dtype=BF16),
            BF16,
        ),  # fmt: skip
        "fp8 per-token quantization": lambda: quantize_per_row_triton(torch.zeros(16, 4096, dtype=BF16)),
        "fp8 per-channel product (1 x K blocks)": lambda: fp8_block(16, 1, 4096),
        "RMSNorm": lambda: rms_norm_triton(torch.zeros(4, 4096, dtype=BF16), torch.ones(4096, dtype=BF16), 1e-5),
        "row mean": lambda: row_mean_triton(torch.zeros(4, 4096)),
        "greedy": lambda: greedy.greedy_tokens(torch.zeros(4, 128256, dtype=BF16)),
        "token rank": lambda: token_rank.token_rank(
            torch.zeros(4, 128256, dtype=BF16), torch.zeros(4, dtype=torch.long)
        ),
        "LoRA": lambda: lora.lora_delta_triton(
            torch.zeros(64, 4096, dtype=BF16),
            torch.zeros(2, 16, 4096, dtype=BF16),
            torch.zeros(2, 4096, 16, dtype=BF16),
            torch.zeros(64, dtype=torch.long),
        ),  # fmt: skip
    }
    for rows in (1, 4, 16, 64, 128):  # the GEMV kernel, then tl.dot tiles
        found[f"AWQ GEMM, {rows} rows"] = lambda rows=rows: awq(rows)
    for rows in (1, 16, 64):
        found[f"fp8 block product, {rows} rows"] = lambda rows=rows: fp8_block(rows, 128, 128)
    return found


def main() -> None:
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("run without TRITON_INTERPRET: the interpreter compiles nothing")
    fake_h100()
    results = {}
    for name, case in cases().items():
        try:
            case()
            results[name] = "ok"
        except Exception as error:  # noqa: BLE001 - reported per case
            results[name] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
    print(json.dumps(results))


if __name__ == "__main__":
    main()
