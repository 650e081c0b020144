"""Multi-LoRA: adapters loaded on first use into a CPU cache, and the ones a step needs copied to ``max_loras``
device LoRA indices (vLLM's punica layout: each index holds one adapter's A and B) that every LoRA-able layer
reads.

Each LoRA-able base layer (``TARGET_MODULES``) keeps its own weights and gets a forward hook that adds, per token,
the delta of the adapter at that token's LoRA index (``kernels/lora.py``); each index's tensors are zero-padded to
``max_lora_rank``. Every tensor the hook reads stays in place (indices are filled by copying, each step's token
indices are written into one buffer, -1 where no adapter applies), and the hook always runs: a compiled layer and
a captured CUDA graph read whatever the current step put there. The scheduler never runs more distinct adapters in
one step than there are indices, so placing a step's adapters only ever evicts indices it does not use (least
recently used first).

Under tensor parallelism every rank has a manager for its shard: A and B are cut like the layer they modify (a
colwise layer keeps B's rows of its outputs, a rowwise one A's columns of its inputs, whose partial deltas the
layer's all-reduce then sums, so the hook runs before it). Every rank places the same adapters at the same
indices: placement depends only on the sequence of steps and their adapters, which every rank receives.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from paged_backend.config import EngineConfig, LoRAConfig
from paged_backend.kernels.lora import lora_delta_op
from paged_backend.lora.adapter import TARGET_MODULES, LoRAAdapter, load_adapter
from paged_backend.lora.request import LoRARequest
from paged_backend.model_loader.tp_plan import TPShard, tp_shard_of
from paged_backend.model_structure import module_tensor

logger = logging.getLogger(__name__)


_LORA_A, _LORA_B = "paged_lora_a", "paged_lora_b"  # buffer names on each LoRA-able layer


def _in_out(module: nn.Module) -> tuple[int, int] | None:
    from paged_backend.quantization.awq import AWQLinear
    from paged_backend.quantization.fp8 import FP8Linear
    from paged_backend.quantization.fp8_block import FP8BlockLinear

    # the delta needs the layer's input and output, not its weight: quantized layers take adapters too
    if isinstance(module, (nn.Linear, AWQLinear, FP8Linear, FP8BlockLinear)):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D":  # GPT-2: weight [in, out]
        fan_in, fan_out = module_tensor(module, "weight").shape
        return fan_in, fan_out
    return None


def _full_in_out(local: tuple[int, int], shard: TPShard | None) -> tuple[int, int]:
    """A sharded layer's (in, out) before the cut: what an adapter's A and B are shaped for."""
    if shard is None:
        return local
    return (local[0], shard.full_features) if shard.style == "colwise" else (shard.full_features, local[1])


def max_lora_tokens(config: EngineConfig) -> int:
    """Token entries to hold: the most tokens one forward carries, plus a compiled step's padding."""
    return config.max_tokens_per_forward + 8


class LoRAManager:
    def __init__(
        self, model: nn.Module, config: LoRAConfig, device: torch.device, dtype: torch.dtype, max_num_tokens: int
    ) -> None:
        self.config = config
        self.device = device
        self.shapes: dict[str, tuple[int, int]] = {}  # (in, out) an adapter is shaped for
        self.shards: dict[str, TPShard] = {}  # the slice each layer keeps under tensor parallelism
        self.modules: list[nn.Module] = []  # the layers holding LoRA buffers
        self.hooks: list[Any] = []  # removed by close(): the model may be the user's and outlive the engine
        self.lora_a: dict[str, torch.Tensor] = {}  # [S, R, in]
        self.lora_b: dict[str, torch.Tensor] = {}  # [S, out, R]
        indices, rank = config.max_loras, config.max_lora_rank
        for name, module in model.named_modules():
            shape = _in_out(module) if name.rpartition(".")[2] in TARGET_MODULES else None
            if shape is None:
                continue
            shard = tp_shard_of(module)
            if shard is not None:
                self.shards[name] = shard
            self.shapes[name] = _full_in_out(shape, shard)
            self.lora_a[name] = torch.zeros(indices, rank, shape[0], dtype=dtype, device=device)
            self.lora_b[name] = torch.zeros(indices, shape[1], rank, dtype=dtype, device=device)
            # Buffers of the layer itself, read by one hook shared by all: a compiled decoder layer then takes them
            # as inputs, like its weights, and one graph serves every layer.
            module.register_buffer(_LORA_A, self.lora_a[name], persistent=False)
            module.register_buffer(_LORA_B, self.lora_b[name], persistent=False)
            self.modules.append(module)
            # prepend: before a rowwise layer's all-reduce, which then sums the ranks' partial deltas too
            self.hooks.append(module.register_forward_hook(self._add_delta, prepend=True))
        if not self.shapes:
            raise ValueError(f"enable_lora: {type(model).__name__} has no layer named one of {list(TARGET_MODULES)}")
        self.cpu_cache: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_int_id -> adapter, LRU order
        self.known: dict[int, tuple[str, str]] = {}  # lora_int_id -> (name, path), for the engine's lifetime
        self.index_to_lora_id: list[int | None] = [None] * indices  # lora_int_id in each index
        self.index_last_used: list[int] = [0] * indices  # last step that used each index
        # [max_num_tokens] this step's index per token, -1 = base model (and every row past the step's tokens)
        self.token_lora_indices = torch.full((max_num_tokens,), -1, dtype=torch.long, device=device)
        # Written on the host, copied without a sync: the previous copy has run by the time the engine (or, under
        # tensor parallelism, the previous step's all-reduces) read back the previous step.
        # Two pinned buffers, used in turn: a step may be queued while the previous one's copy is still pending.
        self._staging = torch.empty(2, max_num_tokens, dtype=torch.long, pin_memory=device.type == "cuda")
        self._copied = [torch.cuda.Event() for _ in range(2)] if device.type == "cuda" else []  # see cuda_graphs.py
        self.num_loads = 0  # adapters read from disk
        self.num_activations = 0  # adapters copied into a device index
        self._steps = 0

    def _add_delta(self, module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        x = args[0].reshape(-1, args[0].shape[-1])  # [T, in]
        indices = self.token_lora_indices[: x.shape[0]]  # [T]
        delta = lora_delta_op(x, getattr(module, _LORA_A), getattr(module, _LORA_B), indices)  # [T, out]
        return out + delta.view(out.shape)

    # ------------------------------------------------------------------ adapters
    def get(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter, from the CPU cache or read (and checked) from its folder; a bad adapter raises for this
        request only. An id names one adapter (name and path) for the engine's lifetime: the indices and the prefix
        cache know adapters by id."""
        identity = (request.lora_name, request.lora_path)
        known = self.known.get(request.lora_int_id)
        if known is not None and known != identity:
            raise ValueError(
                f"lora_int_id {request.lora_int_id} is adapter {known[0]!r} ({known[1]}), not {identity[0]!r} "
                f"({identity[1]}): each adapter needs its own id"
            )
        adapter = self.cpu_cache.get(request.lora_int_id)
        if adapter is not None:
            self.cpu_cache.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_adapter(request, self.shapes, self.config.max_lora_rank)
        self.known[request.lora_int_id] = identity
        self.num_loads += 1
        self.cpu_cache[request.lora_int_id] = adapter
        limit = self.config.max_cpu_loras
        while limit is not None and len(self.cpu_cache) > limit:
            evicted, _ = self.cpu_cache.popitem(last=False)  # unfinished requests keep their own reference
            logger.debug("LoRA %d evicted from the CPU cache", evicted)
        return adapter

    def close(self) -> None:
        """Take the hooks and buffers off the model."""
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
        for module in self.modules:
            for buffer in (_LORA_A, _LORA_B):
                module._buffers.pop(buffer, None)
        self.modules.clear()

    def set_step(self, adapters: Sequence[LoRAAdapter | None], num_tokens: Sequence[int]) -> None:
        """Place this step's adapters in indices and set each token's index (sequence i has ``num_tokens[i]``)."""
        self._steps += 1
        seq_indices = [-1 if a is None else self._index_for(a) for a in adapters]
        per_token = None
        if any(s >= 0 for s in seq_indices):  # else a base-model step: every index stays -1
            per_token = np.repeat(np.asarray(seq_indices, dtype=np.int64), np.asarray(num_tokens, dtype=np.int64))
        self._write_token_lora_indices(per_token)

    @contextlib.contextmanager
    def step(
        self,
        adapters: Sequence[LoRAAdapter | None] | None,
        lora_requests: Sequence[LoRARequest | None] | None,
        num_tokens: Sequence[int],
    ) -> Iterator[None]:
        """The step's adapters at the device's LoRA indices and each token's index, for the forwards inside. Rank 0
        has each request's adapter in hand (``adapters``); other ranks (None) read theirs by request (cached after
        the first step) and place them alike: placement depends only on the order of steps and their adapters."""
        if adapters is None:
            adapters = [None if r is None else self.get(r) for r in lora_requests or []]
        self.set_step(adapters, num_tokens)
        try:
            yield
        finally:
            self.clear_step()

    def profile_step(self) -> None:
        """Every token through index 0 (zeros until filled): the memory profile's forward computes every delta."""
        self.token_lora_indices.fill_(0)

    def clear_step(self) -> None:
        self.token_lora_indices.fill_(-1)

    def _write_token_lora_indices(self, per_token: np.ndarray | None) -> None:
        index = self._steps % 2
        staging = self._staging[index]
        if self._copied:
            self._copied[index].synchronize()  # its previous copy has run
        full = staging.numpy()
        full.fill(-1)
        if per_token is not None:
            if per_token.shape[0] > full.shape[0]:
                raise ValueError(f"{per_token.shape[0]} tokens in one step; LoRA indices hold {full.shape[0]}")
            full[: per_token.shape[0]] = per_token
        self.token_lora_indices.copy_(staging, non_blocking=True)
        if self._copied:
            self._copied[index].record()

    def _index_for(self, adapter: LoRAAdapter) -> int:
        if adapter.int_id in self.index_to_lora_id:
            index = self.index_to_lora_id.index(adapter.int_id)
        else:
            free = [i for i, used in enumerate(self.index_last_used) if used < self._steps]  # not used by this step
            if not free:
                raise RuntimeError(f"more than max_loras={self.config.max_loras} adapters in one step")
            index = min(free, key=lambda i: (self.index_to_lora_id[i] is not None, self.index_last_used[i]))
            self._activate(index, adapter)
        self.index_last_used[index] = self._steps
        return index

    @torch.no_grad()
    def _activate(self, index: int, adapter: LoRAAdapter) -> None:
        for name in self.shapes:
            a, b = self.lora_a[name][index], self.lora_b[name][index]
            a.zero_()
            b.zero_()
            if name in adapter.weights:
                wa, wb = adapter.weights[name]  # [r, in], [out, r], as shaped for one device
                shard = self.shards.get(name)
                if shard is not None and shard.style == "colwise":
                    wb = wb[shard.start : shard.stop]
                elif shard is not None:
                    wa = wa[:, shard.start : shard.stop]
                a[: adapter.rank].copy_(wa)
                b[:, : adapter.rank].copy_(wb)
        self.index_to_lora_id[index] = adapter.int_id
        self.num_activations += 1
