"""Structured outputs: a JSON schema (from a Pydantic class), a regex and a choice hold the output, token by
token, so even the demo model's random weights produce output that parses; then LangChain's
``with_structured_output`` on the same engine, when langchain-core is installed.

Runs on the embedded demo Llama (built once, no download, no GPU); ``--model PATH`` runs a real checkpoint.
Run: python examples/structured_outputs.py [--model PATH]
"""

import argparse
import logging
import re
from typing import Literal

from pydantic import BaseModel, Field

from paged_backend import LLM, SamplingParams, StructuredOutputsParams
from paged_backend.demo_checkpoint import model_or_demo

logging.basicConfig(level=logging.INFO, format="%(message)s")
logger = logging.getLogger("example")

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--model", default=None, help="checkpoint path or hub id (default: the embedded demo Llama)")
args = parser.parse_args()


class Cache(BaseModel):
    paged: bool
    blocks: int = Field(ge=0, le=999)
    kind: Literal["kv", "prefix"]


llm = LLM(model_or_demo(args.model))
# Sampled, with room to end: a model that knows nothing of JSON may wander in its optional whitespace a while.
schema = SamplingParams(
    temperature=1.0, seed=1, max_tokens=300, structured_outputs=StructuredOutputsParams(json=Cache.model_json_schema())
)
regex = SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(regex=r"[A-Z]{2}-[0-9]{3}"))
choice = SamplingParams(max_tokens=10, structured_outputs=StructuredOutputsParams(choice=["paged", "contiguous"]))
out_schema, out_regex, out_choice = llm.generate(
    ["Describe the cache as JSON:", "A part number:", "The KV cache is"], [schema, regex, choice], use_tqdm=False
)
cache = Cache.model_validate_json(out_schema.outputs[0].text)
logger.info("json schema -> %r", cache)
assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", out_regex.outputs[0].text)
logger.info("regex       -> %r", out_regex.outputs[0].text)
logger.info("choice      -> %r", out_choice.outputs[0].text)

try:
    from paged_backend.integrations.langchain import ChatPagedBackend
except ImportError:
    logger.info("(pip install -e '.[langchain]' for the LangChain part)")
else:
    chat = ChatPagedBackend(backend=llm, temperature=1.0, seed=1, max_tokens=300)
    logger.info("LangChain   -> %r", chat.with_structured_output(Cache).invoke("Describe the cache."))
logger.info("every output follows its format: True")
