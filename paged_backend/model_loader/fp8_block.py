"""Reading a block-wise FP8 checkpoint (``quant_method: "fp8"``, ``quantization/fp8_block.py``) without
transformers' FP8 integration (which needs a GPU to load, and a hub kernel to run): the model is built on the meta
device, each linear the checkpoint quantizes (those with a ``weight_scale_inv``) becomes an empty
``FP8BlockLinear``, and the checkpoint's tensors fill every layer, each checked against the shape the config
implies.
"""

from __future__ import annotations

import copy
import logging

import torch
from transformers import PretrainedConfig, PreTrainedModel

from paged_backend.model_loader.awq import (
    checkpoint_tensors,
    load_quantized_weights,
    replace_quantized,
    resolve_checkpoint_folder,
)
from paged_backend.model_loader.dummy import meta_model
from paged_backend.model_loader.gptq import quantized_modules
from paged_backend.model_structure import set_module_attribute
from paged_backend.quantization.fp8_block import FP8BlockConfig, FP8BlockLinear

logger = logging.getLogger(__name__)


def load_fp8_block_model(
    hf_config: PretrainedConfig, name: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False
) -> PreTrainedModel:
    """The block-wise FP8 checkpoint at ``name`` on ``device``: ``FP8BlockLinear`` modules for the linears it
    quantizes, everything else in ``dtype``."""
    block = FP8BlockConfig.from_hf(hf_config.quantization_config)
    plain = copy.deepcopy(hf_config)
    del plain.quantization_config  # transformers must not try to quantize or dequantize
    model = meta_model(plain, dtype, trust_remote_code)
    folder = resolve_checkpoint_folder(name)
    quantized = quantized_modules(folder, "weight_scale_inv")
    if not quantized:
        raise ValueError(f"fp8 checkpoint {name}: no tensor named *.weight_scale_inv, so no quantized linear")

    def make(linear: torch.nn.Linear) -> FP8BlockLinear:
        return FP8BlockLinear(linear.in_features, linear.out_features, linear.bias is not None, block, "meta")

    replace_quantized(model, quantized, make, "weight_scale_inv", "fp8")
    load_quantized_weights(model, checkpoint_tensors(folder), dtype, device)
    set_module_attribute(model, "fp8_block_config", block)
    logger.info("block-wise FP8: %d linears, blocks of %d x %d", len(quantized), block.block_n, block.block_k)
    return model.eval()
