"""kernels/compile_ahead.py: under ``compiling_ahead`` launches become compiles in a thread pool, one per
specialization, waited for (and their failures raised) on leaving; outside it a launch is ``kernel[grid]``."""

from __future__ import annotations

import threading

import pytest
import torch

from paged_backend.kernels import compile_ahead


class FakeKernel:
    """Records launches (``kernel[grid](...)``) and compiles (``warmup``), with the thread each ran on."""

    def __init__(self, fail: bool = False) -> None:
        self.launched: list[tuple] = []
        self.compiled: list[tuple] = []
        self.threads: set[int] = set()
        self.fail = fail

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched.append((grid, args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        self.threads.add(threading.get_ident())
        if self.fail:
            raise RuntimeError("the compile failed")
        self.compiled.append((grid, args, kwargs))
        return object()


def test_launches_outside_are_launches() -> None:
    kernel = FakeKernel()
    assert not compile_ahead.deferring()
    compile_ahead.launch(kernel, (2, 1, 1))(torch.zeros(4), 7, BLOCK=16)
    assert len(kernel.launched) == 1 and not kernel.compiled


def test_launches_inside_are_compiles_one_per_specialization() -> None:
    """Rows 32 and 48 (both multiples of 16) and the same constexprs make one compile; 1, 3 and another BLOCK each
    their own; nothing is launched, and the compiles ran on the pool's threads."""
    kernel = FakeKernel()
    x = torch.zeros(64)
    with compile_ahead.compiling_ahead(torch.device("cpu"), workers=2) as ahead:
        assert compile_ahead.deferring() and not ahead.compiles  # capture_buckets' pass stops on none
        for rows, block in ((32, 16), (48, 16), (1, 16), (3, 16), (32, 32)):
            compile_ahead.launch(kernel, (rows, 1, 1))(x, rows, BLOCK=block)
        assert len(ahead.compiles) == 4
    assert not compile_ahead.deferring()
    assert not kernel.launched
    assert sorted((args[1], kwargs["BLOCK"]) for _, args, kwargs in kernel.compiled) == [
        (1, 16), (3, 16), (32, 16), (32, 32)
    ]  # fmt: skip
    assert threading.get_ident() not in kernel.threads


def test_a_failed_compile_is_raised_on_leaving() -> None:
    with pytest.raises(RuntimeError, match="the compile failed"):
        with compile_ahead.compiling_ahead(torch.device("cpu"), workers=1):
            compile_ahead.launch(FakeKernel(fail=True), (1,))(torch.zeros(1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton compiles for a GPU")
def test_int4_launches_compiled_ahead_compute_nothing_then_the_twins_result() -> None:
    """The int4 GEMM's paths (the GEMV at 1 and 3 rows, the ``tl.dot`` kernel at 24, the dequantize kernel and
    cuBLAS at 200): under ``compiling_ahead`` each returns zeros of its output's shape (no kernel ran); after it,
    the twin's result."""
    from paged_backend.kernels.awq_gemm import awq_gemm, awq_gemm_torch
    from paged_backend.quantization.rtn import pack_linear

    torch.manual_seed(0)
    packed = pack_linear(torch.randn(384, 256, device="cuda") * 0.02, 128)  # [out, in]
    xs = [torch.randn(rows, 256, device="cuda", dtype=torch.float16) for rows in (1, 3, 24, 200)]
    with compile_ahead.compiling_ahead(torch.device("cuda")):
        for x in xs:
            out = awq_gemm(x, *packed)
            assert out.shape == (x.shape[0], 384) and not out.any()
    for x in xs:
        torch.testing.assert_close(awq_gemm(x, *packed), awq_gemm_torch(x, *packed), rtol=2e-2, atol=2e-3)
