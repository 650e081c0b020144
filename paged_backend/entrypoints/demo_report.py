"""The demo's report: each side's figures over its timed repetitions, the table, and one plain sentence on which
side is faster."""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SideResult:
    """One side of the table, over every timed repetition."""

    seconds: list[float]  # each repetition's wall time
    tokens: list[int]  # each repetition's new tokens (up to and with EOS, where the model's EOS ends rows)
    kv_slots: int  # token slots of KV cache held at the peak of any repetition (HF: rows x the padded length)
    kv_waste: float  # share of those slots holding no token
    preemptions: int | None  # over all repetitions; None: the side has no such notion
    outputs: list[list[int]]  # every repetition's rows, one repetition after another

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)

    @property
    def rates(self) -> list[float]:
        return [n / max(s, 1e-9) for n, s in zip(self.tokens, self.seconds)]

    @property
    def tokens_per_s(self) -> float:
        """The median repetition's throughput."""
        return statistics.median(self.rates)

    @property
    def tokens_per_s_range(self) -> tuple[float, float]:
        """(slowest, fastest) repetition's throughput."""
        return min(self.rates), max(self.rates)


def verdict(hf: SideResult, paged: SideResult, device: str, embedded_model: bool) -> str:
    """One plain sentence on which side is faster, and why where the engine is not clearly so (its slowest run
    behind HF's fastest: the difference is within what the runs vary)."""
    slowest = paged.tokens_per_s_range[0]
    hf_fastest = hf.tokens_per_s_range[1]
    if slowest > hf_fastest:
        return "the engine is faster: its slowest run beats HF's fastest"
    if paged.tokens_per_s >= hf.tokens_per_s:
        lead = "the engine is not clearly faster here (ahead at the median, not in every run)"
    else:
        lead = "the engine is not faster here"
    if device == "cpu" and embedded_model:
        why = (
            "the model is tiny and runs on a CPU: each step's Python bookkeeping (scheduling, block tables, "
            "sampling) costs as much as the model's forward, so batching has little to win; the engine's gain "
            "shows on a GPU and with real models"
        )
    elif device == "cpu":
        why = (
            "on a CPU both sides run the same matrix products on the same rows, and the engine adds its step's "
            "Python bookkeeping; its gain shows on a GPU"
        )
    elif embedded_model:
        why = (
            "the demo model is tiny: each step's Python bookkeeping costs as much as its forward; the engine's "
            "gain shows with real models (--model PATH)"
        )
    else:
        why = (
            "with few, short requests both sides are bound by per-step overhead; the engine gains with more "
            "prompts (--num-prompts) and longer outputs (--max-tokens)"
        )
    return f"{lead}, because {why}"


@dataclass(frozen=True)
class DemoRun:
    """What the demo ran: the table's header and the conclusion's context."""

    path: str
    real: bool  # a real checkpoint (else the embedded random-weight model)
    chat: bool  # chat questions answered until the model's end of turn (else exactly max_tokens a prompt)
    num_prompts: int
    max_tokens: int
    dtype: torch.dtype
    device: str
    repetitions: int
    block_size: int


def log_report(
    run: DemoRun, hf: SideResult, paged: SideResult, answers: list[tuple[str, str]]
) -> tuple[int, float, str]:
    """Log a few (question, answer) pairs, the table, the speed-up and the verdict; returns (rows identical, the
    speed-up, the verdict)."""
    for q, text in answers:
        answer = " ".join(text.split())
        logger.info("Q: %s\nA: %s", q, answer if len(answer) <= 240 else answer[:240] + " ...")
    log_table(run, hf, paged)
    same = sum(a == b for a, b in zip(hf.outputs, paged.outputs))
    agree = sum(
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        for a, b in zip(hf.outputs, paged.outputs)
    )
    speedup = paged.tokens_per_s / hf.tokens_per_s
    worst = paged.tokens_per_s_range[0] / hf.tokens_per_s_range[1]
    best = paged.tokens_per_s_range[1] / hf.tokens_per_s_range[0]
    logger.info(
        "speed-up %.2fx, median against median (%.2fx to %.2fx pairing the slowest and fastest runs); greedy "
        "outputs identical: %d/%d rows (%.0f%% of tokens before a row's first difference)",
        speedup, worst, best, same, len(hf.outputs), 100 * agree / max(sum(map(len, hf.outputs)), 1),
    )  # fmt: skip
    conclusion = verdict(hf, paged, run.device, embedded_model=not run.real)
    logger.info("%s", conclusion)
    if run.real:
        logger.info("serve this model (OpenAI-compatible, needs the [server] extra): paged-backend serve %s", run.path)
    return same, speedup, conclusion


def log_table(run: DemoRun, hf: SideResult, paged: SideResult) -> None:
    rows = [
        ("output tokens/s (median)", f"{hf.tokens_per_s:,.0f}", f"{paged.tokens_per_s:,.0f}"),
        (f"  slowest-fastest of {run.repetitions}", _span(hf.tokens_per_s_range), _span(paged.tokens_per_s_range)),
        ("seconds (median)", f"{hf.median_seconds:.2f}", f"{paged.median_seconds:.2f}"),
        (
            "new tokens a run (median)",
            f"{statistics.median(hf.tokens):,.0f}",
            f"{statistics.median(paged.tokens):,.0f}",
        ),
        (
            f"KV blocks of {run.block_size} held (peak)",
            f"{-(-hf.kv_slots // run.block_size):,}",
            f"{paged.kv_slots // run.block_size:,}",
        ),
        ("KV slots holding no token", f"{hf.kv_waste:.0%}", f"{paged.kv_waste:.0%}"),
        ("preemptions", "n/a", str(paged.preemptions)),
    ]
    ending = (
        f"up to {run.max_tokens} new tokens each (until the end of the answer)"
        if run.chat
        else f"{run.max_tokens} new tokens each"
    )
    logger.info(
        "%s: %d prompts, %s, greedy, %s on %s; each side warmed up on other prompts, then timed %d times",
        run.path, run.num_prompts, ending, run.dtype, run.device, run.repetitions,
    )  # fmt: skip
    logger.info("%-28s %14s %14s", "", "HF generate", "paged-backend")
    for name, left, right in rows:
        logger.info("%-28s %14s %14s", name, left, right)


def _span(low_high: tuple[float, float]) -> str:
    return f"{low_high[0]:,.0f}-{low_high[1]:,.0f}"
