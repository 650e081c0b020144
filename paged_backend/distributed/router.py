"""Which data-parallel replica serves a request: a small policy over the front end's view of the replicas.

Each replica's engine keeps its own prefix cache, so a request whose prompt starts like an earlier one's runs
faster on the replica that ran the earlier one. ``PrefixAffinityRouter`` hashes the first full blocks of a
prompt's token ids (the blocks the engine's prefix cache keys on, chained as the engine chains them) and keeps,
for each replica, the block hashes of the prompts it sent there, in least-recently-used order, as many as that
replica's KV cache holds: its guess of what the replica has cached. A request goes to the replica that holds the
longest run of its first blocks, unless that replica has more requests in flight than the least loaded one by
more than ``max_load_imbalance``: then, as for a prompt that matches too little, to the least loaded (ties: the
one whose cache the router fills least, so that new prefixes spread over the caches). ``RoundRobinRouter`` is the
baseline it is measured against.

The routers never talk to the replicas: the replica set tells them each replica's load and which replicas can
take requests, and ``forget``s a replica whose process died (its cache went with it).
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from paged_backend.field_checks import check_choice, check_float, check_int

ROUTING_POLICIES = ("prefix", "round_robin")


@dataclass(frozen=True)
class RouterConfig:
    """How requests are spread over replicas (``--data-parallel-routing`` and friends)."""

    policy: str = "prefix"  # "prefix": prefix-cache affinity under a load bound; "round_robin": each in turn
    block_size: int = 16  # tokens per hashed block: the engine's block size, so a hashed block is a cached one
    max_prefix_blocks: int = 64  # the first blocks of a prompt the router hashes (a longer match adds little)
    max_load_imbalance: int = 8  # requests in flight the preferred replica may have beyond the least loaded one
    min_match_ratio: float = 0.25  # share of a prompt's hashed blocks a replica must hold to be preferred

    def __post_init__(self) -> None:
        check_choice("policy", self.policy, ROUTING_POLICIES)
        check_int("block_size", self.block_size, 1)
        check_int("max_prefix_blocks", self.max_prefix_blocks, 1)
        check_int("max_load_imbalance", self.max_load_imbalance, 0)
        check_float("min_match_ratio", self.min_match_ratio, 0.0, 1.0, low_open=True)


class Router(Protocol):
    """Picks a replica for each request; told when a replica's cache is gone."""

    def choose(self, token_ids: Sequence[int], loads: Mapping[int, int], salt: int = 0) -> int:
        """The replica (a key of ``loads``: the replicas that can take requests now, with their requests in
        flight) for a prompt of ``token_ids``; ``salt`` separates caches that never share blocks (a LoRA id)."""
        ...

    def forget(self, replica: int) -> None:
        """``replica`` restarted (or left): nothing it cached survives."""
        ...


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int, salt: int = 0) -> list[int]:
    """The chained hashes of the first ``max_blocks`` full blocks of ``token_ids``: block i's hash covers blocks
    0..i, so equal hashes mean equal prefixes. Stable across processes and runs (blake2b, not ``hash``), so every
    front end of a deployment routes a prefix alike."""
    hashes: list[int] = []
    parent = salt.to_bytes(8, "little", signed=True)
    for start in range(0, min(len(token_ids) // block_size, max_blocks) * block_size, block_size):
        block = b"".join(int(t).to_bytes(4, "little", signed=True) for t in token_ids[start : start + block_size])
        parent = hashlib.blake2b(parent + block, digest_size=8).digest()
        hashes.append(int.from_bytes(parent, "little"))
    return hashes


class RoundRobinRouter:
    """Each replica in turn, skipping those that cannot take requests."""

    def __init__(self) -> None:
        self.counter = itertools.count()

    def choose(self, token_ids: Sequence[int], loads: Mapping[int, int], salt: int = 0) -> int:
        _require(loads)
        replicas = sorted(loads)
        return replicas[next(self.counter) % len(replicas)]

    def forget(self, replica: int) -> None:
        pass


class PrefixAffinityRouter:
    """Prefix-cache affinity under a load bound (see the module's docstring)."""

    def __init__(self, config: RouterConfig, capacity_blocks: int) -> None:
        check_int("capacity_blocks", capacity_blocks, 1)
        self.config = config
        self.capacity_blocks = capacity_blocks  # a replica's KV blocks: its table's size
        self.tables: dict[int, OrderedDict[int, None]] = {}  # replica -> block hashes, least recently used first

    def choose(self, token_ids: Sequence[int], loads: Mapping[int, int], salt: int = 0) -> int:
        _require(loads)
        config = self.config
        hashes = prefix_block_hashes(token_ids, config.block_size, config.max_prefix_blocks, salt)
        least = min(loads, key=lambda r: (loads[r], len(self.tables.get(r, ())), r))
        target = least
        if hashes:
            best = max(loads, key=lambda r: (self.matched(r, hashes), -loads[r], -r))
            enough = self.matched(best, hashes) >= config.min_match_ratio * len(hashes)
            if enough and loads[best] <= loads[least] + config.max_load_imbalance:
                target = best
            self._remember(target, hashes)
        return target

    def matched(self, replica: int, hashes: Sequence[int]) -> int:
        """How many of the first blocks ``replica`` is believed to hold."""
        table = self.tables.get(replica)
        if not table:
            return 0
        count = 0
        for h in hashes:
            if h not in table:
                break
            count += 1
        return count

    def forget(self, replica: int) -> None:
        self.tables.pop(replica, None)

    def _remember(self, replica: int, hashes: Sequence[int]) -> None:
        table = self.tables.setdefault(replica, OrderedDict())
        for h in hashes:
            table[h] = None
            table.move_to_end(h)
        while len(table) > self.capacity_blocks:
            table.popitem(last=False)


def make_router(config: RouterConfig, capacity_blocks: int) -> Router:
    """The router ``config.policy`` names; ``capacity_blocks``: one replica's KV cache, in blocks."""
    if config.policy == "round_robin":
        return RoundRobinRouter()
    return PrefixAffinityRouter(config, capacity_blocks)


def _require(loads: Mapping[int, int]) -> None:
    if not loads:
        raise RuntimeError("no replica can take requests")
