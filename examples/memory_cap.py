"""A memory cap: ``gpu_memory_utilization`` bounds the share of the GPU the engine takes (weights, activations and
the KV cache it sizes to fit), ``max_model_len`` the longest sequence, and with them the cache's blocks. On a CPU,
``kv_cache_memory_gib`` sizes the cache instead.

Runs on the embedded demo Llama (built once, no download, no GPU); ``--model PATH`` runs a real checkpoint.
Run: python examples/memory_cap.py [--model PATH] [--gpu-memory-utilization 0.5] [--max-model-len 256]
"""

import argparse
import logging

import torch

from paged_backend import LLM, SamplingParams
from paged_backend.demo_checkpoint import model_or_demo

logging.basicConfig(level=logging.INFO, format="%(message)s")
logger = logging.getLogger("example")

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--model", default=None, help="checkpoint path or hub id (default: the embedded demo Llama)")
parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
parser.add_argument("--max-model-len", type=int, default=256)
args = parser.parse_args()

cap = {"gpu_memory_utilization": args.gpu_memory_utilization} if torch.cuda.is_available() else {}
cap = cap or {"kv_cache_memory_gib": 0.05}  # CPU: the cache's size in GiB
llm = LLM(model_or_demo(args.model), max_model_len=args.max_model_len, **cap)
stats = llm.stats()
logger.info("cap %s: %d KV blocks of %d tokens", cap, stats["num_kv_blocks"], stats["block_size"])

llm.generate(["The paged KV cache"] * 8, SamplingParams(temperature=0.8, max_tokens=32, seed=0))
logger.info("8 requests done, %d preemptions", llm.stats()["num_preemptions"])

too_long = {"prompt_token_ids": [1] * (args.max_model_len + 1)}
try:
    llm.generate(too_long, SamplingParams(max_tokens=1))
except ValueError as error:  # refused up front, not after filling the cache
    logger.info("a prompt longer than max_model_len is refused: %s", error)
