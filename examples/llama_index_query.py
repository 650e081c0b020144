"""A LlamaIndex query engine on the paged engine, with a mock embedding: the retrieved passage goes into the
prompt the engine answers.

Runs on the embedded demo Llama (built once, no download, no GPU); ``--model PATH`` runs a real checkpoint (use a
real embedding model too for real answers).
Run: pip install -e ".[llama-index]" && python examples/llama_index_query.py [--model PATH]
"""

import argparse
import asyncio
import logging

from llama_index.core import Document, VectorStoreIndex
from llama_index.core.embeddings import MockEmbedding

from paged_backend import LLM
from paged_backend.demo_checkpoint import model_or_demo
from paged_backend.integrations.llama_index import PagedBackendLLM

logging.basicConfig(level=logging.INFO, format="%(message)s")
logger = logging.getLogger("example")

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--model", default=None, help="checkpoint path or hub id (default: the embedded demo Llama)")
args = parser.parse_args()
llm = LLM(model_or_demo(args.model), max_model_len=2048)  # room for LlamaIndex's prompt templates

documents = [Document(text="A paged KV cache stores keys and values in fixed-size blocks."), Document(text="Zebras.")]
index = VectorStoreIndex.from_documents(documents, embed_model=MockEmbedding(embed_dim=8))
engine = index.as_query_engine(llm=PagedBackendLLM(backend=llm, max_new_tokens=24), similarity_top_k=1)

logger.info("query  -> %r", engine.query("What does a paged KV cache store?").response)
logger.info("aquery -> %r", asyncio.run(engine.aquery("What is a block?")).response)
