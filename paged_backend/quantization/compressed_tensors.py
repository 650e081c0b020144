"""compressed-tensors checkpoints (llm-compressor's format, ``quant_method: compressed-tensors``): which schemes run,
which linears they cover, and how their tensors become our layers.

- ``pack-quantized`` int4 weights (W4A16: per group or per output channel, symmetric or with zero points) run as
  ``AWQLinear``: the compressed-tensors package unpacks them and they are packed again in AWQ's GEMM layout, so
  one set of int4 kernels serves both formats.
  Weights quantized in activation order with their groups kept in place (GPTQ's ``actorder: static``) load as
  any others: the order only decided how they were rounded.
- ``float-quantized`` fp8 weights (a scale per output channel or one per tensor; activations unquantized,
  quantized per token at run time, ``FP8_DYNAMIC``, or with one static scale per tensor, ``FP8``) run as
  ``FP8Linear``.
- An fp8 KV cache with one static scale per layer for keys and for values (``kv_cache_scheme``).

Anything else — other bit widths, groups reordered by activation order (``actorder: group``), several schemes,
sparsity, transforms — fails when the checkpoint is opened, naming the setting, never runs wrong.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paged_backend.kernels.awq_format import pack

FORMATS = ("pack-quantized", "float-quantized")
INT4_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
FP8_PARTS = ("weight", "weight_scale")
# The model attribute holding a checkpoint's fp8 KV-cache scales: {layer_idx: (k_scale, v_scale)}, the cache
# holding k / k_scale (the worker starts an fp8 cache with them)
KV_CACHE_SCALES_ATTR = "checkpoint_kv_cache_scales"


def _unsupported(setting: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"compressed-tensors checkpoint: {setting} {value!r} is not supported ({allowed})")


@dataclass(frozen=True)
class CompressedTensorsScheme:
    format: str  # one of FORMATS
    strategy: str  # "group" | "channel" (int4); "channel" | "tensor" (fp8)
    group_size: int | None  # int4 "group" only
    symmetric: bool
    dynamic_activations: bool  # fp8: activations quantized per token at run time
    static_activations: bool = False  # fp8: activations quantized with each linear's ``input_scale``
    ignore: tuple[str, ...] = ()  # module names, or "re:" + a pattern, that stay unquantized
    kv_cache_scales: bool = False  # attention modules carry k_scale and v_scale (an fp8 KV cache's, static)

    @classmethod
    def from_hf(cls, quantization_config: Any) -> CompressedTensorsScheme:
        qc = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
        if str(qc.get("quant_method", "")).lower() != "compressed-tensors":
            raise _unsupported("quant_method", qc.get("quant_method"), "'compressed-tensors'")
        for key in ("sparsity_config", "transform_config"):
            if qc.get(key):
                raise _unsupported(key, qc[key], "none")
        kv_cache = qc.get("kv_cache_scheme")
        if kv_cache and not (
            kv_cache.get("num_bits") == 8
            and kv_cache.get("type") == "float"
            and kv_cache.get("strategy") == "tensor"
            and not kv_cache.get("dynamic")
            and kv_cache.get("symmetric", True)
        ):
            raise _unsupported("kv_cache_scheme", kv_cache, "none, or fp8 with one static scale per layer")
        groups = qc.get("config_groups") or {}
        if len(groups) != 1:
            raise _unsupported("config_groups", sorted(groups), "exactly one scheme")
        group = next(iter(groups.values()))
        if group.get("output_activations"):
            raise _unsupported("output_activations", group["output_activations"], "none")
        fmt = group.get("format") or qc.get("format")
        if fmt not in FORMATS:
            raise _unsupported("format", fmt, f"one of {list(FORMATS)}")
        weights = group.get("weights") or {}
        if weights.get("actorder") not in (None, "static", "weight") or weights.get("dynamic"):
            raise _unsupported("weights", weights, "static weights, in place (actorder none or 'static')")
        if weights.get("block_structure"):
            raise _unsupported("weights", weights, "static weights without blocks")
        if fmt == "pack-quantized" and importlib.util.find_spec("compressed_tensors") is None:
            raise ImportError(
                "compressed-tensors int4 (pack-quantized) checkpoints are unpacked by the compressed-tensors "
                "package: pip install 'paged-backend[quant]'"
            )
        if fmt == "pack-quantized":
            scheme, static = cls._int4(weights), False
        else:
            activations = group.get("input_activations") or {}
            scheme, static = cls._fp8(weights, activations), bool(activations) and not activations.get("dynamic")
        ignore = tuple(qc.get("ignore") or ())
        return cls(fmt, *scheme, static_activations=static, ignore=ignore, kv_cache_scales=bool(kv_cache))

    @staticmethod
    def _int4(weights: dict[str, Any]) -> tuple[str, int | None, bool, bool]:
        if weights.get("num_bits") != 4 or weights.get("type") != "int":
            raise _unsupported("pack-quantized weights", f"{weights.get('num_bits')}-bit {weights.get('type')}", "int4")
        strategy = weights.get("strategy")
        if strategy not in ("group", "channel"):
            raise _unsupported("int4 weight strategy", strategy, "'group' or 'channel'")
        group_size = weights.get("group_size") if strategy == "group" else None
        if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
            raise _unsupported("int4 group_size", group_size, "a positive integer")
        return strategy, group_size, bool(weights.get("symmetric", True)), False

    @staticmethod
    def _fp8(weights: dict[str, Any], activations: dict[str, Any]) -> tuple[str, None, bool, bool]:
        if weights.get("num_bits") != 8 or weights.get("type") != "float" or not weights.get("symmetric", True):
            raise _unsupported("float-quantized weights", weights, "symmetric 8-bit float (fp8 e4m3)")
        if weights.get("strategy") not in ("channel", "tensor"):
            raise _unsupported("fp8 weight strategy", weights.get("strategy"), "'channel' or 'tensor'")
        if activations and not (
            activations.get("num_bits") == 8
            and activations.get("type") == "float"
            and activations.get("symmetric", True)
            and (activations.get("dynamic"), activations.get("strategy")) in ((True, "token"), (False, "tensor"))
        ):
            allowed = "none, fp8 per token at run time, or fp8 with one static scale per tensor"
            raise _unsupported("input_activations", activations, allowed)
        return weights["strategy"], None, True, bool(activations) and bool(activations.get("dynamic"))

    def ignores(self, name: str) -> bool:
        return any(re.match(entry[3:], name) if entry.startswith("re:") else name == entry for entry in self.ignore)

    def quantized_linears(self, model: nn.Module) -> dict[str, nn.Linear]:
        """The linears the scheme covers (its target ``Linear``), less those it ignores."""
        return {
            name: module
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and not self.ignores(name)
        }

    def group_size_of(self, linear: nn.Linear) -> int:
        return linear.in_features if self.group_size is None else self.group_size

    def convert(
        self,
        tensors: Iterable[tuple[str, torch.Tensor]],
        quantized: set[str],
        kv_scales: dict[str, dict[str, torch.Tensor]],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors with each quantized linear's parts turned into our layer's buffers
        (``AWQLinear``'s or ``FP8Linear``'s), once all of its parts have been read; an attention module's
        ``k_scale`` and ``v_scale`` go to ``kv_scales`` (by module); other tensors pass as they are."""
        parts: tuple[str, ...] = INT4_PARTS if self.format == "pack-quantized" else FP8_PARTS
        parts += ("input_scale",) if self.static_activations else ()
        needed = set(parts) - ({"weight_zero_point"} if self.symmetric else set())
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors:
            module, _, attr = key.rpartition(".")
            if self.kv_cache_scales and attr in ("k_scale", "v_scale"):
                kv_scales.setdefault(module, {})[attr] = tensor.float().reshape(-1)
                continue
            if module not in quantized or attr not in parts:
                yield key, tensor
                continue
            found = pending.setdefault(module, {})
            found[attr] = tensor
            if needed <= set(found):
                del pending[module]
                converted = self._int4_buffers(found) if self.format == "pack-quantized" else self._fp8_buffers(found)
                yield from ((f"{module}.{name}", value) for name, value in converted.items())
        if pending:
            module, found = next(iter(pending.items()))
            raise ValueError(f"compressed-tensors checkpoint: {module} lacks {sorted(needed - set(found))}")

    def _int4_buffers(self, found: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """AWQ's ``qweight`` [in, out/8], ``qzeros`` [groups, out/8] and ``scales`` [groups, out] from the packed
        signed int4 weight [out, in], its scales [out, groups] and (asymmetric) zero points."""
        from compressed_tensors.compressors import unpack_from_int32

        shape = torch.Size(int(n) for n in found["weight_shape"].tolist())  # (out, in)
        scale = found["weight_scale"]
        q = unpack_from_int32(found["weight_packed"], 4, shape).to(torch.int32) + 8  # [out, in] in [0, 15]
        if self.symmetric:
            z = torch.full((shape[0], scale.shape[1]), 8, dtype=torch.int32)
        else:
            zero_shape = torch.Size((shape[0], scale.shape[1]))
            z = unpack_from_int32(found["weight_zero_point"], 4, zero_shape, packed_dim=0).to(torch.int32) + 8
        return {"qweight": pack(q.T), "qzeros": pack(z.T), "scales": scale.T.contiguous()}

    @staticmethod
    def _fp8_buffers(found: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        weight, scale = found["weight"], found["weight_scale"].float().reshape(-1)
        buffers = {"weight": weight, "weight_scale": scale.expand(weight.shape[0]).contiguous()}
        if "input_scale" in found:
            input_scale = found["input_scale"].float().reshape(-1)
            if input_scale.numel() != 1:
                raise _unsupported("input_scale of", tuple(found["input_scale"].shape), "one scale per tensor")
            buffers["input_scale"] = input_scale
        return buffers
