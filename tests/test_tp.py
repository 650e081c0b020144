"""Tensor parallelism on CPU: two processes over gloo give HF ``generate``'s greedy output and TP=1's seeded
samples, under chunked prefill and preemption; workers stop with the engine; a dead worker is reported."""

from __future__ import annotations

import gc
import multiprocessing
import time

import pytest
import torch

from paged_backend import LLM, SamplingParams
from paged_backend.quantization.fp8 import FP8Linear
from tests.conftest import assert_idle, hf_greedy, ragged_prompts, tp2
from tests.fixtures.tiny_models import build_tiny_model

pytestmark = tp2
ENGINE = dict(block_size=4, max_model_len=128)


def tp_workers() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("paged-backend-tp-")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer):
    """Tiny Llama (KV heads split), Qwen2 (q/k/v biases, a sliding window) and Qwen3 (one KV head: replicated),
    saved where worker processes can load them."""
    paths = {}
    for arch in ("llama", "qwen2", "qwen3"):
        path = tmp_path_factory.mktemp(arch)
        model = build_tiny_model(arch, vocab_size=len(tokenizer))
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[arch] = (str(path), model)
    return paths


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tp2_greedy_equals_hf_generate(checkpoints, arch: str) -> None:
    path, model = checkpoints[arch]
    prompts = ragged_prompts(4)
    # 14 blocks of 4 tokens and a 24-token budget: chunked prefill and preemption happen, on every rank alike
    llm = LLM(path, tensor_parallel_size=2, block_size=4, max_model_len=48, num_kv_blocks=14, max_num_batched_tokens=24)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=16))
        for prompt, out in zip(prompts, outs):
            assert list(out.outputs[0].token_ids) == hf_greedy(model, prompt, 16)
        assert llm.stats()["num_preemptions"] > 0 and llm.stats()["num_chunked_prefill_steps"] > 0
        assert_idle(llm)
    finally:
        llm.llm_engine.shutdown()
    assert not tp_workers()


def test_each_step_is_one_message_to_the_workers(checkpoints) -> None:
    """Greedy decoding runs in multi-step rounds; each round (its batch: the workers derive the round's forwards)
    and each single step reaches the workers as one message, the batch without its Python objects; one message
    per sequence would cost a round trip each."""
    path, model = checkpoints["llama"]
    prompts = ragged_prompts(6)
    llm = LLM(path, tensor_parallel_size=2, num_kv_blocks=128, num_scheduler_steps=8, **ENGINE)
    engine, sent, steps = llm.llm_engine, [], [0]
    assert engine.executor.driver_worker.agree is not None  # graph captures agreed over the ranks
    group = engine.executor.group
    send, step = group.send, engine.step

    def counted_send(method: str, *args: object) -> None:
        sent.append((method, args))
        send(method, *args)

    def counted_step(*args: object, **kwargs: object) -> list:
        steps[0] += 1
        return step(*args, **kwargs)

    group.send, engine.step = counted_send, counted_step
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=24))
        for prompt, out in zip(prompts, outs):
            assert list(out.outputs[0].token_ids) == hf_greedy(model, prompt, 24)
    finally:
        llm.llm_engine.shutdown()
    assert {method for method, _ in sent} == {"execute_model"}
    assert len(sent) == steps[0]
    wires = [args[0] for _, args in sent]
    assert all(not wire.seqs and not wire.sampling_seqs for wire in wires)  # no Python objects travel
    rounds = [wire.batch.num_steps for wire in wires if wire.batch.num_steps is not None]
    assert rounds and all(max(n) > 1 for n in rounds)  # multi-step rounds happened


def test_seeded_samples_match_tp1_and_workers_stop_with_the_engine(checkpoints) -> None:
    path, _ = checkpoints["llama"]
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=7, n=2)
    prompts = ["Hello world", "The paged cache"]
    single = LLM(path, num_kv_blocks=128, **ENGINE).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, tensor_parallel_size=2, num_kv_blocks=128, **ENGINE)
    assert len(tp_workers()) == 1
    double = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in double] == [[c.token_ids for c in o.outputs] for o in single]
    del llm, double
    gc.collect()  # the engine's finalizer stops its workers
    for process in tp_workers():
        process.join(timeout=15)
    assert not tp_workers()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_dummy_weights_are_the_slices_of_the_model_one_device_holds(checkpoints, arch: str) -> None:
    """load_format='dummy' builds from config.json alone, each module from a generator seeded by its name: TP=2's
    slices are cut from the same full model that TP=1 builds, so both give HF generate's output on that model."""
    path, saved = checkpoints[arch]
    prompts = ragged_prompts(4)[:4]
    params = SamplingParams(temperature=0, max_tokens=8)
    single = LLM(path, load_format="dummy", seed=3, num_kv_blocks=128, **ENGINE)
    model = single.llm_engine.model
    layer = model.model.layers[0]
    std = model.config.initializer_range
    assert abs(layer.mlp.down_proj.weight.std().item() - std) < 0.1 * std  # the architecture's own init
    assert torch.equal(layer.input_layernorm.weight, torch.ones_like(layer.input_layernorm.weight))
    assert not torch.equal(layer.mlp.down_proj.weight, saved.model.layers[0].mlp.down_proj.weight)  # not loaded
    expected = [hf_greedy(model, p, 8) for p in prompts]
    outs = single.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    again = LLM(path, load_format="dummy", seed=3, num_kv_blocks=128, **ENGINE).llm_engine.model
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    del single, again
    llm = LLM(path, load_format="dummy", seed=3, tensor_parallel_size=2, num_kv_blocks=128, **ENGINE)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
    finally:
        llm.llm_engine.shutdown()


def test_online_fp8_cuts_its_fp8_layers(checkpoints) -> None:
    """quantization='fp8' under TP=2, from a checkpoint read whole and from dummy weights: rank 0's fp8 layers
    hold its rows of TP=1's (per-row scales with them) and the engine generates. (Exact equality of the ranks'
    sums: tests/test_tp_plan.py; activations quantized per token over a rank's slice make TP=2's output differ
    from TP=1's.)"""
    path, _ = checkpoints["llama"]
    prompts = [{"prompt_token_ids": p} for p in ragged_prompts(2)]
    for extra in ({}, {"load_format": "dummy"}):
        single = LLM(path, quantization="fp8", num_kv_blocks=64, **ENGINE, **extra).llm_engine.model
        whole = single.model.layers[0].self_attn.k_proj
        llm = LLM(path, quantization="fp8", tensor_parallel_size=2, num_kv_blocks=64, **ENGINE, **extra)
        try:
            k_proj = llm.llm_engine.model.model.layers[0].self_attn.k_proj
            assert isinstance(k_proj, FP8Linear) and k_proj.out_features == whole.out_features // 2
            rows = slice(0, k_proj.out_features)
            assert torch.equal(k_proj.weight.view(torch.uint8), whole.weight[rows].view(torch.uint8))
            assert torch.equal(k_proj.weight_scale, whole.weight_scale[rows])
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
        finally:
            llm.llm_engine.shutdown()


def test_a_dead_worker_is_reported_mid_step_and_between_steps(checkpoints) -> None:
    path, _ = checkpoints["llama"]
    llm = LLM(path, tensor_parallel_size=2, num_kv_blocks=128, **ENGINE)
    try:
        (worker,) = tp_workers()
        driver = llm.llm_engine.executor.driver_worker  # rank 0's own Worker, behind the broadcasting executor
        forward = driver.execute_model
        steps = [0]

        def dying_forward(*args, **kwargs):
            steps[0] += 1
            if steps[0] == 3:  # the worker dies while rank 0 is inside a step: its next all-reduce fails
                worker.kill()
                worker.join(timeout=10)
            return forward(*args, **kwargs)

        driver.execute_model = dying_forward
        params = SamplingParams(max_tokens=50, ignore_eos=True)
        started = time.monotonic()
        with pytest.raises(RuntimeError):
            llm.generate(["Hello"] * 4, params, use_tqdm=False)
        assert time.monotonic() - started < 60  # an error, not a hang until the group's timeout
        with pytest.raises(RuntimeError, match="tensor-parallel worker paged-backend-tp-1 died"):
            llm.generate("Hello", SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert not tp_workers()


def test_a_failing_worker_is_reported_not_waited_for(checkpoints, capfd) -> None:
    """A worker whose call raises says why before its teardown (under NCCL an orderly teardown waits on rank 0,
    which is inside a collective that worker never joins) and leaves; rank 0 then raises instead of hanging."""
    path, _ = checkpoints["llama"]
    llm = LLM(path, tensor_parallel_size=2, num_kv_blocks=128, **ENGINE)
    try:
        (worker,) = tp_workers()
        llm.llm_engine.executor.group.send("no_such_method")  # the worker's getattr raises AttributeError
        started = time.monotonic()
        with pytest.raises(RuntimeError):
            llm.generate("Hello", SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert time.monotonic() - started < 60
        worker.join(timeout=30)
        assert not worker.is_alive()
        err = capfd.readouterr().err  # the worker's stderr
        assert "tensor-parallel worker 1 failed" in err and "no_such_method" in err
    finally:
        llm.llm_engine.shutdown()
    assert not tp_workers()


def test_workers_choose_cuda_graphs_like_rank_0() -> None:
    """Workers get each step without its sequences; the graph-or-not choice must not depend on them (a worker
    running eagerly beside a rank 0 replaying a padded graph would all-reduce tensors of other sizes)."""
    from paged_backend.core.scheduler_output import ScheduledBatch, SchedulerOutput
    from paged_backend.worker.cuda_graphs import fits_decode_graph
    from paged_backend.worker.step_inputs import build_step_inputs

    for sampling in ([0, 1, 2], [0, 1]):  # all three decode, or one is a prefill chunk that does not sample yet
        batch = ScheduledBatch(
            input_token_ids=[5, 6, 7],
            num_computed_tokens=[4, 9, 2],
            num_scheduled_tokens=[1, 1, 1],
            block_tables=[[0], [1, 2, 3], [4]],
            sampling_rows=sampling,
        )
        output = SchedulerOutput(batch, seqs=[object()] * 3, sampling_seqs=[object()] * len(sampling))
        wire = output.to_wire()  # what a worker gets
        assert wire.batch is batch and not wire.seqs and not wire.sampling_seqs
        inputs = build_step_inputs(wire.batch, block_size=4)
        assert fits_decode_graph(inputs, 8) == (len(sampling) == 3)


def test_ranks_keep_only_the_graphs_every_rank_captured() -> None:
    """A capture that failed on one rank (out of memory, say) drops those graphs on every rank, and only those."""
    from types import SimpleNamespace

    from paged_backend.worker.cuda_graphs import keep_agreed

    names = ["graphs", "verify_graphs", "mixed_graphs"]
    other_rank = {"graphs": 1, "verify_graphs": 1, "mixed_graphs": 0}  # its mixed capture failed
    ours = SimpleNamespace(graphs="decode", verify_graphs=None, mixed_graphs="mixed")
    asked: list[int] = []

    def agree(value: int) -> int:  # the minimum over this rank and the other
        asked.append(value)
        return min(value, other_rank[names[len(asked) - 1]])

    keep_agreed(ours, names, agree)
    assert asked == [1, 0, 1]  # one call a name, in order, on every rank
    assert ours.graphs == "decode" and ours.verify_graphs is None and ours.mixed_graphs is None


def test_unsupported_layouts_are_refused_before_any_worker_starts(checkpoints, tokenizer, tmp_path) -> None:
    path, _ = checkpoints["llama"]
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        LLM(path, tensor_parallel_size=3, num_kv_blocks=128, **ENGINE)
    build_tiny_model("gpt2", vocab_size=len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(NotImplementedError, match="no base_model_tp_plan"):
        LLM(str(tmp_path), tensor_parallel_size=2, num_kv_blocks=128, **ENGINE)
    with pytest.raises(ValueError, match="pass model as a path"):
        LLM(checkpoints["llama"][1], tensor_parallel_size=2, num_kv_blocks=128, **ENGINE)
    assert not tp_workers()


def test_ray_executor_on_a_local_ray_instance(checkpoints) -> None:
    ray = pytest.importorskip("ray")
    path, model = checkpoints["llama"]
    prompts = ragged_prompts(4)[:4]
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # not another test's cluster
    try:
        llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", num_kv_blocks=128, **ENGINE)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8))
            assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(model, p, 8) for p in prompts]
            (worker,) = llm.llm_engine.executor.group.processes
            assert worker.is_alive()
        finally:
            llm.llm_engine.shutdown()
        assert not worker.is_alive()  # the Ray task ended with the engine
    finally:
        ray.shutdown()
