"""Makes the GPTQ checkpoints under this folder (``quant_method: gptq``, AutoGPTQ's layout as GPTQModel writes it)
with GPTQModel itself, in an environment of its own, and beside each GPTQModel's own dequantized weights
(``TorchQuantLinear.dequantize_weight``): what the tests hold our GPTQ loader to.

    python -m venv /tmp/genv && /tmp/genv/bin/pip install torch==2.13.0 transformers==5.17.0 requests
    BUILD_CUDA_EXT=0 /tmp/genv/bin/pip install gptqmodel==7.5.0
    GPTQMODEL_CPU_WORKERS=2 /tmp/genv/bin/python tests/data/quantized/make_gptq_fixtures.py

(7.5.0: later versions need torch >= 2.14, which the registry has only as a CUDA build.) Each checkpoint is the
tiny random Llama (fp32, hidden 128, two layers, 512 tokens) quantized on the CPU by ``GPTQModel.quantize`` on
random token ids and saved by ``save``. The versions used are added to ``versions.json``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import save_file
from tiny_llama import CONFIG, random_model

HERE = Path(__file__).resolve().parent
# name -> (sym, group_size, desc_act): both zero-point conventions, the three group sizes, activation order on/off
VARIANTS: dict[str, tuple[bool, int, bool]] = {
    "gptq_sym_group128_desc_act": (True, 128, True),
    "gptq_asym_group32_desc_act": (False, 32, True),
    "gptq_asym_group64": (False, 64, False),
}


def word_tokenizer():
    """A tokenizer of the model's 512 ids (GPTQModel loads one from the model's folder)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(CONFIG.vocab_size)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", bos_token="t1", eos_token="t2")


def make(name: str, sym: bool, group_size: int, desc_act: bool) -> None:
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig

    out = HERE / name
    shutil.rmtree(out, ignore_errors=True)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, CONFIG.vocab_size, (16, 48), generator=generator).tolist()
    calibration = [{"input_ids": row, "attention_mask": [1] * len(row)} for row in ids]
    with tempfile.TemporaryDirectory() as base:
        random_model().save_pretrained(base)
        word_tokenizer().save_pretrained(base)
        config = QuantizeConfig(bits=4, group_size=group_size, desc_act=desc_act, sym=sym)
        model = GPTQModel.load(base, config, device="cpu")
        model.quantize(calibration, batch_size=4)
        model.save(str(out))
    # GPTQModel dequantizes in fp16 or bf16 only: fp16, each product rounded once
    loaded = GPTQModel.load(str(out), device="cpu", backend=BACKEND.TORCH, dtype=torch.float16)
    reference = {
        f"{module_name}.weight": module.dequantize_weight().T.float().contiguous()  # [in, out] -> [out, in]
        for module_name, module in loaded.model.named_modules()
        if hasattr(module, "dequantize_weight") and hasattr(module, "qweight")
    }
    for extra in ("quant_log.csv", "tokenizer.json", "tokenizer_config.json"):  # the tests bring their tokenizer
        (out / extra).unlink(missing_ok=True)
    save_file(reference, str(out / "reference.safetensors"))
    print(name, sorted(p.name for p in out.iterdir()), len(reference), "linears")


def main() -> None:
    for name, (sym, group_size, desc_act) in VARIANTS.items():
        make(name, sym, group_size, desc_act)
    path = HERE / "versions.json"
    versions = json.loads(path.read_text()) if path.exists() else {}
    versions["gptqmodel"] = {p: version(p) for p in ("gptqmodel", "transformers", "torch")}
    path.write_text(json.dumps(versions, indent=2) + "\n")


if __name__ == "__main__":
    main()
