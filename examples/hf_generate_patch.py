"""Existing Hugging Face code, made paged by one line: ``paged_backend.patch(model, tokenizer)``.

Runs on the embedded tiny model (no download, no GPU); with a real checkpoint, load it with
``AutoModelForCausalLM.from_pretrained`` as usual. Run: python examples/hf_generate_patch.py
"""

import logging

import torch

import paged_backend
from paged_backend.demo import build_tiny_model, build_tiny_tokenizer

logging.basicConfig(level=logging.INFO, format="%(message)s")
logger = logging.getLogger("example")

tokenizer = build_tiny_tokenizer()
tokenizer.padding_side = "left"
model = build_tiny_model("llama", vocab_size=len(tokenizer))
batch = tokenizer(["Hello, my name is", "The paged KV cache"], return_tensors="pt", padding=True)

with torch.no_grad():
    before = model.generate(**batch, max_new_tokens=16, do_sample=False)

paged_backend.patch(model, tokenizer, block_size=16)  # the only new line
after = model.generate(**batch, max_new_tokens=16, do_sample=False)
paged_backend.unpatch(model)

for row in after:
    logger.info("%r", tokenizer.decode(row, skip_special_tokens=True))
logger.info("same tokens as HF's own generate: %s", torch.equal(before, after))
