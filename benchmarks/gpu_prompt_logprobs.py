"""GPU check of prompt logprobs: ``SamplingParams(prompt_logprobs=k)`` on the GPU (eager and compiled, whole and
chunked prefill) against HF's own forward on the same device, for the tiny fp32 Llama.

    python benchmarks/gpu_prompt_logprobs.py
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: tests.fixtures

from paged_backend import LLM, SamplingParams  # noqa: E402
from paged_backend.demo_checkpoint import build_tiny_tokenizer  # noqa: E402
from tests.fixtures.tiny_models import build_tiny_model  # noqa: E402

logger = logging.getLogger("gpu_prompt_logprobs")
PROMPTS = [[5 + (i * 11 + j * 7) % 400 for j in range(n)] for i, n in enumerate([2, 9, 23, 40, 61])]


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build_tiny_model("llama").cuda()
    with torch.no_grad():
        expected = [
            torch.log_softmax(model(torch.tensor([p], device="cuda")).logits[0, :-1].float(), -1) for p in PROMPTS
        ]
    worst = 0.0
    for label, kwargs in [
        ("eager, whole", {"enforce_eager": True}),
        ("eager, chunked", {"enforce_eager": True, "max_num_batched_tokens": 16, "max_num_seqs": 16}),
        ("compiled, chunked", {"max_num_batched_tokens": 16, "max_num_seqs": 16}),
    ]:
        llm = LLM(model, tokenizer=build_tiny_tokenizer(), block_size=4, num_kv_blocks=256, max_model_len=96, **kwargs)
        params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        for prompt, out, rows in zip(PROMPTS, outs, expected):
            assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
            for i, entry in enumerate(out.prompt_logprobs[1:]):
                token = prompt[i + 1]
                worst = max(worst, abs(entry[token].logprob - rows[i, token].item()))
                assert set(rows[i].topk(2).indices.tolist()) <= set(entry), (label, i)
        logger.info(
            "prompt logprobs == HF on GPU: %-18s %d prompts, largest difference so far %.2e", label, len(PROMPTS), worst
        )
        llm.llm_engine.shutdown()
    assert worst < 1e-3, worst


if __name__ == "__main__":
    main()
