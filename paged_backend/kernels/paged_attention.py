"""Paged attention: each sequence's new queries attend to its cached context through its block table.

Query ``j`` of a sequence with ``q_len`` new tokens and ``ctx_len`` tokens in the cache (new ones included)
sits at absolute position ``ctx_len - q_len + j`` and sees keys at positions ``<=`` that (causal), and with a
sliding window ``w`` only keys at positions ``> pos - w`` (transformers' convention). An fp8 cache holds keys
and values divided by a scale per KV head (``k_scale``, ``v_scale``); they are multiplied back as they are read.
The torch twin is kernels/attention_twin.py.
"""

from __future__ import annotations

import torch

from paged_backend.kernels import num_sms, tl, triton
from paged_backend.kernels.arrival import arrival_counters
from paged_backend.kernels.cache_write import check_cache_strides, values_transposed

# ---------------------------------------------------------------------------------------------------- Triton
# One kernel serves prefill, mixed and decode batches. A program owns a tile of BLOCK_Q query tokens of one
# sequence times the G query heads that share one KV head (rows = BLOCK_Q * G_PAD), so each KV tile is loaded
# once per KV head. The kernel finds its sequence by a binary search over ``cu_seqlens_q``; the grid depends
# only on T and B, so it is the same at every replay of a CUDA graph. With SPLIT (decode of long
# contexts with few sequences) each program covers a slice of the context and writes a partial output plus
# its log-sum-exp; the last program of a tile to finish merges the slices (``kernels/arrival.py``).

MAX_SPLITS = 32
MIN_SPLIT_TOKENS = 128  # one decode tile (BLOCK_N) at least: a shorter slice is not worth its merge


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# Arguments that change from step to step are not specialised on (Triton would otherwise compile a new variant
# whenever one of them becomes 1 or a multiple of 16, in the middle of serving).
_VARYING_ARGS = (
    "num_seqs num_splits stride_qt stride_qh stride_bt stride_os stride_ot stride_oh stride_ls stride_lt stride_ft"
    " stride_fh"
)

if triton is not None:
    from paged_backend.kernels.arrival import last_to_arrive
    from paged_backend.kernels.online_softmax import attend_tile, merge_slices

    @triton.jit(do_not_specialize=_VARYING_ARGS.split())
    def _paged_attention_kernel(
        out_ptr,  # [T, H, D] final, or [S, T, H, D] fp32 partials when SPLIT
        lse_ptr,  # [S, T, H] fp32 (SPLIT only)
        final_ptr,  # [T, H, D]: where the last slice's program writes the merged output (SPLIT only)
        counters_ptr,  # [tiles] int32 zeros (``kernels/arrival.py``)
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        k_scale_ptr,  # [Hkv] fp32 (SCALED only)
        v_scale_ptr,
        block_tables_ptr,
        cu_seqlens_q_ptr,
        context_lens_ptr,
        num_seqs,
        num_splits,  # S, at most SPLITS_PAD: a value, not a constant, so that every S shares one compiled kernel
        scale,
        softcap,
        sliding_window,
        stride_qt,
        stride_qh,
        stride_cb,
        stride_cs,
        stride_ch,
        stride_bt,
        stride_os,
        stride_ot,
        stride_oh,
        stride_ls,
        stride_lt,
        stride_ft,
        stride_fh,
        QUERIES_PER_KV: tl.constexpr,
        G_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        SPLIT: tl.constexpr,  # num_splits > 1
        SPLITS_PAD: tl.constexpr,
        MIN_SPLIT: tl.constexpr,
        USE_WINDOW: tl.constexpr,
        USE_SOFTCAP: tl.constexpr,
        IEEE: tl.constexpr,  # fp32 inputs: full-precision dots, not TF32
        SCALED: tl.constexpr,  # an fp8 cache: keys and values are read in the queries' dtype, times their scale
        FP16_DOTS: tl.constexpr,  # SCALED with bf16 queries: the dots run in fp16
        MASK_ALL: tl.constexpr,  # every key tile masked: a row's arithmetic then never depends on its tile's rows
        CVT: tl.constexpr,  # FP16_DOTS: fp8 made fp16 by the GPU's conversion instruction
        VT: tl.constexpr,  # the value cache stored [NB, Hkv, D, BS] (kernels/cache_write.py), block stride stride_cb
    ):
        BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
        pid = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)

        # Sequence of this program: the largest i with cu_seqlens_q[i] // BLOCK_Q + i <= pid.
        lo = pid * 0
        hi = lo + num_seqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid <= pid:
                lo = mid
            else:
                hi = mid - 1
        seq = lo
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        tile_start = (pid - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first query of the tile, within the seq
        ctx_len = tl.load(context_lens_ptr + seq)
        prefix = ctx_len - q_len  # tokens cached before this step's queries

        offs_m = tl.arange(0, BLOCK_M)
        q_tok = tile_start + offs_m // G_PAD  # [M]
        head = kv_head * QUERIES_PER_KV + offs_m % G_PAD  # [M]
        row_valid = (q_tok < q_len) & (offs_m % G_PAD < QUERIES_PER_KV)
        offs_d = tl.arange(0, DIM_PAD)
        d_mask = offs_d < HEAD_DIM
        q = tl.load(
            q_ptr + (q_start + q_tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=row_valid[:, None] & d_mask[None, :],
            other=0.0,
        )  # [M, D]
        q_pos = prefix + q_tok  # [M] absolute positions
        qk_scale = scale
        if SCALED:  # one KV head a program: its scales are two scalars, folded into the scores and the output
            qk_scale = scale * tl.load(k_scale_ptr + kv_head)
        if FP16_DOTS:  # bf16 queries over an fp8 cache, as fp16 times 2^8 (see the launcher)
            q = tl.clamp(q.to(tl.float32) * 0.00390625, -65504.0, 65504.0).to(tl.float16)
            qk_scale = qk_scale * 256.0
            # the cache as 16-bit words (``attend_tile``): its strides, given in bytes, halved here, where Triton
            # still sees them divisible by 8 (given in words, a head of 80 would lose its aligned loads)
            stride_cb = stride_cb // 2
            stride_cs = stride_cs // 2
            stride_ch = stride_ch // 2
        v_head_offset = kv_head * stride_ch
        if VT:
            v_head_offset = kv_head * (HEAD_DIM * BLOCK_SIZE // (2 if FP16_DOTS else 1))

        # Keys this tile can see: [kv_lo, kv_hi). An empty range (tile past q_len) runs no iteration.
        kv_hi = prefix + tl.minimum(tile_start + BLOCK_Q, q_len)
        kv_lo = kv_hi * 0
        if USE_WINDOW:
            kv_lo = tl.maximum(kv_lo, prefix + tile_start - sliding_window + 1)
        kv_lo = (kv_lo // BLOCK_N) * BLOCK_N
        kv_hi = tl.where(tile_start < q_len, kv_hi, kv_lo)
        num_active = 1  # slices with keys (SPLIT)
        if SPLIT:
            per_split = tl.maximum(tl.cdiv(kv_hi - kv_lo, num_splits), MIN_SPLIT)
            per_split = tl.cdiv(per_split, BLOCK_N) * BLOCK_N
            num_active = tl.cdiv(kv_hi - kv_lo, per_split)
            kv_lo = kv_lo + split * per_split
            kv_hi = tl.minimum(kv_hi, kv_lo + per_split)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
        # Key tiles every row of the tile sees whole (below the diagonal, inside the range, no window) skip the
        # mask; the rest (the diagonal, the range's last tile, windowed ranges) are masked.
        full_hi = kv_lo + tl.maximum(tl.minimum(kv_hi, prefix + tile_start + 1) - kv_lo, 0) // BLOCK_N * BLOCK_N
        if USE_WINDOW or MASK_ALL:
            full_hi = kv_lo
        for start_n in range(kv_lo, full_hi, BLOCK_N):
            acc, m_i, l_i = attend_tile(
                acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt, start_n,
                kv_hi, kv_head * stride_ch, v_head_offset, stride_cb, stride_cs, qk_scale, softcap, sliding_window,
                offs_d, d_mask, BLOCK_N, BLOCK_SIZE, False, USE_WINDOW, USE_SOFTCAP, IEEE, SCALED, FP16_DOTS, HEAD_DIM,
                DIM_PAD, CVT, VT,
            )  # fmt: skip
        for start_n in range(full_hi, kv_hi, BLOCK_N):
            acc, m_i, l_i = attend_tile(
                acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt, start_n,
                kv_hi, kv_head * stride_ch, v_head_offset, stride_cb, stride_cs, qk_scale, softcap, sliding_window,
                offs_d, d_mask, BLOCK_N, BLOCK_SIZE, True, USE_WINDOW, USE_SOFTCAP, IEEE, SCALED, FP16_DOTS, HEAD_DIM,
                DIM_PAD, CVT, VT,
            )  # fmt: skip

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if SCALED:
            out = out * tl.load(v_scale_ptr + kv_head)
        token = (q_start + q_tok).to(tl.int64)
        out_mask = row_valid[:, None] & d_mask[None, :]
        if SPLIT:
            if num_active <= 1:  # one slice holds the whole context (or there is none): it writes the output
                if split == 0:
                    dst = token[:, None] * stride_ft + head[:, None] * stride_fh + offs_d[None, :]
                    tl.store(final_ptr + dst, out.to(final_ptr.dtype.element_ty), mask=out_mask)
            elif split < num_active:  # slices past the context have no keys and no part
                dst = split * stride_os + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
                tl.store(out_ptr + dst, out, mask=out_mask)
                lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))  # log2 domain
                tl.store(lse_ptr + split * stride_ls + token * stride_lt + head, lse, mask=row_valid)
                if last_to_arrive(counters_ptr + pid * tl.num_programs(1) + kv_head, num_active):
                    merge_slices(
                        out_ptr, lse_ptr, final_ptr, token, head, row_valid, out_mask, offs_d, num_active,
                        stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_ft, stride_fh,
                        BLOCK_M, DIM_PAD, SPLITS_PAD,
                    )  # fmt: skip
        else:
            dst = token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
            tl.store(out_ptr + dst, out.to(out_ptr.dtype.element_ty), mask=out_mask)


def choose_num_splits(num_seqs: int, num_tokens: int, num_kv_heads: int, device: torch.device) -> int:
    """Split the context only for decode-only batches too small to fill the GPU: aim for two programs per SM.
    Short contexts still take one slice (MIN_SPLIT_TOKENS is enforced in the kernel)."""
    if num_tokens != num_seqs or device.type != "cuda":
        return 1
    programs = num_seqs * num_kv_heads
    target = 2 * num_sms(device)
    return max(1, min(MAX_SPLITS, _next_pow2(-(-target // programs))))


def _tiles(decode: bool, g_pad: int, dim_pad: int, fp16_words: bool = False) -> tuple[int, int, dict[str, int]]:
    """(BLOCK_Q, BLOCK_N, launch options). A tile holds BLOCK_Q tokens x ``g_pad`` grouped heads of queries.
    Decode has one query a sequence, so its tiles take the 16 rows ``tl.dot`` needs at least and long key tiles,
    streaming the cache; prefill tiles hold 64 rows, each key tile reused by all of them. An fp8 cache read by
    bf16 queries (``fp16_words``: as 16-bit words) takes shorter decode tiles: converted in registers, a 64-key
    tile keeps fewer values live and two stages in flight suffice (``kernel_sweep.py --caches fp8``). 256-wide
    heads take short key tiles, so that K and V fit in shared memory. ``benchmarks/kernel_sweep.py`` times the
    alternatives."""
    rows, block_n, tuning = (16, 128, {"num_warps": 4, "num_stages": 3}) if decode else (64, 64, {"num_stages": 2})
    if decode and fp16_words:
        block_n, tuning = 64, {"num_warps": 4, "num_stages": 2}
    if dim_pad >= 256:
        block_n = 32
    return max(1, rows // g_pad), block_n, tuning


def paged_attention_triton(
    query: torch.Tensor,  # [T, H, D], last dim contiguous
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D], stored as kernels/cache_write.new_kv_cache stores it
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D], with the key cache's strides or stored transposed
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32, cached + new tokens
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # [T, H, D], written in place when given
    k_scale: torch.Tensor | None = None,  # [Hkv] fp32, fp8 caches only
    v_scale: torch.Tensor | None = None,  # [Hkv] fp32, fp8 caches only
    batch_invariant: bool = False,
) -> torch.Tensor:  # [T, H, D]
    """Triton twin of ``attention_twin.paged_attention_torch``; no host synchronisation, grid fixed by (T, B).
    ``num_splits`` (slices of the context, decode only) defaults to :func:`choose_num_splits`, which splits only on
    a GPU that the batch leaves idle; a given number splits anywhere.

    ``batch_invariant``: a query's result is the same bits whatever its step holds: every step takes the decode
    tiles (decode dominates generation), one context slice and the mask on every key tile (whether a tile is
    masked depends on its first query, so on the chunking; an unmasked tile may compile to other instructions).

    bf16 queries over an fp8 cache run their dots in fp16: fp8 converts to fp16 in one instruction and to bf16
    only through fp32, which made the fp8 kernel slower than the bf16 one. fp16 holds every fp8 value and the
    probabilities exactly; the queries go in as ``q / 2^8`` (scores times 2^8), so the range reaches 1.7e7
    (larger queries are clamped) and a query element loses at most 2^-17 in absolute terms, far below bf16's
    own rounding of any element that matters to a score. The caches go in as 16-bit words, two values each, made
    fp16 in registers (``attend_tile``): a conversion of the fp8 tile itself runs in the dot's operand layout, which
    reads the tile from shared memory a byte at a time."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = block_tables.shape[0]
    num_kv_heads = k_cache.shape[2]
    queries_per_kv = num_heads // num_kv_heads
    if query.stride(-1) != 1:
        query = query.contiguous()
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    fp16_dots = k_scale is not None and query.dtype == torch.bfloat16
    # fp8 caches read by fp16 dots go in as 16-bit words, two values each (``attend_tile``), strides in words
    if fp16_dots and not (k_cache.dtype == v_cache.dtype == torch.float8_e4m3fn):
        raise ValueError(f"scaled caches are float8_e4m3fn, got {k_cache.dtype} and {v_cache.dtype}")
    check_cache_strides(k_cache, v_cache)
    transposed = values_transposed(v_cache)
    values = v_cache.permute(0, 2, 3, 1) if transposed else v_cache  # its storage's order, for the word view
    caches = (k_cache.view(torch.int16), values.view(torch.int16)) if fp16_dots else (k_cache, v_cache)
    if batch_invariant:
        num_splits = 1
    elif num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_tokens, num_kv_heads, query.device)
    elif not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be between 1 and {MAX_SPLITS}, got {num_splits}")
    g_pad = _next_pow2(queries_per_kv)
    dim_pad = _next_pow2(head_dim)
    block_q, block_n, tuning = _tiles(num_tokens == num_seqs or batch_invariant, g_pad, dim_pad, fp16_dots)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    if num_splits > 1:
        partial = torch.empty((num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=query.device)
        lse = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32, device=query.device)
        target, stride_os, stride_ls, stride_lt = partial, partial.stride(0), lse.stride(0), lse.stride(1)
        stride_ot, stride_oh = partial.stride(1), partial.stride(2)
    else:
        target, lse, stride_os, stride_ls, stride_lt = out, out, 0, 0, 0
        stride_ot, stride_oh = out.stride(0), out.stride(1)
    _paged_attention_kernel[grid](
        target,
        lse,
        out,
        arrival_counters(query.device, grid[0] * grid[1]),
        query,
        *caches,
        context_lens if k_scale is None else k_scale,  # not read unless SCALED
        context_lens if v_scale is None else v_scale,
        block_tables,
        cu_seqlens_q,
        context_lens,
        num_seqs,
        num_splits,
        float(scale),
        float(softcap or 0.0),
        int(sliding_window or 0),
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),  # in elements (bytes, for an fp8 cache)
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        stride_os,
        stride_ot,
        stride_oh,
        stride_ls,
        stride_lt,
        out.stride(0),
        out.stride(1),
        QUERIES_PER_KV=queries_per_kv,
        G_PAD=g_pad,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_N=block_n,
        BLOCK_SIZE=k_cache.shape[1],
        SPLIT=num_splits > 1,
        SPLITS_PAD=MAX_SPLITS if num_splits > 1 else 1,
        MIN_SPLIT=MIN_SPLIT_TOKENS,
        USE_WINDOW=bool(sliding_window),
        USE_SOFTCAP=bool(softcap),
        IEEE=query.dtype == torch.float32,
        SCALED=k_scale is not None,
        FP16_DOTS=fp16_dots,
        CVT=fp16_dots and query.is_cuda,  # the interpreter (CPU tensors) runs no PTX
        MASK_ALL=batch_invariant,
        VT=transposed,
        **tuning,
    )
    return out
