"""Serving: W1's prompts through an OpenAI-compatible server with Poisson arrivals, at several request rates.

Servers, each a subprocess loading the same saved checkpoint:
  paged     ``python -m paged_backend.entrypoints.openai.api_server`` (this library)
  hf_serve  ``transformers serve --continuous-batching`` (when the installed transformers has it)
Checkpoint: the benchmark model of docs/benchmarks.md (Llama-3-8B shape, random normal(0, 0.02) bf16 weights, no
EOS), saved once with ``save_pretrained``, plus a word-level tokenizer whose token i is the word ``t{i}``: a
prompt's text encodes to exactly W1's token ids in either server, and every generated token decodes to one word, so
output tokens are counted as words. Its chat template passes the user message through unchanged.
Requests: the first ``--num-prompts`` of W1's prompts (lengths uniform in [64, 1024], random.Random(0)) at the first
rate's first run, and as many drawn the same way with a seed of their own at the warm-up and every other run (the
paged server caches prefixes: repeating a prompt set would serve its prefill from the cache), as streamed
``/v1/chat/completions`` with temperature 0 and ``max_tokens`` 256; arrival gaps are exponential with mean 1/rate
(drawn with the run's seed); ``inf`` sends them all at once. Per rate: output tok/s (tokens streamed / from the
first send to the last token), time to first token (first chunk with text) and inter-token latency p50/p99 (a chunk
of k tokens after a gap g counts as k gaps of g/k: multi-step decoding streams several tokens at once), and time per
output token (per request: from its first to its last token, over its tokens after the first). Each rate runs
``--repeats`` times, each time with prompts and arrivals of its own; a figure is the median of the runs that
completed a request, the runs kept beside it, the counts (requests, completed, errors, tokens) summed.

  python benchmarks/serving.py --json benchmarks/results/h200_serving.json --plot docs/images/h200_serving.png
  python benchmarks/serving.py --tiny --servers paged --repeats 1   # smoke run on CPU, tiny model
  python benchmarks/serving.py --paged-args="--num-scheduler-steps 1" ...   # the paged server with other flags (the
                                                                            # "=": argparse reads a leading "--")
  python benchmarks/serving.py --servers paged --paged-args="" --paged-args="--max-num-batched-tokens 256" ...
      # several settings of the paged server side by side, each a server of its own ("paged", "paged <flags>")
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import math
import random
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: ``benchmarks`` and ``tests``

from benchmarks.throughput import add_plot_arguments, build_model, replotted, versions, w1_prompts, write_json

logger = logging.getLogger("benchmarks.serving")

CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
MAX_TOKENS = 256


# ---------------------------------------------------------------------------------------------------- checkpoint
def word_tokenizer(vocab_size: int):
    """Token i <-> the word ``t{i}``, split on whitespace: text and token ids map one to one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=CHAT_TEMPLATE)


def save_checkpoint(directory: Path, tiny: bool) -> int:
    """Save the benchmark model and its word tokenizer; returns the vocabulary size."""
    if tiny:
        from tests.fixtures.tiny_models import build_tiny_model

        model = build_tiny_model("llama", vocab_size=512)
        model.config.eos_token_id = model.generation_config.eos_token_id = None
    else:
        model = build_model(None)
    vocab = model.config.vocab_size
    model.save_pretrained(directory)
    word_tokenizer(vocab).save_pretrained(directory)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return vocab


def prompt_text(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


# ---------------------------------------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(name: str, checkpoint: Path, port: int, *, tiny: bool, paged_args: list[str]) -> list[str]:
    if name == "paged":
        cmd = [sys.executable, "-m", "paged_backend.entrypoints.openai.api_server", "--model", str(checkpoint)]
        cmd += ["--port", str(port), "--max-num-seqs", "256"]
        return cmd + (["--device", "cpu", "--max-model-len", "512"] if tiny else []) + paged_args
    if name == "hf_serve":
        exe = shutil.which("transformers")
        if exe is None:
            raise RuntimeError("the transformers CLI is not installed")
        help_text = subprocess.run([exe, "serve", "--help"], capture_output=True, text=True).stdout
        if "continuous-batching" not in help_text:
            raise RuntimeError("this transformers has no `serve --continuous-batching`")
        cmd = [exe, "serve", "--continuous-batching", "--host", "127.0.0.1", "--port", str(port)]
        return cmd + (["--force-model", str(checkpoint)] if "--force-model" in help_text else [str(checkpoint)])
    raise ValueError(f"servers must be paged or hf_serve, got {name!r}")


def wait_ready(base: str, process: subprocess.Popen, timeout: float) -> None:
    """Until the server answers HTTP at all (transformers 5.17's ``/v1/models`` answers 500 offline); the warm-up
    requests then check that it generates."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before it was ready")
        try:
            httpx.get(base + "/health", timeout=5)
            return
        except httpx.HTTPError:
            time.sleep(1)
    raise RuntimeError(f"server not ready after {timeout:.0f} s")


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# ---------------------------------------------------------------------------------------------------- client
@dataclass
class Result:
    sent: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival time, tokens in the chunk)
    error: str | None = None

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.chunks)


async def one_request(client: httpx.AsyncClient, url: str, model: str, text: str, delay: float) -> Result:
    await asyncio.sleep(delay)
    result = Result(sent=time.perf_counter())
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices") or [{}]
                content = (choices[0].get("delta") or {}).get("content")
                if content and content.split():
                    result.chunks.append((time.perf_counter(), len(content.split())))
    except httpx.HTTPError as exc:
        result.error = repr(exc)
    return result


async def run_rate(base: str, model: str, prompts: list[str], rate: float, seed: int) -> list[Result]:
    rng = random.Random(seed)
    delays, at = [], 0.0
    for _ in prompts:
        delays.append(at)
        at += rng.expovariate(rate) if math.isfinite(rate) else 0.0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        url = base + "/v1/chat/completions"
        return list(await asyncio.gather(*(one_request(client, url, model, p, d) for p, d in zip(prompts, delays))))


COUNTS = ("requests", "completed", "errors", "output_tokens")


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A rate's figures: each rate, latency and throughput the median over the runs that completed a request (a run
    that completed none has no figures), the counts summed over all, the first error kept."""
    done = [run for run in runs if run["completed"]]
    figures = [k for k, v in runs[0].items() if isinstance(v, float) and k not in COUNTS]
    return {
        **{k: statistics.median(run[k] for run in done) if done else float("nan") for k in figures},
        **{k: sum(run[k] for run in runs) for k in COUNTS},
        "runs_with_figures": len(done),
        "first_error": next((run["first_error"] for run in runs if run["first_error"]), None),
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summarize(results: list[Result]) -> dict[str, Any]:
    ok = [r for r in results if r.error is None and r.chunks]
    ttft = [r.chunks[0][0] - r.sent for r in ok]
    itl: list[float] = []
    tpot: list[float] = []
    for r in ok:
        for (before, _), (after, n) in zip(r.chunks, r.chunks[1:]):
            itl += [(after - before) / n] * n
        if r.tokens > 1:
            tpot.append((r.chunks[-1][0] - r.chunks[0][0]) / (r.tokens - r.chunks[0][1] or 1))
    span = max(r.chunks[-1][0] for r in ok) - min(r.sent for r in results) if ok else float("nan")
    tokens = sum(r.tokens for r in ok)
    errors = [r.error for r in results if r.error is not None]
    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "output_tokens": tokens,
        "output_tok_s": tokens / span,
        "ttft_ms_p50": 1e3 * percentile(ttft, 0.5),
        "ttft_ms_p99": 1e3 * percentile(ttft, 0.99),
        "ttft_ms_mean": 1e3 * statistics.mean(ttft) if ttft else float("nan"),
        "itl_ms_p50": 1e3 * percentile(itl, 0.5),
        "itl_ms_p99": 1e3 * percentile(itl, 0.99),
        "tpot_ms_p50": 1e3 * percentile(tpot, 0.5),
    }


# ---------------------------------------------------------------------------------------------------- driver
def bench_server(
    name: str,
    checkpoint: Path,
    warm_up: list[str],
    runs: list[tuple[float, int, list[str]]],  # (rate, seed, prompts) a run
    command: Callable[[int], list[str]],  # the server's command line, given its port
    log_dir: Path,
    out: dict[str, Any],
    save: Callable[[], None],
) -> None:
    """Fills ``out`` (startup time, then per rate each run's summary and their medians, saved after each run; or
    the error and log tail). ``warm_up`` and every run's prompts share no prefix (the paged server caches
    prefixes)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = log_dir / (re.sub(r"[^\w.-]+", "_", name) + ".log")  # a name may carry the server's flags
    with log_path.open("w") as log:
        process = subprocess.Popen(command(port), stdout=log, stderr=subprocess.STDOUT)
    try:
        started = time.perf_counter()
        wait_ready(base, process, timeout=600)
        warm = asyncio.run(run_rate(base, str(checkpoint), warm_up[:4], math.inf, 0))  # loads lazily, compiles
        if any(r.error for r in warm):
            raise RuntimeError(f"warm-up failed: {next(r.error for r in warm if r.error)}")
        out.update(startup_s=time.perf_counter() - started, rates={})
        for rate, seed, prompts in runs:
            summary = summarize(asyncio.run(run_rate(base, str(checkpoint), prompts, rate, seed)))
            by_rate = out["rates"].setdefault(str(rate), {"runs": []})
            by_rate["runs"].append(summary)
            by_rate.update(medians(by_rate["runs"]))
            logger.info("%s rate %s: %s", name, rate, summary)
            save()
    except Exception as exc:  # report and go on to the next server
        tail = log_path.read_text()[-3000:]
        logger.error("%s failed: %s\n%s", name, exc, tail)
        out.update(error=str(exc), log_tail=tail)
    finally:
        stop(process)


def plot(results: dict[str, Any], path: Path) -> None:
    """Grouped bars: for each request rate, one bar per server, for throughput, TTFT p50 and ITL p99."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = {name: s["rates"] for name, s in results["servers"].items() if s.get("rates")}
    rates = sorted({r for by_rate in servers.values() for r in by_rate}, key=float)
    metrics = [("output_tok_s", "output tok/s"), ("ttft_ms_p50", "TTFT p50 (ms)"), ("itl_ms_p99", "ITL p99 (ms)")]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.8))
    width = 0.8 / max(1, len(servers))
    for ax, (key, title) in zip(axes, metrics):
        for k, (name, by_rate) in enumerate(servers.items()):
            xs = [i + k * width for i, r in enumerate(rates) if r in by_rate]
            bars = ax.bar(xs, [by_rate[r][key] for r in rates if r in by_rate], width, label=name)
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
            for x, r in zip(xs, [r for r in rates if r in by_rate]):
                values = [run[key] for run in by_rate[r].get("runs", [])]
                ax.plot([x] * len(values), values, "k.", markersize=3)
        ax.set_xticks([i + width * (len(servers) - 1) / 2 for i in range(len(rates))], rates)
        ax.set_xlabel("request rate (req/s; inf: all at once)")
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    flags = f", paged server {' '.join(results['paged_args'])}" if results.get("paged_args") else ""
    runs = f"median of {results['repeats']} runs (dots)" if results.get("repeats") else "one run"
    fig.suptitle(f"Serving {results['num_prompts']} W1-like prompts a run, 256 new tokens, {runs}{flags} - "
                 f"{results['machine']}", fontsize=10)  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", default="paged,hf_serve", help="comma list of paged, hf_serve")
    parser.add_argument("--rates", default="4,16,inf", help="comma list of request rates (req/s); inf: all at once")
    parser.add_argument("--num-prompts", type=int, default=128, help="W1 prompts per rate (at most 256)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each rate, each with prompts of its own")
    parser.add_argument(
        "--paged-args",
        action="append",
        default=None,
        help="more flags for the paged server, one string: --paged-args=...; given again, another paged server",
    )
    parser.add_argument("--tiny", action="store_true", help="tiny random Llama, prompts cut to 64 tokens")
    parser.add_argument("--checkpoint", type=Path, default=None, help="where to save the checkpoint (default: tmp)")
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    add_plot_arguments(parser, "throughput, TTFT and ITL by rate")
    args = parser.parse_args(argv)
    if (loaded := replotted(parser, args, plot)) is not None:
        return loaded
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    if not 1 <= args.num_prompts <= 256:
        raise SystemExit(f"--num-prompts must be in 1..256, got {args.num_prompts}")
    rates = [float(r) for r in args.rates.split(",")]
    servers = args.servers.split(",")
    for name in servers:
        if name not in ("paged", "hf_serve"):
            raise SystemExit(f"--servers takes paged and hf_serve, got {name!r}")
    if args.paged_args and "paged" not in servers:
        raise SystemExit("--paged-args is for the paged server, which --servers leaves out")
    variants = [shlex.split(a) for a in args.paged_args or [""]]  # the paged server's settings, one server each
    if len({shlex.join(v) for v in variants}) != len(variants):
        raise SystemExit(f"--paged-args given twice the same: {args.paged_args}")

    work = Path(tempfile.mkdtemp(prefix="serving-"))
    checkpoint = args.checkpoint or work / "model"
    started = time.perf_counter()
    vocab = save_checkpoint(checkpoint, args.tiny)
    logger.info("checkpoint saved in %.1f s", time.perf_counter() - started)

    def prompts(seed: int) -> list[str]:  # W1's (seed 0), or others of the same lengths' distribution
        return [prompt_text(p[:64] if args.tiny else p) for p in w1_prompts(vocab, 256, seed=seed)[: args.num_prompts]]

    # W1's prompts (seed 0) at the first rate's first run; every other run and the warm-up (seed 100) a seed of its own
    seeds = [(rate, i if j == 0 else 1000 * j + i) for j in range(args.repeats) for i, rate in enumerate(rates)]
    if len({seed for _, seed in seeds} | {100}) != len(seeds) + 1:
        raise SystemExit(f"--rates takes fewer than 100 rates, got {len(rates)}")
    runs = [(rate, seed, prompts(seed)) for rate, seed in seeds]

    results: dict[str, Any] = {
        "machine": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "versions": versions(),
        "command": shlex.join(["python", "benchmarks/serving.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d"),
        "num_prompts": args.num_prompts,
        "repeats": args.repeats,
        "paged_args": variants[0] if len(variants) == 1 else [],  # several: each in its server's name
        "servers": {},
    }

    def save() -> None:  # after every run
        write_json(args.json, results)

    named = [(name, []) for name in servers if name != "paged"]
    if "paged" in servers:
        only = len(variants) == 1
        named[servers.index("paged") : servers.index("paged")] = [
            ("paged" if only or not v else f"paged {shlex.join(v)}", v) for v in variants
        ]
    for label, paged_args in named:
        results["servers"][label] = {}
        name = "paged" if label.startswith("paged") else label
        command = functools.partial(server_command, name, checkpoint, tiny=args.tiny, paged_args=paged_args)
        bench_server(label, checkpoint, prompts(100), runs, command, work, results["servers"][label], save)
        save()
    shutil.rmtree(work, ignore_errors=True)
    if args.plot is not None:
        plot(results, args.plot)
    logger.info("%s", json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    main()
