"""Data parallelism: prefix-affinity routing against round-robin and against one replica of the same total cache.

Workload ``tenants`` (the default, CPU): 8 tenants, each a shared system prompt, 64 requests each (512 in all),
each request its tenant's system prompt plus a user message of its own, in a random order (``random.Random(seed)``,
a new set of tenants each repetition), ``--concurrency`` requests in flight at once. Each replica's KV cache holds
about half the tenants' prompts (``--kv-blocks-per-replica``): the regime where routing decides what stays cached.
Figures: the prefix-cache hit rate from the replicas' ``stats()`` (prompt tokens served from cache / prompt tokens
admitted, over the repetition) and the time to first token (submission to first streamed output, p50 / p99).

    python benchmarks/scale_out.py --json benchmarks/results/scale_out_cpu_<commit>.json

Workload ``w1`` (GPUs): W1 (256 prompts, lengths uniform in [64, 1024], 256 new tokens, greedy) on the Llama-3-8B
shape (``load_format="dummy"``: the model's own normal(0, 0.02) init), one replica against two, each on its own GPU;
the figure is output tokens per second, end to end.

    python benchmarks/scale_out.py --workload w1 --device cuda --json benchmarks/results/scale_out_w1_<gpu>.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray

from paged_backend import SamplingParams
from paged_backend.distributed.router import RouterConfig
from paged_backend.entrypoints.data_parallel import DataParallelConfig, DataParallelLLM

logger = logging.getLogger("benchmarks.scale_out")
ROOT = Path(__file__).resolve().parent.parent


def tenant_requests(seed: int, tenants: int, per_tenant: int, system_len: int, user_len: int) -> list[list[int]]:
    """Every request's token ids: its tenant's system prompt, then a user message of its own; shuffled."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 500) for _ in range(system_len)] for _ in range(tenants)]
    requests = [s + [rng.randrange(3, 500) for _ in range(user_len)] for s in systems for _ in range(per_tenant)]
    rng.shuffle(requests)
    return requests


async def run_closed_loop(
    llm: DataParallelLLM, prompts: list[list[int]], params: SamplingParams, concurrency: int
) -> tuple[list[float], int, float]:
    """Every prompt through the replica set, ``concurrency`` at a time; (time to first output of each, output
    tokens, seconds)."""
    queue = list(enumerate(prompts))
    ttfts: list[float] = []
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while queue:
            i, ids = queue.pop(0)
            started = time.monotonic()
            request_id = f"bench-{i}-{started}"
            (ticket,) = await llm.replica_set.add([(request_id, {"prompt_token_ids": ids})], params, stream=True)
            first = None
            async for out in llm.replica_set.stream(request_id, ticket):
                if first is None and out.outputs[0].token_ids:
                    first = time.monotonic() - started
                if out.finished:
                    tokens += len(out.outputs[0].token_ids)
            ttfts.append(first if first is not None else time.monotonic() - started)

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ttfts, tokens, time.monotonic() - started


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def tenants_setting(args: argparse.Namespace, name: str) -> tuple[int, str, int]:
    """(replicas, routing, KV blocks each) of a named setting: the same total cache in each."""
    blocks, n = kv_blocks_per_replica(args), args.replicas
    settings = {
        "affinity": (n, "prefix", blocks),
        "round_robin": (n, "round_robin", blocks),
        "one_replica": (1, "prefix", n * blocks),
    }  # noqa: E501
    return settings[name]


def kv_blocks_per_replica(args: argparse.Namespace) -> int:
    """``--kv-blocks-per-replica``, else what one replica's share of the tenants needs: their system prompts, and
    its share of the requests in flight (their own blocks, one more for the output). Round-robin sends every tenant
    to every replica, which then holds about ``1 / replicas`` of the prompts it is asked for."""
    if args.kv_blocks_per_replica is not None:
        return int(args.kv_blocks_per_replica)
    per = -(-args.tenants // args.replicas) * -(-args.system_len // args.block_size)
    own = -(-(args.user_len + args.new_tokens) // args.block_size) + 1
    return per + -(-args.concurrency // args.replicas) * own


def measure_tenants(args: argparse.Namespace, model: str) -> dict[str, Any]:
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    runs: dict[str, list[dict[str, float]]] = {}
    for name in ("affinity", "round_robin", "one_replica"):
        replicas, routing, blocks = tenants_setting(args, name)
        config = DataParallelConfig(replicas, RouterConfig(policy=routing), num_cpus_per_replica=args.cpus_per_replica)
        engine = dict(block_size=args.block_size, num_kv_blocks=blocks, max_num_seqs=args.concurrency)
        engine |= dict(max_model_len=args.system_len + args.user_len + 64, device=args.device)
        with DataParallelLLM(model, config=config, **engine) as llm:
            warm = [[2 + i] * (args.system_len + args.user_len) for i in range(2 * replicas)]  # never measured
            llm.generate([{"prompt_token_ids": w} for w in warm], params)
            runs[name] = []
            for rep in range(args.repetitions):
                prompts = tenant_requests(1000 + rep, args.tenants, args.per_tenant, args.system_len, args.user_len)
                before = llm.stats()
                ttfts, tokens, seconds = asyncio.run(run_closed_loop(llm, prompts, params, args.concurrency))
                after = llm.stats()
                cached = after["num_prompt_tokens_cached"] - before["num_prompt_tokens_cached"]
                admitted = after["num_prompt_tokens_admitted"] - before["num_prompt_tokens_admitted"]
                run = {
                    "hit_rate": cached / admitted,
                    "ttft_p50_s": percentile(ttfts, 0.5),
                    "ttft_p99_s": percentile(ttfts, 0.99),
                    "output_tok_s": tokens / seconds,
                    "seconds": seconds,
                    "requests_per_replica": [r["stats"]["num_prompt_tokens_admitted"] for r in after["replicas"]],
                }
                logger.info("%s rep %d: %s", name, rep, {k: v for k, v in run.items() if k != "requests_per_replica"})
                runs[name].append(run)
    return runs


def measure_w1(args: argparse.Namespace, model: str) -> dict[str, Any]:
    rng = random.Random(0)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(64, 1024))] for _ in range(args.w1_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.w1_new_tokens, ignore_eos=True)
    warm = [[1 + (i % 2)] * 64 for i in range(8)]
    runs: dict[str, list[dict[str, float]]] = {}
    for replicas in (1, args.replicas):
        config = DataParallelConfig(replicas, RouterConfig(policy="prefix"), num_cpus_per_replica=args.cpus_per_replica)
        engine: dict[str, Any] = dict(
            load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", device=args.device
        )
        with DataParallelLLM(model, config=config, **engine) as llm:
            llm.generate([{"prompt_token_ids": w} for w in warm], params)
            runs[f"{replicas}_replicas"] = []
            for rep in range(args.repetitions):
                started = time.monotonic()
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
                seconds = time.monotonic() - started
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                runs[f"{replicas}_replicas"].append({"output_tok_s": tokens / seconds, "seconds": seconds})
                logger.info("%d replicas rep %d: %.1f tok/s", replicas, rep, tokens / seconds)
    return runs


def w1_checkpoint() -> str:
    """A folder holding only the Llama-3-8B shape's config.json (weights: ``load_format="dummy"``)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from throughput import benchmark_config

    folder = Path(tempfile.mkdtemp(prefix="scale-out-w1-"))
    benchmark_config().save_pretrained(folder)
    return str(folder)


def summary(runs: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, list[float]]]:
    """Each figure's median, min and max over the repetitions."""
    table: dict[str, dict[str, list[float]]] = {}
    for name, reps in runs.items():
        for key in (k for k, v in reps[0].items() if isinstance(v, float)):
            values = [r[key] for r in reps]
            table.setdefault(name, {})[key] = [statistics.median(values), min(values), max(values)]
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, required=True, help="where to write the result")
    parser.add_argument("--workload", choices=["tenants", "w1"], default="tenants")
    parser.add_argument("--model", default=None, help="checkpoint (default: the demo Llama; w1: the 8B shape)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--per-tenant", type=int, default=64)
    parser.add_argument("--system-len", type=int, default=256, help="tokens of each tenant's system prompt")
    parser.add_argument("--user-len", type=int, default=32, help="tokens of each request's own message")
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--kv-blocks-per-replica", type=int, default=None, help="default: a replica's share")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (tenants)")
    parser.add_argument("--cpus-per-replica", type=float, default=None, help="default: the cores over the replicas")
    parser.add_argument("--w1-prompts", type=int, default=256)
    parser.add_argument("--w1-new-tokens", type=int, default=256)
    args = parser.parse_args()
    if args.cpus_per_replica is None:
        args.cpus_per_replica = len(os.sched_getaffinity(0)) / args.replicas if args.device == "cpu" else 1.0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ray.init(include_dashboard=False, log_to_driver=False)
    if args.workload == "tenants":
        from paged_backend.demo_checkpoint import model_or_demo

        runs = measure_tenants(args, model_or_demo(args.model))
    else:
        runs = measure_w1(args, args.model or w1_checkpoint())
    import torch
    import transformers

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    result = {
        "command": " ".join(["python", *sys.argv]),
        "commit": commit.strip(),
        "machine": platform.processor() or platform.machine(),
        "cpu": _cpu_name(),
        "cpus": len(os.sched_getaffinity(0)),
        "gpus": torch.cuda.device_count(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "ray": ray.__version__},
        "settings": {k: v for k, v in vars(args).items() if k != "json"} | {"kv_blocks": kv_blocks_per_replica(args)},
        "runs": runs,
        "summary (median, min, max)": summary(runs),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary (median, min, max)"], indent=1))
    ray.shutdown()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
