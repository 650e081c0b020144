"""Existing Hugging Face code, made paged by one line: ``paged_backend.patch(model, tokenizer)``.

Runs on the embedded demo Llama (built once, no download, no GPU); ``--model PATH`` runs a real checkpoint.
Run: python examples/hf_generate_patch.py [--model PATH]
"""

import argparse
import logging

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import paged_backend
from paged_backend.demo_checkpoint import model_or_demo

logging.basicConfig(level=logging.INFO, format="%(message)s")
logger = logging.getLogger("example")

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--model", default=None, help="checkpoint path or hub id (default: the embedded demo Llama)")
args = parser.parse_args()
path = model_or_demo(args.model)
tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
device = "cuda" if torch.cuda.is_available() else "cpu"
model = AutoModelForCausalLM.from_pretrained(path, dtype="auto").to(device)
batch = tokenizer(["Hello, my name is", "The paged KV cache"], return_tensors="pt", padding=True).to(device)

with torch.no_grad():
    before = model.generate(**batch, max_new_tokens=16, do_sample=False)

paged_backend.patch(model, tokenizer, block_size=16)  # the only new line
after = model.generate(**batch, max_new_tokens=16, do_sample=False)
paged_backend.unpatch(model)

for row in after:
    logger.info("%r", tokenizer.decode(row, skip_special_tokens=True))
logger.info("same tokens as HF's own generate: %s", torch.equal(before, after))
