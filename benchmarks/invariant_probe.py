"""Where ``batch_invariant=True`` spends W1's time on a GPU: for the default engine and the invariant one at
several block sizes (``GPU_ROWS``), W1's prefill alone (one new token each) and W1 whole, and for the default
and the first block size the GPU kernels of a 32-token run and of the prefill alone, whose GPU busy time against
its wall time says whether the host's dispatch bounds it (``throughput.profile_kernels``). One process,
fresh prompts for every run (no prefix-cache hits, ``run_paged`` refuses them).

    python benchmarks/invariant_probe.py --json invariant_probe.json

A diagnostic for work on the mode, not a figure: ``throughput.py --backends paged,paged_invariant`` measures
its cost.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import build_model, profile_kernels, release_engine, run_paged, w1_prompts, write_json  # noqa: E402

from paged_backend import LLM  # noqa: E402
from paged_backend.worker import batch_invariant  # noqa: E402

logger = logging.getLogger("invariant_probe")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="256,128,512", help="GPU_ROWS values to try, the first profiled")
    parser.add_argument("--num-layers", type=int, default=None, help="fewer layers for a quick try")
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    args = parser.parse_args(argv)
    model = build_model(args.num_layers)
    vocab = model.config.vocab_size
    results: dict[str, Any] = {}
    seed = 100  # W1's own seeds (0-5) stay unused: no prompt here is one a figure measures
    sizes = [int(r) for r in args.rows.split(",")]
    for name, rows in [("default", None), *((f"invariant_{r}", r) for r in sizes)]:
        if rows is not None:
            batch_invariant.GPU_ROWS = rows
        llm = LLM(model, batch_invariant=rows is not None)
        run_paged(llm, w1_prompts(vocab, 64, seed=seed), 8)  # warm-up
        _, prefill = run_paged(llm, w1_prompts(vocab, 256, seed=seed + 1), 1)
        tokens, whole = run_paged(llm, w1_prompts(vocab, 256, seed=seed + 2), 256)
        entry = {"prefill_s": prefill, "w1_s": whole, "w1_tok_s": sum(map(len, tokens)) / whole}
        if rows is None or rows == sizes[0]:
            entry["kernels"] = profile_kernels(llm, w1_prompts(vocab, 256, seed=seed + 3), 32, top=14)
            # W1's prefill alone, profiled: its wall time against the GPU's busy time (one "step" = the whole run)
            entry["prefill_profile"] = profile_kernels(llm, w1_prompts(vocab, 256, seed=seed + 4), 1, top=14)
        seed += 5
        results[name] = entry
        logger.info("%s: %s", name, {k: v for k, v in entry.items() if k != "kernels"})
        write_json(args.json, results)
        llm.llm_engine.shutdown()
        del llm
        release_engine(name)
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main()
