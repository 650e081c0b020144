"""Makes the quantized checkpoints under this folder with the real producer, llm-compressor, in an environment of
its own (it pins versions the project does not), and beside each the producer's own dequantized weights: what the
tests hold our loader to.

    python -m venv /tmp/qenv && /tmp/qenv/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1 transformers==5.17.0
    /tmp/qenv/bin/python tests/data/quantized/make_fixtures.py

Each checkpoint is a tiny random Llama (fp32, hidden 128, two layers, the tiny tokenizer's 512 tokens), quantized
by ``llmcompressor.oneshot`` and saved compressed (``save_compressed=True``); ``reference.safetensors`` holds every
quantized linear's weight as transformers decompresses it (``CompressedTensorsConfig(run_compressed=False)``).
The versions used are written to ``versions.json``.
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
from tiny_llama import CONFIG, random_model
from transformers import AutoModelForCausalLM, LlamaForCausalLM

HERE = Path(__file__).resolve().parent


def weight_only(num_bits: int, kind: str, strategy: str, symmetric: bool, group_size: int | None) -> dict:
    weights = {"num_bits": num_bits, "type": kind, "strategy": strategy, "symmetric": symmetric}
    if group_size is not None:
        weights["group_size"] = group_size
    return {"group_0": {"targets": ["Linear"], "weights": weights}}


def schemes() -> dict[str, dict]:
    """Fixture name -> QuantizationModifier arguments."""
    return {
        "w4a16_group128": {"scheme": "W4A16"},  # int4, symmetric, groups of 128 (llm-compressor's preset)
        "w4a16_asym_group32": {"config_groups": weight_only(4, "int", "group", False, 32)},
        "w4a16_channel": {"config_groups": weight_only(4, "int", "channel", True, None)},
        "fp8_dynamic": {"scheme": "FP8_DYNAMIC"},  # fp8 weights per channel, activations per token at run time
        # and an fp8 KV cache with a static scale per layer for keys and for values, calibrated on random tokens
        "fp8_dynamic_kv": {"scheme": "FP8_DYNAMIC", "kv_cache_scheme": KV_CACHE_SCHEME},
        # fp8 weights per tensor, activations with one static scale per tensor calibrated on random tokens
        "fp8_static_kv": {"scheme": "FP8", "kv_cache_scheme": KV_CACHE_SCHEME},
        # GPTQ (calibrated on random tokens), int4 with zero points, groups of 128, quantized in activation order
        # with the groups kept in place (its default "static"; llm-compressor's GPTQ makes no other order)
        "w4a16_asym_gptq": {"gptq": True, "scheme": "W4A16_ASYM"},
    }


KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def word_tokenizer():
    """A tokenizer of the model's 512 ids (oneshot wants one beside a dataset; the dataset is already ids)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(CONFIG.vocab_size)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")), pad_token="t0")


def calibration_dataset():
    """Random token ids: enough for the KV cache's observers to see keys and values."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, CONFIG.vocab_size, (16, 48), generator=generator).tolist()
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 48 for _ in ids]})


def make(name: str, arguments: dict) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = random_model()
    out = HERE / name
    shutil.rmtree(out, ignore_errors=True)
    with tempfile.TemporaryDirectory() as base:  # oneshot reads the model's config back from its folder
        model.save_pretrained(base)
        model = LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval()
        arguments = dict(arguments)
        modifier = GPTQModifier if arguments.pop("gptq", False) else QuantizationModifier
        recipe = modifier(targets="Linear", ignore=["lm_head"], **arguments)
        if "kv_cache_scheme" in arguments or modifier is GPTQModifier or arguments.get("scheme") == "FP8":
            oneshot(
                model=model,
                recipe=recipe,
                dataset=calibration_dataset(),
                processor=word_tokenizer(),
                num_calibration_samples=16,
                max_seq_length=48,
            )
        else:
            oneshot(model=model, recipe=recipe)
        model.save_pretrained(out, save_compressed=True)
    decompressed = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=CompressedTensorsConfig(run_compressed=False), torch_dtype=torch.float32
    )
    reference = {
        f"{module_name}.weight": module.weight.detach().float().contiguous()
        for module_name, module in decompressed.named_modules()
        if isinstance(module, torch.nn.Linear) and module_name != "lm_head"
    }
    save_file(reference, str(out / "reference.safetensors"))
    print(name, sorted(p.name for p in out.iterdir()))


def main() -> None:
    names = sys.argv[1:] or list(schemes())
    for name in names:
        make(name, schemes()[name])
    packages = ["llmcompressor", "compressed-tensors", "transformers", "torch"]
    path = HERE / "versions.json"
    versions = json.loads(path.read_text()) if path.exists() else {}
    versions["llmcompressor"] = {p: version(p) for p in packages}
    path.write_text(json.dumps(versions, indent=2) + "\n")


if __name__ == "__main__":
    main()
