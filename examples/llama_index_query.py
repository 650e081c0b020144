"""A LlamaIndex query engine on the paged engine, with the embedded tiny model and a mock embedding (no
download, no GPU): the retrieved passage goes into the prompt the engine answers.

Swap the tiny model for ``PagedBackendLLM(model="your/model")`` and a real embedding model for real answers.
Run: pip install -e ".[llama-index]" && python examples/llama_index_query.py
"""

import asyncio
import logging

from llama_index.core import Document, VectorStoreIndex
from llama_index.core.embeddings import MockEmbedding

from paged_backend import LLM
from paged_backend.demo import build_tiny_model, build_tiny_tokenizer
from paged_backend.integrations.llama_index import PagedBackendLLM

logging.basicConfig(level=logging.INFO, format="%(message)s")
logger = logging.getLogger("example")

tokenizer = build_tiny_tokenizer()
model = build_tiny_model("llama", vocab_size=len(tokenizer))
model.config.max_position_embeddings = 2048  # room for LlamaIndex's prompt templates
llm = LLM(model, tokenizer=tokenizer, block_size=16, max_model_len=2048)

documents = [Document(text="A paged KV cache stores keys and values in fixed-size blocks."), Document(text="Zebras.")]
index = VectorStoreIndex.from_documents(documents, embed_model=MockEmbedding(embed_dim=8))
engine = index.as_query_engine(llm=PagedBackendLLM(backend=llm, max_new_tokens=24), similarity_top_k=1)

logger.info("query  -> %r", engine.query("What does a paged KV cache store?").response)
logger.info("aquery -> %r", asyncio.run(engine.aquery("What is a block?")).response)
