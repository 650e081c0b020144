"""The front end's view of its replicas: each one's state, kept true by a thread that pings them, and their
``stats()`` summed into one engine's.

A replica is ``running`` while it answers; ``restarting`` from the moment a call to it fails because its process
died (or a ping goes unanswered) until it answers again — Ray restarts it, and the router starts it with an empty
table, since its cache died with it; ``dead`` once Ray gave up on it (``max_restarts`` spent). A replica whose
process lives but whose engine loop stopped is killed, so that Ray restarts it.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from paged_backend.entrypoints.data_parallel.replica import EngineReplica

logger = logging.getLogger(__name__)

ReplicaState = Literal["running", "restarting", "dead"]

# Counters that add up over replicas; the rest of a replica's stats are per replica (listed under "replicas").
_SUMMED = (
    "num_kv_blocks",
    "num_free_blocks",
    "num_running",
    "num_waiting",
    "num_preemptions",
    "num_swapped_out",
    "num_swapped",
    "num_free_cpu_blocks",
    "num_cpu_blocks",
    "num_chunked_prefill_steps",
    "num_cached_blocks",
    "num_prompt_tokens_cached",
    "num_prompt_tokens_admitted",
    "num_prompt_tokens",
    "num_generated_tokens",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)


@dataclass
class Replica:
    """One replica as the front end sees it (changed under ``Replicas.lock``)."""

    index: int
    actor: ActorHandle[EngineReplica]
    pid: int
    node_id: str
    state: ReplicaState = "running"
    restarts: int = 0  # times it came back after its process died
    died_answers: int = 0  # pings in a row answered "the actor died" (the watcher's own count)

    def describe(self) -> dict[str, Any]:
        return {"replica": self.index, "state": self.state, "restarts": self.restarts, "node_id": self.node_id}


class Replicas:
    """The replicas, their states and the thread that watches them. ``on_lost(i)``: replica i's cache is gone."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        on_lost: Callable[[int], None],
        probe_interval_s: float,
        probe_timeout_s: float,
    ) -> None:
        self.items = list(replicas)
        self.on_lost = on_lost
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.probe_interval_s, self.probe_timeout_s = probe_interval_s, probe_timeout_s
        self.thread = threading.Thread(target=self._watch, name="paged-backend-replicas", daemon=True)
        self.thread.start()

    def running(self) -> list[int]:
        with self.lock:
            return [r.index for r in self.items if r.state == "running"]

    def describe(self) -> list[dict[str, Any]]:
        with self.lock:
            return [r.describe() for r in self.items]

    def lost(self, index: int, reason: BaseException) -> None:
        """A call to replica ``index`` failed because its process died: stop routing to it until it answers."""
        with self.lock:
            replica = self.items[index]
            if replica.state != "running":
                return
            replica.state = "restarting"
        logger.warning("data-parallel replica %d is down (%s); requests go to the others", index, reason)
        self.on_lost(index)

    def close(self, wait: bool = True) -> None:
        """Stop the watcher; ``wait``: until its probe in flight (if any) ends."""
        self.stop.set()
        if wait:
            self.thread.join(timeout=self.probe_timeout_s + 1)

    def _watch(self) -> None:
        while not self.stop.wait(self.probe_interval_s):
            for replica in list(self.items):
                if replica.state != "dead" and not self.stop.is_set():
                    self._probe(replica)

    def _probe(self, replica: Replica) -> None:
        import ray
        from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError, RayTaskError

        state: ReplicaState = "running"
        pid = replica.pid
        try:
            pid = cast(int, ray.get(replica.actor.ping.remote(), timeout=self.probe_timeout_s))
            replica.died_answers = 0
        except GetTimeoutError:
            state = "restarting"
        except ActorDiedError:
            # A call in flight when the process died fails so too; a fresh one fails so only once Ray gave up
            # (calls to an actor being restarted wait for it): twice in a row, it is dead.
            replica.died_answers += 1
            state = "dead" if replica.died_answers >= 2 else "restarting"
        except RayActorError:
            state = "restarting"
        except RayTaskError as exc:  # the process lives but its engine loop stopped: Ray restarts a killed actor
            logger.error("data-parallel replica %d failed (%s): restarting it", replica.index, exc.cause)
            ray.kill(replica.actor, no_restart=False)
            state = "restarting"
        self._set(replica, state, pid)

    def _set(self, replica: Replica, state: ReplicaState, pid: int) -> None:
        with self.lock:
            before, replica.state = replica.state, state
            came_back = state == "running" and pid != replica.pid
            if came_back:
                replica.pid = pid
                replica.restarts += 1
        if came_back or (state != "running" and before == "running"):
            self.on_lost(replica.index)  # a new process (or one going away): nothing it cached survives
        if state != before:
            log = logger.warning if state != "running" else logger.info
            log("data-parallel replica %d: %s -> %s", replica.index, before, state)


def summed_stats(per_replica: Sequence[dict[str, Any]], replicas: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's ``stats()`` keys over the replicas that answered (counters summed, the hit rate over the
    summed tokens), plus ``replicas``: each replica's state and, when it answered, its own stats."""
    total: dict[str, Any] = {key: sum(s.get(key, 0) for s in per_replica) for key in _SUMMED}
    per_pos = [s.get("spec_decode_num_accepted_tokens_per_pos", []) for s in per_replica]
    total["spec_decode_num_accepted_tokens_per_pos"] = [sum(c) for c in itertools.zip_longest(*per_pos, fillvalue=0)]
    if per_replica:
        total["block_size"] = per_replica[0]["block_size"]
        waste = [s["kv_waste_fraction"] for s in per_replica]
        total["kv_waste_fraction"] = sum(waste) / len(waste)
    total["prefix_cache_hit_rate"] = total["num_prompt_tokens_cached"] / max(1, total["num_prompt_tokens_admitted"])
    total["replicas"] = replicas
    return total
