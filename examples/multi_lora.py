"""Multi-LoRA: one engine serves the base model and several PEFT adapters in the same batch; each request names
its adapter with a ``LoRARequest``, and adapters rotate through ``max_loras`` device slots.

Runs on the embedded demo Llama with two random adapters made here (no download, no GPU). With a real model:
``--model PATH --lora NAME=ADAPTER_DIR ...`` (PEFT adapters of that model).
Run: pip install peft && python examples/multi_lora.py [--model PATH --lora sql=/path/to/adapter ...]
"""

import argparse
import logging
import tempfile

import torch

from paged_backend import LLM, LoRARequest, SamplingParams
from paged_backend.demo_checkpoint import model_or_demo

logging.basicConfig(level=logging.INFO, format="%(message)s")
logger = logging.getLogger("example")


def random_adapters(model: str, folder: str) -> dict[str, str]:
    """Two PEFT adapters with random weights (a stand-in for trained ones): one on attention, one on the MLP."""
    import peft
    from transformers import AutoModelForCausalLM

    adapters = {}
    for name, targets in {"attn": ["q_proj", "v_proj"], "mlp": ["gate_proj", "up_proj", "down_proj"]}.items():
        base = AutoModelForCausalLM.from_pretrained(model)
        config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False)
        adapter = peft.get_peft_model(base, config)
        with torch.no_grad():
            for param_name, param in adapter.named_parameters():
                if "lora_" in param_name:
                    param.normal_(0.0, 0.3)
        adapter.save_pretrained(f"{folder}/{name}")
        adapters[name] = f"{folder}/{name}"
    return adapters


parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--model", default=None, help="checkpoint path or hub id (default: the embedded demo Llama)")
parser.add_argument("--lora", nargs="*", default=[], metavar="NAME=DIR", help="PEFT adapters of --model")
args = parser.parse_args()
model = model_or_demo(args.model)

with tempfile.TemporaryDirectory() as folder:
    if args.lora:
        adapters = dict(item.split("=", 1) for item in args.lora)
    else:
        adapters = random_adapters(model, folder)
    requests = [None] + [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())]
    llm = LLM(model, enable_lora=True, max_loras=2, max_lora_rank=64)
    prompt = "The paged KV cache"
    # the same prompt under the base model and under each adapter, in one batch
    outputs = llm.generate(
        [prompt] * len(requests), SamplingParams(temperature=0, max_tokens=16), lora_request=requests
    )
    for request, output in zip(requests, outputs):
        logger.info("%-6s -> %r", request.lora_name if request else "base", output.outputs[0].text)
