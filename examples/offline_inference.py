"""Offline batched generation with vLLM's API, on the embedded tiny model (no download, no GPU).

Swap ``build_tiny_model`` / ``build_tiny_tokenizer`` for ``LLM(model="your/model")`` to use a real checkpoint.
Run: python examples/offline_inference.py
"""

import logging

from paged_backend import LLM, SamplingParams
from paged_backend.demo import build_tiny_model, build_tiny_tokenizer

logging.basicConfig(level=logging.INFO, format="%(message)s")
logger = logging.getLogger("example")

tokenizer = build_tiny_tokenizer()
llm = LLM(build_tiny_model("llama", vocab_size=len(tokenizer)), tokenizer=tokenizer, block_size=16)

prompts = ["Hello, my name is", "The paged KV cache", "Continuous batching lets"]
outputs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=0))
for output in outputs:
    logger.info("%r -> %r", output.prompt, output.outputs[0].text)

chat = llm.chat([{"role": "user", "content": "Hello world!"}], SamplingParams(temperature=0, max_tokens=16))
logger.info("chat -> %r (%s)", chat[0].outputs[0].text, chat[0].outputs[0].finish_reason)
logger.info("stats: %s", llm.stats())
