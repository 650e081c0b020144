"""LangChain on the paged engine, with the embedded tiny model (no download, no GPU): an LCEL chain invoked,
streamed and batched, and a text model with a constructor-level stop string.

Swap the tiny model for ``ChatPagedBackend(model="your/model", engine_kwargs={...})`` to use a real checkpoint.
Run: pip install -e ".[langchain]" && python examples/langchain_chat.py
"""

import logging

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate

from paged_backend import LLM
from paged_backend.demo import build_tiny_model, build_tiny_tokenizer
from paged_backend.integrations.langchain import ChatPagedBackend, PagedBackendLLM

logging.basicConfig(level=logging.INFO, format="%(message)s")
logger = logging.getLogger("example")

tokenizer = build_tiny_tokenizer()
llm = LLM(build_tiny_model("llama", vocab_size=len(tokenizer)), tokenizer=tokenizer, block_size=16)

chat = ChatPagedBackend(backend=llm, temperature=0, max_tokens=24)
chain = ChatPromptTemplate.from_messages([("system", "Be brief."), ("user", "{question}")]) | chat | StrOutputParser()
logger.info("invoke -> %r", chain.invoke({"question": "What is a paged KV cache?"}))
logger.info("stream -> %r", list(chain.stream({"question": "Hello"})))
logger.info("batch  -> %r", chain.batch([{"question": q} for q in ("one", "two", "three")]))

text = PagedBackendLLM(backend=llm, temperature=0, max_tokens=24, stop=["."])  # shares the same engine
logger.info("text   -> %r", text.invoke("The paged KV cache"))
