"""Makes the block-wise FP8 checkpoint under this folder (``fp8_block_32x64``) with transformers' own quantizer
(``FineGrainedFP8Config``, the ``quant_method: "fp8"`` format of DeepSeek-V3 and Qwen3-FP8), and beside it the
weights transformers dequantizes from it (``FineGrainedFP8Config(dequantize=True)``): what the tests hold our
loader to. Runs in the project's own environment:

    python tests/data/quantized/make_fp8_block_fixtures.py

transformers refuses to quantize without a GPU, although its quantization (``Fp8Quantize``) is torch ops on the
CPU: the check is skipped here. Blocks of 32 outputs by 64 inputs (not square, so swapped axes show; the hub's
are 128 × 128, larger than the tiny model's 128 inputs allow more than one of).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import save_file
from tiny_llama import random_model
from transformers import AutoModelForCausalLM, FineGrainedFP8Config
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

HERE = Path(__file__).resolve().parent
NAME = "fp8_block_32x64"
BLOCK = [32, 64]


def main() -> None:
    FineGrainedFP8HfQuantizer.validate_environment = lambda self, *args, **kwargs: None  # see the docstring
    out = HERE / NAME
    shutil.rmtree(out, ignore_errors=True)
    with tempfile.TemporaryDirectory() as base:
        random_model().save_pretrained(base)
        config = FineGrainedFP8Config(weight_block_size=BLOCK, modules_to_not_convert=["lm_head"])
        quantized = AutoModelForCausalLM.from_pretrained(base, quantization_config=config, dtype=torch.float32)
        quantized.save_pretrained(out)
    dequantize = FineGrainedFP8Config(weight_block_size=BLOCK, dequantize=True)
    decompressed = AutoModelForCausalLM.from_pretrained(out, quantization_config=dequantize, dtype=torch.float32)
    reference = {
        f"{module_name}.weight": module.weight.detach().float().contiguous()
        for module_name, module in decompressed.named_modules()
        if isinstance(module, torch.nn.Linear) and module_name != "lm_head"
    }
    save_file(reference, str(out / "reference.safetensors"))
    path = HERE / "versions.json"
    versions = json.loads(path.read_text()) if path.exists() else {}
    versions["transformers_fp8"] = {p: version(p) for p in ("transformers", "torch")}
    path.write_text(json.dumps(versions, indent=2) + "\n")
    print(NAME, sorted(p.name for p in out.iterdir()), file=sys.stderr)


if __name__ == "__main__":
    main()
