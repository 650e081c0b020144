"""Reading a PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) into the per-module
``A`` and scaled ``B`` matrices the engine adds to its base layers: ``y = base(x) + (x A^T) B^T``, where ``B`` is
already multiplied by ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA).

Every problem is raised for the one request that asked for the adapter, naming the adapter and the reason.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

from paged_backend.lora.request import LoRARequest

PEFT_PREFIX = "base_model.model."
# Module names (last path part) a LoRA may target: Llama-style projections and GPT-2's.
TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "c_attn",
    "c_proj",
    "c_fc",
)


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    int_id: int
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A [r, in], scaled B [out, r]), fp32 on CPU


def load_adapter(request: LoRARequest, shapes: dict[str, tuple[int, int]], max_rank: int) -> LoRAAdapter:
    """The adapter of ``request``, checked against the model's LoRA-able modules (``shapes``: module name ->
    (in_features, out_features)) and ``max_lora_rank``."""
    name, folder = request.lora_name, request.lora_path

    def fail(reason: str) -> ValueError:
        return ValueError(f"LoRA adapter {name!r} ({folder}): {reason}")

    config_path = os.path.join(folder, "adapter_config.json")
    weights_path = os.path.join(folder, "adapter_model.safetensors")
    for path in (config_path, weights_path):
        if not os.path.isfile(path):
            raise fail(f"missing {os.path.basename(path)}")
    with open(config_path) as f:
        config = json.load(f)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise fail(f"adapter_config.json's r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise fail(f"rank {rank} is above max_lora_rank={max_rank}")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise fail("only LoRA matrices are supported (bias='none', no modules_to_save)")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise fail("per-module ranks or alphas (rank_pattern, alpha_pattern) are not supported")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

    from safetensors.torch import load_file

    tensors = load_file(weights_path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, kind = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise fail(f"unexpected tensor {key} (only lora_A / lora_B weights are supported)")
        pairs.setdefault(module, {})[kind[0]] = tensor
    if not pairs:
        raise fail("adapter_model.safetensors holds no LoRA weights")
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in sorted(pairs.items()):
        if module not in shapes:
            raise fail(f"targets {module}, which the model has no LoRA-able layer for (layers named {TARGET_MODULES})")
        if set(pair) != {"A", "B"}:
            raise fail(f"{module} has lora_{'A' if 'A' in pair else 'B'} without its pair")
        a, b = pair["A"].float(), pair["B"].float()
        in_features, out_features = shapes[module]
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise fail(
                f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the model's layer "
                f"({in_features} -> {out_features}) at rank {rank}: trained for another base model?"
            )
        weights[module] = (a.contiguous(), (b * scaling).contiguous())
    return LoRAAdapter(name, request.lora_int_id, rank, weights)
