"""Reading a GPTQ checkpoint (``quant_method: gptq``, AutoGPTQ's layout) into ``AWQLinear`` layers, without
gptqmodel: the model is built on the meta device, each linear the checkpoint quantizes (those with a ``qweight``)
becomes an empty ``AWQLinear``, and ``GPTQConfig.convert`` repacks each one's tensors into AWQ's layout as they are
read (``quantization/gptq.py``).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Iterator

import torch
from transformers import PretrainedConfig, PreTrainedModel

from paged_backend.model_loader.awq import (
    checkpoint_tensors,
    load_quantized_weights,
    replace_quantized,
    resolve_checkpoint_folder,
)
from paged_backend.model_loader.dummy import meta_model
from paged_backend.model_loader.hf import checkpoint_files
from paged_backend.model_structure import set_module_attribute
from paged_backend.quantization.awq import AWQLinear
from paged_backend.quantization.gptq import GPTQConfig

logger = logging.getLogger(__name__)


def quantized_modules(folder: str, part: str = "qweight") -> set[str]:
    """The modules whose ``part`` (a tensor only quantized linears have) the checkpoint holds."""
    from safetensors import safe_open

    modules = set()
    suffix = f".{part}"
    for path in checkpoint_files(folder):
        with safe_open(path, framework="pt", device="cpu") as f:
            modules |= {key[: -len(suffix)] for key in f.keys() if key.endswith(suffix)}  # noqa: SIM118
    return modules


def without_zero_biases(
    tensors: Iterable[tuple[str, torch.Tensor]], biasless: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """AutoGPTQ writes a bias of zeros for every quantized linear, with one or not: those of linears that have
    none are dropped (a nonzero one is an error naming it)."""
    for key, tensor in tensors:
        module, _, attr = key.rpartition(".")
        if attr == "bias" and module in biasless:
            if torch.count_nonzero(tensor):
                raise ValueError(f"GPTQ checkpoint: {key} is not zero but the model's {module} has no bias")
            continue
        yield key, tensor


def load_gptq_model(
    hf_config: PretrainedConfig, name: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False
) -> PreTrainedModel:
    """The GPTQ checkpoint at ``name`` on ``device``: ``AWQLinear`` modules for the quantized linears (reading their
    input in activation order under ``desc_act``), everything else in ``dtype``."""
    gptq = GPTQConfig.from_hf(hf_config.quantization_config)
    plain = copy.deepcopy(hf_config)
    del plain.quantization_config  # transformers must not try to quantize (it would need gptqmodel)
    model = meta_model(plain, dtype, trust_remote_code)
    folder = resolve_checkpoint_folder(name)
    quantized = quantized_modules(folder)

    def make(linear: torch.nn.Linear) -> AWQLinear:
        bias = linear.bias is not None
        group_size = gptq.group_size_of(linear)
        return AWQLinear(linear.in_features, linear.out_features, group_size, bias, "meta", gptq.desc_act)

    replace_quantized(model, quantized, make, "qweight", "GPTQ")
    biasless = {m for m in quantized if model.get_submodule(m).bias is None}
    tensors = without_zero_biases(checkpoint_tensors(folder), biasless)
    load_quantized_weights(model, gptq.convert(tensors, quantized), dtype, device)
    set_module_attribute(model, "gptq_config", gptq)
    logger.info("GPTQ int4: %d linears, group size %d, desc_act %s", len(quantized), gptq.group_size, gptq.desc_act)
    return model.eval()
