"""``GET /metrics`` in Prometheus' text format, from the engine's ``stats()`` and the outputs the loop delivers.

Each server has its own registry (no process-global state), so several servers or tests can run in one process.
Names follow vLLM's ``vllm:`` metrics with a ``paged_backend:`` prefix.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from paged_backend.outputs import RequestOutput

PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, text: str) -> Gauge:
            return Gauge(f"paged_backend:{name}", text, labels, registry=self.registry)

        self.running = gauge("num_requests_running", "sequences in the running batch")
        self.waiting = gauge("num_requests_waiting", "sequences waiting to be admitted")
        self.swapped = gauge("num_requests_swapped", "sequences swapped out to CPU memory")
        self.kv_usage = gauge("kv_cache_usage_perc", "share of KV blocks in use")
        self.hit_rate = gauge("prefix_cache_hit_rate", "prompt tokens served from the prefix cache / prompt tokens")
        self.prompt_tokens = Counter(
            "paged_backend:prompt_tokens", "prompt tokens of finished requests", labels, registry=self.registry
        )
        self.generation_tokens = Counter(
            "paged_backend:generation_tokens", "tokens generated", labels, registry=self.registry
        )
        self.ttft = Histogram(
            "paged_backend:time_to_first_token_seconds",
            "arrival to first token",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "paged_backend:inter_token_latency_seconds",
            "time between a request's successive tokens",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.spec = {  # vLLM's spec_decode counters, from the engine's running totals
            name: Counter(f"paged_backend:{name}", text, labels, registry=self.registry)
            for name, text in (
                ("spec_decode_num_drafts", "decoding rows that had proposed tokens"),
                ("spec_decode_num_draft_tokens", "proposed tokens"),
                ("spec_decode_num_accepted_tokens", "proposed tokens taken"),
            )
        }
        # each source's last totals: the engine, or each data-parallel replica by (index, restarts)
        self.spec_seen: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.spec_per_pos = Counter(
            "paged_backend:spec_decode_num_accepted_tokens_per_pos",
            "proposed tokens taken, by their position in the row",
            [*labels, "position"],
            registry=self.registry,
        )
        # data-parallel replicas (--data-parallel-size): each one's state, and requests run again after one died
        self.replica_up = Gauge(
            "paged_backend:replica_up",
            "1 while a data-parallel replica serves, 0 while it restarts or once it is dead",
            [*labels, "replica", "state"],
            registry=self.registry,
        )
        self.retries = Counter(
            "paged_backend:request_retries", "requests queued again after their replica died", labels,
            registry=self.registry,
        )  # fmt: skip
        self.retries_seen = 0
        self.labels = {"model_name": model_name}
        self.progress: dict[str, tuple[int, float]] = {}  # request id -> (tokens seen, time of the last)

    def observe(self, out: RequestOutput) -> None:
        """One delivered output: count its new tokens and their timing (called by the engine loop)."""
        now = time.monotonic()
        tokens = sum(len(c.token_ids) for c in out.outputs)
        seen, last = self.progress.get(out.request_id, (0, out.metrics.get("arrival_time", now)))
        new = tokens - seen
        if new > 0:
            if seen == 0:
                self.ttft.labels(**self.labels).observe(now - last)
            else:
                for _ in range(new):  # a multi-step round delivers several tokens at once
                    self.itl.labels(**self.labels).observe((now - last) / new)
            self.generation_tokens.labels(**self.labels).inc(new)
        if out.finished:
            self.progress.pop(out.request_id, None)
            self.prompt_tokens.labels(**self.labels).inc(len(out.prompt_token_ids))
        else:
            self.progress[out.request_id] = (tokens, now if new > 0 else last)

    def forget(self, request_id: str) -> None:
        self.progress.pop(request_id, None)

    def render(self, stats: dict[str, Any]) -> bytes:
        self.running.labels(**self.labels).set(stats["num_running"])
        self.waiting.labels(**self.labels).set(stats["num_waiting"])
        self.swapped.labels(**self.labels).set(stats["num_swapped"])
        self.kv_usage.labels(**self.labels).set(1 - stats["num_free_blocks"] / max(1, stats["num_kv_blocks"]))
        self.hit_rate.labels(**self.labels).set(stats["prefix_cache_hit_rate"])
        self._count_speculation(stats)
        if "replicas" in stats:
            self.replica_up.clear()  # a replica's state changes: only its current one is shown
            for replica in stats["replicas"]:
                up = 1 if replica["state"] == "running" else 0
                self.replica_up.labels(**self.labels, replica=str(replica["replica"]), state=replica["state"]).set(up)
            self.retries.labels(**self.labels).inc(stats["num_request_retries"] - self.retries_seen)
            self.retries_seen = stats["num_request_retries"]
        return generate_latest(self.registry)

    def _count_speculation(self, stats: dict[str, Any]) -> None:
        """The spec-decode counters grown by what each source's totals grew since it was last seen. A sum over
        data-parallel replicas would drop when one misses a scrape and count its history again when it answers:
        each replica is followed on its own, a restarted one (its ``restarts`` changed) from zero."""
        sources: dict[tuple[Any, ...], dict[str, Any]] = {("engine",): stats}
        if "replicas" in stats:
            sources = {(r["replica"], r["restarts"]): r["stats"] for r in stats["replicas"] if "stats" in r}
        grown = dict.fromkeys(self.spec, 0)
        grown_at: list[int] = []
        for key, totals in sources.items():
            last = self.spec_seen.get(key, {})
            for name in self.spec:
                grown[name] += max(0, totals.get(name, 0) - last.get(name, 0))
            seen = last.get(PER_POSITION, [])
            for position, count in enumerate(totals.get(PER_POSITION, [])):
                grown_at += [0] * (position + 1 - len(grown_at))
                grown_at[position] += max(0, count - (seen[position] if position < len(seen) else 0))
            self.spec_seen[key] = {name: totals.get(name, 0) for name in self.spec}
            self.spec_seen[key][PER_POSITION] = list(totals.get(PER_POSITION, []))
        newest = {key[0]: key[1] for key in sources if len(key) == 2}  # replica index -> its restarts now
        for key in [key for key in self.spec_seen if len(key) == 2 and key[1] < newest.get(key[0], key[1])]:
            del self.spec_seen[key]  # a replica's run before a restart: its totals never come back
        for name, counter in self.spec.items():
            counter.labels(**self.labels).inc(grown[name])
        for position, count in enumerate(grown_at):
            self.spec_per_pos.labels(**self.labels, position=str(position)).inc(count)
