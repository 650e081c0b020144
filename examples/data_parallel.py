"""Data parallelism: ``DataParallelLLM`` runs N engine replicas as Ray actors, each with its own KV cache, and
routes each request to the replica that most likely caches its prompt's beginning (the server's
``--data-parallel-size N`` runs the same). Two tenants, each with its own long system prompt: each tenant's
requests keep to one replica, so its prompt is computed once. Greedy output equals one engine's.

Runs on the embedded demo Llama (built once, no download, no GPU) on a local Ray instance (``RAY_ADDRESS`` names a
running cluster instead); ``--model PATH`` runs a real checkpoint. Needs ``pip install -e ".[ray]"``.
Run: python examples/data_parallel.py [--model PATH] [--data-parallel-size 2]
"""

import argparse
import logging
import os

import ray

from paged_backend import LLM, SamplingParams
from paged_backend.demo_checkpoint import model_or_demo
from paged_backend.entrypoints.data_parallel import DataParallelLLM

logging.basicConfig(level=logging.INFO, format="%(message)s")
logger = logging.getLogger("example")

SYSTEMS = [
    "You are a support agent for a bicycle shop. Answer questions about repairs, parts and opening hours. " * 3,
    "You are a travel assistant. Suggest routes, trains and places to stay, and keep every answer short. " * 3,
]
QUESTIONS = ["How do I fix a flat tyre?", "What is open on Sunday?", "Which chain fits my bike?", "Any tips?"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint path or hub id (default: the embedded demo Llama)")
    parser.add_argument("--data-parallel-size", type=int, default=2)
    args = parser.parse_args()
    model = model_or_demo(args.model)
    ray.init(address=os.environ.get("RAY_ADDRESS", "local"), include_dashboard=False, log_to_driver=False)
    prompts = [system + "\nUser: " + question for question in QUESTIONS for system in SYSTEMS]
    params = SamplingParams(temperature=0, max_tokens=16)
    with DataParallelLLM(model, data_parallel_size=args.data_parallel_size) as llm:
        # each tenant's first question, then the rest: those find their tenant's prompt cached on its replica
        outputs = llm.generate(prompts[: len(SYSTEMS)], params) + llm.generate(prompts[len(SYSTEMS) :], params)
        stats = llm.stats()
    for replica in stats["replicas"]:
        logger.info("replica %d: %s, %d prompt tokens, %d of them from its prefix cache", replica["replica"],
                    replica["state"], replica["stats"]["num_prompt_tokens_admitted"],
                    replica["stats"]["num_prompt_tokens_cached"])  # fmt: skip
    logger.info("prefix-cache hit rate over the replicas: %.2f", stats["prefix_cache_hit_rate"])
    ray.shutdown()
    with LLM(model) as one:
        expected = [o.outputs[0].text for o in one.generate(prompts, params, use_tqdm=False)]
    logger.info("greedy output equals one engine's: %s", [o.outputs[0].text for o in outputs] == expected)
