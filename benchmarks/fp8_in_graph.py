"""W1 with FP8 weights beside bf16, with or without the activations' quantization moved into the compiled layer
(``worker/fp8_activations.py``): ``--without`` replaces that pass by one that rewrites nothing, so every FP8
call quantizes in its own kernel (``kernels/fp8_quant.py``) as before the pass. Run it twice, each in a process
of its own, and compare the two ``paged_fp8`` figures (each beside the same run's ``paged``):

    python benchmarks/fp8_in_graph.py --without --json benchmarks/results/w1_fp8_graph_quant_off.json
    python benchmarks/fp8_in_graph.py --json benchmarks/results/w1_fp8_graph_quant_on.json

The rest is ``benchmarks/throughput.py --workload w1 --backends paged,paged_fp8 --repeats 3 --skip-check``. With
``--check`` instead, ``gpu_check.py``'s fp8 rows (tiny Llama, fp32 and bf16, compiled + CUDA graphs against the
eager engine) with or without the pass.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # throughput.py beside this file

import throughput  # noqa: E402

import paged_backend.worker.compile as regional_compile  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--without", action="store_true", help="FP8 calls quantize in their own kernel")
    parser.add_argument("--check", action="store_true", help="gpu_check.py's fp8 rows instead of W1")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.without:
        regional_compile.quantize_fp8_activations = lambda gm: 0  # type: ignore[assignment]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    state = "off" if args.without else "on"
    if args.check:
        import gpu_check

        from paged_backend.demo_checkpoint import build_tiny_tokenizer

        for row in gpu_check.fp8_weights_equality(build_tiny_tokenizer()):
            logging.getLogger("fp8_in_graph").info("quantization in the graph %s: %s", state, row)
        return
    if args.json is None:
        parser.error("--json is needed for W1")
    w1 = ["--workload", "w1", "--backends", "paged,paged_fp8", "--repeats", "3", "--skip-check"]
    results = throughput.main([*w1, "--json", str(args.json)])
    logging.getLogger("fp8_in_graph").info("quantization in the graph %s: %s", state, results["w1"])


if __name__ == "__main__":
    main()
