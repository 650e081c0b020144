"""Tensor parallelism on two GPUs: greedy equality first, then speed beside Hugging Face.

Parts (``--parts``, all by default):
  check    tiny fp32 Llama and Qwen2 (Qwen3: one KV head, replicated) at TP=2 with chunked prefill and
           preemption, eager and compiled + CUDA graphs: greedy output == HF ``generate`` on one GPU
  w1       W1 (docs/benchmarks.md) on the Llama-3-8B shape: paged TP=1 and TP=2, beside HF ``generate`` (batches of 64,
           one GPU) on the first 64 prompts
  kill     a worker killed inside a step (tiny Llama, TP=2): seconds until rank 0 raises
  w2_70b   W2 (one 128-token prompt, 256 new tokens) on a Llama-3-70B shape (80 layers, hidden 8192, 64 heads,
           8 KV heads, FFN 28672, vocab 128256): paged TP=2 beside HF ``generate`` with the layers split over the
           two GPUs (accelerate's ``dispatch_model``, what ``device_map="auto"`` does)
Each check (architecture and mode), W1 engine, the 70B run and the kill test run in a child process of their own,
killed with their workers after ``--unit-timeout`` seconds (``--in-process``: all in this one).
Weights: ``load_format="dummy"``, the architecture's own random init (normal(0, 0.02), norms 1) in bf16, made on
the GPUs from config.json alone (a 70B checkpoint would not fit this machine's disk). No EOS: fixed lengths.

    python benchmarks/tp.py --json benchmarks/results/h200x2_tp.json --plot docs/images/h200x2_tp.png
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

from benchmarks.gpu_check import hf_greedy_on_gpu, tiny_prompts  # noqa: E402
from benchmarks.throughput import (  # noqa: E402
    MODEL_CONFIG,
    benchmark_config,
    one_prompt,
    release_engine,
    run_hf,
    run_paged,
    step_breakdown,
    tokens_per_second,
    versions,
    w1_prompts,
    write_json,
)
from paged_backend import LLM, SamplingParams  # noqa: E402
from paged_backend.demo_checkpoint import build_tiny_tokenizer  # noqa: E402
from paged_backend.model_loader.dummy import materialize, meta_model  # noqa: E402
from tests.fixtures.tiny_models import build_tiny_model  # noqa: E402

logger = logging.getLogger("benchmarks.tp")

MODEL_70B = dict(MODEL_CONFIG, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, intermediate_size=28672)
# Weights one GPU reads per decode step at TP=2: every layer's half plus the replicated embedding row and LM head.
H200_COPY_TBPS = 4.27


def save_config(path: Path, shape: dict[str, Any], num_layers: int | None) -> LlamaConfig:
    config = benchmark_config(shape, num_layers)
    config.dtype = "bfloat16"
    config.save_pretrained(path)
    return config


def paged_llm(path: Path, tp: int, **kwargs: Any) -> LLM:
    return LLM(
        str(path),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        tensor_parallel_size=tp,
        **kwargs,
    )


# ---------------------------------------------------------------------------------------------------- check
@torch.no_grad()
def save_tiny(tmp: Path, arch: str, tokenizer: Any) -> tuple[Path, Any]:
    """A tiny fp32 model of ``arch`` and the tokenizer, saved in ``tmp / arch``."""
    model = build_tiny_model(arch, vocab_size=len(tokenizer))
    path = tmp / arch
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model


def check(
    tmp: Path, archs: tuple[str, ...] = ("llama", "qwen2", "qwen3"), modes: tuple[str, ...] = ("eager", "compiled")
) -> list[dict[str, Any]]:
    tokenizer = build_tiny_tokenizer()
    rows = []
    for arch in archs:
        path, model = save_tiny(tmp, arch, tokenizer)
        model = model.cuda()
        prompts = tiny_prompts()
        refs = [hf_greedy_on_gpu(model, prompt) for prompt in prompts]
        for eager in [mode == "eager" for mode in modes]:
            llm = LLM(
                str(path),
                tensor_parallel_size=2,
                dtype="float32",
                block_size=4,
                num_kv_blocks=40,
                max_num_batched_tokens=24,
                max_model_len=80,
                max_num_seqs=16,
                enforce_eager=eager,
            )
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False
            )
            stats = llm.stats()
            rows.append(
                {
                    "arch": arch,
                    "mode": "eager" if eager else "compiled+graphs",
                    "matches": sum(list(o.outputs[0].token_ids) == r for o, r in zip(outs, refs)),
                    "prompts": len(prompts),
                    "preemptions": stats["num_preemptions"],
                    "swap_outs": stats["num_swapped_out"],
                    "all_reduce": "symm_mem" if llm.llm_engine.executor.all_reduce.buffer is not None else "nccl",
                }
            )
            logger.info("check %s", rows[-1])
            llm.llm_engine.shutdown()
            del llm, outs
            release_engine(f"{arch} TP=2")
        del model
    return rows


def kill_worker_mid_step(tmp: Path) -> dict[str, Any]:
    """NCCL does not notice a dead peer; the group's watcher must abort it so that rank 0 raises within seconds."""
    import time

    llm = LLM(str(tmp / "llama"), tensor_parallel_size=2, dtype="float32", block_size=4, max_model_len=80)
    (worker,) = llm.llm_engine.executor.group.processes
    driver = llm.llm_engine.executor.driver_worker
    forward, steps = driver.execute_model, [0]

    def dying_forward(*args: Any, **kwargs: Any) -> Any:
        steps[0] += 1
        if steps[0] == 3:
            worker.kill()
            worker.join(timeout=10)
        return forward(*args, **kwargs)

    driver.execute_model = dying_forward
    started = time.monotonic()
    try:
        llm.generate(["Hello"] * 4, SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)
        error = "none"
    except Exception as exc:  # noqa: BLE001 - recorded, whatever it is
        error = f"{type(exc).__name__}: {str(exc)[:200]}"
    result = {"seconds_to_error": time.monotonic() - started, "error": error}
    logger.info("dead worker: %s", result)
    llm.llm_engine.shutdown()
    del llm, driver
    release_engine("dead-worker check")
    return result


# ---------------------------------------------------------------------------------------------------- w1
def profile_rank0(llm: LLM, prompts: list[list[int]], path: Path) -> None:
    """torch.profiler's kernel table on rank 0 for W1's prompts with 32 new tokens each: the NCCL kernels' total
    against the rest says how long rank 0 waited for the other rank."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, seconds = run_paged(llm, prompts, 32)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90)
    path.write_text(f"{len(prompts)} prompts x 32 tokens, {seconds:.2f} s wall\n{table}")
    logger.info("profile written to %s", path)


def w1(
    tmp: Path,
    num_layers: int | None,
    num_prompts: int,
    max_tokens: int,
    backends: list[str],
    breakdown: bool = False,
    profile_dir: Path | None = None,
    engine_args: dict[str, Any] | None = None,
    results: dict[str, Any] | None = None,
    save: Any = None,
    keep_tokens: bool = False,
) -> dict[str, Any]:
    """W1 per backend into ``results`` (``save()`` after each, so a run stopped by a time limit keeps the rest)."""
    path = tmp / "llama-3-8b-shape"
    config = save_config(path, MODEL_CONFIG, num_layers)
    prompts = w1_prompts(config.vocab_size, num_prompts)
    results = {} if results is None else results
    save = save or (lambda: None)

    if "hf" in backends:
        model = materialize(meta_model(config, torch.bfloat16), torch.device("cuda", 0), seed=0)
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        run_hf(model, prompts[:4], 4)  # warm-up
        outs, seconds = run_hf(model, prompts[:64], max_tokens)
        results["hf_generate_64_prompts"] = tokens_per_second(outs, seconds)
        logger.info("W1 hf generate (64 prompts): %.1f tok/s", results["hf_generate_64_prompts"])
        save()
        del model
        release_engine("HF")

    variants = {"tp1": (1, {}), "tp2": (2, {}), "tp2_nccl": (2, {"disable_custom_all_reduce": True})}
    tokens: dict[str, list[list[int]]] = {}
    for name, (tp, extra) in variants.items():
        if name not in backends:
            continue
        llm = paged_llm(path, tp, **(engine_args or {}), **extra)
        run_paged(llm, w1_prompts(config.vocab_size, 64, seed=1), 8)  # warm-up, sharing no prefix with W1
        outs, seconds = run_paged(llm, prompts, max_tokens)
        results[f"paged_{name}"] = tokens_per_second(outs, seconds)
        results[f"paged_{name}_preemptions"] = llm.stats()["num_preemptions"]
        if tp > 1:
            results[f"paged_{name}_symm_mem_all_reduce"] = llm.llm_engine.executor.all_reduce.buffer is not None
        tokens[name] = outs
        if keep_tokens and name in ("tp2", "tp2_nccl"):  # for the parent process to compare (popped there)
            results[f"tokens_{name}"] = outs
        logger.info("W1 paged %s: %.1f tok/s", name, results[f"paged_{name}"])
        if breakdown:
            fresh = w1_prompts(config.vocab_size, num_prompts, seed=2)  # prompts the prefix cache has not seen
            results[f"breakdown_{name}"] = step_breakdown(llm, fresh, max_tokens)
            results[f"breakdown_{name}"]["prefill_only_s"] = run_paged(
                llm, w1_prompts(config.vocab_size, num_prompts, seed=3), 1
            )[1]
            logger.info("W1 %s breakdown: %s", name, results[f"breakdown_{name}"])
        if profile_dir is not None:
            profile_rank0(
                llm, w1_prompts(config.vocab_size, num_prompts, seed=4), profile_dir / f"{name}_rank0_profile.txt"
            )
        save()
        llm.llm_engine.shutdown()
        del llm
        release_engine(name)
    compare_w1(results, tokens)
    return results


def compare_w1(results: dict[str, Any], tokens: dict[str, list[list[int]]]) -> None:
    """The TP=2 speedup, and how many W1 outputs of TP=2 with symmetric memory equal those with NCCL."""
    if "paged_tp1" in results and "paged_tp2" in results:
        results["speedup_tp2_over_tp1"] = results["paged_tp2"] / results["paged_tp1"]
    if "tp2" in tokens and "tp2_nccl" in tokens:  # a + b is exact either way: the same tokens, bf16 included
        results["tp2_same_tokens_as_nccl"] = sum(a == b for a, b in zip(tokens["tp2"], tokens["tp2_nccl"]))


# ---------------------------------------------------------------------------------------------------- w2 70b
def split_over_gpus(config: LlamaConfig) -> Any:
    """HF's model with its layers split in two halves over cuda:0 and cuda:1, made module by module."""
    from accelerate import dispatch_model

    model = meta_model(config, torch.bfloat16)
    half = config.num_hidden_layers // 2

    def gpu_of(name: str) -> int:
        if name.startswith("model.layers."):
            return int(int(name.split(".")[2]) >= half)
        return 1 if name in ("model.norm", "lm_head") else 0

    materialize(model, torch.device("cuda", 0), seed=0, shard=lambda name, module: module.to(f"cuda:{gpu_of(name)}"))
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1, "lm_head": 1}
    device_map.update({f"model.layers.{i}": int(i >= half) for i in range(config.num_hidden_layers)})
    model = dispatch_model(model, device_map)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def w2_70b(tmp: Path, num_layers: int | None, max_tokens: int) -> dict[str, Any]:
    path = tmp / "llama-3-70b-shape"
    config = save_config(path, MODEL_70B, num_layers)
    prompt = one_prompt(config.vocab_size, 128, seed=1)
    results: dict[str, Any] = {}

    try:
        model = split_over_gpus(config)
        run_hf(model, [prompt], 4)  # warm-up
        outs, seconds = run_hf(model, [prompt], max_tokens)
        results["hf_generate_split"] = tokens_per_second(outs, seconds)
        logger.info("W2 70B hf generate, layers split over 2 GPUs: %.2f tok/s", results["hf_generate_split"])
    except Exception as exc:  # noqa: BLE001 - recorded; the paged engine is still measured
        logger.exception("HF generate over two GPUs failed")
        results["hf_generate_split_error"] = f"{type(exc).__name__}: {exc}"
    model = None
    release_engine("HF")

    llm = paged_llm(path, 2, max_num_seqs=8)
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.llm_engine.model.parameters())
    run_paged(llm, [one_prompt(config.vocab_size, 128, seed=2)], max_tokens)  # warm-up, another prompt
    outs, seconds = run_paged(llm, [prompt], max_tokens)
    results["paged_tp2"] = tokens_per_second(outs, seconds)
    # The floor: rank 0's weights read once per token at the copy bandwidth (the embedding reads one row only).
    embed = config.vocab_size * config.hidden_size * 2
    results["weights_per_gpu_gb"] = weight_bytes / 1e9
    results["bandwidth_floor_tok_s"] = H200_COPY_TBPS * 1e12 / (weight_bytes - embed)
    logger.info("W2 70B paged TP=2: %.2f tok/s (floor %.1f)", results["paged_tp2"], results["bandwidth_floor_tok_s"])
    llm.llm_engine.shutdown()
    del llm
    release_engine("70B TP=2")
    return results


# ---------------------------------------------------------------------------------------------------- report
def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    if "w1" in results:
        r = results["w1"]
        panels.append(
            (
                "W1, Llama-3-8B shape: output tok/s",
                {
                    name: r[key]
                    for key, name in (
                        ("hf_generate_64_prompts", "hf generate\n(1 GPU)"),
                        ("paged_tp1", "paged TP=1"),
                        ("paged_tp2_nccl", "paged TP=2\n(NCCL only)"),
                        ("paged_tp2", "paged TP=2"),
                    )
                    if r.get(key) is not None
                },
                None,
            )
        )
    if "w2_70b" in results:
        r = results["w2_70b"]
        panels.append(
            (
                "W2, Llama-3-70B shape: tok/s",
                {
                    name: r[key]
                    for key, name in (("hf_generate_split", "hf generate\n(layers split)"), ("paged_tp2", "paged TP=2"))
                    if r.get(key) is not None
                },
                r["bandwidth_floor_tok_s"],
            )
        )
    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 3.8), squeeze=False)
    for ax, (title, values, floor) in zip(axes[0], panels):
        colors = ["#888" if name.startswith("hf") else "#4c72b0" if "TP=1" in name else "#dd8452" for name in values]
        bars = ax.bar(list(values), list(values.values()), color=colors)
        ax.bar_label(bars, fmt="%.0f" if max(values.values()) > 100 else "%.1f")
        if floor:
            ax.axhline(floor, color="k", linestyle="--", linewidth=1)
            ax.text(0, floor, f" bandwidth floor {floor:.0f}", va="bottom", fontsize=8)
        ax.set_title(title, fontsize=10)
    fig.suptitle(f"{results['machine']}, bf16, random weights", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# Options each child process gets as they were given.
_PASSED_ON = (
    "--num-prompts",
    "--max-tokens",
    "--num-layers",
    "--profile-dir",
    "--num-scheduler-steps",
)


def isolated_units(args: argparse.Namespace) -> list[list[str]]:
    """The command lines of the child processes that run ``args``'s parts: each check (architecture and mode),
    each W1 engine, the 70B run and the kill test in a process of its own."""
    parts = args.parts.split(",")
    units = []
    if "check" in parts:
        units += [
            ["--parts", "check", "--check-archs", arch, "--check-modes", mode]
            for arch in args.check_archs.split(",")
            for mode in args.check_modes.split(",")
        ]
    if "w1" in parts:
        units += [["--parts", "w1", "--w1-backends", backend] for backend in args.w1_backends.split(",")]
    units += [["--parts", part] for part in ("w2_70b", "kill") if part in parts]
    return units


def run_isolated(args: argparse.Namespace, results: dict[str, Any], save: Any) -> None:
    """Each unit in a child process (``isolated_units``), its results merged into ``results`` as it ends."""
    import os
    import signal
    import subprocess

    passed_on = []
    for flag in _PASSED_ON:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            passed_on += [flag, str(value)]
    if args.breakdown:
        passed_on.append("--breakdown")
    tokens: dict[str, list[list[int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, unit in enumerate(isolated_units(args)):
            out = Path(tmp) / f"unit{i}.json"
            command = [sys.executable, __file__, *unit, *passed_on, "--in-process", "--keep-tokens", "--json", str(out)]
            logger.info("child process: %s", " ".join(command[1:]))
            # its own process group: on a time-out the child and its tensor-parallel workers go together
            child_process = subprocess.Popen(command, start_new_session=True)
            try:
                returncode = child_process.wait(timeout=args.unit_timeout)
            except subprocess.TimeoutExpired:
                os.killpg(child_process.pid, signal.SIGKILL)
                returncode = child_process.wait()
                logger.error("child process %s ran past --unit-timeout=%d s: killed", unit, args.unit_timeout)
            if not out.exists():
                logger.error("child process %s wrote no results (exit code %d)", unit, returncode)
                continue
            child = json.loads(out.read_text())
            for part in ("check", "w1", "w2_70b", "kill"):
                if part not in child:
                    continue
                if part == "check":
                    results.setdefault("check", []).extend(child["check"])
                elif part == "w1":
                    for key in [k for k in child["w1"] if k.startswith("tokens_")]:
                        tokens[key.removeprefix("tokens_")] = child["w1"].pop(key)
                    results.setdefault("w1", {}).update(child["w1"])
                    compare_w1(results["w1"], tokens)
                else:
                    results[part] = child[part]
            save()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="check,w1,w2_70b,kill", help="comma list of check, w1, w2_70b, kill")
    parser.add_argument(
        "--w1-backends",
        default="hf,tp1,tp2",
        help="comma list of hf, tp1, tp2, tp2_nccl (TP=2 without symmetric memory)",
    )
    parser.add_argument("--num-prompts", type=int, default=256, help="W1 prompts (the workload: 256)")
    parser.add_argument("--max-tokens", type=int, default=256, help="new tokens per prompt (the workload: 256)")
    parser.add_argument("--num-layers", type=int, default=None, help="fewer layers for a quick try")
    parser.add_argument("--check-archs", default="llama,qwen2,qwen3", help="check: comma list of llama, qwen2, qwen3")
    parser.add_argument("--check-modes", default="eager,compiled", help="check: comma list of eager, compiled")
    parser.add_argument("--breakdown", action="store_true", help="W1: where rank 0's time goes, by step kind")
    parser.add_argument("--profile-dir", type=Path, default=None, help="W1: write rank 0's kernel tables here")
    parser.add_argument("--num-scheduler-steps", type=int, default=None, help="W1: decode steps per round")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run every part and engine in this process (by default each check, W1 engine, 70B run and kill "
        "test runs in a child process: on two H200s a TP=2 engine started after another engine in the same "
        "process hung while compiling, docs/benchmarks.md)",
    )
    parser.add_argument(
        "--unit-timeout", type=int, default=900, help="seconds after which a child process and its workers are killed"
    )
    parser.add_argument("--keep-tokens", action="store_true", help=argparse.SUPPRESS)  # a child, for its parent
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    parser.add_argument("--plot", type=Path, default=None, help="write a bar chart here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if torch.cuda.device_count() < 2:
        parser.error(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    parts = args.parts.split(",")
    unknown = set(parts) - {"check", "w1", "w2_70b", "kill"}
    if unknown:
        parser.error(f"--parts takes check, w1, w2_70b, kill; got {sorted(unknown)}")
    modes = tuple(args.check_modes.split(","))
    if set(modes) - {"eager", "compiled"}:
        parser.error(f"--check-modes takes eager, compiled; got {args.check_modes!r}")
    results: dict[str, Any] = {
        "machine": f"2x {torch.cuda.get_device_name(0)}",
        "versions": versions(),
        "command": "python benchmarks/tp.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }

    def save() -> None:
        write_json(args.json, results)

    if not args.in_process:
        run_isolated(args, results, save)
    else:
        run_parts(args, parts, modes, results, save)
    if args.plot and ("w1" in results or "w2_70b" in results):
        plot(results, args.plot)
    logger.info("%s", json.dumps({k: v for k, v in results.items() if k != "versions"}, indent=2))
    return results


def run_parts(
    args: argparse.Namespace, parts: list[str], modes: tuple[str, ...], results: dict[str, Any], save: Any
) -> None:
    """``parts`` one after the other in this process."""
    with tempfile.TemporaryDirectory() as tmp:
        if "check" in parts:
            results["check"] = check(Path(tmp), tuple(args.check_archs.split(",")), modes)
            save()
        if "w1" in parts:
            engine_args = {}
            if args.num_scheduler_steps is not None:
                engine_args["num_scheduler_steps"] = args.num_scheduler_steps
            results["w1"] = {}
            w1(
                Path(tmp),
                args.num_layers,
                args.num_prompts,
                args.max_tokens,
                args.w1_backends.split(","),
                breakdown=args.breakdown,
                profile_dir=args.profile_dir,
                engine_args=engine_args,
                results=results["w1"],
                save=save,
                keep_tokens=args.keep_tokens,
            )
            save()
        if "w2_70b" in parts:
            results["w2_70b"] = w2_70b(Path(tmp), args.num_layers, args.max_tokens)
            save()
        if "kill" in parts:
            if "check" not in parts:
                save_tiny(Path(tmp), "llama", build_tiny_tokenizer())
            results["kill"] = kill_worker_mid_step(Path(tmp))
            save()


if __name__ == "__main__":
    main()
