"""Tensor parallelism across two Ray nodes, simulated on one machine (``ray.cluster_utils.Cluster``): rank 0 runs
in this process on the head node, which offers Ray no CPU, so rank 1's Ray task (a CPU rank reserves one) must run
on the other node. Greedy output equals HF ``generate``; removing the remote node mid-run fails the requests in
flight with an error naming the dead worker, and a new engine on a fresh node runs again."""

from __future__ import annotations

import time

import pytest

from paged_backend import LLM, SamplingParams
from tests.conftest import hf_greedy, ragged_prompts
from tests.fixtures.tiny_models import build_tiny_model

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

ENGINE = dict(tensor_parallel_size=2, distributed_executor_backend="ray", block_size=4, max_model_len=128)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tp-llama")
    model = build_tiny_model("llama", vocab_size=len(tokenizer))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), model


@pytest.fixture(scope="module")
def cluster():
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def remote_node(cluster):
    """The node that is not the head: where rank 1 runs."""
    (node,) = cluster.worker_nodes
    return node


def test_tp2_across_two_nodes_equals_hf_and_survives_a_lost_node(cluster, checkpoint) -> None:
    path, model = checkpoint
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    prompts = ragged_prompts(4)[:4]
    llm = LLM(path, num_kv_blocks=128, **ENGINE)
    try:
        (worker,) = llm.llm_engine.executor.group.processes
        assert ray.available_resources().get("CPU", 0) == 0  # rank 1 holds the remote node's only CPU
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8))
        assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(model, p, 8) for p in prompts]

        driver = llm.llm_engine.executor.driver_worker
        forward, steps = driver.execute_model, [0]

        def losing_the_node(*args, **kwargs):
            steps[0] += 1
            if steps[0] == 3:  # the remote node goes away while requests are in flight
                cluster.remove_node(remote_node(cluster))
            return forward(*args, **kwargs)

        driver.execute_model = losing_the_node
        started = time.monotonic()
        dead = "tensor-parallel worker paged-backend-tp-1 died"
        with pytest.raises(RuntimeError, match=dead):  # the requests in flight
            llm.generate(["Hello"] * 4, SamplingParams(max_tokens=60, ignore_eos=True), use_tqdm=False)
        assert time.monotonic() - started < 60  # an error, not a hang until the group's timeout
        with pytest.raises(RuntimeError, match=dead):  # and the next
            llm.generate("Hello", SamplingParams(max_tokens=4), use_tqdm=False)
        assert not worker.is_alive()
    finally:
        llm.shutdown()
    cluster.add_node(num_cpus=1)  # a replacement node; the engine starts again on it
    cluster.wait_for_nodes()
    llm = LLM(path, num_kv_blocks=128, **ENGINE)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8))
        assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(model, p, 8) for p in prompts]
    finally:
        llm.shutdown()
