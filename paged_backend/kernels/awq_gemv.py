"""The AWQ GEMV: a few rows of x against int4 weights with no ``tl.dot``, whose 16-row minimum would waste most of
the math at decode's one or two rows. ``awq_gemm.py`` launches it up to ``GEMV_MAX_M`` rows; the layout it unpacks
is ``awq_format.py``'s. Each nibble becomes a float by one AND-OR instead of an int-to-float conversion (see
``_nibble_floats``), and each thread holds one pack, so that a program needs few registers and many warps stay
resident with loads in flight.
"""

from __future__ import annotations

from paged_backend.kernels import tl, triton

if triton is not None:
    from paged_backend.kernels.arrival import add_parts, last_to_arrive

    @triton.jit
    def _nibble_floats(packed, magic, J: tl.constexpr):
        """Column ``J`` of each int32 pack as the fp32 ``2**23 + q * 2**B`` (exact; B from ``_nibble_scale``):
        the nibble masked in place and OR-ed with 2**23's exponent bits is that float, so no int-to-float
        conversion runs (a quarter-rate instruction, which would bound the GEMV). Nibbles above bit 19 are first
        shifted down 12 bits, so that ``q * 2**B`` fits the 23-bit mantissa."""
        POS: tl.constexpr = (J // 2) * 4 + (J % 2) * 16  # AWQ_SHIFTS[J]
        PRE: tl.constexpr = 12 if POS >= 20 else 0
        return (((packed >> PRE) & (0xF << (POS - PRE))) | magic).to(tl.float32, bitcast=True)

    @triton.jit
    def _nibble_scale(scale_row, offs_pack, mask_pack, J: tl.constexpr):
        """Column ``J``'s scales times ``2**-B``, which undoes the place of its nibble in ``_nibble_floats``."""
        POS: tl.constexpr = (J // 2) * 4 + (J % 2) * 16
        B: tl.constexpr = POS - (12 if POS >= 20 else 0)
        s = tl.load(scale_row + offs_pack * 8 + J, mask=mask_pack, other=0.0).to(tl.float32)
        return s * (1.0 / (1 << B))

    @triton.jit
    def awq_gemv_kernel(
        x_ptr,  # [M, K]
        qweight_ptr,  # [K, N / 8] int32
        qzeros_ptr,  # [K / G, N / 8] int32
        scales_ptr,  # [K / G, N]
        out_ptr,  # [M, N] in x's dtype
        partial_ptr,  # [SPLIT_K, M, N] fp32 when K is split (programs along axis 2)
        counters_ptr,  # [tiles] int32 zeros (``kernels/arrival.py``)
        M,
        n_packs,  # N / 8
        K,
        k_per_split,  # a multiple of GROUP_SIZE
        magic,  # 0x4B000000, the bits of 2.0**23: an argument, so that it stays in a register and each nibble's
        # mask is the AND-OR's one immediate (with two immediates, ptxas moves every mask into a register first)
        ROW_PACKS: tl.constexpr,  # row stride of qweight and qzeros (``awq_gemm._row_packs``): a constant, so that the
        # unrolled loads below address by immediate offsets
        BLOCK_M: tl.constexpr,  # rows of x per program, each weight made once for all of them
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,  # rows per load; divides GROUP_SIZE
        GROUP_SIZE: tl.constexpr,
        SPLIT: tl.constexpr,  # K split: fp32 parts, the last program of a tile adds them
    ):
        """A few rows of x (all in one program) against a block of columns, with no ``tl.dot`` (its 16-row
        minimum wastes most of the math at decode's one or two rows). The eight columns of each pack are eight
        tensors of the loaded tile's own shape, so nothing moves between threads until the end. A weight costs an
        AND-OR, a subtract (of the zero, made the same way, which also cancels the 2**23) and a multiply-add per
        row; each thread sums its own rows, and per group ``acc += s * sum_k x_k (q_kn - z_n)``: tile-shaped
        accumulators, reduced once. With one pack per thread (tiles of 32 x num_warps packs) a program needs few
        registers, so many warps are resident and keep loads in flight."""
        pid_m = tl.program_id(0)  # fastest: the programs reading one weight tile run together and share it in L2
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        N = n_packs * 8
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        offs_pack = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
        mask_pack = offs_pack < n_packs  # an argument (divisible by 16): the mask is constant over vectors
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        acc0 = tl.zeros((BLOCK_M, BLOCK_K, BLOCK_N // 8), dtype=tl.float32)
        acc1, acc2, acc3, acc4, acc5, acc6, acc7 = acc0, acc0, acc0, acc0, acc0, acc0, acc0
        for k0 in range(k_start, k_end, GROUP_SIZE):
            group = k0 // GROUP_SIZE
            zeros = tl.load(qzeros_ptr + group * ROW_PACKS + offs_pack, mask=mask_pack, other=0)  # [BN / 8]
            z0, z1 = _nibble_floats(zeros, magic, 0)[None, :], _nibble_floats(zeros, magic, 1)[None, :]
            z2, z3 = _nibble_floats(zeros, magic, 2)[None, :], _nibble_floats(zeros, magic, 3)[None, :]
            z4, z5 = _nibble_floats(zeros, magic, 4)[None, :], _nibble_floats(zeros, magic, 5)[None, :]
            z6, z7 = _nibble_floats(zeros, magic, 6)[None, :], _nibble_floats(zeros, magic, 7)[None, :]
            part0 = tl.zeros((BLOCK_M, BLOCK_K, BLOCK_N // 8), dtype=tl.float32)
            part1, part2, part3, part4, part5, part6, part7 = part0, part0, part0, part0, part0, part0, part0
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x_ptrs = x_ptr + offs_m[:, None] * K + offs_k[None, :]  # [BM, BK]
            w_ptrs = qweight_ptr + offs_k[:, None] * ROW_PACKS + offs_pack[None, :]  # [BK, BN / 8]
            for r in tl.static_range(GROUP_SIZE // BLOCK_K):
                x = tl.load(x_ptrs + r * BLOCK_K, mask=mask_m[:, None], other=0.0).to(tl.float32)[:, :, None]
                packed = tl.load(w_ptrs + r * BLOCK_K * ROW_PACKS, mask=mask_pack[None, :], other=0)  # [BK, BN / 8]
                # each weight is made once and used for the BM rows of x: [BK, BN / 8] -> [1, BK, BN / 8]
                part0 += x * (_nibble_floats(packed, magic, 0) - z0)[None, :, :]
                part1 += x * (_nibble_floats(packed, magic, 1) - z1)[None, :, :]
                part2 += x * (_nibble_floats(packed, magic, 2) - z2)[None, :, :]
                part3 += x * (_nibble_floats(packed, magic, 3) - z3)[None, :, :]
                part4 += x * (_nibble_floats(packed, magic, 4) - z4)[None, :, :]
                part5 += x * (_nibble_floats(packed, magic, 5) - z5)[None, :, :]
                part6 += x * (_nibble_floats(packed, magic, 6) - z6)[None, :, :]
                part7 += x * (_nibble_floats(packed, magic, 7) - z7)[None, :, :]
            scale_row = scales_ptr + group * ROW_PACKS * 8
            acc0 += part0 * _nibble_scale(scale_row, offs_pack, mask_pack, 0)[None, None, :]
            acc1 += part1 * _nibble_scale(scale_row, offs_pack, mask_pack, 1)[None, None, :]
            acc2 += part2 * _nibble_scale(scale_row, offs_pack, mask_pack, 2)[None, None, :]
            acc3 += part3 * _nibble_scale(scale_row, offs_pack, mask_pack, 3)[None, None, :]
            acc4 += part4 * _nibble_scale(scale_row, offs_pack, mask_pack, 4)[None, None, :]
            acc5 += part5 * _nibble_scale(scale_row, offs_pack, mask_pack, 5)[None, None, :]
            acc6 += part6 * _nibble_scale(scale_row, offs_pack, mask_pack, 6)[None, None, :]
            acc7 += part7 * _nibble_scale(scale_row, offs_pack, mask_pack, 7)[None, None, :]
        # [BM, BN / 8]: column 0 of each pack
        if SPLIT:
            out = partial_ptr + pid_k * M * N + offs_m[:, None] * N + offs_pack[None, :] * 8
            dtype = tl.float32
        else:
            out = out_ptr + offs_m[:, None] * N + offs_pack[None, :] * 8
            dtype = out_ptr.dtype.element_ty
        mask = mask_m[:, None] & mask_pack[None, :]
        tl.store(out + 0, tl.sum(acc0, axis=1).to(dtype), mask=mask)
        tl.store(out + 1, tl.sum(acc1, axis=1).to(dtype), mask=mask)
        tl.store(out + 2, tl.sum(acc2, axis=1).to(dtype), mask=mask)
        tl.store(out + 3, tl.sum(acc3, axis=1).to(dtype), mask=mask)
        tl.store(out + 4, tl.sum(acc4, axis=1).to(dtype), mask=mask)
        tl.store(out + 5, tl.sum(acc5, axis=1).to(dtype), mask=mask)
        tl.store(out + 6, tl.sum(acc6, axis=1).to(dtype), mask=mask)
        tl.store(out + 7, tl.sum(acc7, axis=1).to(dtype), mask=mask)
        if SPLIT:
            if last_to_arrive(counters_ptr + pid_m * tl.num_programs(1) + pid_n, tl.num_programs(2)):
                offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
                tile_mask = mask_m[:, None] & (offs_n < N)[None, :]
                total = add_parts(partial_ptr, offs_m, offs_n, tile_mask, M, N, tl.num_programs(2), BLOCK_M, BLOCK_N)
                tile = out_ptr + offs_m[:, None] * N + offs_n[None, :]
                tl.store(tile, total.to(out_ptr.dtype.element_ty), mask=tile_mask)
