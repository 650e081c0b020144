"""Large batches with ``n`` and ``best_of``: each prompt is prefilled once and its samples fork its KV blocks
(copy on write), so ``n`` samples cost one prompt's cache, not ``n``; ``best_of`` keeps the ``n`` most likely.

Runs on the embedded demo Llama (built once, no download, no GPU); ``--model PATH`` runs a real checkpoint.
Run: python examples/large_batches.py [--model PATH] [--num-prompts 64]
"""

import argparse
import logging

from paged_backend import LLM, SamplingParams
from paged_backend.demo_checkpoint import CORPUS, model_or_demo

logging.basicConfig(level=logging.INFO, format="%(message)s")
logger = logging.getLogger("example")

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--model", default=None, help="checkpoint path or hub id (default: the embedded demo Llama)")
parser.add_argument("--num-prompts", type=int, default=64)
args = parser.parse_args()

llm = LLM(model_or_demo(args.model))
prompts = [CORPUS[i % len(CORPUS)] for i in range(args.num_prompts)]
params = SamplingParams(n=4, best_of=8, temperature=0.9, top_p=0.95, max_tokens=24, seed=0)
outputs = llm.generate(prompts, params)

first = outputs[0]
logger.info("%r: %d of %d samples kept, most likely first", first.prompt, len(first.outputs), params.best_of)
for sample in first.outputs:
    logger.info("  logprob %7.2f  %r", sample.cumulative_logprob, sample.text)
stats = llm.stats()
logger.info("%d prompts, %d prompt tokens prefilled (once per prompt)", len(outputs), stats["num_prompt_tokens"])
