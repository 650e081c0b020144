"""The paged KV cache tensors: per layer ``[num_blocks, block_size, Hkv, D]`` for k and for v (on a GPU stored
head-major, an fp8 value cache transposed, under that shape: kernels/cache_write.py), and the swap space in CPU
memory, indexed alike (token-major: blocks move between the two by index, not as raw bytes). An
fp8 cache also has per layer a float32 scale per KV head for k and for v (the cache holds ``k / k_scale``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from paged_backend.kernels.cache_write import new_kv_cache
from paged_backend.kernels.ops import write_kv_cache_op


@dataclass(frozen=True)
class KVCacheSpec:
    """KV geometry read from the model config (GPT-2's ``n_head``/``n_embd`` map through ``attribute_map``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    # speculative decoding's draft model keeps a cache of its own beside this one, block for block: a block of
    # the scheduler's costs both (worker/draft_runner.py)
    draft: KVCacheSpec | None = None

    @classmethod
    def from_config(cls, config: PretrainedConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> KVCacheSpec:
        """``dtype``: the model's; ``kv_cache_dtype``: ``CacheConfig.kv_cache_dtype``."""
        cfg = config.get_text_config()
        num_heads = cfg.num_attention_heads
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        cache_dtype = dtype if kv_cache_dtype == "auto" else torch.float8_e4m3fn
        return cls(cfg.num_hidden_layers, num_kv_heads, head_dim, cache_dtype)

    @property
    def scaled(self) -> bool:
        """Whether the cache stores scaled values (fp8)."""
        return self.dtype == torch.float8_e4m3fn

    def bytes_per_block(self, block_size: int) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        draft = 0 if self.draft is None else self.draft.bytes_per_block(block_size)
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * element + draft


class SwapSpace:
    """The swap space: the cache's shape in CPU memory (token-major), pinned on a GPU machine. Page-locking the
    default 4 GiB takes seconds of a start-up, so a thread of its own allocates it while the decoder layer
    compiles; the model runner waits for it before capturing CUDA graphs (a host allocation during a capture would
    break it), and an allocation that failed stops the start there. Left unwritten (a block is read back only after
    a swap-out wrote all of it): zeroing it would be start-up time for nothing."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, num_layers: int, device: torch.device) -> None:
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._error: BaseException | None = None
        if device.type == "cuda" and device.index is None:  # the engine's device, as this thread sees it
            device = torch.device("cuda", torch.cuda.current_device())
        args = (shape, dtype, num_layers, device)
        self._thread = threading.Thread(target=self._allocate, args=args, name="swap-space", daemon=True)
        if num_layers:  # else no swap space: nothing to allocate
            self._thread.start()

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype, num_layers: int, device: torch.device) -> None:
        try:
            pin = device.type == "cuda"
            if pin:  # a new thread's current device is the first GPU: pin under the engine's own
                torch.cuda.set_device(device)
            empty = [torch.empty(shape, dtype=dtype, pin_memory=pin) for _ in range(2 * num_layers)]
            self._caches = list(zip(empty[0::2], empty[1::2]))
        except BaseException as exc:  # noqa: BLE001 - raised by caches(), in the thread that waits for it
            self._error = exc

    def join(self) -> None:
        """Wait until the allocation has ended (or failed)."""
        if self._thread.ident is not None:
            self._thread.join()

    def caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) ``[num_cpu_blocks, block_size, Hkv, D]``, once allocated."""
        self.join()
        if self._error is not None:
            raise RuntimeError(f"allocating the swap space failed: {self._error}") from self._error
        return self._caches


class CacheEngine:
    """Allocates the cache once and moves blocks for copy-on-write."""

    def __init__(
        self, spec: KVCacheSpec, num_blocks: int, block_size: int, device: torch.device, num_cpu_blocks: int = 0
    ) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_caches = [new_kv_cache(shape, spec.dtype, device) for _ in range(spec.num_layers)]
        ones = [torch.ones(spec.num_kv_heads, dtype=torch.float32, device=device) for _ in range(2 * spec.num_layers)]
        self.kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = (
            list(zip(ones[0::2], ones[1::2])) if spec.scaled else None
        )
        cpu_shape = (num_cpu_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.swap_space = SwapSpace(cpu_shape, spec.dtype, spec.num_layers if num_cpu_blocks else 0, device)

    def write_tokens(
        self, kv: list[tuple[torch.Tensor, torch.Tensor]], block_table: list[int], dtype: torch.dtype
    ) -> None:
        """Write the keys and values of a sequence's first tokens (per layer [P, Hkv, D], any device) into its
        slots (an fp8 cache scales them as it writes)."""
        device = self.kv_caches[0][0].device
        table = torch.tensor(block_table, dtype=torch.long)
        positions = torch.arange(kv[0][0].shape[0])
        slots = (table[positions // self.block_size] * self.block_size + positions % self.block_size).to(device)
        for layer, ((key, value), (k_cache, v_cache)) in enumerate(zip(kv, self.kv_caches)):
            k_scale, v_scale = self.kv_scales[layer] if self.kv_scales is not None else (None, None)
            write_kv_cache_op(key.to(device, dtype), value.to(device, dtype), k_cache, v_cache, slots, k_scale, v_scale)

    def release(self) -> None:
        """Give the device cache's memory back, keeping the tensors (what refers to them stays valid in shape;
        their contents are gone). The swap space is host memory and stays."""
        for k_cache, v_cache in self.kv_caches:
            k_cache.untyped_storage().resize_(0)
            v_cache.untyped_storage().resize_(0)

    def restore(self) -> None:
        """Allocate the device cache again (zeros) after ``release``: new memory, so new addresses."""
        for k_cache, v_cache in self.kv_caches:
            for cache in (k_cache, v_cache):
                cache.untyped_storage().resize_(cache.numel() * cache.element_size())
                cache.zero_()

    @property
    def released(self) -> bool:
        return self.kv_caches[0][0].untyped_storage().nbytes() == 0 if self.kv_caches else False

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy (device block, CPU block) pairs to the swap space."""
        if not mapping:
            return
        src = torch.tensor([s for s, _ in mapping], device=self.kv_caches[0][0].device)
        dst = torch.tensor([d for _, d in mapping])
        for (k_cache, v_cache), (k_cpu, v_cpu) in zip(self.kv_caches, self.swap_space.caches()):
            _bytes(k_cpu).index_copy_(0, dst, _bytes(k_cache).index_select(0, src).cpu())
            _bytes(v_cpu).index_copy_(0, dst, _bytes(v_cache).index_select(0, src).cpu())

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy (CPU block, device block) pairs back from the swap space."""
        if not mapping:
            return
        device = self.kv_caches[0][0].device
        src = torch.tensor([s for s, _ in mapping])
        dst = torch.tensor([d for _, d in mapping], device=device)
        for (k_cache, v_cache), (k_cpu, v_cpu) in zip(self.kv_caches, self.swap_space.caches()):
            _bytes(k_cache).index_copy_(0, dst, _bytes(k_cpu).index_select(0, src).to(device, non_blocking=True))
            _bytes(v_cache).index_copy_(0, dst, _bytes(v_cpu).index_select(0, src).to(device, non_blocking=True))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        device = self.kv_caches[0][0].device
        src = torch.tensor([s for s, _ in copies], device=device)
        dst = torch.tensor([d for _, d in copies], device=device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    """A cache's bytes, block-first: blocks move as bytes (CPU torch has no ``index_copy_`` for fp8)."""
    return cache.view(torch.uint8)
