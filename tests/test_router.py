"""The data-parallel routers as policies, without Ray: prefix hashes are stable and chained, a shared prefix keeps
to its replica until the load bound says otherwise, new prefixes spread, a restarted replica is forgotten, and
round-robin takes each replica in turn."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_backend.distributed.router import (
    PrefixAffinityRouter,
    RoundRobinRouter,
    RouterConfig,
    make_router,
    prefix_block_hashes,
)

CONFIG = RouterConfig(block_size=4, max_load_imbalance=2)


def test_hashes_are_chained_over_full_blocks_and_stable_across_processes() -> None:
    ids = list(range(11))  # two full blocks of 4, three tokens left over
    hashes = prefix_block_hashes(ids, 4, 64)
    assert len(hashes) == 2
    assert prefix_block_hashes([*ids[:8], 99], 4, 64) == hashes  # only full blocks count
    assert prefix_block_hashes([0, *ids[1:]], 4, 64) == hashes
    assert prefix_block_hashes([99, *ids[1:]], 4, 64)[1] != hashes[1]  # block 1's hash covers block 0
    assert prefix_block_hashes(ids, 4, 1) == hashes[:1]
    assert prefix_block_hashes(ids, 4, 64, salt=3) != hashes  # another LoRA adapter: other blocks
    code = "from paged_backend.distributed.router import prefix_block_hashes as h; print(h(range(11), 4, 64))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == str(hashes)  # no per-process salt (Python's str hash has one)


def test_a_shared_prefix_keeps_to_its_replica_and_new_ones_spread() -> None:
    router = PrefixAffinityRouter(CONFIG, capacity_blocks=1000)
    tenant_a, tenant_b = list(range(16)), list(range(100, 116))
    first = router.choose(tenant_a + [1], {0: 0, 1: 0})
    assert first == 0  # a tie: the lower index
    second = router.choose(tenant_b + [1], {0: 1, 1: 0})
    assert second == 1  # a new prefix: the least loaded
    for i in range(5):
        assert router.choose(tenant_a + [i], {0: 1, 1: 1}) == 0
        assert router.choose(tenant_b + [i], {0: 1, 1: 1}) == 1


def test_the_load_bound_sends_a_prefix_to_the_least_loaded() -> None:
    router = PrefixAffinityRouter(CONFIG, capacity_blocks=1000)
    prompt = list(range(16))
    assert router.choose(prompt, {0: 0, 1: 0}) == 0
    assert router.choose(prompt, {0: 2, 1: 0}) == 0  # 2 more in flight: within the bound
    assert router.choose(prompt, {0: 3, 1: 0}) == 1  # 3 more: beyond it
    assert router.choose(prompt, {0: 3, 1: 3}) in (0, 1)  # both hold it now; either is right


def test_a_small_match_counts_as_none() -> None:
    """Prompts that share only a template's first block are different tenants: spread by load."""
    router = PrefixAffinityRouter(CONFIG, capacity_blocks=1000)
    preamble = [1, 2, 3, 4]
    router.choose(preamble + list(range(10, 30)), {0: 0, 1: 0})
    assert router.choose(preamble + list(range(50, 70)), {0: 1, 1: 0}) == 1


def test_a_forgotten_replica_and_a_full_table_lose_their_prefixes() -> None:
    router = PrefixAffinityRouter(CONFIG, capacity_blocks=4)
    a, b = list(range(16)), list(range(100, 116))
    assert router.choose(a, {0: 0, 1: 0}) == 0
    router.forget(0)
    assert router.matched(0, prefix_block_hashes(a, 4, 64)) == 0
    router.choose(a, {0: 0, 1: 1})
    router.choose(b, {0: 0})  # only replica 0 runs: b's 4 blocks push a's out of its table of 4
    assert router.matched(0, prefix_block_hashes(b, 4, 64)) == 4
    assert router.matched(0, prefix_block_hashes(a, 4, 64)) == 0


def test_round_robin_takes_each_running_replica_in_turn() -> None:
    router = make_router(RouterConfig(policy="round_robin"), 10)
    assert isinstance(router, RoundRobinRouter)
    assert [router.choose([1] * 64, {0: 5, 1: 0, 2: 0}) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    assert router.choose([], {1: 0}) == 1
    with pytest.raises(RuntimeError, match="no replica"):
        router.choose([], {})


@pytest.mark.parametrize(
    ("field", "value"),
    [("policy", "random"), ("block_size", 0), ("max_load_imbalance", -1), ("min_match_ratio", 0.0)],
)
def test_bad_router_settings_name_their_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        RouterConfig(**{field: value})


@settings(max_examples=200, deadline=None)
@given(
    prompts=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40)), min_size=1, max_size=40),
    loads=st.lists(st.integers(0, 10), min_size=1, max_size=4),
)
def test_the_choice_is_running_and_within_the_load_bound(prompts: list[tuple[int, int]], loads: list[int]) -> None:
    """Whatever came before: the chosen replica runs, and is never loaded beyond the least loaded by more than
    the bound; the same history gives the same choices (two routers agree)."""
    routers = [PrefixAffinityRouter(CONFIG, capacity_blocks=16) for _ in range(2)]
    current = dict(enumerate(loads))
    for tenant, suffix in prompts:
        prompt = [tenant] * 12 + [suffix] * 5
        choices = {router.choose(prompt, current) for router in routers}
        assert len(choices) == 1
        (choice,) = choices
        assert choice in current and current[choice] <= min(current.values()) + CONFIG.max_load_imbalance
        current[choice] += 1
