"""GPTQ int4 checkpoints as AutoGPTQ and GPTQModel write them (``quant_method: gptq``, ``checkpoint_format: gptq``),
run on the AWQ kernels: each linear's tensors are unpacked and packed again in AWQ's GEMM layout at load.

    qweight  int32 [in / 8, out]   eight 4-bit values packed along the input (row 8r + i in bits 4i..4i+3)
    qzeros   int32 [groups, out / 8]  zero points packed along the output, the int32 stored minus 0x11111111
    scales   fp16  [groups, out]
    g_idx    int32 [in]            each input row's group

With ``desc_act`` (activation order) a group's rows are scattered over the input. Sorting the rows by group makes
every group contiguous again, as AWQ's layout has them; the layer then reads its input in that order
(``AWQLinear.input_order``), one gather a call. ``sym`` only decides the zero points, which are stored either way.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paged_backend.kernels.awq_format import MAX_INT, pack

GROUP_SIZES = (32, 64, 128, -1)  # -1: one group of the whole input (a scale per output channel)
PARTS = ("qweight", "qzeros", "scales", "g_idx")


def _unsupported(setting: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"GPTQ checkpoint: quantization_config.{setting}={value!r} is not supported ({allowed})")


@dataclass(frozen=True)
class GPTQConfig:
    group_size: int  # -1: per output channel
    sym: bool
    desc_act: bool

    @classmethod
    def from_hf(cls, quantization_config: Any) -> GPTQConfig:
        """A checkpoint's ``quantization_config``, every setting we do not run refused by name."""
        qc = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
        if str(qc.get("quant_method", "")).lower() != "gptq":
            raise _unsupported("quant_method", qc.get("quant_method"), "'gptq'")
        if qc.get("bits") != 4:
            raise _unsupported("bits", qc.get("bits"), "4")
        if qc.get("group_size") not in GROUP_SIZES:
            raise _unsupported("group_size", qc.get("group_size"), f"one of {list(GROUP_SIZES)}")
        checkpoint_format = qc.get("checkpoint_format", qc.get("format", "gptq"))
        if checkpoint_format != "gptq":
            raise _unsupported("checkpoint_format", checkpoint_format, "'gptq', AutoGPTQ's layout")
        if qc.get("lm_head"):
            raise _unsupported("lm_head", qc["lm_head"], "false: a quantized output embedding")
        if qc.get("dynamic"):
            raise _unsupported("dynamic", qc["dynamic"], "none: one setting for every layer")
        if qc.get("pack_dtype", "int32") != "int32":
            raise _unsupported("pack_dtype", qc["pack_dtype"], "'int32'")
        return cls(int(qc["group_size"]), bool(qc.get("sym", True)), bool(qc.get("desc_act", False)))

    def group_size_of(self, linear: nn.Linear) -> int:
        return linear.in_features if self.group_size == -1 else self.group_size

    def convert(
        self, tensors: Iterable[tuple[str, torch.Tensor]], quantized: set[str]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors, each quantized linear's four parts turned into ``AWQLinear``'s buffers once
        all have been read; other tensors pass as they are."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors:
            module, _, attr = key.rpartition(".")
            if module not in quantized or attr not in PARTS:
                yield key, tensor
                continue
            found = pending.setdefault(module, {})
            found[attr] = tensor
            if len(found) == len(PARTS):
                del pending[module]
                try:
                    buffers = self.awq_buffers(**found)
                except ValueError as exc:
                    raise ValueError(f"GPTQ checkpoint: {module}: {exc}") from exc
                yield from ((f"{module}.{name}", value) for name, value in buffers.items())
        if pending:
            module, found = next(iter(pending.items()))
            raise ValueError(f"GPTQ checkpoint: {module} lacks {sorted(set(PARTS) - set(found))}")

    def awq_buffers(
        self, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """AWQ's ``qweight`` [in, out / 8], ``qzeros`` [groups, out / 8] and ``scales`` [groups, out] of one GPTQ
        linear, its rows sorted by group (and ``input_order``, the sort, under ``desc_act``)."""
        shifts = torch.arange(0, 32, 4, dtype=torch.int32)
        q = ((qweight[:, None, :] >> shifts[None, :, None]) & MAX_INT).reshape(-1, qweight.shape[1])  # [in, out]
        z = unpack_v1_zeros(qzeros)
        groups, group_size = scales.shape[0], q.shape[0] // scales.shape[0]
        order = torch.argsort(g_idx.long(), stable=True)
        if (
            not torch.equal(g_idx.long()[order], torch.arange(q.shape[0]) // group_size)
            or groups * group_size != q.shape[0]
        ):
            raise ValueError(f"g_idx does not give each of the {groups} groups {group_size} input rows")
        buffers = {"qweight": pack(q[order]), "qzeros": pack(z), "scales": scales}
        if self.desc_act:
            buffers["input_order"] = order
        elif not torch.equal(order, torch.arange(q.shape[0])):
            raise ValueError("g_idx reorders the input rows but quantization_config.desc_act is false")
        return buffers


V1_ZERO_OFFSET = 0x11111111  # one in each nibble


def unpack_v1_zeros(qzeros: torch.Tensor) -> torch.Tensor:  # [groups, out / 8] int32 -> [groups, out] in [0, 15]
    """GPTQ v1's zero points: each group's eight packed together, minus one *as an int32* (``packed - 0x11111111``,
    so a zero point of 0 borrows from the nibble above it); GPTQModel adds the int32 back when it reads v1."""
    packed = (qzeros.to(torch.int64) + V1_ZERO_OFFSET) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    return ((packed[:, :, None] >> shifts) & MAX_INT).reshape(qzeros.shape[0], -1).to(torch.int32)
