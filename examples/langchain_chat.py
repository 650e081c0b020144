"""LangChain on the paged engine: an LCEL chain invoked, streamed and batched, and a text model with a
constructor-level stop string.

Runs on the embedded demo Llama (built once, no download, no GPU); ``--model PATH`` runs a real checkpoint.
Run: pip install -e ".[langchain]" && python examples/langchain_chat.py [--model PATH]
"""

import argparse
import logging

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate

from paged_backend import LLM
from paged_backend.demo_checkpoint import model_or_demo
from paged_backend.integrations.langchain import ChatPagedBackend, PagedBackendLLM

logging.basicConfig(level=logging.INFO, format="%(message)s")
logger = logging.getLogger("example")

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--model", default=None, help="checkpoint path or hub id (default: the embedded demo Llama)")
args = parser.parse_args()
llm = LLM(model_or_demo(args.model))

chat = ChatPagedBackend(backend=llm, temperature=0, max_tokens=24)
chain = ChatPromptTemplate.from_messages([("system", "Be brief."), ("user", "{question}")]) | chat | StrOutputParser()
logger.info("invoke -> %r", chain.invoke({"question": "What is a paged KV cache?"}))
logger.info("stream -> %r", list(chain.stream({"question": "Hello"})))
logger.info("batch  -> %r", chain.batch([{"question": q} for q in ("one", "two", "three")]))

text = PagedBackendLLM(backend=llm, temperature=0, max_tokens=24, stop=["."])  # shares the same engine
logger.info("text   -> %r", text.invoke("The paged KV cache"))
