"""AWQ int4: quantize a model with AWQ, then serve the checkpoint with the paged engine.

Runs on the embedded demo Llama (built once, no download, no GPU). With a real model: ``--model PATH`` (a Llama,
Mistral or Qwen2/3 checkpoint) quantizes it; an existing AutoAWQ checkpoint loads directly with
``LLM(path, quantization="awq")``. Run: python examples/awq_quantize.py [--model PATH] [--output DIR]
"""

import argparse
import logging
import tempfile

from transformers import AutoModelForCausalLM, AutoTokenizer

from paged_backend import LLM, SamplingParams
from paged_backend.demo_checkpoint import CORPUS, model_or_demo
from paged_backend.quantization.awq_quantize import quantize

logging.basicConfig(level=logging.INFO, format="%(message)s")
logger = logging.getLogger("example")

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--model", default=None, help="checkpoint to quantize (default: the embedded demo Llama)")
parser.add_argument("--output", default=None, help="where to write the AWQ checkpoint (default: a temp folder)")
args = parser.parse_args()

path = model_or_demo(args.model)
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
output = args.output or tempfile.mkdtemp(prefix="awq-")
quantize(model, tokenizer, output, calib_texts=CORPUS, group_size=128)

llm = LLM(output)  # quantization="awq" is read from the checkpoint's config.json
for out in llm.generate(["The paged KV cache", "Hello, my name is"], SamplingParams(temperature=0, max_tokens=16)):
    logger.info("%r -> %r", out.prompt, out.outputs[0].text)
