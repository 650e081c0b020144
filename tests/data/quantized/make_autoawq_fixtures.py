"""Makes the AutoAWQ checkpoints under this folder with AutoAWQ itself, in an environment of its own (it needs
transformers 4.x), and beside each AutoAWQ's own dequantized weights (``awq.utils.packing_utils.dequantize_gemm``):
what the tests hold our AWQ loader to.

    python -m venv /tmp/awqenv && /tmp/awqenv/bin/pip install torch==2.13.0 transformers==4.51.3 autoawq==0.2.9
    /tmp/awqenv/bin/python tests/data/quantized/make_autoawq_fixtures.py

Each checkpoint is a tiny random Llama (fp32, hidden 128, two layers, 512 tokens) quantized by
``AutoAWQForCausalLM.quantize`` (GEMM, 4 bits, groups of 128, zero points) on random token ids, saved by
``save_quantized``. The versions used are added to ``versions.json``.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import save_file
from tiny_llama import random_model

HERE = Path(__file__).resolve().parent
# AutoAWQ 0.2.9 cannot leave a Llama linear unconverted: with modules_to_not_convert=["down_proj"] its scale
# search looks up that layer's inputs, which it did not record (KeyError 'mlp.down_proj' in
# get_layers_for_scaling); a checkpoint with modules_to_not_convert comes from our own quantizer (tests/test_awq.py).
VARIANTS: dict[str, list[str]] = {"autoawq_group128": []}


def make(name: str, skip: list[str]) -> None:
    from awq import AutoAWQForCausalLM
    from awq.modules.linear import WQLinear_GEMM
    from awq.utils.packing_utils import dequantize_gemm

    base = random_model()
    rng = random.Random(0)
    calibration = [[rng.randrange(3, 512) for _ in range(64)] for _ in range(16)]  # token ids, no tokenizer needed
    out = HERE / name
    shutil.rmtree(out, ignore_errors=True)
    with tempfile.TemporaryDirectory() as folder:
        base.save_pretrained(folder)
        model = AutoAWQForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
        quant_config = {"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"}
        if skip:
            quant_config["modules_to_not_convert"] = skip
        model.quantize(
            None, quant_config=quant_config, calib_data=calibration, max_calib_samples=16, max_calib_seq_len=64
        )
        model.save_quantized(str(out))
    reference = {
        f"{module_name}.weight": dequantize_gemm(m.qweight, m.qzeros, m.scales, 4, 128).T.float().contiguous()
        for module_name, m in model.model.named_modules()
        if isinstance(m, WQLinear_GEMM)
    }
    save_file(reference, str(out / "reference.safetensors"))
    print(name, sorted(p.name for p in out.iterdir()), len(reference), "quantized linears")


def main() -> None:
    for name, skip in VARIANTS.items():
        make(name, skip)
    path = HERE / "versions.json"
    versions = json.loads(path.read_text()) if path.exists() else {}
    versions["autoawq"] = {p: version(p) for p in ("autoawq", "transformers", "torch")}
    path.write_text(json.dumps(versions, indent=2) + "\n")


if __name__ == "__main__":
    main()
