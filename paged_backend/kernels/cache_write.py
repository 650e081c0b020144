"""Cache write: store the new tokens' k/v into their paged slots (``slot = block_id * block_size + offset``).

A negative slot means "padding, write nothing": CUDA-graph batches are padded up to their bucket size. An fp8
cache stores ``k / k_scale`` (a scale per KV head), saturated to the format's largest value, and NaN as 0 (keys
too, for one rule): the attention kernel reads an fp8 value tile whole, slots past a sequence's context
included, and lets their probability of 0 cancel them, which a NaN would not (another request's NaN must not
reach this one).

Both caches are indexed ``[block, offset, head, dim]``; what lies where in memory is the caches' strides, which
every kernel takes (``new_kv_cache``). On a GPU the caches are stored head-major, ``[block, head, offset, dim]``:
decode attention reads one KV head's tokens of a block, and head-major they are one contiguous run of ``block_size *
dim`` elements instead of ``block_size`` runs of ``dim`` (``benchmarks/kernel_sweep.py``: its ``bf16`` and ``fp8``
cases against ``bf16_token_major`` and ``fp8_keys_token_major``). An fp8 value cache with blocks of an even number
of tokens is stored ``[block, head, dim, offset]``: the attention kernel reads an fp8 cache as 16-bit words of two
values and hands them to the tensor cores as they are, which take pairs along the product's reduction: the head
dimension for q·kᵀ (the key cache's words), the tokens for p·v (the value words of this layout). Stored like keys,
each converted value tile would pass through shared memory once more to be paired along the tokens. A CPU keeps both
token-major, where the torch twin gathers whole ``[head, dim]`` rows.
"""

from __future__ import annotations

import torch

from paged_backend.kernels import tl, triton
from paged_backend.kernels.fp8_quant import FP8_MAX


def quantize_kv_torch(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``x`` [T, Hkv, D] as the cache stores it: divided by its head's scale and saturated when scaled."""
    if scale is None:
        return x.to(dtype)
    return (x.float() / scale[None, :, None]).nan_to_num(nan=0.0).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def new_kv_cache(
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: torch.device | str,
    head_major: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's (key, value) cache of ``shape`` ``[num_blocks, block_size, Hkv, D]``, zeros; stored
    ``[num_blocks, Hkv, block_size, D]`` when ``head_major`` (default: on a GPU), and an fp8 value cache (blocks of
    an even number of tokens) stored ``[num_blocks, Hkv, D, block_size]`` (``values_transposed``)."""
    _, block_size, num_kv_heads, head_dim = shape
    strides = (block_size * num_kv_heads * head_dim, num_kv_heads * head_dim, head_dim, 1)
    if torch.device(device).type == "cuda" if head_major is None else head_major:
        strides = _head_major_strides(shape)
    key = torch.empty_strided(shape, strides, dtype=dtype, device=device).zero_()
    if dtype == torch.float8_e4m3fn and shape[1] % 2 == 0:  # the kernel reads two tokens a word
        strides = _transposed_strides(shape)
    return key, torch.empty_strided(shape, strides, dtype=dtype, device=device).zero_()


def _head_major_strides(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """The strides of ``[num_blocks, block_size, Hkv, D]`` stored ``[num_blocks, Hkv, block_size, D]``."""
    _, block_size, num_kv_heads, head_dim = shape
    return (num_kv_heads * block_size * head_dim, head_dim, block_size * head_dim, 1)


def _transposed_strides(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """The strides of ``[num_blocks, block_size, Hkv, D]`` stored ``[num_blocks, Hkv, D, block_size]``."""
    _, block_size, num_kv_heads, head_dim = shape
    return (num_kv_heads * head_dim * block_size, 1, head_dim * block_size, block_size)


def values_transposed(v_cache: torch.Tensor) -> bool:
    """Whether ``v_cache`` (``[num_blocks, block_size, Hkv, D]``) is stored ``[num_blocks, Hkv, D, block_size]``."""
    return v_cache.shape[1] % 2 == 0 and v_cache.stride() == _transposed_strides(tuple(v_cache.shape))


def head_major(cache: torch.Tensor) -> bool:
    """Whether ``cache`` (``[num_blocks, block_size, Hkv, D]``) is stored ``[num_blocks, Hkv, block_size, D]``."""
    return cache.stride() == _head_major_strides(tuple(cache.shape))


def write_kv_cache_torch(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
    k_scale: torch.Tensor | None = None,  # [Hkv] fp32, fp8 caches only
    v_scale: torch.Tensor | None = None,  # [Hkv] fp32, fp8 caches only
) -> None:
    """Reference twin: an ``index_copy_`` over the flattened (block, offset) axis (of the bytes: CPU torch has
    no ``index_copy_`` for fp8); a cache stored otherwise (head-major, values transposed) by indexing its blocks
    and offsets."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    for cache, new, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
        rows = quantize_kv_torch(new, scale, cache.dtype).view(torch.uint8)
        if cache.is_contiguous():
            cache.view(-1, *cache.shape[2:]).view(torch.uint8).index_copy_(0, slot_mapping, rows)
        else:
            block_size = cache.shape[1]
            cache.view(torch.uint8)[slot_mapping // block_size, slot_mapping % block_size] = rows


if triton is not None:

    @triton.jit(do_not_specialize=["stride_kt", "stride_kh", "stride_vt", "stride_vh"])
    def _write_kv_cache_kernel(
        key_ptr,
        value_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_mapping_ptr,
        k_scale_ptr,
        v_scale_ptr,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_cb,
        stride_cs,
        stride_ch,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEADS_PAD: tl.constexpr,
        DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        SCALED: tl.constexpr,  # an fp8 cache: divide by each head's scale, saturate
        VT: tl.constexpr,  # the value cache stored [NB, Hkv, D, BS] (``values_transposed``)
    ):
        """One program per token: its [Hkv, D] k and v rows go to one cache slot."""
        token = tl.program_id(0)
        slot = tl.load(slot_mapping_ptr + token)
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = tl.arange(0, HEADS_PAD)
        dims = tl.arange(0, DIM_PAD)
        # A padding token (slot -1) writes nothing: its mask is false everywhere.
        limit = tl.where(slot >= 0, NUM_KV_HEADS, 0)
        mask = (heads[:, None] < limit) & (dims[None, :] < HEAD_DIM)
        k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
        v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
        dst = block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch + dims[None, :]
        v_dst = dst
        if VT:
            v_dst = block * stride_cb + heads[:, None] * (HEAD_DIM * BLOCK_SIZE) + dims[None, :] * BLOCK_SIZE + offset
        if SCALED:
            k_scale = tl.load(k_scale_ptr + heads, mask=heads < NUM_KV_HEADS, other=1.0)
            v_scale = tl.load(v_scale_ptr + heads, mask=heads < NUM_KV_HEADS, other=1.0)
            # IEEE division (Triton's `/` is approximate), so the stored fp8 value is the twin's
            k = tl.div_rn(k.to(tl.float32), k_scale[:, None])
            v = tl.div_rn(v.to(tl.float32), v_scale[:, None])
            k = tl.clamp(tl.where(k == k, k, 0.0), -448.0, 448.0)  # NaN as 0; FP8_MAX
            v = tl.clamp(tl.where(v == v, v, 0.0), -448.0, 448.0)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(
    key: torch.Tensor,  # [T, Hkv, D], last dim contiguous
    value: torch.Tensor,  # [T, Hkv, D], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], as new_kv_cache stores it
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], the key cache's strides or stored transposed (fp8)
    slot_mapping: torch.Tensor,  # [T] int64
    k_scale: torch.Tensor | None = None,  # [Hkv] fp32, fp8 caches only
    v_scale: torch.Tensor | None = None,  # [Hkv] fp32, fp8 caches only
) -> None:
    """Triton twin of :func:`write_kv_cache_torch` (no host sync; negative slots are skipped)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        key, value = key.contiguous(), value.contiguous()
    check_cache_strides(k_cache, v_cache)
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        slot_mapping if k_scale is None else k_scale,  # not read unless SCALED
        slot_mapping if v_scale is None else v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        SCALED=k_scale is not None,
        VT=values_transposed(v_cache),
    )


def check_cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The kernels address a value cache by the key cache's strides (its block stride too, when it is stored
    transposed), so the key cache must be stored whole, token-major or head-major, as ``new_kv_cache`` stores it."""
    keys_whole = k_cache.is_contiguous() or head_major(k_cache)
    if not keys_whole or not (values_transposed(v_cache) or v_cache.stride() == k_cache.stride()):
        raise ValueError(
            f"caches as new_kv_cache makes them: key strides {k_cache.stride()} (token-major or head-major), value "
            f"strides {v_cache.stride()} (the same, or an fp8 value cache's transposed ones)"
        )
