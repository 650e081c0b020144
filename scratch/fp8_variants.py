"""Scratch: fp8-cache decode attention variants at W1's decode shape (not committed)."""
import importlib, sys, random, re
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
src = Path("paged_backend/kernels/paged_attention.py").read_text()
LOAD_T = '''        if MASKED:
            k = tl.load(
                k_cache_ptr + slots[None, :] + offs_d[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0
            )
        else:
            k = tl.load(k_cache_ptr + slots[None, :] + offs_d[:, None], mask=d_mask[:, None], other=0.0)  # [D, N]
        if SCALED:
            k = k.to(q.dtype)'''
assert LOAD_T in src, "pattern"
LOAD_N = '''        if MASKED:
            k = tl.load(k_cache_ptr + slots[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        else:
            k = tl.load(k_cache_ptr + slots[:, None] + offs_d[None, :], mask=d_mask[None, :], other=0.0)
        if SCALED:
            k = k.to(q.dtype)
        k = tl.trans(k)'''
Q16_A = "        qk_scale = scale\n"
Q16_B = "        qk_scale = scale\n        if SCALED:\n            q = (q * 0.00390625).to(tl.float16)\n            qk_scale = scale * 256.0\n"
assert Q16_A in src
variants = {"v0_now": src, "v1_trans": src.replace(LOAD_T, LOAD_N), "v2_fp16": src.replace(Q16_A, Q16_B),
            "v3_both": src.replace(LOAD_T, LOAD_N).replace(Q16_A, Q16_B)}
for name, text in variants.items():
    Path(f"scratch/pa_{name}.py").write_text(text)
from benchmarks.kernel_sweep import decode_batch, gpu_ms
from paged_backend.kernels.paged_attention import paged_attention_torch
rng = random.Random(0)
ctx = [rng.randint(64, 1024) + rng.randint(0, 256) for _ in range(256)]
for fp8 in (False, True):
    batch = decode_batch(ctx, fp8)
    gb = sum(ctx) * 8 * 128 * 2 * (1 if fp8 else 2) / 1e9
    ref = None
    for name in variants:
        mod = importlib.import_module(f"pa_{name}")
        f = lambda: mod.paged_attention_triton(**batch, scale=0.088)
        out = f().float()
        if ref is None:
            ref = out
        err = ((out - ref).norm() / ref.norm()).item()
        ms = min(gpu_ms(f) for _ in range(3))
        print(f"fp8={fp8} {name}: {ms:.3f} ms ({gb/ms*1e3:.0f} GB/s) rel err vs v0 {err:.2e}", flush=True)
