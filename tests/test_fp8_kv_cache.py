"""``kv_cache_dtype="fp8"``: keys and values stored as float8_e4m3fn divided by a scale per KV head.

The oracle is HF's own ``generate`` with an attention function that passes keys and values through the same
fp8 round trip (divide by the head's scale, saturate, cast, cast back, multiply) before attending: what the
cache holds is then exactly what HF attends to, so greedy output must be equal token for token — across
architectures, block boundaries, chunked prefill and preemption by swap (fp8 blocks move as bytes) and by
recompute, with scales of 1 and with a different scale per layer and head. The kernels are checked against
their torch twins on fp8 caches, and against the fp32 twin reading the dequantized cache.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from paged_backend import LLM, SamplingParams
from paged_backend.kernels import tl, triton
from paged_backend.kernels.attention_twin import paged_attention_torch
from paged_backend.kernels.cache_write import (
    head_major,
    new_kv_cache,
    values_transposed,
    write_kv_cache_torch,
    write_kv_cache_triton,
)
from paged_backend.kernels.fp8_quant import FP8_MAX
from paged_backend.kernels.paged_attention import paged_attention_triton
from tests.conftest import assert_idle, hf_greedy, ragged_prompts
from tests.fixtures.fp8_kv import FP8, Scales, fp8_kv_model
from tests.fixtures.tiny_models import build_tiny_model
from tests.test_kernels import DEVICE, DTYPES, TOLERANCE, make_batch, relative_error

GREEDY = SamplingParams(temperature=0, max_tokens=12)  # EOS stops both, as in hf_greedy


def engine_scales(llm: LLM) -> list[tuple[torch.Tensor, torch.Tensor]]:
    scales = llm.llm_engine.executor.model_runner.cache_engine.kv_scales
    assert scales is not None, "an fp8 cache has scales"
    return scales


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "gpt2"])
@pytest.mark.parametrize("per_head_scales", [False, True], ids=["scale-1", "per-head"])
def test_greedy_equals_hf_reading_the_same_fp8_values(tokenizer, arch: str, per_head_scales: bool) -> None:
    llm = LLM(build_tiny_model(arch), tokenizer=tokenizer, kv_cache_dtype="fp8", block_size=4, max_model_len=256)
    scales: Scales = {}
    if per_head_scales:  # distinct per layer and head, small enough that keys use fp8's whole range
        gen = torch.Generator().manual_seed(0)
        for layer, (k_scale, v_scale) in enumerate(engine_scales(llm)):
            k_scale.copy_(torch.rand(k_scale.shape, generator=gen) * 0.02 + 0.005)
            v_scale.copy_(torch.rand(v_scale.shape, generator=gen) * 0.02 + 0.005)
            scales[layer] = (k_scale.clone(), v_scale.clone())
    reference = fp8_kv_model(arch, scales)
    prompts = ragged_prompts(4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, GREEDY.max_tokens), prompt
    assert_idle(llm)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {"max_num_batched_tokens": 8, "max_num_seqs": 8},
        {"num_kv_blocks": 24, "preemption_mode": "swap", "swap_space": 0.01},
        {"num_kv_blocks": 24, "preemption_mode": "recompute"},
    ],
    ids=["chunked", "swap", "recompute"],
)
def test_chunks_and_preemption_keep_the_fp8_values(tokenizer, engine_kwargs: dict) -> None:
    llm = LLM(
        build_tiny_model("llama"), tokenizer=tokenizer, kv_cache_dtype="fp8", block_size=4, max_model_len=64,
        **engine_kwargs,
    )  # fmt: skip
    reference = fp8_kv_model("llama", {})
    prompts = ragged_prompts(4, seed=3)[:6]
    params = SamplingParams(temperature=0, max_tokens=24)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 24), prompt
    if "num_kv_blocks" in engine_kwargs:
        assert llm.stats()["num_preemptions"] > 0
    # the engine's fp8 value caches are stored transposed (kernels/cache_write.py): swapped, copied, read so
    assert all(values_transposed(v) for _, v in llm.llm_engine.executor.model_runner.cache_engine.kv_caches)
    assert_idle(llm)


def test_sleep_and_wake_keep_the_transposed_values(tokenizer) -> None:
    """Sleep gives the cache's memory back and wake allocates it again: the value caches keep their transposed
    layout (their strides, not a contiguous copy), and greedy output equals the fp8 reference after waking."""
    llm = LLM(build_tiny_model("llama"), tokenizer=tokenizer, kv_cache_dtype="fp8", block_size=4, max_model_len=64)
    reference = fp8_kv_model("llama", {})
    prompt = ragged_prompts(1, seed=4)[0]
    expected = hf_greedy(reference, prompt, GREEDY.max_tokens)
    assert llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
    llm.sleep()
    llm.wake_up()
    caches = llm.llm_engine.executor.model_runner.cache_engine.kv_caches
    assert all(values_transposed(v) and v.untyped_storage().nbytes() > 0 for _, v in caches)
    assert llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_the_same_memory_holds_a_token_per_byte_of_element(tokenizer) -> None:
    """An fp8 cache in the memory of an fp32 one holds four times the tokens (twice a bf16 one's)."""
    sizes = {}
    for dtype in ("auto", "fp8"):
        llm = LLM(build_tiny_model("llama"), tokenizer=tokenizer, kv_cache_dtype=dtype, kv_cache_memory_gib=0.01)
        sizes[dtype] = llm.stats()["num_kv_blocks"]
    assert sizes["fp8"] // 4 == sizes["auto"]  # fp32 model: 4 bytes an element against 1 (blocks round down)


def test_kv_cache_dtype_is_checked() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of \\['auto', 'fp8', 'fp8_e4m3'\\]"):
        LLM(build_tiny_model("llama"), kv_cache_dtype="fp8_e5m2")


# ------------------------------------------------------------------------------------------------------ kernels
# how the caches are stored (kernels/cache_write.py): token-major, the values transposed, and as on a GPU (the
# values transposed, the keys head-major)
LAYOUTS = ["values-token-major", "values-transposed", "keys-head-major"]


def scaled_cache(batch: dict, num_kv_heads: int, seed: int, layout: str = LAYOUTS[0]) -> tuple[torch.Tensor, ...]:
    """Turn a batch's caches into fp8 ones with per-head scales (large values saturate), the value cache stored as
    ``layout`` says; returns the scales."""
    gen = torch.Generator().manual_seed(seed)
    k_scale = (torch.rand(num_kv_heads, generator=gen) * 0.01 + 0.002).to(DEVICE)
    v_scale = (torch.rand(num_kv_heads, generator=gen) * 0.01 + 0.002).to(DEVICE)
    for name, scale in (("k_cache", k_scale), ("v_cache", v_scale)):
        values = batch[name].float() / scale[None, None, :, None]
        batch[name] = values.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    if layout != "values-token-major":
        batch["v_cache"] = stored_transposed(batch["v_cache"])
    if layout == "keys-head-major":
        batch["k_cache"] = stored_head_major(batch["k_cache"])
    return k_scale, v_scale


def stored_head_major(cache: torch.Tensor) -> torch.Tensor:
    """``cache``'s values in a key cache stored head-major (the same indices, other strides)."""
    out = new_kv_cache(cache.shape, cache.dtype, cache.device, head_major=True)[0]
    assert head_major(out) and not head_major(cache)
    out.view(torch.uint8).copy_(cache.view(torch.uint8))
    return out


def stored_transposed(cache: torch.Tensor) -> torch.Tensor:
    """``cache``'s values in a value cache of the engine's fp8 layout (the same indices, other strides)."""
    out = new_kv_cache(cache.shape, FP8, cache.device, head_major=False)[1]
    assert values_transposed(out) and not values_transposed(cache)
    out.view(torch.uint8).copy_(cache.view(torch.uint8))
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_attention_kernel_on_an_fp8_cache(dtype: torch.dtype, num_splits: int, layout: str) -> None:
    """Prefill, chunks and decodes (or, split, decodes alone) over fp8 caches with per-head scales: the kernel
    equals the twin, and the twin equals itself reading the dequantized cache with no scales."""
    if num_splits == 1:
        batch = make_batch([1, 33, 7, 1, 16], [40, 0, 9, 15, 16], 8, 2, 64, dtype, 16, seed=5)
    else:
        batch = make_batch([1, 1, 1], [700, 31, 3], 8, 2, 64, dtype, 16, seed=6)
    k_scale, v_scale = scaled_cache(batch, 2, seed=num_splits, layout=layout)
    scale = batch["query"].shape[-1] ** -0.5
    args = (batch["block_tables"], batch["cu_seqlens_q"], batch["context_lens"], scale)
    ref = paged_attention_torch(batch["query"].float(), batch["k_cache"], batch["v_cache"], *args,
                                k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    dequantized = [batch[n].float() * s[None, None, :, None] for n, s in (("k_cache", k_scale), ("v_cache", v_scale))]
    plain = paged_attention_torch(batch["query"].float(), *dequantized, *args)
    assert relative_error(ref, plain) < 1e-6
    poisoned = torch.full_like(batch["query"], float("nan"))
    out = paged_attention_triton(**batch, scale=scale, out=poisoned, num_splits=num_splits,
                                 k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    assert not out.isnan().any() and relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32], ids=["words", "bytes"])
def test_fp8_caches_of_one_token_blocks_as_a_gpu_stores_them(query_dtype: torch.dtype) -> None:
    """Blocks of one token hold no pair of values: a GPU's engine stores both fp8 caches head-major then (values
    not transposed), and the kernel reads them through the key cache's strides: equal to the twin."""
    batch = make_batch([1, 5, 1], [20, 0, 3], 4, 2, 64, torch.float32, 1, seed=41)
    batch["query"] = batch["query"].to(query_dtype)
    k_scale, v_scale = scaled_cache(batch, 2, seed=42)
    stored = new_kv_cache(tuple(batch["k_cache"].shape), FP8, DEVICE, head_major=True)
    assert all(head_major(c) for c in stored) and not values_transposed(stored[1])
    for name, cache in zip(("k_cache", "v_cache"), stored):
        batch[name] = cache.view(torch.uint8).copy_(batch[name].view(torch.uint8)).view(FP8)
    scale = batch["query"].shape[-1] ** -0.5
    args = (batch["block_tables"], batch["cu_seqlens_q"], batch["context_lens"], scale)
    ref = paged_attention_torch(batch["query"].float(), batch["k_cache"], batch["v_cache"], *args,
                                k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    out = paged_attention_triton(**batch, scale=scale, k_scale=k_scale, v_scale=v_scale)
    assert not out.isnan().any() and relative_error(out, ref) < TOLERANCE[query_dtype]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("query_magnitude", [1.0, 6e4])
def test_bf16_queries_over_an_fp8_cache(query_magnitude: float, layout: str) -> None:
    """bf16 queries over an fp8 cache run their dots in fp16 (the queries scaled by 2^-8): equal to the twin,
    also for queries past fp16's range (65504), which would overflow without the scaling. (fp16 dots also run in
    Triton's interpreter, where bf16 ones do not.)"""
    batch = make_batch([1, 33, 7, 1, 16], [300, 0, 9, 15, 130], 8, 2, 64, torch.float32, 16, seed=7)
    batch["query"] = (batch["query"] * query_magnitude / 2).to(torch.bfloat16)  # the largest ~1.2e5 at 6e4
    k_scale, v_scale = scaled_cache(batch, 2, seed=3, layout=layout)
    k_scale = k_scale / query_magnitude  # scores of the same size whatever the queries' magnitude
    scale = batch["query"].shape[-1] ** -0.5
    args = (batch["block_tables"], batch["cu_seqlens_q"], batch["context_lens"], scale)
    ref = paged_attention_torch(batch["query"].float(), batch["k_cache"], batch["v_cache"], *args,
                                k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    out = paged_attention_triton(**batch, scale=scale, k_scale=k_scale, v_scale=v_scale)
    assert batch["query"].abs().max() > 65504 or query_magnitude == 1.0
    assert not out.isnan().any() and relative_error(out, ref) < TOLERANCE[torch.bfloat16]


if triton is not None:
    from paged_backend.kernels.online_softmax import e4m3_pairs_as_fp16

    @triton.jit
    def _pairs_kernel(words_ptr, out_ptr, N: tl.constexpr, CVT: tl.constexpr):
        offs = tl.arange(0, N)
        values = e4m3_pairs_as_fp16(tl.load(words_ptr + offs), CVT)  # [N, 2]
        tl.store(out_ptr + offs[:, None] * 2 + tl.arange(0, 2)[None, :], values)


@pytest.mark.parametrize("cvt", [False, True] if DEVICE.type == "cuda" else [False])  # PTX: a GPU's only
def test_fp8_words_become_fp16_values_exactly(cvt: bool) -> None:
    """The kernel reads an fp8 cache read by fp16 dots as 16-bit words, two values each, made fp16
    (``e4m3_pairs_as_fp16``: by integer arithmetic, or on a GPU by its conversion instruction): every pair of
    finite e4m3 bytes gives its two values exactly (subnormals, the largest values and both zeros included), the
    lower address first."""
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # 0x7F, 0xFF: NaN
    first, second = torch.meshgrid(finite, finite, indexing="ij")
    data = torch.stack([first.flatten(), second.flatten()], dim=1)  # [N, 2] bytes, in memory order
    n = 1 << (data.shape[0] - 1).bit_length()  # a power of two for tl.arange; the extra words repeat the first
    data = torch.cat([data, data[: n - data.shape[0]]]).contiguous()
    out = torch.empty(n, 2, dtype=torch.float16, device=DEVICE)
    _pairs_kernel[(1,)](data.to(DEVICE).view(torch.int16).flatten(), out, N=n, CVT=cvt)
    expected = data.view(FP8).float().to(torch.float16)  # exact: fp16 holds every e4m3 value
    assert torch.equal(out.cpu().view(torch.int16), expected.view(torch.int16))  # bits, so -0.0 counts too


@pytest.mark.parametrize(
    ("num_splits", "options"),
    [(1, {}), (4, {}), (1, {"sliding_window": 24}), (1, {"softcap": 5.0}), (1, {"batch_invariant": True})],
    ids=["whole", "split", "window", "softcap", "invariant"],
)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_queries_over_an_fp8_cache_of_an_odd_head_size(num_splits: int, options: dict, layout: str) -> None:
    """Heads of 80 (padded to 128 in the kernel: the padding's words masked), split and not, with a sliding window,
    a softcap and every tile masked (``batch_invariant``): bf16 queries over an fp8 cache equal the twin."""
    if num_splits == 1:
        batch = make_batch([1, 20, 1], [60, 0, 17], 4, 2, 80, torch.float32, 16, seed=11)
    else:
        batch = make_batch([1, 1], [400, 35], 4, 2, 80, torch.float32, 16, seed=12)
    batch["query"] = batch["query"].to(torch.bfloat16)
    k_scale, v_scale = scaled_cache(batch, 2, seed=13, layout=layout)
    scale = batch["query"].shape[-1] ** -0.5
    args = (batch["block_tables"], batch["cu_seqlens_q"], batch["context_lens"], scale)
    twin_options = {k: v for k, v in options.items() if k != "batch_invariant"}
    ref = paged_attention_torch(batch["query"].float(), batch["k_cache"], batch["v_cache"], *args,
                                k_scale=k_scale, v_scale=v_scale, **twin_options)  # fmt: skip
    out = paged_attention_triton(**batch, scale=scale, k_scale=k_scale, v_scale=v_scale, num_splits=num_splits,
                                 **options)  # fmt: skip
    assert not out.isnan().any() and relative_error(out, ref) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32], ids=["words", "bytes"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_transposed_values_past_the_context_never_count(num_splits: int, query_dtype: torch.dtype) -> None:
    """A transposed value cache is read two tokens a word and a whole tile at a time: where a context ends inside a
    word (odd lengths, blocks of 2) or a tile, the kernel reads slots outside the context (another sequence's, or
    never written) and lets their probability of 0 cancel them. Here every such slot holds fp8's largest value
    (an fp8 cache holds no NaN: ``test_cache_write_to_fp8``), for bf16 queries (words of two) and fp32 ones (bytes):
    the output equals the twin's over the same cache without them."""
    batch = make_batch([1, 9, 1, 1], [40, 0, 10, 301], 4, 2, 64, torch.float32, 2, seed=21)
    batch["query"] = batch["query"].to(query_dtype)
    k_scale, v_scale = scaled_cache(batch, 2, seed=22)
    scale = batch["query"].shape[-1] ** -0.5
    args = (batch["block_tables"], batch["cu_seqlens_q"], batch["context_lens"], scale)
    ref = paged_attention_torch(batch["query"].float(), batch["k_cache"], batch["v_cache"], *args,
                                k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    used = set()
    for row, length in enumerate(batch["context_lens"].tolist()):
        used |= {int(batch["block_tables"][row, t // 2]) * 2 + t % 2 for t in range(length)}
    poison = torch.tensor([s not in used for s in range(batch["v_cache"].shape[0] * 2)], device=DEVICE)
    assert poison.any()
    v_cache = batch["v_cache"].view(torch.uint8).flatten(0, 1).clone()
    v_cache[poison] = 0x7E  # 448
    batch["v_cache"] = stored_transposed(v_cache.view(FP8).view(batch["k_cache"].shape))
    out = paged_attention_triton(**batch, scale=scale, k_scale=k_scale, v_scale=v_scale, num_splits=num_splits)
    assert not out.isnan().any() and relative_error(out, ref) < TOLERANCE[query_dtype]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_write_to_fp8(dtype: torch.dtype, layout: str) -> None:
    """The kernel stores the bytes the twin stores: scaled per head, saturated at 448, padding slots skipped. On
    CPU the inputs are fp8 values times power-of-two scales (doubled, so the largest saturate): Triton's
    interpreter rounds to fp8 wrongly when rounding carries into the exponent (-7.84 becomes -4), which the
    GPU's conversion does not, so only there do arbitrary values and scales go in."""
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 6, 16, 3, 64, 29
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[4] = -1
    scale = torch.tensor([0.5, 0.01, 0.002] if DEVICE.type == "cuda" else [0.5, 2**-7, 2**-9])  # small: saturates
    rows = []
    for _ in range(2):
        x = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 4
        if DEVICE.type == "cpu":  # exactly representable after scaling (doubled: the largest saturate)
            x = (x / scale[None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale[None, :, None] * 2
        rows.append(x.to(DEVICE, dtype))
    rows[0][5, 1, 3] = rows[1][6, 0, 0] = float("nan")  # stored as 0, in keys and values
    scales = [scale.to(DEVICE), scale.to(DEVICE)]
    caches = [torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=FP8, device=DEVICE) for _ in range(5)]
    if layout != "values-token-major":  # the twin and the kernel write transposed value caches; [4] token-major
        caches[1], caches[3] = (stored_transposed(caches[i]) for i in (1, 3))
    if layout == "keys-head-major":  # and head-major key caches
        caches[0], caches[2] = (stored_head_major(caches[i]) for i in (0, 2))
    write_kv_cache_torch(*rows, caches[0], caches[1], slots.to(DEVICE), *scales)
    write_kv_cache_triton(*rows, caches[2], caches[3], slots.to(DEVICE), *scales)
    write_kv_cache_torch(*rows, caches[2].clone(), caches[4], slots.to(DEVICE), *scales)
    for twin, kernel in ((caches[0], caches[2]), (caches[1], caches[3]), (caches[4], caches[3])):
        assert torch.equal(twin.view(torch.uint8), kernel.view(torch.uint8))
    assert caches[0].float().abs().max().item() == FP8_MAX  # saturated, not NaN
    assert not caches[0].float().isnan().any() and not caches[1].float().isnan().any()
    for cache, token, head, dim in ((caches[0], 5, 1, 3), (caches[1], 6, 0, 0)):
        slot = int(slots[token])
        assert cache[slot // block_size, slot % block_size, head, dim].item() == 0.0


def test_calculated_scales_come_from_the_first_step(tokenizer) -> None:
    """``calculate_kv_scales``: the first step's largest key of each head maps to 192, value to 96 (e4m3 values,
    so last-bit noise cannot flip their rounding); every token is then stored with those scales, so greedy equals
    HF reading through them. The first layer's keys are HF's own (later layers' already read fp8 values), so its
    scales are checked exactly."""
    llm = LLM(
        build_tiny_model("llama"), tokenizer=tokenizer, kv_cache_dtype="fp8", calculate_kv_scales=True,
        block_size=4, max_model_len=256,
    )  # fmt: skip
    prompts = ragged_prompts(4, seed=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    scales = {layer: (k.clone(), v.clone()) for layer, (k, v) in enumerate(engine_scales(llm))}
    # The first step held every prompt: their first-layer keys and values, from HF's own forward, give its scales.
    captured: dict[int, list[torch.Tensor]] = {}
    model = build_tiny_model("llama")

    def capture(module, query, key, value, attention_mask, **kwargs):  # type: ignore[no-untyped-def]
        captured.setdefault(module.layer_idx, []).extend([key, value])
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("capture_kv", capture)
    AttentionMaskInterface.register("capture_kv", sdpa_mask)
    model.set_attn_implementation("capture_kv")
    with torch.no_grad():
        for prompt in prompts:
            model(torch.tensor([prompt]))
    keys, values = captured[0][0::2], captured[0][1::2]
    k_max = torch.stack([k[0].abs().amax(dim=(1, 2)) for k in keys]).amax(0)
    v_max = torch.stack([v[0].abs().amax(dim=(1, 2)) for v in values]).amax(0)
    torch.testing.assert_close(scales[0][0], k_max / 192.0)
    torch.testing.assert_close(scales[0][1], v_max / 96.0)
    assert all(bool((k != 1).all() and (v != 1).all()) for k, v in scales.values())
    reference = fp8_kv_model("llama", scales)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, GREEDY.max_tokens), prompt


def test_calculate_kv_scales_needs_an_fp8_cache() -> None:
    with pytest.raises(ValueError, match="calculate_kv_scales needs kv_cache_dtype='fp8'"):
        LLM(build_tiny_model("llama"), calculate_kv_scales=True)
