"""Tensor parallelism: ``tensor_parallel_size=N`` cuts each layer's weights over N GPUs (one worker process each,
NCCL all-reduces); without GPUs the same runs on N CPU processes over gloo, which is what this example does on a
laptop. Greedy output equals the single-device engine's.

Runs on the embedded demo Llama (built once, no download, no GPU); ``--model PATH`` runs a real checkpoint.
Run: python examples/tensor_parallel.py [--model PATH] [--tensor-parallel-size 2]
"""

import argparse
import logging

from paged_backend import LLM, SamplingParams
from paged_backend.demo_checkpoint import model_or_demo

logging.basicConfig(level=logging.INFO, format="%(message)s")
logger = logging.getLogger("example")


def generate(model: str, tensor_parallel_size: int) -> list[str]:
    llm = LLM(model, tensor_parallel_size=tensor_parallel_size)
    try:
        outputs = llm.generate(
            ["Hello, my name is", "The paged KV cache"], SamplingParams(temperature=0, max_tokens=16)
        )
    finally:
        llm.llm_engine.shutdown()  # stops the workers
    return [output.outputs[0].text for output in outputs]


if __name__ == "__main__":  # worker processes re-import this file: only the parent generates
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint path or hub id (default: the embedded demo Llama)")
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    args = parser.parse_args()
    model = model_or_demo(args.model)
    parallel = generate(model, args.tensor_parallel_size)
    for text in parallel:
        logger.info("TP=%d -> %r", args.tensor_parallel_size, text)
    logger.info("greedy output equals one device's: %s", parallel == generate(model, 1))
