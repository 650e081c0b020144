"""Host time of entering and leaving the engine's attention switch (``worker/attention.PagedAttentionSwitch``), which
every step does, for a model in eval mode and one left in train mode (a trainer's policy between its steps: the
switch runs it in eval mode and puts the flags back). A Llama-3.2-1B-shaped module tree (16 layers) with tiny
widths: the cost is per module, not per weight. Runs on a CPU.

    python benchmarks/train_mode_switch.py --json train_mode_switch.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from paged_backend.worker.attention import PagedAttentionSwitch  # noqa: E402

logger = logging.getLogger("train_mode_switch")


def us_per_step(switch: PagedAttentionSwitch, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        with switch:
            pass
    return 1e6 * (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config)
    switch = PagedAttentionSwitch(model, kv_caches=[])
    results = {"modules": float(len(list(model.modules())))}
    for mode in ("eval", "train"):
        getattr(model, mode)()
        us_per_step(switch, args.steps // 10)  # warm-up
        results[f"{mode}_us"] = us_per_step(switch, args.steps)
        assert model.training == (mode == "train") and all(m.training == model.training for m in model.modules())
    logger.info("%s", json.dumps(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
