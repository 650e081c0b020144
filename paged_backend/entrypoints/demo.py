"""``paged-backend demo``: one batch through HF ``generate`` and through the engine, side by side.

Without ``--model`` it builds, once, a small random-weight Llama checkpoint and its tokenizer into a cache folder
(no download, no GPU). Both sides decode greedily for exactly ``max_tokens`` tokens, so the speed and the KV
memory compare like for like. The demo model runs in fp32 everywhere, where the outputs must agree token for
token; a ``--model`` runs in bf16 on a GPU, where a few may part where two logits tie within rounding.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from paged_backend.demo_checkpoint import CORPUS, default_cache_dir, demo_checkpoint

logger = logging.getLogger(__name__)


def demo_prompts(num_prompts: int) -> list[str]:
    """Prompts of ragged lengths (the case a padded batch handles worst)."""
    return [
        " ".join(CORPUS[(i + j) % len(CORPUS)] for j in range(1 + i % 3))[: 24 + 37 * (i % 7)]
        for i in range(num_prompts)
    ]


@dataclass(frozen=True)
class SideResult:
    """One side of the table."""

    seconds: float
    output_tokens: int
    kv_slots: int  # token slots of KV cache held at the peak (HF: rows x the padded length)
    kv_waste: float  # share of those slots holding no token
    preemptions: int | None  # None: the side has no such notion
    outputs: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / max(self.seconds, 1e-9)


@torch.no_grad()
def run_hf(model: Any, tokenizer: Any, prompts: list[str], max_tokens: int, batch_size: int) -> SideResult:
    """HF ``generate`` on left-padded batches of ``batch_size``. Its cache holds every row at the batch's
    longest prompt plus ``max_tokens``: the padding and the tails are the waste."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:  # e.g. Llama 3's: padding needs one, and left padding is never attended
        tokenizer.pad_token = tokenizer.eos_token
    config = model.generation_config
    config.eos_token_id = None  # exactly max_tokens a row, as the engine's ignore_eos
    config.pad_token_id = tokenizer.pad_token_id
    device = model.device
    model.generate(**tokenizer(prompts[:1], return_tensors="pt").to(device), max_new_tokens=2, do_sample=False)
    outputs: list[list[int]] = []
    peak_slots = peak_real = 0
    start = time.perf_counter()
    for i in tqdm(range(0, len(prompts), batch_size), desc="HF generate", unit="batch"):
        batch = tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True).to(device)
        out = model.generate(**batch, max_new_tokens=max_tokens, do_sample=False)
        rows, width = batch["input_ids"].shape
        outputs += out[:, width:].tolist()
        slots = rows * (width + max_tokens - 1)  # the last token is sampled, never cached
        if slots > peak_slots:
            peak_slots, peak_real = slots, int(batch["attention_mask"].sum()) + rows * (max_tokens - 1)
    seconds = time.perf_counter() - start
    return SideResult(seconds, len(prompts) * max_tokens, peak_slots, 1 - peak_real / peak_slots, None, outputs)


def run_paged(llm: Any, prompts: list[str], max_tokens: int) -> SideResult:
    """The engine, stepped here so that its KV use is read after every step."""
    from paged_backend import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    preempted_before = engine.stats()["num_preemptions"]
    finished: dict[str, list[int]] = {}
    peak_blocks, waste, block_size = 0, 0.0, engine.stats()["block_size"]
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"demo-{i}", prompt, params)
    with tqdm(total=len(prompts), desc="paged engine", unit="prompt") as bar:
        while engine.has_unfinished_requests():
            for output in engine.step(finished_only=True):
                finished[output.request_id] = list(output.outputs[0].token_ids)
                bar.update(1)
            used = engine.scheduler.block_manager.num_used_blocks
            if used > peak_blocks:  # the waste walks every block table: only at a new peak, off most steps' clock
                peak_blocks, waste = used, engine.stats()["kv_waste_fraction"]
    seconds = time.perf_counter() - start
    preemptions = engine.stats()["num_preemptions"] - preempted_before
    outputs = [finished[f"demo-{i}"] for i in range(len(prompts))]
    return SideResult(seconds, sum(map(len, outputs)), peak_blocks * block_size, waste, preemptions, outputs)


def run_demo(
    model: str | None = None,
    num_prompts: int = 32,
    max_tokens: int = 64,
    batch_size: int | None = None,
    cache_dir: Path | None = None,
    **engine_args: Any,
) -> dict[str, Any]:
    """Build (or find) the checkpoint, run both sides, log the table; returns its figures."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from paged_backend import LLM

    if num_prompts < 1 or max_tokens < 1:
        raise ValueError(f"num_prompts and max_tokens must be >= 1, got {num_prompts} and {max_tokens}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 or None (all prompts in one batch), got {batch_size}")
    path = str(model or demo_checkpoint(cache_dir or default_cache_dir()))
    prompts = demo_prompts(num_prompts)
    tokenizer = AutoTokenizer.from_pretrained(path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # a real model in bf16 on a GPU; the demo's random weights in fp32, where greedy outputs must agree exactly
    dtype = torch.bfloat16 if device == "cuda" and model else torch.float32
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    hf_model = hf_model.to(device).eval()  # type: ignore[arg-type]  # transformers wraps to(): self unbound
    hf = run_hf(hf_model, tokenizer, prompts, max_tokens, batch_size or num_prompts)
    del hf_model
    llm = LLM(path, dtype=str(dtype).removeprefix("torch."), **engine_args)
    block_size = llm.llm_engine.stats()["block_size"]
    try:
        paged = run_paged(llm, prompts, max_tokens)
    finally:
        llm.llm_engine.shutdown()
    same = sum(a == b for a, b in zip(hf.outputs, paged.outputs))
    agree = sum(
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(hf.outputs, paged.outputs)
    )
    rows = [
        ("output tokens/s", f"{hf.tokens_per_s:,.0f}", f"{paged.tokens_per_s:,.0f}"),
        ("seconds", f"{hf.seconds:.2f}", f"{paged.seconds:.2f}"),
        (
            f"KV blocks of {block_size} held (peak)",
            f"{-(-hf.kv_slots // block_size):,}",
            f"{paged.kv_slots // block_size:,}",
        ),
        ("KV slots holding no token", f"{hf.kv_waste:.0%}", f"{paged.kv_waste:.0%}"),
        ("preemptions", "n/a", str(paged.preemptions)),
    ]
    logger.info("%s: %d prompts, %d new tokens each, greedy, %s on %s", path, num_prompts, max_tokens, dtype, device)
    logger.info("%-28s %14s %14s", "", "HF generate", "paged-backend")
    for name, left, right in rows:
        logger.info("%-28s %14s %14s", name, left, right)
    logger.info(
        "speed-up %.1fx; greedy outputs identical: %d/%d (%.0f%% of tokens before a row's first difference)",
        paged.tokens_per_s / hf.tokens_per_s,
        same,
        len(prompts),
        100 * agree / max(hf.output_tokens, 1),
    )
    return {"model": path, "hf": hf, "paged": paged, "identical": same, "dtype": dtype}
