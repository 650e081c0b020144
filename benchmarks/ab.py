"""Two trees of the library side by side in one run: the same ``benchmarks/throughput.py`` workloads, once per tree
(each in its own process, since both are the package ``paged_backend``) in each of ``--rounds`` rounds, which take
the two in turn (baseline first, then current first, ...) so neither always runs on a warmer card; into one JSON
with every repetition and each side's median, and a plot.

    git archive <base commit> paged_backend | tar -x -C .baseline      # the baseline tree, beside this one
    python benchmarks/ab.py --baseline .baseline --baseline-commit <sha> --commit <sha> \\
        --json benchmarks/results/h200_ab.json --plot docs/images/h200_ab.png -- --workload w1,w2 --backends paged

Everything after ``--`` goes to ``throughput.py`` (``--json`` is set per run).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger("benchmarks.ab")
HERE = Path(__file__).resolve().parent


def run_tree(tree: Path, args: list[str]) -> dict[str, Any]:
    """``throughput.py`` with ``tree`` first on the import path; its JSON."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{HERE.parent}"}
        command = [sys.executable, str(HERE / "throughput.py"), *args, "--json", str(out)]
        subprocess.run(command, env=env, check=True)
        return json.loads(out.read_text())


def merge(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per side and figure: every repetition of every round, and their median."""
    merged: dict[str, Any] = {}
    for side, results in runs.items():
        for workload in ("w1", "w2"):
            values = [v for r in results for v in r.get(workload, {}).get("paged_runs", [])]
            if values:
                merged.setdefault(workload, {})[side] = {"median": statistics.median(values), "runs": values}
        merged.setdefault("startup_s", {})[side] = [(r.get("engine_start_s") or {}).get("paged") for r in results]
    return merged


def plot(merged: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [w for w in ("w1", "w2") if w in merged]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, workload in zip(axes[0], panels):
        sides = list(merged[workload])
        medians = [merged[workload][s]["median"] for s in sides]
        low = [m - min(merged[workload][s]["runs"]) for s, m in zip(sides, medians)]
        high = [max(merged[workload][s]["runs"]) - m for s, m in zip(sides, medians)]
        ax.bar(sides, medians, yerr=[low, high], capsize=6, color=["#999999", "#2a6f97"])
        ax.set_title(f"{workload.upper()}: output tok/s (median, min-max)")
        for i, m in enumerate(medians):
            ax.text(i, m, f"{m:,.0f}", ha="center", va="bottom")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def save(
    args: argparse.Namespace, argv: list[str], runs: dict[str, list[dict[str, Any]]], merged: dict[str, Any]
) -> None:
    first = (runs["current"] or runs["baseline"])[0]
    result = {
        "command": "python " + " ".join(["benchmarks/ab.py", *argv]),
        "baseline_commit": args.baseline_commit,
        "commit": args.commit,
        "machine": first.get("machine"),
        "versions": first.get("versions"),
        "date": first.get("date"),
        "runs_per_side": {side: len(results) for side, results in runs.items()},
        **merged,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


def main() -> None:
    argv = sys.argv[1:]
    passthrough = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="a tree holding the baseline paged_backend/")
    parser.add_argument("--baseline-commit", default="unknown", help="the commit the baseline tree came from")
    parser.add_argument("--commit", default="unknown", help="the commit of this tree")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of one run per tree, the order alternating")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(own)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if not (args.baseline / "paged_backend").is_dir():
        parser.error(f"--baseline must hold a paged_backend/ folder, got {args.baseline}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "current": []}
    trees = {"baseline": args.baseline.resolve(), "current": HERE.parent}
    merged: dict[str, Any] = {}
    for round_index in range(args.rounds):
        order = ("baseline", "current") if round_index % 2 == 0 else ("current", "baseline")
        for side in order:
            runs[side].append(run_tree(trees[side], passthrough))
            merged = merge(runs)
            save(args, argv, runs, merged)  # after every run: a run cut short keeps what it measured
    for workload in ("w1", "w2"):
        if workload in merged:
            sides = merged[workload]
            logger.info(
                "%s: baseline %.1f, current %.1f tok/s (medians; current/baseline %.3f)",
                workload,
                sides["baseline"]["median"],
                sides["current"]["median"],
                sides["current"]["median"] / sides["baseline"]["median"],
            )
    if args.plot is not None:
        plot(merged, args.plot)


if __name__ == "__main__":
    main()
