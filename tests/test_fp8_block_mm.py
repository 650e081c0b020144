"""The block-wise FP8 product (``kernels/fp8_block_mm.py``) against its torch twin: ragged shapes, K whole or
split, fp8 dots and fp16 ones on bytes decoded in the kernel, every fp8 value, per-channel scales as blocks of
1 x K, the activations' per-group quantization, and compiled (not interpreted) for GPUs with and without fp8
units."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch

from paged_backend.kernels.fp8_block_mm import (
    BlockLaunch,
    expand_scales,
    fp8_block_mm_torch,
    fp8_block_mm_triton,
    quantize_per_block,
    quantize_per_group,
)
from paged_backend.kernels.fp8_quant import FP8, quantize_per_row
from paged_backend.quantization.fp8_block import CUBLAS_MIN_ROWS, fp8_block_mm_cublas, uses_cublas
from tests.test_fp8_block import BLOCK_K, BLOCK_N, DEVICE, block_quantized


@pytest.mark.parametrize(("m", "n", "k"), [(1, 64, 128), (5, 96, 200), (40, 130, 64), (70, 33, 96)])
@pytest.mark.parametrize("upcast", [False, True])
def test_block_kernel_equals_its_twin(m: int, n: int, k: int, upcast: bool) -> None:
    """Ragged rows, outputs and inputs (partial blocks at every edge), fp8 dots and fp16 ones, K whole or split
    into parts the last program of a tile adds (an element left unwritten shows as garbage against the twin)."""
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen)
    q, scale = quantize_per_group(x, BLOCK_K)
    weight, weight_scale = block_quantized(n, k, gen)
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    args = (q.to(DEVICE), scale.to(DEVICE), weight.to(DEVICE), weight_scale.to(DEVICE), BLOCK_N, BLOCK_K, dtype)
    twin = fp8_block_mm_torch(*args).float()
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    # the default's, one part, K split (unevenly), and warps and stages of a launch's own
    for launch in (None, (16, 32, 1), (32, 64, 2), (16, 64, 3), BlockLaunch(64, 32, 2, num_warps=8, num_stages=2)):
        out = fp8_block_mm_triton(*args, upcast=upcast, launch=launch).float()
        assert not out.isnan().any()
        torch.testing.assert_close(out, twin, rtol=tolerance, atol=tolerance)
    exact = x @ (weight.float() * expand_scales(weight_scale, n, k, BLOCK_N, BLOCK_K)).T  # fp8's rounding away
    assert (twin.cpu() - exact).abs().max() < 0.1 * exact.abs().max()


COMPILE_FOR = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from paged_backend.kernels.fp8_block_mm import _fp8_block_mm_kernel as fn

results = {}
for case in sys.argv[1:]:
    cc, upcast, split = (int(part) for part in case.split(","))
    operand = "*u8" if upcast else "*fp8e4nv"
    signature = dict(zip(fn.arg_names, [operand, "*fp32", operand, "*fp32", "*bf16", "*fp32", "*i32"] + ["i32"] * 7))
    constexprs = dict(BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, UPCAST=upcast)
    constexprs["SPLIT"] = bool(split)
    signature |= dict.fromkeys(constexprs, "constexpr")
    source = ASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    try:
        triton.compile(source, target=GPUTarget("cuda", cc, 32))
        results[case] = "ok"
    except Exception as exc:
        results[case] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
print(json.dumps(results))
"""
COMPILE_CASES = [(90, False, True, True), (80, True, True, True), (80, True, False, True), (80, False, True, False)]


@functools.cache
def compiled_for_targets() -> dict[str, str]:
    """Each case of ``COMPILE_CASES`` compiled in one process without Triton's interpreter: "ok" or the error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cases = [f"{cc},{int(upcast)},{int(split)}" for cc, upcast, split, _ in COMPILE_CASES]
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR, *cases], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("cc", "upcast", "split", "compiles"), COMPILE_CASES)
def test_the_kernel_compiles_for_gpus_with_and_without_fp8_units(
    cc: int, upcast: bool, split: bool, compiles: bool
) -> None:
    """Compiled (not interpreted) for an H100 (sm_90) with fp8 operands, and for an A100 (sm_80), where Triton has
    no fp8 type, with the operands' bytes decoded in the kernel; fp8 operands there fail to compile (what the
    bytes avoid)."""
    result = compiled_for_targets()[f"{cc},{int(upcast)},{int(split)}"]
    assert (result == "ok") == compiles, result


@pytest.mark.parametrize("upcast", [False, True])
def test_every_fp8_value_reaches_the_product_exactly(upcast: bool) -> None:
    """Each of float8_e4m3fn's 254 values (all but its two NaNs: ±0, subnormals, ±448) as a weight, times one
    activation of 1: the output is the value itself, through fp8 dots and through the bytes decoded to fp16."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8)
    values = values[~values.float().isnan()]  # [254]
    weight = torch.zeros(len(values), 32, dtype=FP8)
    weight[:, 0] = values
    q = torch.zeros(1, 32, dtype=FP8)
    q[0, 0] = 1.0
    ones = torch.ones(-(-len(values) // 32), 1)
    out = fp8_block_mm_triton(q.to(DEVICE), torch.ones(1, 1, device=DEVICE), weight.to(DEVICE), ones.to(DEVICE),
                              32, 32, torch.float32, upcast=upcast)  # fmt: skip
    assert torch.equal(out[0].cpu(), values.float())


@pytest.mark.parametrize("upcast", [False, True])
def test_one_scale_per_row_is_a_block_of_all_inputs_and_splits_anywhere(upcast: bool) -> None:
    """Per-channel weights and per-token activations (FP8Linear's scales, ``fp8_scaled_mm``'s kernel) are blocks of
    1 x K: one activation group, so K splits at any step, not only at a block's edge; fp8 dots, or fp16 dots on
    the bytes decoded in the kernel."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(9, 384, generator=gen), torch.randn(40, 384, generator=gen) * 0.1
    (q, scale), (weight, weight_scale) = quantize_per_row(x), quantize_per_row(w)
    args = (q.to(DEVICE), scale.to(DEVICE), weight.to(DEVICE), weight_scale.to(DEVICE), 1, 384, torch.float32)
    twin = fp8_block_mm_torch(*args)
    torch.testing.assert_close(twin.cpu(), (q.float() * scale) @ (weight.float() * weight_scale).T)
    for launch in ((16, 32, 3), (16, 64, 1)):  # 3 parts of 128 inputs
        torch.testing.assert_close(fp8_block_mm_triton(*args, upcast=upcast, launch=launch), twin, rtol=1e-5, atol=1e-5)


def test_per_group_quantization_is_per_row_quantization_of_each_group() -> None:
    """Each group of inputs is a row of ``quantize_per_row``; a short last group is padded with zeros, which move
    no largest magnitude."""
    x = torch.randn(3, 150, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_per_group(x, 64)
    assert q.shape == (3, 150) and scale.shape == (3, 3)
    for g, start in enumerate(range(0, 150, 64)):
        q_row, scale_row = quantize_per_row(x[:, start : start + 64])
        assert torch.equal(scale[:, g : g + 1], scale_row)
        assert torch.equal(q[:, start : start + 64].view(torch.uint8), q_row.view(torch.uint8))


def _cublas_serves() -> bool:
    return torch.cuda.is_available() and uses_cublas(
        torch.empty(CUBLAS_MIN_ROWS, 128, device="cuda"), torch.empty(128, 128, device="cuda"), 128, 128
    )


@pytest.mark.skipif(not hasattr(torch.nn.functional, "scaled_mm"), reason="torch's scaled_mm is torch 2.10's")
@pytest.mark.parametrize(("m", "n", "k"), [(65, 384, 640), (128, 128, 512), (130, 6144, 4096), (257, 4096, 14336)])
def test_cublas_layouts_pass_torchs_own_checks(m: int, n: int, k: int) -> None:
    """On the meta device (no GPU needed) torch checks the block-scaled recipe's shapes and strides as it does
    before calling cuBLAS: the activation scales column-major with rows a multiple of 4, the weight's K blocks a
    multiple of 4. A layout off in either is refused there."""
    meta = {"device": "meta"}
    q, q_scale = torch.empty(m, k, dtype=FP8, **meta), torch.empty(m, k // 128, **meta)
    weight, weight_scale = torch.empty(n, k, dtype=FP8, **meta), torch.empty(n // 128, k // 128, **meta)
    out = fp8_block_mm_cublas(q, q_scale, weight, weight_scale, torch.bfloat16)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="blockwise"):  # the activation scales row-major, as quantized
        rows = m - m % 4
        F = torch.nn.functional
        F.scaled_mm(q[:rows], weight.t(), q_scale[:rows], F.ScalingType.BlockWise1x128,
                    weight_scale.t(), F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)  # fmt: skip


@pytest.mark.parametrize(
    ("m", "k", "dtype"),
    [
        (CUBLAS_MIN_ROWS - 1, 640, torch.bfloat16),
        (CUBLAS_MIN_ROWS, 640, torch.bfloat16),  # rows and K blocks (5) padded
        (128, 512, torch.bfloat16),  # neither padded
        (130, 512, torch.float16),  # rows padded
        (256, 640, torch.float16),  # K blocks padded
    ],
)
def test_cublas_block_product_equals_the_twin_from_its_row_count_on(
    m: int, k: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below ``CUBLAS_MIN_ROWS`` rows the kernel answers, from there on cuBLAS does, its rows and K blocks padded
    to multiples of 4 where they are not and sliced off, in either 16-bit output dtype."""
    if not _cublas_serves():
        pytest.skip("cuBLAS's block-scaled fp8 product needs a Hopper GPU, torch's scaled_mm and CUDA 12.9")
    from paged_backend.quantization import fp8_block

    calls: list[str] = []
    for name in ("fp8_block_mm_cublas", "fp8_block_mm_triton"):
        real = getattr(fp8_block, name)
        monkeypatch.setattr(fp8_block, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    gen = torch.Generator().manual_seed(m + k)
    q, scale = quantize_per_group(torch.randn(m, k, generator=gen), 128)
    weight, weight_scale = quantize_per_block(torch.randn(384, k, generator=gen) * 0.1, 128, 128)
    args = (q.cuda(), scale.cuda(), weight.cuda(), weight_scale.cuda(), 128, 128, dtype)
    out = fp8_block.fp8_block_mm(*args)
    assert calls == ["fp8_block_mm_cublas" if m >= CUBLAS_MIN_ROWS else "fp8_block_mm_triton"]
    assert out.shape == (m, 384) and out.dtype == dtype
    torch.testing.assert_close(out.float(), fp8_block_mm_torch(*args).float(), rtol=2e-2, atol=2e-2)
