"""GPU check of the engine with its Triton kernels: greedy equality with HF ``generate`` on the GPU for the tiny
fp32 models of every tested architecture (full-precision dots in fp32), eagerly and with regional torch.compile
+ CUDA graphs (``--compiled`` picks the architectures; default all); with ``--lora``, a batch mixing the base
model and a PEFT adapter on all seven projections, against the PEFT-merged model; with ``--awq``, an AWQ
checkpoint against its dequantized model; with ``--fp8``, fp8 weights compiled against the eager engine; with
``--fp8-kv``, ``kv_cache_dtype="fp8"`` (scales of 1, and from the
first step with ``calculate_kv_scales``) against HF reading keys and values through the same fp8 round trip;
with ``--paths``, prompt embeddings against HF ``generate(inputs_embeds=...)`` (compiled engine: their steps run
without graphs), greedy JSON-schema requests in multi-step rounds against single steps, and ``batch_invariant=True``
(fp32 and bf16: one request alone against it beside 63 others, in one step's budget and chunked over 32-token
steps, tokens and logprobs; its decode steps replay CUDA graphs), and async scheduling against the
synchronous engine (64 prompts with stops inside rounds). Engines on the GPU schedule asynchronously by default,
so every row above runs with it unless it says otherwise.
The kernels' own tests run with ``python -m pytest tests/test_kernels.py tests/test_fp8_kv_cache.py`` on the
same machine; speed is ``benchmarks/throughput.py``.

Run: ``python benchmarks/gpu_check.py [--compiled llama,gpt2]`` on a CUDA machine.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: tests.fixtures

from paged_backend import LLM, SamplingParams  # noqa: E402
from paged_backend.demo_checkpoint import build_tiny_tokenizer  # noqa: E402
from tests.fixtures.tiny_models import TINY_CONFIGS, build_tiny_model  # noqa: E402

logger = logging.getLogger("gpu_check")
# A small cache and token budget: chunked prefill and preemption (by swapping, the default on a GPU with swap space)
SMALL_ENGINE = {"block_size": 4, "num_kv_blocks": 40, "max_num_batched_tokens": 24, "max_model_len": 80}


def tiny_prompts() -> list[list[int]]:
    """Eight prompts of 1 to 40 tokens (ids 3..511, past the tiny tokenizer's specials)."""
    rng = random.Random(0)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 3, 4, 5, 14, 2, 19, 40)]


@torch.no_grad()
def hf_greedy_on_gpu(model, prompt: list[int], max_new_tokens: int = 16) -> list[int]:
    """HF ``generate``'s greedy continuation, cut after the first EOS (id 2)."""
    ref = model.generate(
        torch.tensor([prompt], device="cuda"),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=2,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    return ref[: ref.index(2) + 1] if 2 in ref else ref


def tiny_equality(tokenizer, compiled: set[str]) -> list[tuple[str, str, int, int, int, int]]:
    """Eager for every architecture, then compiled + CUDA graphs for those in ``compiled``. The small cache and
    token budget force chunked prefill and preemption (by swapping, the default on a GPU with swap space).
    Rows: (arch, mode, matches, prompts, preemptions, swap-outs)."""
    rows = []
    for arch, eager in [(a, True) for a in TINY_CONFIGS] + [(a, False) for a in TINY_CONFIGS if a in compiled]:
        model = build_tiny_model(arch, vocab_size=len(tokenizer)).cuda()
        llm = LLM(model, tokenizer=tokenizer, enforce_eager=eager, **SMALL_ENGINE)
        prompts = tiny_prompts()
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False
        )
        matches = sum(out.outputs[0].token_ids == hf_greedy_on_gpu(model, p) for p, out in zip(prompts, outs))
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_kv_blocks"]
        mode = "eager" if eager else "compiled+graphs"
        rows.append((arch, mode, matches, len(prompts), stats["num_preemptions"], stats["num_swapped_out"]))
        del llm, model
        torch.cuda.empty_cache()
    return rows


def engine_row(name: str, eager: bool, llm: LLM, outs: list, refs: list[list[int]]) -> tuple:
    """(name, mode, matches, prompts, preemptions, swap-outs) of one engine's outputs; the engine is shut down."""
    matches = sum(out.outputs[0].token_ids == ref for out, ref in zip(outs, refs))
    stats = llm.stats()
    runner = llm.llm_engine.executor.model_runner
    compiled = runner.regions is not None and runner.graphs is not None
    llm.llm_engine.shutdown()
    if not eager and not compiled:  # the engine fell back to eager layers or no graphs: a failure here
        return name, "compile FAILED", 0, len(refs), stats["num_preemptions"], stats["num_swapped_out"]
    mode = "eager" if eager else "compiled+graphs"
    return name, mode, matches, len(refs), stats["num_preemptions"], stats["num_swapped_out"]


def lora_equality(tokenizer) -> list[tuple[str, str, int, int, int, int]]:
    """Tiny Llama with one random PEFT adapter (peft needed): each prompt once on the base model and once with
    the adapter, eager and compiled + CUDA graphs, against HF ``generate`` on the base and the merged model."""
    import copy
    import tempfile

    import peft

    from paged_backend import LoRARequest

    base = build_tiny_model("llama", vocab_size=len(tokenizer))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False, lora_dropout=0.0)
    adapted = peft.get_peft_model(copy.deepcopy(base), config)
    torch.manual_seed(0)
    with torch.no_grad():  # large enough to change greedy outputs
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        adapted.save_pretrained(folder)
        merged = adapted.merge_and_unload().eval().cuda()
        base = base.cuda()
        prompts = tiny_prompts()
        refs = [hf_greedy_on_gpu(base, p) for p in prompts] + [hf_greedy_on_gpu(merged, p) for p in prompts]
        lora = LoRARequest("adapter", 1, folder)
        for eager in (True, False):
            llm = LLM(
                base,
                tokenizer=tokenizer,
                block_size=4,
                num_kv_blocks=80,
                max_model_len=80,
                enforce_eager=eager,
                enable_lora=True,
                max_lora_rank=8,
            )
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in prompts + prompts],
                SamplingParams(temperature=0, max_tokens=16),
                lora_request=[None] * len(prompts) + [lora] * len(prompts),
                use_tqdm=False,
            )
            rows.append(engine_row("llama+lora", eager, llm, outs, refs))
            del llm
            torch.cuda.empty_cache()
    return rows


def awq_equality(tokenizer) -> list[tuple[str, str, int, int, int, int]]:
    """Tiny Llama written as an AWQ checkpoint (round to nearest, group 32): the engine in fp32, eager and compiled
    + CUDA graphs (AWQ siblings fused), against HF ``generate`` on the dequantized model. On the GPU the AWQ
    kernels run: the GEMV at one row, the ``tl.dot`` kernel up to 128 rows, dequantize + cuBLAS above."""
    import tempfile

    from paged_backend.quantization.awq_quantize import write_checkpoint
    from tests.fixtures.awq import dequantized_copy

    model = build_tiny_model("llama", vocab_size=len(tokenizer))
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        write_checkpoint(model, folder, 32, tokenizer)
        reference = dequantized_copy(model, folder).cuda()
        prompts = tiny_prompts()
        refs = [hf_greedy_on_gpu(reference, p) for p in prompts]
        for eager in (True, False):
            llm = LLM(
                folder,
                dtype="float32",
                block_size=4,
                num_kv_blocks=40,
                max_num_batched_tokens=24,
                max_model_len=80,
                enforce_eager=eager,
            )
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False
            )
            rows.append(engine_row("llama+awq", eager, llm, outs, refs))
            del llm
            torch.cuda.empty_cache()
    return rows


def fp8_weights_equality(tokenizer) -> list[tuple[str, str, int, int, int, int]]:
    """Tiny Llama loaded with ``quantization="fp8"`` (weights per channel, activations per token), in fp32 (the
    twins' products) and bf16 (``torch._scaled_mm``): compiled + CUDA graphs, where the activations' quantization
    joins the compiled graph (``worker/fp8_activations.py``), against the eager engine, whose steps have the same
    rows and quantize with ``kernels/fp8_quant.py``."""
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        build_tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        prompts = tiny_prompts()
        for dtype in ("float32", "bfloat16"):
            refs: list[list[int]] = []
            for eager in (True, False):
                llm = LLM(folder, dtype=dtype, quantization="fp8", enforce_eager=eager, **SMALL_ENGINE)
                outs = llm.generate(
                    [{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0, max_tokens=16),
                    use_tqdm=False,
                )
                refs = refs or [out.outputs[0].token_ids for out in outs]
                rows.append(engine_row(f"llama+fp8 {dtype} vs eager", eager, llm, outs, refs))
                del llm
                torch.cuda.empty_cache()
    return rows


def fp8_kv_equality(tokenizer) -> list[tuple[str, str, int, int, int, int]]:
    """``kv_cache_dtype="fp8"`` on the GPU, eager and compiled + CUDA graphs, under chunked prefill and swapping,
    against HF attending to the same fp8 values (``tests/fixtures/fp8_kv.py``)."""
    from tests.fixtures.fp8_kv import fp8_kv_model

    rows = []
    for arch, eager, calculate in [("llama", True, False), ("llama", False, False), ("mistral", False, False),
                                   ("gpt2", False, False), ("llama", False, True)]:  # fmt: skip
        model = build_tiny_model(arch, vocab_size=len(tokenizer)).cuda()
        fp8 = {"kv_cache_dtype": "fp8", "calculate_kv_scales": calculate}
        llm = LLM(model, tokenizer=tokenizer, enforce_eager=eager, **fp8, **SMALL_ENGINE)
        prompts = tiny_prompts()
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False
        )
        scales = llm.llm_engine.executor.model_runner.cache_engine.kv_scales or []
        reference = fp8_kv_model(
            arch, {i: (k.cpu(), v.cpu()) for i, (k, v) in enumerate(scales)}, vocab_size=len(tokenizer)
        )
        refs = [hf_greedy_on_gpu(reference.cuda(), p) for p in prompts]
        rows.append(engine_row(f"{arch} fp8kv" + (" calc" if calculate else ""), eager, llm, outs, refs))
        torch.cuda.empty_cache()
    return rows


def paths_equality(tokenizer) -> list[tuple[str, str, int, int, int, int]]:
    """Prompt embeddings, grammar rounds and batch invariance on the GPU (see the module's docstring)."""
    from paged_backend import StructuredOutputsParams

    rows = []
    model = build_tiny_model("llama", vocab_size=len(tokenizer)).cuda()
    prompts = tiny_prompts()
    weight = model.get_input_embeddings().weight.detach()
    embeds = [weight[p] + 0.05 * torch.randn(len(p), weight.shape[1], device="cuda") for p in prompts]
    llm = LLM(model, tokenizer=tokenizer, enable_prompt_embeds=True, **SMALL_ENGINE)
    outs = llm.generate(
        [{"prompt_embeds": e} for e in embeds], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False
    )
    refs = []
    for e in embeds:
        ref = model.generate(inputs_embeds=e[None], max_new_tokens=16, do_sample=False, eos_token_id=2, pad_token_id=0)
        ref = ref[0].tolist()
        refs.append(ref[: ref.index(2) + 1] if 2 in ref else ref)
    rows.append(engine_row("llama embeds", False, llm, outs, refs))
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 6}
    json_params = SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(json=schema))
    by_steps = []
    del llm
    for steps in (1, 8):
        llm = LLM(model, tokenizer=tokenizer, num_scheduler_steps=steps, max_model_len=80, num_kv_blocks=1024)
        by_steps.append(
            [
                o.outputs[0].token_ids
                for o in llm.generate([{"prompt_token_ids": p} for p in prompts], json_params, use_tqdm=False)
            ]
        )
        llm.llm_engine.shutdown()
    rows.append(("llama json", "rounds=single", sum(a == b for a, b in zip(*by_steps)), len(prompts), 0, 0))
    invariant = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    others = [[random.Random(i).randrange(3, 512) for _ in range(5 + i % 40)] for i in range(63)]
    bf16 = build_tiny_model("llama", vocab_size=len(tokenizer)).cuda().to(torch.bfloat16)
    for name, invariant_model in (("llama invariant", model), ("llama bf16 invariant", bf16)):
        results = []  # alone; beside 63 others in one step's budget; beside them, chunked over 32-token steps
        for batch, budget in (([], None), (others, None), (others, 32)):
            llm = LLM(
                invariant_model,
                tokenizer=tokenizer,
                batch_invariant=True,
                max_model_len=80,
                num_kv_blocks=1024,
                **({"max_num_batched_tokens": budget, "max_num_seqs": 16} if budget else {}),
            )
            out = llm.generate([{"prompt_token_ids": p} for p in [prompts[-1], *batch]], invariant, use_tqdm=False)
            first = out[0].outputs[0]
            results.append((first.token_ids, [{t: e.logprob for t, e in d.items()} for d in first.logprobs]))
            llm.llm_engine.shutdown()
        rows.append((name, "alone=in 64, chunked", sum(r == results[0] for r in results[1:]), 2, 0, 0))
    return rows + async_equality(tokenizer, model)


def async_equality(tokenizer, model) -> list[tuple[str, str, int, int, int, int]]:
    """Async scheduling (rounds queued behind rounds, CUDA graphs, compiled) against the synchronous engine on
    64 prompts with stop tokens, EOS and ragged lengths ending inside rounds; fails if no round was queued."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(3, 60))] for _ in range(64)]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(8, 60), stop_token_ids=[rng.randrange(3, 512)])
        for _ in prompts
    ]
    results, continued = [], [0]
    for async_scheduling in (False, True):
        llm = LLM(model, tokenizer=tokenizer, max_model_len=160, num_kv_blocks=2048, async_scheduling=async_scheduling)
        executor = llm.llm_engine.executor
        launch = executor.execute_model_async

        def counting(scheduler_output, launch=launch):
            continued[0] += scheduler_output.batch.prev_rows is not None
            return launch(scheduler_output)

        executor.execute_model_async = counting
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs])
        llm.llm_engine.shutdown()
        del llm
    logger.info("async scheduling: %d rounds queued behind another", continued[0])
    matches = sum(a == b for a, b in zip(*results)) if continued[0] else 0
    return [("llama async", "async=sync", matches, len(prompts), 0, 0)]


def main() -> None:
    parser = argparse.ArgumentParser(description="greedy equality with HF generate on the GPU")
    parser.add_argument("--compiled", default=",".join(TINY_CONFIGS), help="architectures also run compiled")
    parser.add_argument("--lora", action="store_true", help="also a base + PEFT adapter batch (needs peft)")
    parser.add_argument("--awq", action="store_true", help="also an AWQ checkpoint against its dequantized model")
    parser.add_argument("--fp8-kv", action="store_true", help="also an fp8 KV cache against HF reading fp8 values")
    parser.add_argument("--fp8", action="store_true", help="also fp8 weights, compiled against the eager engine")
    parser.add_argument("--paths", action="store_true", help="also prompt embeddings, grammar rounds, batch_invariant")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logger.info("torch %s, %s", torch.__version__, torch.cuda.get_device_name())
    if args.paths:  # its grammar rounds need xgrammar: fail before the other checks, not after them
        import xgrammar  # noqa: F401
    tokenizer = build_tiny_tokenizer()
    checks = [lambda: tiny_equality(tokenizer, set(args.compiled.split(",")))]
    checks += [lambda: lora_equality(tokenizer)] if args.lora else []
    checks += [lambda: awq_equality(tokenizer)] if args.awq else []
    checks += [lambda: fp8_kv_equality(tokenizer)] if args.fp8_kv else []
    checks += [lambda: fp8_weights_equality(tokenizer)] if args.fp8 else []
    checks += [lambda: paths_equality(tokenizer)] if args.paths else []
    failures = 0
    for check in checks:  # each check's rows are logged as it ends: a later failure does not lose them
        for arch, mode, matches, total, preempted, swapped in check():
            logger.info(
                "greedy == HF generate on GPU: %-8s %-16s %d/%d prompts (%d preemptions, %d swapped out)",
                *(arch, mode, matches, total, preempted, swapped),
            )
            failures += matches != total
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
