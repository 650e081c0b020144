"""The benchmark scripts' own copies of the paged attention launch stay in step with the kernel: ``kernel_sweep``'s
``launch`` (every setting exposed) gives the library launcher's output, over a bf16-style and an fp8 cache, and
``attention_sass`` still compiles the kernel for sm_90: a kernel argument added without them breaks both, and
otherwise only a GPU run would tell. And every kernel still compiles for sm_90 with the installed Triton."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import benchmarks.kernel_sweep as kernel_sweep
from paged_backend.kernels.paged_attention import paged_attention_triton
from tests.test_fp8_kv_cache import scaled_cache
from tests.test_kernels import TOLERANCE, make_batch, relative_error, stored_head_major


@pytest.mark.parametrize("fp8", [False, True], ids=["plain cache", "fp8 cache"])
def test_kernel_sweep_launches_as_the_library_does(fp8: bool) -> None:
    """On caches stored as a GPU's engine stores them (head-major; an fp8 cache's values transposed)."""
    batch = make_batch([1, 1, 1], [70, 31, 3], 8, 2, 64, torch.float32, 16, seed=31)  # a decode step
    scales: dict[str, torch.Tensor] = {}
    if fp8:
        batch["query"] = batch["query"].to(torch.bfloat16)
        scales = dict(zip(("k_scale", "v_scale"), scaled_cache(batch, 2, 32, "keys-head-major"), strict=True))
    else:
        batch = stored_head_major(batch)
    expected = paged_attention_triton(**batch, scale=0.125, **scales)
    out = kernel_sweep.launch(**batch, scale=0.125, **scales)
    assert relative_error(out, expected) < TOLERANCE[batch["query"].dtype]


def test_attention_sass_still_compiles_the_kernel(tmp_path) -> None:
    """Compiled as the script compiles it, in a process of its own: the tests' Triton interprets kernels."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "attention_sass.py"
    done = subprocess.run(
        [sys.executable, str(script), "--json", str(tmp_path / "sass.json")], env=env, capture_output=True, text=True
    )
    if done.returncode != 0 and "ptxas" in done.stderr:
        pytest.skip("this Triton wheel has no ptxas")
    assert done.returncode == 0, done.stderr[-2000:]
    caches = json.loads((tmp_path / "sass.json").read_text())["caches"]
    assert caches["bf16"]["registers"] > 0 and caches["fp8"]["instructions"] > 0


def test_every_kernel_compiles_for_an_h100(tmp_path) -> None:
    """Each kernel through its own launcher, compiled for sm_90 by the installed Triton (tests/kernels_for_sm90.py),
    in a process of its own without the interpreter, and a cold cache (a cached kernel would not compile again)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernels_for_sm90"], cwd=root, env=env, capture_output=True, text=True
    )
    if done.returncode != 0 and "ptxas" in done.stderr:
        pytest.skip("this Triton wheel has no ptxas")
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) >= 25 and {name: r for name, r in results.items() if r != "ok"} == {}
