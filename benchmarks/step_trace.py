"""What a stream sees when a prompt arrives beside running decodes: the gaps between one running request's tokens
around each arrival, in one process (no HTTP), on the 8B-shaped benchmark model.

``--running`` requests decode (W1-length prompts, no end); every ``--every`` steps a fresh prompt of each length in
``--prompt-lens`` arrives (``max_tokens`` 1). For each setting of ``--settings`` (``steps:threshold``, the
scheduler's ``num_scheduler_steps`` and ``long_prefill_token_threshold``, changed on the live engine between
phases) the script reports the watched request's median token gap away from arrivals, and per prompt length the
largest gap within the steps that follow an arrival, and the phase's longest gaps with what the ``step()`` call that
ended each one spent its time on (``StepClock``: scheduling, launches, the wait for the device, bookkeeping,
outputs, the garbage collector) and how many prompt tokens it scheduled. Tokens that arrive together (a multi-step
round) count as k gaps of g/k, as ``serving.py`` counts them.

    python benchmarks/step_trace.py --json benchmarks/results/step_trace_h100.json
    python benchmarks/step_trace.py --max-num-batched-tokens 384 ...   # at the OpenAI server's step budget
    python benchmarks/step_trace.py --tiny     # the same on CPU with a tiny random model (a smoke run)
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: ``benchmarks``, ``tests``

from benchmarks.throughput import build_model, one_prompt, run_header, write_json  # noqa: E402
from paged_backend import LLM, SamplingParams  # noqa: E402

logger = logging.getLogger("benchmarks.step_trace")


class StepClock:
    """Where each ``engine.step()`` call's time goes: the scheduler's calls, the launches, the wait for the device
    (``get_output``), the bookkeeping and the outputs, and Python's garbage collector; and how many prompt tokens
    the steps it scheduled carry. The engine's own methods are wrapped on the instance (this script's engine only).
    """

    PARTS = ("schedule", "launch", "wait", "update", "tokens", "outputs", "gc")

    def __init__(self, engine: Any) -> None:
        self.current: dict[str, float] = dict.fromkeys(self.PARTS, 0.0)
        self.prompt_tokens = 0
        self.calls: list[dict[str, float]] = []
        scheduler, processor = engine.scheduler, engine.output_processor
        self._timed(scheduler, "schedule", "schedule", count=True)
        self._timed(scheduler, "schedule_continuation", "schedule")
        self._timed(scheduler, "update_from_output", "update")
        self._timed(processor, "process_tokens", "tokens")
        self._timed(processor, "make_outputs", "outputs")
        launch = engine.executor.execute_model_async

        def timed_launch(scheduler_output: Any) -> Any:
            start = time.perf_counter()
            pending = launch(scheduler_output)
            self.current["launch"] += time.perf_counter() - start
            read = pending.get_output

            def timed_read() -> Any:
                begin = time.perf_counter()
                try:
                    return read()
                finally:
                    self.current["wait"] += time.perf_counter() - begin

            pending.get_output = timed_read
            read_step = getattr(pending, "read_step", None)
            if read_step is not None:  # a round a stream reads a step at a time

                def timed_step(step: int) -> Any:
                    begin = time.perf_counter()
                    try:
                        return read_step(step)
                    finally:
                        self.current["wait"] += time.perf_counter() - begin

                pending.read_step = timed_step
            return pending

        engine.executor.execute_model_async = timed_launch
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.current["gc"] += time.perf_counter() - self._gc_start

    def _timed(self, owner: Any, name: str, part: str, count: bool = False) -> None:
        inner = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                out = inner(*args, **kwargs)
            finally:
                self.current[part] += time.perf_counter() - start
            if count and out is not None and out.batch.num_steps is None:
                self.prompt_tokens += sum(n for n in out.batch.num_scheduled_tokens if n > 1)
            return out

        setattr(owner, name, wrapper)

    def close(self) -> dict[str, float]:
        """The finished call's record (milliseconds), and a fresh one begun."""
        record = {k: 1e3 * v for k, v in self.current.items()} | {"prompt_tokens": float(self.prompt_tokens)}
        self.current, self.prompt_tokens = dict.fromkeys(self.PARTS, 0.0), 0
        self.calls.append(record)
        return record


def trace_phase(llm: LLM, clock: StepClock, vocab: int, prompt_lens: list[int], every: int, seed: int) -> dict:
    """One phase: arrivals of each prompt length three times, ``every`` steps apart; the watched request's gaps."""
    engine = llm.llm_engine
    watched = "running-0"
    outputs_at: list[tuple[float, int, dict[str, float]]] = []  # (when, its token count, the call's record)
    arrivals: list[tuple[int, int]] = []  # (index into outputs_at, prompt length)
    plan = [length for length in prompt_lens for _ in range(3)]
    step = 0
    last = time.perf_counter()
    while plan or step % every:
        if step % every == every // 2 and plan:
            length = plan.pop(0)
            rid = f"arrival-{seed}-{len(arrivals)}"
            engine.add_request(rid, {"prompt_token_ids": one_prompt(vocab, length, seed=seed + len(arrivals))},
                               SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))  # fmt: skip
            arrivals.append((len(outputs_at), length))
        outputs = engine.step()
        now = time.perf_counter()
        record = clock.close() | {"call": 1e3 * (now - last)}
        last = now
        count = next((len(o.outputs[0].token_ids) for o in outputs if o.request_id == watched), None)
        if count is not None:
            outputs_at.append((now, count, record))
        step += 1
    gaps: list[float] = []  # per token, as a stream counts them
    gap_at: list[tuple[float, int, dict[str, float]]] = []  # (per-token gap, tokens, the record) per output
    for (t0, c0, _), (t1, c1, record) in zip(outputs_at, outputs_at[1:], strict=False):
        k = max(1, c1 - c0)
        gaps += [(t1 - t0) / k] * k
        gap_at.append((1e3 * (t1 - t0) / k, k, record))
    near = {i + d for i, _ in arrivals for d in range(-1, 4)}
    quiet = [g for i, (g, _, _) in enumerate(gap_at) if i not in near]
    by_len: dict[int, list[float]] = {}
    for i, length in arrivals:
        by_len.setdefault(length, []).append(max((g for g, _, _ in gap_at[i : i + 4]), default=0.0))
    longest = sorted(range(len(gap_at)), key=lambda i: -gap_at[i][0])[:8]
    return {
        "quiet_gap_ms_p50": statistics.median(quiet) if quiet else None,
        "gap_ms_p99": 1e3 * sorted(gaps)[int(0.99 * (len(gaps) - 1))] if gaps else None,
        "arrival_max_gap_ms": {str(k): v for k, v in by_len.items()},
        "longest_gaps": [
            {"gap_ms": gap_at[i][0], "k": gap_at[i][1], "near_arrival": i in near, **gap_at[i][2]} for i in longest
        ],
        "median_call": {part: statistics.median(r[part] for _, _, r in gap_at) for part in (*StepClock.PARTS, "call")},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--running", type=int, default=32, help="requests decoding throughout")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--every", type=int, default=24, help="engine steps between arrivals")
    parser.add_argument("--settings", nargs="+", default=["8:0", "1:0", "1:512", "1:256", "2:256"],
                        help="num_scheduler_steps:long_prefill_token_threshold per phase")  # fmt: skip
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the step's token budget (default: LLM's; the server's is 384)")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama on CPU (smoke run)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = [tuple(int(x) for x in s.split(":")) for s in args.settings]
    max_steps = max(s for s, _ in settings)
    if args.tiny:
        from tests.fixtures.tiny_models import build_tiny_model

        model = build_tiny_model("llama", vocab_size=1000, max_position_embeddings=8192)
        kwargs: dict[str, Any] = {"num_kv_blocks": 8000}
    else:
        model, kwargs = build_model(None), {}
    vocab = model.config.vocab_size
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(model, num_scheduler_steps=max_steps, max_model_len=8192, **kwargs)
    engine = llm.llm_engine
    clock = StepClock(engine)
    endless = SamplingParams(max_tokens=engine.config.max_model_len - 1024, temperature=0.0, ignore_eos=True)
    for i in range(args.running):
        engine.add_request(f"running-{i}", {"prompt_token_ids": one_prompt(vocab, 64 + 29 * i % 960, seed=i)}, endless)
    for _ in range(40):  # the running requests' prefills, compiles and first rounds
        engine.step()
    clock.close()
    results: dict[str, Any] = run_header(argv)
    results |= {"running": args.running, "every": args.every, "budget": engine.config.max_num_batched_tokens}
    results["phases"] = {}
    for n, (steps, threshold) in enumerate(settings):
        engine.scheduler.num_scheduler_steps = steps
        engine.scheduler.long_prefill_token_threshold = threshold
        trace_phase(llm, clock, vocab, args.prompt_lens[:1], args.every, seed=1000 + 100 * n)  # warm-up
        phase = trace_phase(llm, clock, vocab, args.prompt_lens, args.every, seed=5000 + 100 * n)
        results["phases"][f"{steps}:{threshold}"] = phase
        logger.info(
            "steps %d, threshold %d: quiet gap p50 %.1f ms, p99 %.1f ms; after arrivals (max) %s; median call %s",
            steps, threshold, phase["quiet_gap_ms_p50"], phase["gap_ms_p99"],
            {k: [round(g, 1) for g in v] for k, v in phase["arrival_max_gap_ms"].items()},
            {k: round(v, 2) for k, v in phase["median_call"].items()},
        )  # fmt: skip
        for gap in phase["longest_gaps"]:
            logger.info("   long gap: %s", {k: round(v, 2) if isinstance(v, float) else v for k, v in gap.items()})
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
