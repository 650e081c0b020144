"""RL rollouts on the engine: TRL's ``GRPOTrainer`` calls ``model.generate`` on the policy it trains, so patching
that model (``paged_backend.patch``) makes every step's rollouts come from the paged engine, reading the
parameters the optimizer has just updated in place: no weight copy, no second model in memory.

``--parity``: the engine as TRL's vLLM backend instead (``use_paged_backend``, ``batch_invariant=True``), so TRL's
importance-sampling correction runs and compares the engine's sampled logprobs with the trainer's: the ratio it
logs is exactly 1.0 (docs/guides/rl.md).

Runs on the embedded demo Llama (built once, no download, no GPU); ``--model PATH`` trains a real checkpoint.
Run: pip install -e ".[test]" && python examples/trl_grpo.py [--model PATH] [--steps 2] [--parity]
"""

import argparse
import logging
import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import paged_backend
from paged_backend.demo_checkpoint import model_or_demo

logging.basicConfig(level=logging.INFO, format="%(message)s")
logger = logging.getLogger("example")

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--model", default=None, help="checkpoint path or hub id (default: the embedded demo Llama)")
parser.add_argument("--steps", type=int, default=2)
parser.add_argument("--parity", action="store_true", help="TRL's vLLM path on the engine, logprob parity on")
args = parser.parse_args()

try:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
except ImportError:
    raise SystemExit("this example needs trl: pip install trl") from None

path = model_or_demo(args.model)
tokenizer = AutoTokenizer.from_pretrained(path)
tokenizer.padding_side = "left"  # TRL pads prompts on the left for generation
model = AutoModelForCausalLM.from_pretrained(path)
if not args.parity:  # "error": a rollout that would not run on the engine stops
    handle = paged_backend.patch(model, tokenizer, fallback="error")


def longer_is_better(completions: list[str], **kwargs: object) -> list[float]:
    return [float(len(text)) for text in completions]


config = GRPOConfig(
    output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, num_generations=2, max_completion_length=16,
    max_steps=args.steps, learning_rate=1e-3, report_to=[], save_strategy="no", logging_steps=1,
    use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
    vllm_importance_sampling_mode="token_truncate",  # (read on the vLLM path only: --parity)
)  # fmt: skip
prompts = ["The paged KV cache", "Continuous batching", "A prefix cache hit", "Tensor parallelism"]
trainer = GRPOTrainer(
    model=model,
    reward_funcs=longer_is_better,
    args=config,
    train_dataset=Dataset.from_dict({"prompt": prompts * args.steps}),
    processing_class=tokenizer,
)
if args.parity:
    from paged_backend.integrations.trl import use_paged_backend

    llm = use_paged_backend(trainer, batch_invariant=True)
    trainer.train()
    stats = llm.stats()
    llm.shutdown()
    for name in ("min", "mean", "max"):
        logged = [entry[key] for entry in trainer.state.log_history
                  if (key := f"sampling/importance_sampling_ratio/{name}") in entry]  # fmt: skip
        logger.info("TRL's importance-sampling ratio, %s over each step: %s", name, logged)
else:
    trainer.train()
    stats = handle.engine.stats()
    paged_backend.unpatch(model)  # restores generate and gives the engine's memory back
logger.info("rollout tokens generated on the engine: %d", stats["num_generated_tokens"])
logger.info("every rollout ran on the engine: %s", stats["num_generated_tokens"] > 0)
