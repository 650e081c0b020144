"""Which slice of each weight a tensor-parallel rank holds, and cutting a model down to it.

The plan is the model's own ``base_model_tp_plan`` (transformers ships one for Llama, Mistral, Qwen2/3 and
more): ``colwise`` layers (q/k/v, gate/up) keep a contiguous block of output rows, so each rank computes whole
heads and a slice of the MLP's hidden units; ``rowwise`` layers (o, down) keep the matching block of input
columns, and their partial outputs are summed across ranks (an all-reduce). Everything else (embeddings, norms,
the LM head) is replicated. K/V heads fewer than the ranks are replicated: each rank keeps the one KV head its
query heads read, the documented fallback of vLLM.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from paged_backend.model_structure import set_module_attribute
from paged_backend.quantization.awq import AWQLinear
from paged_backend.quantization.fp8 import FP8Linear
from paged_backend.quantization.fp8_block import FP8BlockLinear

STYLES = ("colwise", "rowwise")
LINEARS = (nn.Linear, AWQLinear, FP8Linear, FP8BlockLinear)  # the layers a plan cuts


class AllReduce(Protocol):
    """The sum of a rowwise layer's partial output over the ranks, hooked on the layer's output: in place
    (returning None) or as a returned tensor. The process group that provides it (``paged_backend.distributed``)
    is the caller's: the loader only hooks it on, so it depends on no process group."""

    def __call__(self, x: torch.Tensor, /) -> torch.Tensor | None: ...


@dataclass(frozen=True)
class HeadLayout:
    """How attention heads split over ``world_size`` ranks."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    world_size: int

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.world_size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.world_size)

    def kv_heads_of(self, rank: int) -> range:
        """The KV heads rank ``rank`` keeps: its own block, or (fewer KV heads than ranks) the one its query heads
        are grouped with."""
        if self.num_kv_heads >= self.world_size:
            return range(rank * self.local_kv_heads, (rank + 1) * self.local_kv_heads)
        first_query_head = rank * self.local_heads
        kv = first_query_head // (self.num_heads // self.num_kv_heads)
        return range(kv, kv + 1)


@dataclass(frozen=True)
class TPShard:
    """The slice a sharded linear keeps, recorded on it (``linear.tp_shard``) for whatever must be cut alike (LoRA's
    B rows of a colwise layer, A columns of a rowwise one)."""

    style: str  # "colwise": output rows start:stop; "rowwise": input columns start:stop
    start: int
    stop: int
    full_features: int  # the cut dimension's size on one device


def head_layout(config: PretrainedConfig, world_size: int) -> HeadLayout:
    """Validate that the model splits over ``world_size`` ranks, naming what does not divide."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    if num_heads % world_size:
        raise ValueError(f"tensor_parallel_size={world_size} must divide the model's {num_heads} attention heads")
    if num_kv_heads >= world_size and num_kv_heads % world_size:
        raise ValueError(
            f"tensor_parallel_size={world_size} must divide the model's {num_kv_heads} KV heads "
            f"(or exceed them, which replicates KV heads)"
        )
    if num_kv_heads < world_size and world_size % num_kv_heads:
        raise ValueError(
            f"with fewer KV heads ({num_kv_heads}) than ranks, tensor_parallel_size={world_size} must be a "
            "multiple of them"
        )
    intermediate = getattr(config, "intermediate_size", None)
    if intermediate is not None and intermediate % world_size:
        raise ValueError(f"tensor_parallel_size={world_size} must divide intermediate_size={intermediate}")
    return HeadLayout(num_heads, num_kv_heads, head_dim, world_size)


def tp_plan(model: PreTrainedModel) -> dict[str, str]:
    """Module name -> ``colwise`` / ``rowwise`` for every linear (nn, AWQ or FP8) the model's ``base_model_tp_plan``
    covers. A model without a plan is refused, naming its architecture."""
    config = model.config
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise NotImplementedError(
            f"{type(model).__name__} has no base_model_tp_plan in its config: tensor parallelism is not "
            "available for this architecture"
        )
    prefix = getattr(model, "base_model_prefix", "")
    resolved: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LINEARS):
            continue
        local = name[len(prefix) + 1 :] if prefix and name.startswith(prefix + ".") else name
        for pattern, style in plan.items():
            if not fnmatch.fnmatchcase(local, pattern):
                continue
            if style not in STYLES:  # e.g. Phi3's colwise_gather_output: skipping it would split heads wrongly
                raise NotImplementedError(
                    f"{type(model).__name__}'s base_model_tp_plan shards {name} as {style!r}; tensor parallelism "
                    f"supports {list(STYLES)}"
                )
            resolved[name] = style
    return resolved


def _output_range(name: str, out_features: int, layout: HeadLayout, rank: int) -> tuple[int, int]:
    """The output rows a colwise layer keeps: whole heads for q/k/v, a contiguous block otherwise."""
    d = layout.head_dim
    if name.endswith(("k_proj", "v_proj")):
        heads = layout.kv_heads_of(rank)
        return heads.start * d, heads.stop * d
    if name.endswith("q_proj"):
        return rank * layout.local_heads * d, (rank + 1) * layout.local_heads * d
    size = out_features // layout.world_size
    return rank * size, (rank + 1) * size


def _keep(tensor: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    return tensor.narrow(dim, start, stop - start).clone()


def _keep_blocks(name: str, linear: FP8BlockLinear, dim: int, start: int, stop: int) -> None:
    """A block-wise FP8 layer's outputs (``dim`` 0) or inputs (1) ``start:stop`` with their scales: whole blocks
    of one scale each (the layer's last block may be short)."""
    block = linear.block_n if dim == 0 else linear.block_k
    if start % block or (stop % block and stop != linear.weight.shape[dim]):
        raise ValueError(
            f"{name}: block-wise FP8 has one scale per {block} {('outputs', 'inputs')[dim]}; this rank's "
            f"{start}:{stop} splits a block"
        )
    linear.weight = _keep(linear.weight, dim, start, stop)
    linear.weight_scale_inv = _keep(linear.weight_scale_inv, dim, start // block, -(-stop // block))


def tp_shard_of(module: nn.Module) -> TPShard | None:
    """The slice ``shard_linear`` recorded on a layer (``module.tp_shard``); None on a layer it did not cut."""
    shard = getattr(module, "tp_shard", None)
    return shard if isinstance(shard, TPShard) else None


@torch.no_grad()
def shard_linear(
    name: str,
    linear: nn.Module,
    style: str,
    layout: HeadLayout,
    rank: int,
    all_reduce: AllReduce | None,
) -> None:
    """Cut one planned linear (``colwise`` or ``rowwise``; one of ``LINEARS``) in place down to rank ``rank``'s
    slice. AWQ's packed tensors are cut on whole packs of eight outputs and whole groups of inputs; FP8's
    per-output-channel scales go with their rows; block-wise FP8 is cut on whole blocks.
    A rowwise bias is added once, on rank 0; ``all_reduce`` (sum over ranks, in place or returned) is hooked on a
    rowwise layer's output, None leaves the partial sums to the caller (a single-process check)."""
    if not isinstance(linear, LINEARS):  # tp_plan() names only these
        raise TypeError(f"{name}: tensor parallelism cuts {[c.__name__ for c in LINEARS]}, not {type(linear).__name__}")
    if style == "colwise":
        start, stop = _output_range(name, linear.out_features, layout, rank)
        if isinstance(linear, AWQLinear):
            if start % 8 or stop % 8:
                raise ValueError(
                    f"{name}: AWQ packs 8 outputs per int32; rank {rank}'s outputs {start}:{stop} split one"
                )
            linear.qweight = _keep(linear.qweight, 1, start // 8, stop // 8)
            linear.qzeros = _keep(linear.qzeros, 1, start // 8, stop // 8)
            linear.scales = _keep(linear.scales, 1, start, stop)
        elif isinstance(linear, FP8Linear):
            linear.weight = _keep(linear.weight, 0, start, stop)
            linear.weight_scale = _keep(linear.weight_scale, 0, start, stop)
        elif isinstance(linear, FP8BlockLinear):
            _keep_blocks(name, linear, 0, start, stop)
        else:
            linear.weight = nn.Parameter(_keep(linear.weight, 0, start, stop), requires_grad=False)
        if isinstance(linear.bias, torch.Tensor):
            linear.bias = nn.Parameter(_keep(linear.bias, 0, start, stop), requires_grad=False)
        set_module_attribute(linear, "tp_shard", TPShard(style, start, stop, linear.out_features))
        linear.out_features = stop - start
        return
    size = linear.in_features // layout.world_size
    start, stop = rank * size, (rank + 1) * size
    if isinstance(linear, AWQLinear):
        if linear.input_order is not None:
            raise ValueError(
                f"{name}: a GPTQ layer in activation order (desc_act) reads its inputs out of order, so they do not "
                f"split by rank: run it with tensor_parallel_size=1"
            )
        group = linear.group_size
        if size % group:
            raise ValueError(
                f"{name}: each rank's {size} inputs must be whole AWQ groups of {group} "
                f"(tensor_parallel_size={layout.world_size})"
            )
        linear.qweight = _keep(linear.qweight, 0, start, stop)
        linear.qzeros = _keep(linear.qzeros, 0, start // group, stop // group)
        linear.scales = _keep(linear.scales, 0, start // group, stop // group)
    elif isinstance(linear, FP8Linear):
        linear.weight = _keep(linear.weight, 1, start, stop)
    elif isinstance(linear, FP8BlockLinear):
        _keep_blocks(name, linear, 1, start, stop)
    else:
        linear.weight = nn.Parameter(_keep(linear.weight, 1, start, stop), requires_grad=False)
    set_module_attribute(linear, "tp_shard", TPShard(style, start, stop, linear.in_features))
    linear.in_features = size
    if isinstance(linear.bias, torch.Tensor) and rank != 0:
        linear.bias = nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)
    if all_reduce is not None:
        linear.register_forward_hook(lambda _m, _i, out: all_reduce(out))


def set_local_heads(model: nn.Module, layout: HeadLayout) -> None:
    """Attention modules that keep head counts read the local ones."""
    for module in model.modules():
        if hasattr(module, "num_key_value_groups"):
            set_module_attribute(module, "num_key_value_groups", layout.local_heads // layout.local_kv_heads)
        for attr, value in (("num_heads", layout.local_heads), ("num_key_value_heads", layout.local_kv_heads)):
            if isinstance(getattr(module, attr, None), int):
                setattr(module, attr, value)


def shard_model(model: PreTrainedModel, rank: int, world_size: int, all_reduce: AllReduce | None) -> None:
    """Cut a whole loaded ``model`` in place down to rank ``rank``'s slices (see ``shard_linear``)."""
    layout = head_layout(model.config, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    modules = dict(model.named_modules())
    for name, style in tp_plan(model).items():
        shard_linear(name, modules[name], style, layout, rank, all_reduce)
    set_local_heads(model, layout)
