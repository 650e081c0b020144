"""The online softmax's two pieces, shared by the paged attention kernel: one key tile folded into a running
``(acc, m, l)`` — masked only where a row may not see every key of the tile — and the merge of context slices
computed by separate programs (split-KV decode)."""

from __future__ import annotations

from paged_backend.kernels import tl, triton

if triton is not None:

    @triton.jit
    def e4m3_bits_as_fp16(b):
        """fp8 e4m3 values given as their bits (int32, 0..255), as fp16 values 2^-8 times as large, exactly: the
        sign moves to bit 15, exponent and mantissa to bits 7..14 (fp16's exponent bias is e4m3's plus 8, so the
        same exponent field means 2^-8 times the value; subnormals map to subnormals alike). The NaN byte, which a
        cache never holds, becomes a finite value."""
        return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)

    @triton.jit
    def e4m3_pairs_as_fp16(words, CVT: tl.constexpr):
        """16-bit words of two e4m3 bytes each, as their fp16 values (exact): ``[..., 2]``, the first byte (the lower
        address) first. ``CVT``: by the GPU's own conversion (one instruction a pair, sm_89 and later), else by
        integer arithmetic (``e4m3_bits_as_fp16``; Triton's interpreter runs no PTX)."""
        if CVT:
            both = tl.inline_asm_elementwise(
                "cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h", [words], dtype=tl.int32, is_pure=True, pack=1
            )  # the first byte's value in the lower half
            lo = (both & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
            hi = (both >> 16).to(tl.int16).to(tl.float16, bitcast=True)
            return tl.join(lo, hi)
        w = words.to(tl.int32) & 0xFFFF
        lo = (e4m3_bits_as_fp16(w & 0xFF).to(tl.float32) * 256.0).to(tl.float16)
        hi = (e4m3_bits_as_fp16(w >> 8).to(tl.float32) * 256.0).to(tl.float16)
        return tl.join(lo, hi)

    @triton.jit
    def load_transposed_values(
        v_cache_ptr,
        table_ptr,
        start_n,
        kv_hi,
        n_mask,  # [N]
        blocks,  # [N] each key's block
        v_head_offset,
        stride_cb,
        offs_d,
        d_mask,
        BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        MASKED: tl.constexpr,
        BYTES: tl.constexpr,
        DIM_PAD: tl.constexpr,
        CVT: tl.constexpr,
    ):
        """A tile's values ``[N, D]`` from a value cache stored ``[NB, Hkv, D, BS]`` (strides in words when
        ``BYTES``). ``BYTES``: ``[N/2, D]`` words, each two consecutive tokens' values of one dimension (a block holds
        an even number of tokens), made ``[N/2, D, 2]`` fp16 values, then ``[N/2, 2, D]``: row ``2i + j`` is token
        ``2i + j`` of the tile, the pairs already along the tokens, where p·v's operand wants them."""
        if BYTES:
            # pair i holds tokens 2i and 2i + 1. A run of RUN pairs lies in one block, its words contiguous: the
            # tile is loaded as [runs, D, RUN], so that the contiguity the loads' vectorization needs is the
            # shape's own, then laid out [N/2, D]
            RUN: tl.constexpr = BLOCK_SIZE // 2 if BLOCK_SIZE < BLOCK_N else BLOCK_N // 2
            first = start_n // 2 + RUN * tl.arange(0, BLOCK_N // (2 * RUN))  # each run's first pair
            if MASKED:  # a run past the range reads the range's last block
                run_blocks = tl.load(table_ptr + tl.minimum(first // (BLOCK_SIZE // 2), (kv_hi - 1) // BLOCK_SIZE))
            else:
                run_blocks = tl.load(table_ptr + first // (BLOCK_SIZE // 2))
            base = run_blocks.to(tl.int64) * stride_cb + v_head_offset + first % (BLOCK_SIZE // 2)
            offs_r = tl.arange(0, RUN)
            # unmasked along the pairs, so that the loads stay vectorized and the values keep the conversion's
            # layout up to the product: a token past the range (a pair's second, or one of the range's last
            # block) is a finite value (a scaled fp8 cache holds no NaN: kernels/cache_write.py) that its
            # probability of 0 cancels
            words = tl.load(
                v_cache_ptr + base[:, None, None] + offs_d[None, :, None] * (BLOCK_SIZE // 2) + offs_r[None, None, :],
                mask=d_mask[None, :, None],
                other=0,
            )
            words = tl.reshape(tl.permute(words, (0, 2, 1)), (BLOCK_N // 2, DIM_PAD))
            v = tl.reshape(tl.permute(e4m3_pairs_as_fp16(words, CVT), (0, 2, 1)), (BLOCK_N, DIM_PAD))
        else:
            base = blocks.to(tl.int64) * stride_cb + v_head_offset + (start_n + tl.arange(0, BLOCK_N)) % BLOCK_SIZE
            v_mask = n_mask[:, None] & d_mask[None, :] if MASKED else d_mask[None, :]
            v = tl.load(v_cache_ptr + base[:, None] + offs_d[None, :] * BLOCK_SIZE, mask=v_mask, other=0.0)
        return v

    @triton.jit
    def attend_tile(
        acc,
        m_i,
        l_i,
        q,  # [M, D]
        q_pos,  # [M] absolute positions
        k_cache_ptr,
        v_cache_ptr,
        table_ptr,  # this sequence's block table
        start_n,
        kv_hi,
        head_offset,
        v_head_offset,  # VT: the value cache's head offset (else ``head_offset``)
        stride_cb,
        stride_cs,
        qk_scale,
        softcap,
        sliding_window,
        offs_d,
        d_mask,
        BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        MASKED: tl.constexpr,  # False: every row sees every key of the tile, which lies inside [kv_lo, kv_hi)
        USE_WINDOW: tl.constexpr,
        USE_SOFTCAP: tl.constexpr,
        IEEE: tl.constexpr,
        SCALED: tl.constexpr,
        BYTES: tl.constexpr,  # an fp8 cache given as 16-bit words (strides in words), read as fp16
        HEAD_DIM: tl.constexpr,  # BYTES only
        DIM_PAD: tl.constexpr,  # BYTES only
        CVT: tl.constexpr,  # BYTES: the GPU's conversion instruction (``e4m3_pairs_as_fp16``)
        VT: tl.constexpr,  # the value cache stored [NB, Hkv, D, BS] (kernels/cache_write.py)
    ):
        """One key tile of the online softmax: ``(acc, m_i, l_i)`` updated, scores in the log2 domain.

        ``BYTES``: an fp8 cache is read as 16-bit words, two values each, made fp16 (``e4m3_pairs_as_fp16``) and
        split in registers (``tl.join``, then the pairs laid out along the head dimension). A conversion of the fp8
        tile itself (``to(tl.float16)``, or integer arithmetic on its bytes) is moved by Triton into the dot's operand
        layout, which reads the tile from shared memory a byte at a time."""
        LOG2E: tl.constexpr = 1.4426950408889634
        offs_n = start_n + tl.arange(0, BLOCK_N)  # [N]
        n_mask = offs_n < kv_hi
        if MASKED:
            blocks = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
        else:
            blocks = tl.load(table_ptr + offs_n // BLOCK_SIZE)
        slots = blocks.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs + head_offset
        if BYTES:  # [D/2, N] words, then [D/2, 2, N] values: row 2i + j is byte j of word i
            offs_p = tl.arange(0, DIM_PAD // 2)
            p_mask = offs_p < HEAD_DIM // 2
            k_mask = p_mask[:, None] & n_mask[None, :] if MASKED else p_mask[:, None]
            words = tl.load(k_cache_ptr + slots[None, :] + offs_p[:, None], mask=k_mask, other=0)
            k = tl.reshape(tl.permute(e4m3_pairs_as_fp16(words, CVT), (0, 2, 1)), (DIM_PAD, BLOCK_N))
        elif MASKED:
            k = tl.load(
                k_cache_ptr + slots[None, :] + offs_d[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0
            )
        else:
            k = tl.load(k_cache_ptr + slots[None, :] + offs_d[:, None], mask=d_mask[:, None], other=0.0)  # [D, N]
        if SCALED and not BYTES:
            k = k.to(q.dtype)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee") * qk_scale  # [M, N] fp32
        else:
            s = tl.dot(q, k) * qk_scale
        if USE_SOFTCAP:
            s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)  # softcap * tanh(s / softcap)
        s = s * LOG2E
        if MASKED:
            allowed = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                allowed = allowed & (offs_n[None, :] > q_pos[:, None] - sliding_window)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = m_new
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if VT:  # the value cache stored [NB, Hkv, D, BS]
            v = load_transposed_values(
                v_cache_ptr, table_ptr, start_n, kv_hi, n_mask, blocks, v_head_offset, stride_cb, offs_d, d_mask,
                BLOCK_N, BLOCK_SIZE, MASKED, BYTES, DIM_PAD, CVT,
            )  # fmt: skip
        elif BYTES:  # [N, D/2] words, then [N, D/2, 2] values
            v_mask = n_mask[:, None] & p_mask[None, :] if MASKED else p_mask[None, :]
            words = tl.load(v_cache_ptr + slots[:, None] + offs_p[None, :], mask=v_mask, other=0)
            v = tl.reshape(e4m3_pairs_as_fp16(words, CVT), (BLOCK_N, DIM_PAD))
        elif MASKED:
            v = tl.load(
                v_cache_ptr + slots[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0
            )
        else:
            v = tl.load(v_cache_ptr + slots[:, None] + offs_d[None, :], mask=d_mask[None, :], other=0.0)  # [N, D]
        if SCALED and not BYTES:
            v = v.to(q.dtype)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return acc, m_new, l_i

    @triton.jit
    def merge_slices(
        out_ptr,  # [S, T, H, D] fp32 partials
        lse_ptr,  # [S, T, H] fp32, log2 domain
        final_ptr,  # [T, H, D]
        token,  # [M] int64
        head,  # [M]
        row_valid,  # [M]
        out_mask,  # [M, D]
        offs_d,
        num_active,
        stride_os,
        stride_ot,
        stride_oh,
        stride_ls,
        stride_lt,
        stride_ft,
        stride_fh,
        BLOCK_M: tl.constexpr,
        DIM_PAD: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
    ):
        """The output of ``num_active`` context slices' partial outputs, each weighted by its share of the softmax
        denominator: ``2^(lse_s - max lse)``; an empty row's slices weigh 0."""
        offs_s = tl.arange(0, SPLITS_PAD)
        lses = tl.load(
            lse_ptr + offs_s[:, None] * stride_ls + token[None, :] * stride_lt + head[None, :],
            mask=(offs_s[:, None] < num_active) & row_valid[None, :],
            other=float("-inf"),
            cache_modifier=".cg",
        )  # [S, M]
        m = tl.max(lses, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        total = tl.sum(tl.where(lses == float("-inf"), 0.0, tl.exp2(lses - m[None, :])), 0)  # [M]
        merged = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
        for part in range(0, num_active):
            lse = tl.load(
                lse_ptr + part * stride_ls + token * stride_lt + head,
                mask=row_valid,
                other=float("-inf"),
                cache_modifier=".cg",
            )
            w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - m))  # [M]
            src = part * stride_os + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
            merged += tl.load(out_ptr + src, mask=out_mask, other=0.0, cache_modifier=".cg") * w[:, None]
        merged = merged / tl.where(total > 0, total, 1.0)[:, None]
        dst = token[:, None] * stride_ft + head[:, None] * stride_fh + offs_d[None, :]
        tl.store(final_ptr + dst, merged.to(final_ptr.dtype.element_ty), mask=out_mask)
