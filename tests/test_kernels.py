"""Triton kernels against their torch twins: in Triton's interpreter on CPU (fp32/fp16; bf16 ``tl.dot`` is wrong
there) and compiled on a GPU (fp16/bf16). Inputs are fresh random draws per case; outputs are poisoned with NaN
first so an element a kernel forgot to write shows up."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from paged_backend.kernels.arrival import arrival_counters
from paged_backend.kernels.attention_twin import paged_attention_torch
from paged_backend.kernels.cache_write import (
    check_cache_strides,
    head_major,
    new_kv_cache,
    write_kv_cache_torch,
    write_kv_cache_triton,
)
from paged_backend.kernels.paged_attention import (
    MAX_SPLITS,
    _paged_attention_kernel,
    choose_num_splits,
    paged_attention_triton,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float16, torch.bfloat16] if DEVICE.type == "cuda" else [torch.float32, torch.float16]
# Relative error bound ||out - ref|| / ||ref|| against the fp32 twin, per input dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def make_batch(
    q_lens: list[int],
    prefix_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int,
    seed: int,
) -> dict:
    """A ragged batch over a shuffled paged cache: sequence i has prefix_lens[i] cached tokens plus q_lens[i]
    new ones (already written), and its block table points at random distinct blocks."""
    gen = torch.Generator().manual_seed(seed)
    ctx = [p + q for p, q in zip(prefix_lens, q_lens)]
    blocks_per_seq = [-(-c // block_size) for c in ctx]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_seq)
    tables = torch.zeros(len(q_lens), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = order[used : used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return dict(
        query=torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(DEVICE, dtype),
        k_cache=torch.randn(shape, generator=gen).to(DEVICE, dtype),
        v_cache=torch.randn(shape, generator=gen).to(DEVICE, dtype),
        block_tables=tables.to(DEVICE),
        cu_seqlens_q=torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor(ctx, dtype=torch.int32, device=DEVICE),
    )


def check_attention(batch: dict, dtype: torch.dtype, **kwargs) -> torch.Tensor:
    scale = batch["query"].shape[-1] ** -0.5
    twin_kwargs = {k: v for k, v in kwargs.items() if k in ("sliding_window", "softcap")}
    ref = paged_attention_torch(
        batch["query"].float(), batch["k_cache"].float(), batch["v_cache"].float(),
        batch["block_tables"], batch["cu_seqlens_q"], batch["context_lens"], scale, **twin_kwargs,
    )  # fmt: skip
    poisoned = torch.full_like(batch["query"], float("nan"))
    out = paged_attention_triton(**batch, scale=scale, out=poisoned, **kwargs)
    assert out.data_ptr() == poisoned.data_ptr()
    assert not out.isnan().any(), "some output elements were never written"
    assert relative_error(out, ref) < TOLERANCE[dtype]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_prefill_and_mixed_batch(dtype: torch.dtype, head_dim: int) -> None:
    """Decodes, a fresh prompt, chunks over a cached prefix and block-boundary lengths in one batch (GQA 4:1)."""
    q_lens = [1, 33, 7, 1, 16, 70]
    prefix = [40, 0, 9, 15, 16, 50]
    check_attention(make_batch(q_lens, prefix, 8, 2, head_dim, dtype, 16, seed=head_dim), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "block_size"), [(4, 4, 16), (6, 2, 16), (8, 1, 8), (12, 4, 32)])
def test_head_grouping_and_block_sizes(dtype: torch.dtype, num_heads: int, num_kv_heads: int, block_size: int) -> None:
    """MHA, a group of 3 (padded to 4 rows), MQA, and other block sizes."""
    batch = make_batch([1, 20, 3], [30, 5, 61], num_heads, num_kv_heads, 64, dtype, block_size, seed=num_heads)
    check_attention(batch, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("sliding_window", "softcap"), [(5, None), (40, None), (None, 7.5), (17, 20.0)])
def test_sliding_window_and_softcap(dtype: torch.dtype, sliding_window: int | None, softcap: float | None) -> None:
    batch = make_batch([1, 50, 9, 1], [80, 0, 30, 3], 8, 2, 64, dtype, 16, seed=sliding_window or 0)
    check_attention(batch, dtype, sliding_window=sliding_window, softcap=softcap)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_splits", "sliding_window"), [(1, None), (3, 300), (8, None), (8, 300), (32, None)])
def test_split_kv_decode(dtype: torch.dtype, num_splits: int, sliding_window: int | None) -> None:
    """Decode-only batch with contexts from 1 token to six slices of 128 tokens; with 8 splits some slices are
    empty, so the merge must give them no weight; a context within one slice is written by that slice alone; and a
    window far from the start moves the first slice. A padding row of a CUDA-graph bucket (context 0) comes out
    as zeros, not NaN. At 32 splits a context of 4,000 tokens fills every slice the merge can hold: 32 of 128."""
    prefix = [0, 4000 if num_splits == 32 else 700, 31, 0]
    batch = make_batch([1] * len(prefix), prefix, 8, 2, 64, dtype, 16, seed=num_splits)
    batch["context_lens"][-1] = 0  # the padding row
    out = check_attention(batch, dtype, sliding_window=sliding_window, num_splits=num_splits)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    assert not arrival_counters(DEVICE).any()  # the merging programs left the counters at zero


def test_split_heuristic_on_cpu() -> None:
    assert choose_num_splits(1, 1, 8, torch.device("cpu")) == 1


def test_a_number_of_splits_past_the_merge_is_refused() -> None:
    """The merge reads at most MAX_SPLITS slices: more would leave slices out of the softmax, silently."""
    batch = make_batch([1, 1], [700, 31], 8, 2, 64, torch.float32, 16, seed=0)
    for bad in (0, MAX_SPLITS + 1):
        with pytest.raises(ValueError, match=f"num_splits must be between 1 and {MAX_SPLITS}, got {bad}"):
            paged_attention_triton(**batch, scale=0.125, num_splits=bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels exist on a GPU only")
def test_every_number_of_splits_shares_one_compiled_kernel() -> None:
    """Decode batches of 1 to 32 sequences pick 2 to 32 slices (``choose_num_splits``); each number compiled a
    kernel of its own while CUDA graphs were captured, a second or more each on a fresh machine."""
    caches = getattr(_paged_attention_kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps no per-device kernel caches")
    batch = make_batch([1] * 3, [700, 31, 300], 8, 2, 64, torch.float16, 16, seed=0)
    paged_attention_triton(**batch, scale=0.125, num_splits=2)
    compiled = sum(len(entry[0]) for entry in caches.values())
    for num_splits in (4, 8, 32):
        check_attention(batch, torch.float16, num_splits=num_splits)
    assert sum(len(entry[0]) for entry in caches.values()) == compiled


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the heuristic reads the GPU's SM count")
def test_split_heuristic_on_gpu() -> None:
    """Splitting is for decode-only batches that leave SMs idle; prefill and big batches take one slice."""
    cuda = torch.device("cuda", 0)
    assert choose_num_splits(1, 1, 8, cuda) > 1
    assert choose_num_splits(256, 256, 8, cuda) == 1
    assert choose_num_splits(4, 100, 8, cuda) == 1


def stored_head_major(batch: dict) -> dict:
    """``batch`` with its caches stored head-major, as a GPU's engine stores them (the same values)."""
    k_cache, v_cache = new_kv_cache(tuple(batch["k_cache"].shape), batch["k_cache"].dtype, DEVICE, head_major=True)
    assert head_major(k_cache) and head_major(v_cache) and not head_major(batch["k_cache"])
    return batch | {"k_cache": k_cache.copy_(batch["k_cache"]), "v_cache": v_cache.copy_(batch["v_cache"])}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_head_major_caches(dtype: torch.dtype, num_splits: int) -> None:
    """Caches stored head-major (``[block, head, offset, dim]`` under the same shape): prefill, chunks and decodes,
    or split decodes, read through the caches' strides, equal the twin."""
    if num_splits == 1:
        batch = make_batch([1, 33, 7, 1, 16, 70], [40, 0, 9, 15, 16, 50], 8, 2, 64, dtype, 16, seed=31)
    else:
        batch = make_batch([1, 1, 1], [700, 31, 3], 8, 2, 64, dtype, 16, seed=32)
    check_attention(stored_head_major(batch), dtype, num_splits=num_splits)


def test_caches_of_other_strides_are_refused() -> None:
    """The kernels address a value cache by the key cache's strides: caches stored otherwise are refused."""
    shape = (4, 16, 2, 64)
    token_major = new_kv_cache(shape, torch.float32, DEVICE, head_major=False)
    by_head = new_kv_cache(shape, torch.float32, DEVICE, head_major=True)
    for k_cache, v_cache in (token_major, by_head):
        check_cache_strides(k_cache, v_cache)
    with pytest.raises(ValueError, match="value strides"):
        check_cache_strides(token_major[0], by_head[1])
    fp8_keys, fp8_values = new_kv_cache(shape, torch.float8_e4m3fn, DEVICE, head_major=True)
    check_cache_strides(fp8_keys, fp8_values)  # the values transposed
    wider = torch.zeros(4, 16, 4, 64, dtype=torch.float8_e4m3fn, device=DEVICE)[:, :, :2]  # keys not stored whole
    with pytest.raises(ValueError, match="key strides"):
        check_cache_strides(wider, fp8_values)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "by_head"), [(2, 64, False), (3, 80, True), (8, 128, False)])
def test_cache_write(dtype: torch.dtype, num_kv_heads: int, head_dim: int, by_head: bool) -> None:
    """Scattered slots land where the twin puts them; slot -1 (padding) and untouched slots stay as they were; in
    caches stored head-major (``by_head``) as in token-major ones."""
    rng = random.Random(head_dim)
    num_blocks, block_size, num_tokens = 12, 16, 37
    slots = rng.sample(range(num_blocks * block_size), num_tokens)
    slots[5] = slots[20] = -1
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=DEVICE)
    gen = torch.Generator().manual_seed(head_dim)
    # Non-contiguous [T, Hkv, D] views, as the attention function gets them from [1, Hkv, T, D].
    key = torch.randn(1, num_kv_heads, num_tokens, head_dim, generator=gen).to(DEVICE, dtype)[0].transpose(0, 1)
    value = torch.randn(1, num_kv_heads, num_tokens, head_dim, generator=gen).to(DEVICE, dtype)[0].transpose(0, 1)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) for _ in range(4)]
    if by_head:  # the kernel writes head-major caches; the twin token-major ones
        caches[2:] = [c.fill_(float("nan")) for c in new_kv_cache(shape, dtype, DEVICE, head_major=True)]
    write_kv_cache_torch(key, value, caches[0], caches[1], slot_mapping)
    write_kv_cache_triton(key, value, caches[2], caches[3], slot_mapping)
    assert torch.equal(caches[0].isnan(), caches[2].isnan()) and torch.equal(caches[1].isnan(), caches[3].isnan())
    assert torch.equal(caches[0].nan_to_num(), caches[2].nan_to_num())
    assert torch.equal(caches[1].nan_to_num(), caches[3].nan_to_num())
    written = (~caches[2].isnan()).flatten(0, 1).all(-1).all(-1).sum().item()
    assert written == num_tokens - 2


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32] if DEVICE.type == "cuda" else DTYPES)
@pytest.mark.parametrize("vocab", [7, 2048, 5000])  # below one block, exactly one, several with a short tail
def test_greedy_kernel_equals_its_twin(dtype: torch.dtype, vocab: int) -> None:
    """Argmax (the first index of a tied maximum, as torch's) and its log-probability, one pass per row."""
    from paged_backend.kernels.greedy import greedy_tokens_torch, greedy_tokens_triton

    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(6, vocab, generator=gen) * 4).to(dtype)
    logits[1, vocab // 3] = logits[1, vocab - 1] = logits[1].max() + 1  # a tie across blocks: the first wins
    logits[2, :] = 0.5  # a tie everywhere: index 0, log-probability -log(vocab)
    logits[3, vocab - 1] = 50.0  # the last element, in the tail block
    logits[4, : vocab // 2] = float("-inf")  # masked tokens
    logits = logits.to(DEVICE)
    ref_tokens, ref_logprobs = greedy_tokens_torch(logits)
    # rows in one program, and cut into slices merged by the last to finish (at 5000: the tie at 1666 and 4999
    # spans slices, and with 4 slices of 2048 the last is empty)
    for splits in (None, 2, 4):
        tokens, logprobs = greedy_tokens_triton(logits[:, :vocab], splits)
        assert torch.equal(tokens.cpu(), ref_tokens.cpu())
        assert tokens[1].item() == min(vocab // 3, vocab - 1) and tokens[2].item() == 0
        torch.testing.assert_close(logprobs.cpu(), ref_logprobs.cpu(), rtol=1e-5, atol=1e-5)
    assert not arrival_counters(DEVICE).any()
    strided = torch.cat([logits, logits], dim=1)[:, :vocab]  # rows of a wider tensor (a row stride != vocab)
    assert torch.equal(greedy_tokens_triton(strided)[0].cpu(), ref_tokens.cpu())


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32] if DEVICE.type == "cuda" else DTYPES)
@pytest.mark.parametrize("vocab", [7, 2048, 5000])  # below one block, exactly one, several with a short tail
def test_token_rank_kernel_equals_its_twin(dtype: torch.dtype, vocab: int) -> None:
    """Logsumexp, the given token's rank (ties share the better rank) and the first argmax, one pass per row."""
    from paged_backend.kernels.token_rank import token_rank_torch, token_rank_triton

    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(7, vocab, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, vocab, (7,), generator=gen)
    logits[1, vocab // 3] = logits[1, vocab - 1] = logits[1].max() + 1  # a tie across blocks: the first wins
    targets[1] = vocab - 1  # the tied maximum: rank 1
    logits[2, :] = 0.5  # a tie everywhere: rank 1, argmax 0, logsumexp 0.5 + log(vocab)
    logits[3, vocab - 1] = 50.0  # the last element, in the tail block
    logits[4, : vocab // 2] = float("-inf")  # masked tokens
    targets[5] = logits[5].float().argmin()  # the least likely token: rank vocab when no value repeats it
    logits, targets = logits.to(DEVICE), targets.to(DEVICE)
    expected = token_rank_torch(logits, targets)
    for rows in (logits, torch.cat([logits, logits], dim=1)[:, :vocab]):  # contiguous, and a row stride != vocab
        lse, ranks, argmax = token_rank_triton(rows, targets)
        torch.testing.assert_close(lse.cpu(), expected[0].cpu(), rtol=1e-5, atol=1e-5)
        assert torch.equal(ranks.cpu(), expected[1].cpu()) and torch.equal(argmax.cpu(), expected[2].cpu())
    assert expected[1][1] == 1 and expected[2][1] == min(vocab // 3, vocab - 1)
    assert expected[1][2] == 1 and expected[2][2] == 0
    assert expected[1][5] == vocab - (logits[5] == logits[5].min()).sum() + 1
    assert torch.equal(token_rank_torch(logits[:0], targets[:0])[1], targets[:0])  # no rows


# Steps that hold one sequence's tokens in different company: (sequence, cached tokens, new tokens) per row.
INVARIANT_LAYOUTS = [
    [(0, 149, 1)],  # its last token decoded alone
    [(0, 149, 1), (1, 70, 1), (2, 300, 1), (3, 5, 1)],  # in a decode batch (a GPU would split the context)
    [(1, 0, 40), (0, 100, 50), (2, 250, 1)],  # its prompt's last 50 tokens, a chunk beside a prefill and a decode
    [(0, 0, 150), (3, 0, 6)],  # its whole prompt at once
    [(2, 299, 1), (0, 117, 33)],  # a chunk from another boundary
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sliding_window", [None, 37, 100])
@pytest.mark.usefixtures("row_independent_dot")
def test_batch_invariant_attention(dtype: torch.dtype, sliding_window: int | None) -> None:
    """``batch_invariant=True``: a query's output is the same bits whatever step holds it — decoded alone or in a
    batch, inside a prefill chunk from any boundary or the whole prompt — and still the twin's attention."""
    gen = torch.Generator().manual_seed(3)
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    lengths = [150, 71, 301, 6]  # each sequence's tokens, all in the cache
    num_blocks = sum(-(-n // block_size) for n in lengths) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[order.pop() for _ in range(-(-n // block_size))] for n in lengths]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    queries = [torch.randn(n, num_heads, head_dim, generator=gen).to(DEVICE, dtype) for n in lengths]
    seen: dict[int, torch.Tensor] = {}  # position of sequence 0 -> its first output
    for layout in INVARIANT_LAYOUTS:
        width = max(len(tables[s]) for s, _, _ in layout)
        batch = dict(
            query=torch.cat([queries[s][p : p + n] for s, p, n in layout]),
            k_cache=k_cache,
            v_cache=v_cache,
            block_tables=torch.tensor(
                [tables[s] + [0] * (width - len(tables[s])) for s, _, _ in layout], dtype=torch.int32, device=DEVICE
            ),
            cu_seqlens_q=torch.tensor(
                [0, *itertools.accumulate(n for _, _, n in layout)], dtype=torch.int32, device=DEVICE
            ),
            context_lens=torch.tensor([p + n for _, p, n in layout], dtype=torch.int32, device=DEVICE),
        )
        out = check_attention(batch, dtype, sliding_window=sliding_window, batch_invariant=True)
        offset = 0
        for s, p, n in layout:
            if s == 0:
                for j in range(n):
                    first = seen.setdefault(p + j, out[offset + j])
                    assert torch.equal(out[offset + j], first), f"position {p + j} in layout {layout}"
            offset += n
    assert len(seen) == 150


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32] if DEVICE.type == "cuda" else DTYPES)
@pytest.mark.parametrize("cols", [1, 7, 4096, 5000])  # one column, below a block, exactly one, a looped tail
def test_row_mean_kernel_equals_its_twin(dtype: torch.dtype, cols: int) -> None:
    """The mean over the last dimension (keepdim, in the input's dtype), contiguous and strided rows, any leading
    shape; a row's bits are the same alone and among others."""
    from paged_backend.kernels.row_mean import row_mean_torch, row_mean_triton

    gen = torch.Generator().manual_seed(cols)
    x = (torch.randn(3, 5, cols, generator=gen) + 1).to(DEVICE, dtype)
    for rows in (x, torch.cat([x, x], dim=-1)[..., :cols], x.transpose(0, 1)):
        got = row_mean_triton(rows)
        assert got.shape == (*rows.shape[:-1], 1) and got.dtype == dtype
        torch.testing.assert_close(got.float(), row_mean_torch(rows).float(), rtol=1e-3, atol=1e-5)
    alone = row_mean_triton(x[1, 2:3])
    assert torch.equal(row_mean_triton(x)[1, 2:3], alone)
    assert row_mean_triton(x[:0]).shape == (0, 5, 1)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32] if DEVICE.type == "cuda" else DTYPES)
@pytest.mark.parametrize("cols", [7, 4096, 5000])  # below a block, exactly one, a looped tail
def test_rms_norm_kernel_equals_its_twin(dtype: torch.dtype, cols: int) -> None:
    """HF's RMSNorm in one kernel: its twin's values (HF's own module's), a weight of the input's dtype or fp32
    (the result's dtype promoted, as HF's product gives), contiguous and strided rows; a row's bits are the same
    alone and among others."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from paged_backend.kernels.rms_norm import rms_norm_torch, rms_norm_triton

    gen = torch.Generator().manual_seed(cols)
    x = (torch.randn(3, 5, cols, generator=gen) * 3).to(DEVICE, dtype)
    module = LlamaRMSNorm(cols, eps=1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(cols, generator=gen))
    torch.testing.assert_close(rms_norm_torch(x, module.weight, 1e-5), module(x), rtol=0, atol=0)
    for weight in (module.weight.detach(), module.weight.detach().float()):
        for rows in (x, torch.cat([x, x], dim=-1)[..., :cols]):
            got = rms_norm_triton(rows, weight, 1e-5)
            expected = rms_norm_torch(rows, weight, 1e-5)
            assert got.shape == rows.shape and got.dtype == expected.dtype
            torch.testing.assert_close(got, expected, rtol=2e-2 if dtype == torch.bfloat16 else 2e-3, atol=1e-4)
    assert torch.equal(rms_norm_triton(x, module.weight, 1e-5)[1, 2:3], rms_norm_triton(x[1, 2:3], module.weight, 1e-5))
    assert rms_norm_triton(x[:0], module.weight, 1e-5).shape == (0, 5, cols)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [7, 4096, 5000])  # below a block, exactly one, a looped tail
def test_fp8_quantize_kernel_equals_its_twin(dtype: torch.dtype, cols: int) -> None:
    """Per-token fp8 quantization in one kernel: the twin's fp8 values and scales to the bit, for plain rows, an
    all-zero row (scale 1e-12, zeros), a row whose largest magnitude dwarfs the rest, and strided rows. On a CPU
    the rows are fp8 values times powers of two, one of them 448 (so each scale is that power and nothing rounds):
    Triton's interpreter rounds to fp8 wrongly when rounding carries into the exponent (127.66 becomes 64), which
    the GPU's conversion does not, so only there do arbitrary values go in."""
    from paged_backend.kernels.fp8_quant import FP8, FP8_MAX, quantize_per_row, quantize_per_row_triton

    gen = torch.Generator().manual_seed(cols)
    x = torch.randn(6, cols, generator=gen) * 3
    x[2, 0] = 1e4
    if DEVICE.type == "cpu":
        powers = 2.0 ** torch.arange(-8, -2).float()[:, None]  # one per row
        x = (x / powers).clamp(-FP8_MAX, FP8_MAX).to(FP8).float()
        x[:, -1] = FP8_MAX
        x = x * powers
    x[1] = 0
    x = x.to(DEVICE, dtype)
    for rows in (x, torch.cat([x, x], dim=-1)[:, 1 : cols + 1]):
        q, scale = quantize_per_row_triton(rows)
        q_twin, scale_twin = quantize_per_row(rows)
        assert q.dtype == q_twin.dtype and q.shape == q_twin.shape and scale.shape == scale_twin.shape
        assert torch.equal(scale, scale_twin)
        assert torch.equal(q.view(torch.uint8), q_twin.view(torch.uint8))
    assert quantize_per_row_triton(x[:0])[0].shape == (0, cols)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(("k", "n"), [(256, 48), (300, 20), (3072, 40)])  # under one step; not a multiple of 8
def test_fp8_gemv_equals_its_twin(rows: int, k: int, n: int) -> None:
    """The fp8 GEMV against its twin (x times the dequantized weight in float32), into fp32, fp16 and bf16, with
    weights that are rows of a larger packed buffer (as fused siblings' are): the default launch (2 weight rows
    a program here), and in bf16 the 4-row launch of wide projections and two launches split over K with partial
    blocks of weight rows (3072 in 2,048 + 1,024 and in three; 300 in 256 + 44);
    the programs that added the parts reset the counters. More rows than it takes is an error naming the limit."""
    from paged_backend.kernels.fp8_gemv import GEMV_MAX_M, fp8_gemv_torch, fp8_gemv_triton
    from paged_backend.kernels.fp8_quant import quantize_per_row

    gen = torch.Generator().manual_seed(k + n + rows)
    packed, packed_scale = quantize_per_row((torch.randn(n + 16, k, generator=gen) * 0.02).to(DEVICE))
    weight, weight_scale = packed[8 : 8 + n], packed_scale[8 : 8 + n, 0]  # a view into the packed buffer
    x = torch.randn(rows, k, generator=gen).to(DEVICE)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        expected = fp8_gemv_torch(x.to(dtype).float(), weight, weight_scale)
        for launch in (None, (4, 0, 64), (16, 2, 128), (2, 3, 32)) if dtype == torch.bfloat16 else (None,):
            got = fp8_gemv_triton(x.to(dtype), weight, weight_scale, launch)
            assert got.dtype == dtype and got.shape == (rows, n)
            tol = 1e-4 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)
    assert not arrival_counters(DEVICE).any()
    with pytest.raises(ValueError, match=f"GEMV_MAX_M={GEMV_MAX_M}"):
        fp8_gemv_triton(torch.cat([x] * 5), weight, weight_scale)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize(("k", "n"), [(256, 48), (3072, 41)])
def test_gemv_over_16_bit_weights_equals_its_twin(rows: int, k: int, n: int) -> None:
    """The same GEMV over 16-bit weights without a scale (a bf16 projection at one row): rows of a packed buffer,
    the default launch and one split over K (3072 in three), a last tile of weight rows part empty (41), against
    the twin's ``x @ W.T`` in float32. fp8 weights without their scale are refused."""
    from paged_backend.kernels.fp8_gemv import fp8_gemv_torch, gemv_triton

    gen = torch.Generator().manual_seed(k + n + rows)
    x = torch.randn(rows, k, generator=gen).to(DEVICE)
    for dtype in (torch.float16, torch.bfloat16):
        packed = (torch.randn(n + 16, k, generator=gen) * 0.02).to(DEVICE, dtype)
        weight = packed[8 : 8 + n]
        expected = fp8_gemv_torch(x.to(dtype).float(), weight, None)
        for launch in (None, (2, 3, 32)):
            got = gemv_triton(x.to(dtype), weight, launch=launch)
            assert got.dtype == dtype and got.shape == (rows, n)
            torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)
    assert not arrival_counters(DEVICE).any()
    with pytest.raises(ValueError, match="with their scale only"):
        gemv_triton(x, weight.to(torch.float8_e4m3fn))
