"""What a verifying step costs, so that an acceptance rate measured on one model translates to another: a single
stream's tokens per second when every proposal is taken (the proposals are the target's own greedy continuation,
what a draft equal to the target would propose) and when none is, beside the engine without speculation and HF
``generate``, on random normal bf16 weights of a model's shape, drawn so that each token decides the next by a wide
margin (``decisive``: else bf16 ties on random weights break otherwise in a verifying step than in a decode step).

    python benchmarks/spec_verify.py --shape 8b --k 2,4,8 --json benchmarks/results/spec_verify_<card>_<commit>.json

Shapes: ``8b`` (Llama-3-8B, the throughput benchmark's), ``smollm2`` (SmolLM2-135M, its head untied: see
``SHAPES``). One prompt of 512 random tokens, 256 new tokens, greedy; ``--repetitions`` fresh prompts a backend (the
spread is min-max), each after an untimed warm-up on its own prompt. Backends:

- ``engine``: the engine's defaults (multi-step rounds, async scheduling);
- ``engine_spec_all_k<k>``: ``speculative_config`` with ``num_speculative_tokens`` k, proposals replayed from the
  engine's own greedy output for the prompt (every one taken while the verifying steps agree with it: bf16 ties
  may fall the other way in another kernel, after which no proposal is taken; the accepted length says);
- ``engine_spec_none_k<k>``: k proposals a step that are never taken, the engine's pausing as it is: what
  speculation costs where it does not pay;
- ``engine_verify_k<k>``: the same proposals with pausing off, so that every step after the prefill verifies
  k of them and takes none: each verifying step is then followed by a chained step queued on the guess that it
  takes all (``core/spec_chain.py``), which is dropped, so its time a step is a verifying step's and a dropped
  one's (``all_taken_tok_per_s``, that time times k + 1, is no check on the replay above since the chain);
- ``engine_copying``, ``engine_lookup_rounds_k<k>``, ``engine_lookup_host_k<k>``: prompt lookup itself, on prompts
  that hold their own continuation (the prompt, the engine's greedy continuation of it, its last token again):
  the engine without speculation, with it (verifying steps in rounds on the device while they pay,
  core/lookup_round.py), and with those rounds off (every verifying step planned on the host);
- ``hf``: ``model.generate`` (dynamic cache).

Besides tokens per second: the mean accepted length (tokens a verifying step yields) and the wall time of a
verifying step, against the engine's time per token.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from throughput import MODEL_CONFIG, add_plot_arguments, random_normal, replotted, versions, write_json  # noqa: E402

import paged_backend.core.lookup_round as lookup_round  # noqa: E402
import paged_backend.core.spec_decode as spec_decode  # noqa: E402
from paged_backend import LLM, SamplingParams  # noqa: E402

logger = logging.getLogger("benchmarks.spec_verify")
SHAPES: dict[str, dict[str, Any]] = {
    "8b": MODEL_CONFIG,
    "smollm2": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=False),
}  # fmt: skip
# SmolLM2's head is tied to its embedding; here it is not: on ``decisive`` weights a tied head makes every token its
# own greedy successor, and a text of one token repeated holds nothing for prompt lookup to copy at length. A step
# reads the head's [V, H] matrix either way (the embedding gives one row a token), so its bytes are the model's.
PROMPT_TOKENS, NEW_TOKENS = 512, 256
COPY_MARGIN = 40  # continuation tokens past NEW_TOKENS in a copying prompt: its last lookups still find k
judge = spec_decode.judge


class Replay:
    """Proposes the next k tokens of a known continuation of each prompt, by position (``wrong``: each of them
    shifted by one, never the model's)."""

    def __init__(self, truths: list[list[int]], k: int, wrong: bool = False) -> None:
        self.truths, self.k, self.wrong = truths, k, wrong

    def propose(self, token_ids: list[int], max_tokens: int | None = None, seq_id: int = 0) -> list[int]:
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        for truth in self.truths:
            if truth[:PROMPT_TOKENS] == token_ids[:PROMPT_TOKENS]:
                guess = truth[len(token_ids) : len(token_ids) + k]
                return [(t + 1) % 1000 + 1 for t in guess] if self.wrong else guess
        return []


def build(shape: str, device: str = "cuda") -> LlamaForCausalLM:
    config = LlamaConfig(**SHAPES[shape])
    config.eos_token_id = config.bos_token_id = config.pad_token_id = None
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    return decisive(random_normal(model)).eval()


def decisive(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Make each token decide the next by a wide margin. With every matrix normal(0, 0.02) the top two logits of a
    128k vocabulary lie closer than bf16's rounding, and a verifying step's kernels (several query tokens a row)
    break such ties otherwise than a decode step's: a replayed continuation leaves the model's path after a token
    or two. Here the embedding is normal(0, 1), the layers' output projections (``o_proj``, ``down_proj``)
    normal(0, 2e-4), so the residual stream stays close to the current token's embedding, and an untied LM head is
    the embedding's rows in a fixed random order: token t is followed by the one whose head row is t's embedding,
    thousands of logits ahead of the rest (a tied head repeats t). Shapes, bytes and FLOPs are the model's."""
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding.normal_(0.0, 1.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.normal_(0.0, 2e-4)
            layer.mlp.down_proj.weight.normal_(0.0, 2e-4)
        head = model.get_output_embeddings().weight
        if head.data_ptr() != embedding.data_ptr():
            order = torch.randperm(embedding.shape[0], generator=torch.Generator().manual_seed(0))
            head.copy_(embedding[order.to(embedding.device)])
    return model


def timed_engine(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    """Seconds and steps for one request, stepped by hand (the steps are counted)."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    torch.cuda.synchronize()
    start, steps = time.perf_counter(), 0
    engine.add_request(f"r{start}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    torch.cuda.synchronize()
    return time.perf_counter() - start, steps


def timed_hf(model: LlamaForCausalLM, prompt: list[int]) -> float:
    ids = torch.tensor([prompt], device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                       do_sample=False)  # fmt: skip
    torch.cuda.synchronize()
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = build(args.shape)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(args.repetitions + 1)]
    common = {"max_model_len": PROMPT_TOKENS + 2 * (NEW_TOKENS + COPY_MARGIN) + 320, "num_kv_blocks": 1024}
    engine = LLM(model, skip_tokenizer_init=True, **common)
    longer = SamplingParams(temperature=0, max_tokens=NEW_TOKENS + COPY_MARGIN, ignore_eos=True)
    outs = engine.generate([{"prompt_token_ids": p} for p in prompts], longer, use_tqdm=False)
    truths = [p + out.outputs[0].token_ids for p, out in zip(prompts, outs)]
    # the prompt, its continuation, its last token again: the model goes on as it did, and prompt lookup finds it
    copying = [t + [t[PROMPT_TOKENS - 1]] for t in truths]
    results: dict[str, Any] = {}

    def measure(name: str, llm: LLM, inputs: list[list[int]] = prompts) -> None:
        timed_engine(llm, inputs[-1])  # warm-up on the prompt no figure uses
        before = llm.stats()
        runs = [timed_engine(llm, p) for p in inputs[: args.repetitions]]
        after = llm.stats()
        drafts = after.get("spec_decode_num_drafts", 0) - before.get("spec_decode_num_drafts", 0)
        taken = after.get("spec_decode_num_accepted_tokens", 0) - before.get("spec_decode_num_accepted_tokens", 0)
        row = {
            "tok_per_s": [NEW_TOKENS / s for s, _ in runs],
            "ms_per_step": [s / n * 1e3 for s, n in runs],
            "steps": [n for _, n in runs],
            "verifying_steps": drafts,
            "mean_accepted_length": 1 + taken / drafts if drafts else None,
        }
        results[name] = row
        logger.info("%s: %s tok/s, %s ms a step, accepted length %s", name,
                    [round(x) for x in row["tok_per_s"]], [round(x, 2) for x in row["ms_per_step"]],
                    row["mean_accepted_length"])  # fmt: skip

    measure("engine", engine)
    for k in args.k:
        for name in (f"engine_spec_all_k{k}", f"engine_spec_none_k{k}", f"engine_verify_k{k}"):
            spec = {"method": "ngram", "num_speculative_tokens": k}
            llm = LLM(model, skip_tokenizer_init=True, speculative_config=spec, **common)
            llm.llm_engine.scheduler.drafter.proposer = Replay(truths, k, wrong="_all_" not in name)
            if name.startswith("engine_verify"):
                spec_decode.judge = lambda seq, taken: None  # never paused: every step verifies
            measure(name, llm)
            spec_decode.judge = judge
            if name.startswith("engine_verify"):
                row = results[name]
                row["all_taken_tok_per_s"] = [(k + 1) / ms * 1e3 for ms in row["ms_per_step"]]
            del llm
    measure("engine_copying", engine, copying)
    for k in args.k:  # prompt lookup itself on prompts that hold their continuation: rounds on the device, or not
        for name, max_rows in ((f"engine_lookup_rounds_k{k}", lookup_round.LOOKUP_ROUND_MAX_ROWS),
                               (f"engine_lookup_host_k{k}", 0)):  # fmt: skip
            rows, lookup_round.LOOKUP_ROUND_MAX_ROWS = lookup_round.LOOKUP_ROUND_MAX_ROWS, max_rows
            spec = {"method": "ngram", "num_speculative_tokens": k}
            measure(name, LLM(model, skip_tokenizer_init=True, speculative_config=spec, **common), copying)
            lookup_round.LOOKUP_ROUND_MAX_ROWS = rows
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    timed_hf(model, prompts[-1])
    hf = [timed_hf(model, p) for p in prompts[: args.repetitions]]
    results["hf"] = {"tok_per_s": [NEW_TOKENS / s for s in hf]}
    for row in results.values():
        row["median_tok_per_s"] = statistics.median(row["tok_per_s"])
    return {
        "command": " ".join(sys.argv),
        "machine": torch.cuda.get_device_name(),
        "shape": args.shape,
        "commit": args.commit,
        "versions": versions(),
        "settings": {
            "prompt_tokens": PROMPT_TOKENS,
            "new_tokens": NEW_TOKENS,
            "repetitions": args.repetitions,
            "k": args.k,
        },  # fmt: skip
        "results": results,
    }


def plot(results: dict[str, Any], path: Path) -> None:
    """Median tokens per second a backend, and over each bar its ratio to the engine without speculation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["results"]
    engine = rows["engine"]["median_tok_per_s"]
    fig, ax = plt.subplots(figsize=(9, 3.6))
    bars = ax.bar(range(len(rows)), [row["median_tok_per_s"] for row in rows.values()], color="#2a7")
    ax.bar_label(bars, labels=[f"{row['median_tok_per_s'] / engine:.2f}x" for row in rows.values()], fontsize=7)
    ax.set_xticks(range(len(rows)), list(rows), rotation=20, ha="right", fontsize=7)
    ax.set_ylabel("tokens/s, one stream")
    ax.set_title(f"verifying steps, {results['shape']} shape, {results['machine']}, commit {results['commit']}",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--k", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8])
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--json", type=Path, default=None)
    add_plot_arguments(parser, "a bar chart of the backends' tokens per second")
    args = parser.parse_args(argv)
    if (loaded := replotted(parser, args, plot)) is not None:
        return loaded
    if not torch.cuda.is_available():
        raise SystemExit("this measures the GPU's verifying steps: it needs a GPU")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = run(args)
    engine = results["results"]["engine"]["median_tok_per_s"]
    for name, row in results["results"].items():
        derived = row.get("all_taken_tok_per_s")
        derived = f"  every proposal taken: {statistics.median(derived):.1f} tok/s" if derived else ""
        print(f"{name:22s} {row['median_tok_per_s']:8.1f} tok/s  {row['median_tok_per_s'] / engine:5.2f}x engine  "
              f"accepted length {row.get('mean_accepted_length')}{derived}")  # fmt: skip
    write_json(args.json, results)
    if args.plot is not None:
        plot(results, args.plot)
    return results


if __name__ == "__main__":
    main()
