"""GPU smoke check of the core engine (same code path as CPU, torch reference attention).

1. Greedy equality with HF ``generate`` on the GPU for the tiny fp32 models of every tested architecture.
2. KV-cache sizing from ``gpu_memory_utilization`` on a Llama-3-8B-shaped bf16 model with random normal(0, 0.02)
   weights, then a short generation for the record (not a benchmark: the Triton kernels and CUDA graphs that
   make it fast are separate work).

Run: ``python benchmarks/gpu_check.py`` on a CUDA machine.
"""

from __future__ import annotations

import logging
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from paged_backend import LLM, SamplingParams
from paged_backend.demo import TINY_CONFIGS, build_tiny_model, build_tiny_tokenizer

logger = logging.getLogger("gpu_check")


def tiny_equality(tokenizer) -> list[tuple[str, int, int]]:
    import random

    rows = []
    for arch in TINY_CONFIGS:
        model = build_tiny_model(arch, vocab_size=len(tokenizer)).cuda()
        llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=512)
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 3, 4, 5, 14, 2, 19, 40)]
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False
        )
        matches = 0
        for prompt, out in zip(prompts, outs):
            with torch.no_grad():
                ref = model.generate(
                    torch.tensor([prompt], device="cuda"),
                    max_new_tokens=16,
                    do_sample=False,
                    eos_token_id=2,
                    pad_token_id=0,
                )[0, len(prompt) :].tolist()
            ref = ref[: ref.index(2) + 1] if 2 in ref else ref
            matches += out.outputs[0].token_ids == ref
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_kv_blocks"]
        rows.append((arch, matches, len(prompts)))
        del llm, model
        torch.cuda.empty_cache()
    return rows


def llama8b_sizing() -> dict[str, float]:
    config = LlamaConfig(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    )
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    model.eval()
    start = time.perf_counter()
    llm = LLM(model, gpu_memory_utilization=0.9, max_model_len=4096)
    startup = time.perf_counter() - start
    stats = llm.stats()
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(i * 7 + j) % 128000 for j in range(256)]} for i in range(16)]
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    batch_s = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False)
    single_s = time.perf_counter() - start
    return {
        "startup_s": startup,
        "num_kv_blocks": stats["num_kv_blocks"],
        "kv_gib": stats["num_kv_blocks"] * llm.llm_engine.cache_engine.spec.bytes_per_block(16) / 2**30,
        "batch16_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / batch_s,
        "single_tok_s": 128 / single_s,
    }


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logger.info("torch %s, %s", torch.__version__, torch.cuda.get_device_name())
    tokenizer = build_tiny_tokenizer()
    for arch, matches, total in tiny_equality(tokenizer):
        logger.info("greedy == HF generate on GPU: %-8s %d/%d prompts", arch, matches, total)
    for key, value in llama8b_sizing().items():
        logger.info("llama-3-8b shape: %-14s %.1f", key, value)


if __name__ == "__main__":
    main()
