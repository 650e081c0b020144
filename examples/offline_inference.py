"""Offline batched generation with vLLM's API: ``LLM`` + ``SamplingParams``, then a chat turn.

Runs on the embedded demo Llama (built once, no download, no GPU); ``--model PATH`` runs a real checkpoint.
Run: python examples/offline_inference.py [--model PATH]
"""

import argparse
import logging

from paged_backend import LLM, SamplingParams
from paged_backend.demo_checkpoint import model_or_demo

logging.basicConfig(level=logging.INFO, format="%(message)s")
logger = logging.getLogger("example")

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--model", default=None, help="checkpoint path or hub id (default: the embedded demo Llama)")
args = parser.parse_args()

llm = LLM(model_or_demo(args.model))

prompts = ["Hello, my name is", "The paged KV cache", "Continuous batching lets"]
outputs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=0))
for output in outputs:
    logger.info("%r -> %r", output.prompt, output.outputs[0].text)

chat = llm.chat([{"role": "user", "content": "Hello world!"}], SamplingParams(temperature=0, max_tokens=16))
logger.info("chat -> %r (%s)", chat[0].outputs[0].text, chat[0].outputs[0].finish_reason)
logger.info("stats: %s", llm.stats())
