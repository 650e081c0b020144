"""Multi-LoRA on one GPU: W1 on the Llama-3-8B shape with 4 distinct rank-16 adapters interleaved across the
requests, beside the same engine without LoRA and HF ``generate`` (base model, batches of 64) on the first 64
prompts. ``--tiny`` runs the same code on a tiny Llama shape, anywhere.

Adapters target all seven projections of every layer, with random normal A and B (values are irrelevant to
speed) written as PEFT folders; the base model is ``load_format="dummy"`` (the architecture's own random init).

    python benchmarks/lora.py --json benchmarks/results/h200_lora.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.throughput import (  # noqa: E402
    MODEL_CONFIG,
    benchmark_config,
    release_engine,
    run_hf,
    timed,
    tokens_per_second,
    versions,
    w1_prompts,
    write_json,
)
from paged_backend import LLM, LoRARequest, SamplingParams  # noqa: E402
from paged_backend.model_loader.dummy import dummy_model  # noqa: E402
from tests.fixtures.tiny_models import TINY_CONFIGS  # noqa: E402

logger = logging.getLogger("benchmarks.lora")

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, config: LlamaConfig, rank: int, seed: int) -> None:
    """A PEFT folder with random A [r, in] and B [out, r] for every projection of every layer."""
    from safetensors.torch import save_file

    head_dim = config.hidden_size // config.num_attention_heads
    shapes = {
        "self_attn.q_proj": (config.hidden_size, config.hidden_size),
        "self_attn.k_proj": (config.hidden_size, config.num_key_value_heads * head_dim),
        "self_attn.v_proj": (config.hidden_size, config.num_key_value_heads * head_dim),
        "self_attn.o_proj": (config.hidden_size, config.hidden_size),
        "mlp.gate_proj": (config.hidden_size, config.intermediate_size),
        "mlp.up_proj": (config.hidden_size, config.intermediate_size),
        "mlp.down_proj": (config.intermediate_size, config.hidden_size),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=generator) * 0.01).half()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=generator) * 0.01).half()
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    peft_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
    (folder / "adapter_config.json").write_text(json.dumps(peft_config))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=256, help="W1 prompts (the workload: 256)")
    parser.add_argument("--max-tokens", type=int, default=256, help="new tokens per prompt (the workload: 256)")
    parser.add_argument("--num-layers", type=int, default=None, help="fewer layers for a quick try")
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama shape (runs on a CPU)")
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    args = parser.parse_args(argv)
    args.dtype = "float32" if args.tiny else "bfloat16"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    results: dict[str, Any] = {
        "machine": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "versions": versions(),
        "command": "python benchmarks/lora.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    shape = {k: v for k, v in TINY_CONFIGS["llama"].items() if k != "model_type"} if args.tiny else MODEL_CONFIG
    config = benchmark_config(shape, args.num_layers)
    if args.tiny:
        config.vocab_size, config.max_position_embeddings = 512, 2048
    prompts = w1_prompts(config.vocab_size, args.num_prompts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        config.save_pretrained(base)
        loras = []
        for i in range(args.num_adapters):
            write_adapter(Path(tmp) / f"lora{i}", config, args.rank, seed=i)
            loras.append(LoRARequest(f"lora{i}", i + 1, str(Path(tmp) / f"lora{i}")))
        interleaved = [loras[i % len(loras)] for i in range(len(prompts))]
        common = dict(load_format="dummy", skip_tokenizer_init=True, dtype=args.dtype)
        if torch.cuda.is_available():
            model = dummy_model(config, torch.bfloat16, torch.device("cuda"), seed=0)
            model.generation_config.eos_token_id = None
            model.generation_config.pad_token_id = 0
            outs, seconds = run_hf(model, prompts[:64], args.max_tokens)
            results["w1_hf_generate_64_prompts"] = tokens_per_second(outs, seconds)
            del model
            release_engine("HF")
        requests = [{"prompt_token_ids": p} for p in prompts]
        for name, kwargs, lora in (
            ("paged", {}, None),
            ("paged_lora", dict(enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank), interleaved),
        ):
            llm = LLM(str(base), **common, **kwargs)
            warm = SamplingParams(max_tokens=8, ignore_eos=True)
            # Warm-up prompts share no prefix with the measured ones (the engine caches prefixes).
            warm_prompts = w1_prompts(config.vocab_size, min(64, len(prompts)), seed=1)
            warm_requests = [{"prompt_token_ids": p} for p in warm_prompts]
            llm.generate(warm_requests, warm, lora_request=lora and lora[: len(warm_prompts)], use_tqdm=False)
            run = llm.generate
            done, seconds = timed(lambda run=run, lora=lora: run(requests, params, lora_request=lora, use_tqdm=False))
            results[f"w1_{name}"] = tokens_per_second([list(o.outputs[0].token_ids) for o in done], seconds)
            logger.info("W1 %s: %.1f tok/s", name, results[f"w1_{name}"])
            llm.llm_engine.shutdown()
            del llm, run, done
            release_engine(name)
    results["lora_over_base"] = results["w1_paged_lora"] / results["w1_paged"]
    write_json(args.json, results)
    logger.info("%s", json.dumps({k: v for k, v in results.items() if k != "versions"}, indent=2))
    return results


if __name__ == "__main__":
    main()
