"""The trainer's side of ``batch_invariant``: a model's own forward, inside :func:`batch_invariant_forward`,
computing each token's logits the way the engine's ``batch_invariant=True`` steps computed them, so that the RL
importance ratio between the policy that sampled a token and the policy being trained is exactly 1.

Every reduction has to meet the engine's: linear layers by the same blocks of rows (``BatchInvariantMode``), the
same norms' kernel on a GPU, sibling projections as one product where the engine packed them (the trainer and
the engine share the model, so they share its packed buffers), and the attention:

- on a CPU, one query at a time over exactly the keys it sees, in fp32 (``attend_one``, the engine's own exact
  path there);
- on a GPU, the engine's Triton kernel in its fixed-order configuration, over the whole sequences laid out as a
  paged cache (each sequence's keys in consecutive blocks): every query then meets the decode tiles, the single
  context slice and the masked key tiles its sampling step did, so its sums run in the same order. The kernel
  has no backward: where autograd records, the gradient is that of the same attention in eager fp32 arithmetic
  (only the no-grad "old" logprobs enter the ratio; the gradient pass needs a gradient, not these bits).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch.utils.hooks import RemovableHandle
from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel

from paged_backend.kernels import triton
from paged_backend.kernels.paged_attention import paged_attention_triton
from paged_backend.worker.batch_invariant import BatchInvariantMode, attend_one, invariant_rms_norms
from paged_backend.worker.invariant_modules import modules_outside_the_mode, outside_the_mode
from paged_backend.worker.invariant_products import needs_grad
from paged_backend.worker.invariant_siblings import packed_siblings

EXACT_ATTENTION = "paged_backend_exact"
CACHE_BLOCK_SIZE = 16  # the engine's default block size (the kernel's arithmetic does not depend on it)


def uses_kernel(query: torch.Tensor) -> bool:
    """Whether the attention runs the engine's Triton kernel (the engine's own choice: on a GPU, with Triton)."""
    return query.is_cuda and triton is not None


class CacheLayout(NamedTuple):
    """Packed sequences as the paged kernel reads them: where each token goes (``slots`` [T]), each sequence's
    block table (``tables`` [B, W] int32), how many blocks, and the bounds and lengths as int32 (``cu`` [B + 1],
    ``lens`` [B])."""

    slots: torch.Tensor
    tables: torch.Tensor
    blocks: int
    cu: torch.Tensor
    lens: torch.Tensor


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (in-place writes bump it); ``None`` for a tensor made under inference mode, which
    keeps none (the forward pre-hook's emptying of the caches covers those)."""
    return None if t.is_inference() else t._version


# the forward's layout, with the bounds tensor, its version and the token count it was made for (emptied as each
# forward starts)
_LAYOUT: list[tuple[torch.Tensor, int | None, int, CacheLayout]] = []


def _cache_layout(cu_seqlens: torch.Tensor, num_tokens: int) -> CacheLayout:
    """The layout of a paged cache that gives each of the packed sequences (bounds ``cu_seqlens`` [B + 1],
    ``num_tokens`` in all) consecutive blocks of its own. Every layer of a forward asks with the same bounds
    tensor: made once a forward, its dozen small kernels are not launched again per layer."""
    if _LAYOUT:
        bounds, version, tokens, layout = _LAYOUT[0]
        if bounds is cu_seqlens and version == _version(cu_seqlens) and tokens == num_tokens:
            return layout
    layout = _make_cache_layout(cu_seqlens, num_tokens)
    _LAYOUT[:] = [(cu_seqlens, _version(cu_seqlens), num_tokens, layout)]
    return layout


def _make_cache_layout(cu_seqlens: torch.Tensor, num_tokens: int) -> CacheLayout:
    """Computed on the device, without reading the bounds on the host: sequence i starts at block
    ``cu[i] // BS + i``, after every block of the one before."""
    device, bs = cu_seqlens.device, CACHE_BLOCK_SIZE
    cu = cu_seqlens.long()
    num_seqs = cu.shape[0] - 1
    first_block = cu[:-1] // bs + torch.arange(num_seqs, device=device)
    tokens = torch.arange(num_tokens, device=device)
    owner = torch.searchsorted(cu[1:], tokens, right=True)
    slots = tokens - cu[owner] + first_block[owner] * bs
    blocks = num_tokens // bs + num_seqs + 1
    width = num_tokens // bs + 1  # no sequence has more blocks
    tables = (first_block[:, None] + torch.arange(width, device=device)).clamp(max=blocks - 1)
    cu32 = cu.to(torch.int32)
    return CacheLayout(slots, tables.to(torch.int32), blocks, cu32, cu32[1:] - cu32[:-1])


def _causal_attention_gpu(
    query: torch.Tensor,  # [1, H, T, D]: sequences packed back to back
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    cu_seqlens: torch.Tensor,  # [B + 1] the sequences' bounds
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:  # [1, T, H, D]
    """Causal attention within each packed sequence by the engine's fixed-order paged kernel."""
    _, heads, num_tokens, dim = query.shape
    num_kv_heads = key.shape[1]
    layout = _cache_layout(cu_seqlens, num_tokens)

    def as_cache(x: torch.Tensor) -> torch.Tensor:  # [1, Hkv, T, D] -> [blocks, block, Hkv, D]
        cache = x.new_zeros(layout.blocks * CACHE_BLOCK_SIZE, num_kv_heads, dim)
        cache.index_copy_(0, layout.slots, x[0].transpose(0, 1))
        return cache.view(layout.blocks, CACHE_BLOCK_SIZE, num_kv_heads, dim)

    out = paged_attention_triton(
        query[0].transpose(0, 1), as_cache(key), as_cache(value), layout.tables, layout.cu, layout.lens, scale,
        sliding_window, softcap, batch_invariant=True,
    )  # fmt: skip
    return out[None]


def _causal_attention_eager(
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:  # [1, T, H, D]
    """The same attention in plain differentiable fp32 arithmetic (the GPU path's gradient), a sequence at a time
    (its scores are [H, L, L])."""
    per_kv = query.shape[1] // key.shape[1]
    edges = cu_seqlens.tolist()
    outs = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        keys = key[:, :, lo:hi].float().repeat_interleave(per_kv, dim=1)
        values = value[:, :, lo:hi].float().repeat_interleave(per_kv, dim=1)
        scores = query[:, :, lo:hi].float() @ keys.transpose(-1, -2) * scale  # [1, H, L, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        positions = torch.arange(hi - lo, device=query.device)
        hidden = positions[None, :] > positions[:, None]
        if sliding_window is not None:
            hidden |= positions[None, :] <= positions[:, None] - sliding_window
        outs.append(torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1) @ values)
    return torch.cat(outs, dim=2).transpose(1, 2).to(query.dtype)


class _InvariantAttention(torch.autograd.Function):
    """The kernel's values forward, the eager attention's gradient backward."""

    @staticmethod
    def forward(
        ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, *rest: Any
    ) -> torch.Tensor:
        ctx.save_for_backward(query, key, value, cu)
        ctx.rest = rest
        return _causal_attention_gpu(query, key, value, cu, *rest)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, cu = ctx.saved_tensors
        q, k, v = (t.detach().requires_grad_() for t in (query, key, value))
        with torch.enable_grad():
            out = _causal_attention_eager(q, k, v, cu, *ctx.rest)
        grads = torch.autograd.grad(out, (q, k, v), grad)
        return (*grads, None, None, None, None)


_BOUNDS: list[tuple[torch.Tensor, int | None, torch.Tensor | None]] = []  # the forward's (tensor, version, bounds)


def _new_forward(*_: Any) -> None:
    """A forward pre-hook: what the last forward's layers shared is not this one's, even where its tensors are
    the same objects (a trainer may write its next batch's bounds into the same buffer, and tensors made under
    ``torch.inference_mode`` keep no version counter to tell)."""
    _LAYOUT.clear()
    _BOUNDS.clear()


def sequence_bounds(
    batch: int, length: int, cu_seq_lens_q: torch.Tensor | None, position_ids: torch.Tensor | None
) -> torch.Tensor | None:
    """The bounds [B + 1] of the sequences packed into a one-row forward: HF's ``cu_seq_lens_q``, or where
    ``position_ids`` restart at 0 (HF's padding-free packing without it); ``None``: each row is one sequence.
    Every layer gets the same tensors: they are read (a host sync) once a forward."""
    key = cu_seq_lens_q if cu_seq_lens_q is not None else position_ids
    if key is None or (batch != 1 and cu_seq_lens_q is None):
        return None
    if _BOUNDS and _BOUNDS[0][0] is key and _BOUNDS[0][1] == _version(key):
        return _BOUNDS[0][2]
    bounds: torch.Tensor | None = cu_seq_lens_q
    if cu_seq_lens_q is not None:
        if batch != 1:
            raise ValueError(f"cu_seq_lens_q packs sequences into one row: got a batch of {batch} rows")
        if int(cu_seq_lens_q[-1]) != length:
            raise ValueError(f"cu_seq_lens_q ends at {int(cu_seq_lens_q[-1])}: the row has {length} tokens")
    elif position_ids is not None:
        positions = position_ids.reshape(-1)
        starts = torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1
        if starts.numel():  # packed: every sequence from position 0
            if int(positions[0]) != 0 or bool((positions[starts] != 0).any()):
                raise ValueError("position_ids of a packed row must restart at 0 at each sequence")
            edges = torch.tensor([0, length], device=starts.device)
            bounds = torch.cat([edges[:1], starts, edges[1:]])
    _BOUNDS[:] = [(key, _version(key), bounds)]
    return bounds


_ROW_BOUNDS: list[tuple[tuple[int, int, torch.device], torch.Tensor]] = []  # the last rows' bounds made


def _row_bounds(batch: int, length: int, device: torch.device) -> torch.Tensor:
    """The bounds [B + 1] of ``batch`` rows of ``length`` tokens laid back to back: one tensor for every layer of
    a forward, so that ``_cache_layout`` finds its layout made."""
    key = (batch, length, device)
    if not _ROW_BOUNDS or _ROW_BOUNDS[0][0] != key:
        _ROW_BOUNDS[:] = [(key, torch.arange(0, (batch + 1) * length, length, device=device))]
    return _ROW_BOUNDS[0][1]


def exact_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, L, D]
    key: torch.Tensor,  # [B, Hkv, L, D]
    value: torch.Tensor,  # [B, Hkv, L, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's attention as the engine's batch-invariant steps compute it, differentiable: causal over unpadded
    sequences (the mask is not read), or over sequences packed into one row, as HF's ``cu_seq_lens_q`` (a
    forward kwarg, with ``position_ids`` restarting at each sequence) bounds them."""
    batch, heads, length, dim = query.shape
    sliding_window, softcap = sliding_window or None, softcap or None
    scale = scaling if scaling is not None else dim**-0.5
    cu = sequence_bounds(batch, length, kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids"))
    if uses_kernel(query):
        if cu is None:  # each row a sequence: packed back to back
            cu = _row_bounds(batch, length, query.device)
            query, key, value = (x.transpose(0, 1).reshape(1, x.shape[1], -1, dim) for x in (query, key, value))
        args = (query, key, value, cu, scale, sliding_window, softcap)
        if needs_grad(query, key, value):
            return _InvariantAttention.apply(*args).view(batch, length, heads, dim), None
        with outside_the_mode():
            return _causal_attention_gpu(*args).view(batch, length, heads, dim), None
    per_kv = heads // key.shape[1]
    keys = key.transpose(1, 2).float().repeat_interleave(per_kv, dim=2).contiguous()  # [B, L, H, D]
    values = value.transpose(1, 2).float().repeat_interleave(per_kv, dim=2).contiguous()
    if cu is None:
        bounds = [(b, 0, length) for b in range(batch)]
    else:
        edges = cu.tolist()
        bounds = [(0, lo, hi) for lo, hi in zip(edges[:-1], edges[1:])]
    rows = []
    for b, lo, hi in bounds:
        for p in range(lo, hi):
            first = lo if sliding_window is None else max(lo, p - sliding_window + 1)
            rows.append(
                attend_one(query[b, :, p].float(), keys[b, first : p + 1], values[b, first : p + 1], scale, softcap)
            )
    return torch.stack(rows).view(batch, length, heads, -1).to(query.dtype), None


AttentionInterface.register(EXACT_ATTENTION, exact_attention_forward)


def pack_sequences(sequences: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The forward kwargs that run ``sequences`` (1-D token ids, one device) as one packed row under
    :func:`batch_invariant_forward`: ``input_ids`` [1, T], ``position_ids`` restarting at each sequence and HF's
    ``cu_seq_lens_q``. One forward then serves them all, each token with the bits it has alone: the host's work
    per forward is paid once, not once a sequence."""
    if not sequences:
        raise ValueError("pack_sequences needs at least one sequence")
    device = sequences[0].device
    lengths = torch.tensor([0] + [len(s) for s in sequences], device=device)
    return {
        "input_ids": torch.cat(sequences)[None],
        "position_ids": torch.cat([torch.arange(len(s), device=device) for s in sequences])[None],
        "cu_seq_lens_q": lengths.cumsum(0),
    }


@contextlib.contextmanager
def batch_invariant_forward(model: torch.nn.Module) -> Iterator[None]:
    """Inside, the model's own forward computes as ``batch_invariant=True`` steps do: a trainer's no-grad
    logprobs over unpadded sequences (the "old" logprobs of an RL step) equal, bit for bit, the ones the engine
    reported while sampling them, in the model's dtype (fp32 or bf16). On a CPU each linear layer runs a row at a
    time and the attention a query at a time (slow), with autograd on too; on a GPU the engine's blocks of rows,
    norms and attention kernel, and with autograd on the norms take the module's own arithmetic (a gradient, not
    the engine's bits). The model must be the one the engine ran: its packed sibling projections are found by
    their shared buffers."""
    configs = {
        id(c): c for c in [getattr(m, "config", None) for m in model.modules()] if isinstance(c, PretrainedConfig)
    }
    previous = {key: c._attn_implementation_internal for key, c in configs.items()}
    device = next(model.parameters()).device
    hooks: list[RemovableHandle] = []
    try:
        for c in configs.values():
            c._attn_implementation_internal = EXACT_ATTENTION
        roots = [m for m in model.modules() if m is model or isinstance(m, PreTrainedModel)]  # where a forward starts
        hooks += [m.register_forward_pre_hook(_new_forward) for m in roots]
        norms = invariant_rms_norms(model, device)
        outside = modules_outside_the_mode(model, norms, EXACT_ATTENTION)
        with BatchInvariantMode(norms, packed_siblings(model), outside):
            yield
    finally:
        for hook in hooks:
            hook.remove()
        _new_forward()
        for key, c in configs.items():
            c._attn_implementation_internal = previous[key]
