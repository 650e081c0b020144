"""The attention function registered with transformers' ``AttentionInterface``.

We do not port architectures: the user's HF model runs its own ``forward`` on a flattened batch, and every
attention layer calls :func:`paged_attention_forward` with the new tokens' q/k/v. It writes k/v into the paged
cache and attends over each sequence's cached context through its block table, using the metadata the model
runner passes as the ``attn_metadata`` forward kwarg (transformers forwards extra kwargs to attention).
Because our name has no mask function registered, transformers builds no attention mask for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel

from paged_backend.kernels.attention_twin import TwinGroup
from paged_backend.kernels.ops import paged_attention, paged_attention_op, write_kv_cache, write_kv_cache_op
from paged_backend.worker.batch_invariant import exact_attention
from paged_backend.worker.invariant_modules import outside_the_mode

ATTN_IMPLEMENTATION = "paged_backend"
# Inside the engine's forward each attention module carries its layer's (k_cache, v_cache) under this name. Reading
# it from the module (rather than indexing a list by ``layer_idx``) lets torch.compile reuse one compiled decoder
# layer for every layer: an int like layer_idx would be specialised on, a tensor attribute is a graph input.
KV_CACHE_ATTR = "paged_kv_cache"
KV_SCALE_ATTR = "paged_kv_scale"  # an fp8 cache's (k_scale, v_scale) of the layer, [Hkv] fp32 each
KV_CALIBRATE_ATTR = "paged_kv_calibrate"  # set for the one step that sets those scales (calculate_kv_scales)
# calculate_kv_scales maps the first step's largest key to 192 and value to 96: fp8 goes to 448, so later tokens
# up to 2.3x (keys) and 4.7x (values) larger still fit before saturating. Both are e4m3 values; vLLM's 200 and
# 100 are midpoints between two (192|208, 96|104), where the largest value's last-bit noise picks its rounding.
K_SCALE_CONSTANT, V_SCALE_CONSTANT = 192.0, 96.0


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token (-1: padding, not written)
    block_tables: torch.Tensor  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32, new-token offsets per sequence
    context_lens: torch.Tensor  # [B] int64, cached + new tokens per sequence
    exact: bool = False  # batch_invariant: each query's sums in one fixed order (worker/batch_invariant.py)
    # The torch twin's plan of this step by sliding window (kernels/attention_twin.py), made by its first layer;
    # None: made in every layer (metadata whose tensors are rewritten in place between steps: CUDA graphs')
    twin_plans: dict[int | None, list[TwinGroup]] | None = None


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    attn_metadata: AttentionMetadata | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    if attn_metadata is None:
        raise RuntimeError(
            f"the '{ATTN_IMPLEMENTATION}' attention implementation only runs inside the paged engine "
            "(it needs the attn_metadata forward kwarg)"
        )
    if query.shape[0] != 1:
        raise RuntimeError(f"the paged engine runs a flattened batch of size 1, got batch size {query.shape[0]}")
    kv_cache = getattr(module, KV_CACHE_ATTR, None)
    if kv_cache is None:
        raise RuntimeError(
            f"{type(module).__name__} got no paged KV cache: the engine gives one to each module whose int "
            "layer_idx is below the model's number of layers"
        )
    k_cache, v_cache = kv_cache  # each [num_blocks, block_size, Hkv, D]
    k_scale, v_scale = getattr(module, KV_SCALE_ATTR, None) or (None, None)
    if getattr(module, KV_CALIBRATE_ATTR, False) and k_scale is not None and v_scale is not None:
        kept = attn_metadata.slot_mapping >= 0  # not padding
        set_scale(k_scale, key[0].transpose(0, 1)[kept], K_SCALE_CONSTANT)
        set_scale(v_scale, value[0].transpose(0, 1)[kept], V_SCALE_CONSTANT)
    if scaling is None:
        scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)  # [T, Hkv, D]
    v = value[0].transpose(0, 1)  # [T, Hkv, D]
    tables, cu_seqlens_q, context_lens = (
        attn_metadata.block_tables,
        attn_metadata.cu_seqlens_q,
        attn_metadata.context_lens,
    )
    if torch.compiler.is_compiling():  # opaque custom ops inside a compiled graph
        write_kv_cache_op(k, v, k_cache, v_cache, attn_metadata.slot_mapping, k_scale, v_scale)
        out = paged_attention_op(
            q,
            k_cache,
            v_cache,
            tables,
            cu_seqlens_q,
            context_lens,
            scaling,
            sliding_window or 0,
            softcap or 0.0,
            k_scale,
            v_scale,
        )
    else:
        with outside_the_mode():  # batch_invariant's mode computes nothing here its own way
            write_kv_cache(k, v, k_cache, v_cache, attn_metadata.slot_mapping, k_scale, v_scale)
            args = (q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, scaling, sliding_window, softcap)
            if attn_metadata.exact and not q.is_cuda:  # the torch twin pads each group's contexts: not invariant
                out = exact_attention(*args, k_scale, v_scale)
            else:
                out = paged_attention(
                    *args, k_scale, v_scale, batch_invariant=attn_metadata.exact, twin_plans=attn_metadata.twin_plans
                )
    return out.unsqueeze(0), None  # [1, T, H, D]


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def set_scale(scale: torch.Tensor, rows: torch.Tensor, target: float) -> None:
    """``scale`` [Hkv] such that each head's largest magnitude in ``rows`` [T, Hkv, D] maps to ``target``
    (an all-zero head keeps 1)."""
    amax = rows.abs().amax(dim=(0, 2)).float() if rows.shape[0] else torch.zeros_like(scale)
    scale.copy_(torch.where(amax > 0, amax / target, torch.ones_like(amax)))


def check_model_supported(model: PreTrainedModel | type[PreTrainedModel], config: PretrainedConfig) -> None:
    """Fail clearly for architectures whose attention does not go through ``ALL_ATTENTION_FUNCTIONS``. Takes the
    model or only its class, so a checkpoint is checked from its ``config.json`` before its weights load."""
    model_class = model if isinstance(model, type) else type(model)
    supported = getattr(model_class, "_supports_attention_backend", False)
    if supported:
        can_set = getattr(model_class, "_can_set_attn_implementation", None)
        supported = can_set() if callable(can_set) else True
    if not supported:
        arch = ", ".join(getattr(config, "architectures", None) or [model_class.__name__])
        raise ValueError(
            f"architecture {arch} is not supported: its modeling code does not route attention through "
            "transformers' ALL_ATTENTION_FUNCTIONS (supported examples: Llama, Mistral, Qwen2/3, Gemma, "
            "Phi3, GPT-2, OPT, GPT-NeoX, Mixtral)"
        )


class PagedAttentionSwitch:
    """Routes the model's attention to us only inside ``with switch:``, so the user's own ``generate`` on the
    same model object keeps its original attention implementation, and hands every module with a ``layer_idx``
    its layer's KV cache for that time. Configs and modules are collected once. A model left in train mode (a
    trainer's, between its steps) runs in eval mode inside: our steps are inference (no dropout), and compiled
    layers, traced in eval mode, are not traced again for the flag."""

    def __init__(
        self,
        model: PreTrainedModel,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        configs = [model.config] + [getattr(m, "config", None) for m in model.modules()]
        self.configs: list[PretrainedConfig] = list(
            {id(c): c for c in configs if isinstance(c, PretrainedConfig)}.values()
        )
        self.layer_caches: list[tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]] = []
        self.layer_scales: list[tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]] = []
        for m in model.modules():
            layer_idx = getattr(m, "layer_idx", None)
            if isinstance(layer_idx, int) and 0 <= layer_idx < len(kv_caches):
                self.layer_caches.append((m, kv_caches[layer_idx]))
                if kv_scales is not None:
                    self.layer_scales.append((m, kv_scales[layer_idx]))
        self.model = model
        # (module, whether its class keeps nn.Module's __setattr__: its flag can then be set through __dict__)
        self.modules = [(m, type(m).__setattr__ is torch.nn.Module.__setattr__) for m in model.modules()]
        self.previous: list[str | None] = []
        self.training: list[tuple[torch.nn.Module, bool]] = []
        self.depth = 0

    def __enter__(self) -> None:
        self.depth += 1
        if self.depth > 1:  # already switched: re-entering is a no-op
            return
        self.previous = [c._attn_implementation_internal for c in self.configs]
        self.training = [(m, plain) for m, plain in self.modules if m.training] if self.model.training else []
        for module, plain in self.training:
            _set_training(module, False, plain)
        for c in self.configs:
            c._attn_implementation_internal = ATTN_IMPLEMENTATION
        for module, kv_cache in self.layer_caches:
            module.__dict__[KV_CACHE_ATTR] = kv_cache  # skips nn.Module.__setattr__'s checks, once per layer and step
        for module, kv_scale in self.layer_scales:
            module.__dict__[KV_SCALE_ATTR] = kv_scale

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1
        if self.depth > 0:
            return
        for c, previous in zip(self.configs, self.previous):
            c._attn_implementation_internal = previous
        for module, plain in self.training:
            _set_training(module, True, plain)
        for module, _ in self.layer_caches:
            module.__dict__.pop(KV_CACHE_ATTR, None)
            module.__dict__.pop(KV_SCALE_ATTR, None)

    @contextlib.contextmanager
    def calibrating(self) -> Iterator[None]:
        """Inside: each layer's forward sets its fp8 scales from the step's keys and values, before writing."""
        for module, _ in self.layer_scales:
            module.__dict__[KV_CALIBRATE_ATTR] = True
        try:
            yield
        finally:
            for module, _ in self.layer_scales:
                module.__dict__.pop(KV_CALIBRATE_ATTR, None)


def _set_training(module: torch.nn.Module, flag: bool, plain: bool) -> None:
    """``module.training = flag``; for a class that keeps ``nn.Module.__setattr__`` straight into ``__dict__``,
    skipping that method's checks (a step sets it for every module of a model left in train mode, twice)."""
    if plain:
        module.__dict__["training"] = flag
    else:  # a TorchScript module, a compiled wrapper: their own __setattr__ passes the flag on
        module.training = flag
