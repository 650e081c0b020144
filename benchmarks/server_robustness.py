"""Behaviours of ``paged-backend serve`` under a hostile or departing client, measured on a real server process
over the demo checkpoint (CPU is enough):

- a 10 MB prompt posted while another client streams: how long the big request takes to be refused, and the
  largest gap between the stream's events while it is handled, against the same stream's largest gap alone
  (``--busy N``: with N CPU-bound processes beside the server);
- adversarial grammar compiles (with caps raised so that they compile): a 20,000-value enum schema and six
  15,000-value ones whose clients leave after half a second, sent while four clients stream: each stream's
  largest gap against its gap alone, and a fresh small schema's answer time against its time alone; and the
  same 20,000-value schema against a server with the default caps (refused before any compile);
- SIGTERM under 32 long streams with ``--shutdown-timeout``: when the streams end, when the server has finished
  (its "Finished server process" line, after the engine thread is joined), when the process exits, its status,
  and whether anything printed a traceback.

    python benchmarks/server_robustness.py --repeats 3 --busy 2 --json benchmarks/results/server_robustness.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx

logger = logging.getLogger("benchmarks.server_robustness")
ROOT = Path(__file__).resolve().parent.parent
MAX_LEN = 512


class Server:
    """``python -m paged_backend.entrypoints.openai.api_server`` on a free port, its stderr lines timed."""

    def __init__(self, model: str, *flags: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        command = [sys.executable, "-m", "paged_backend.entrypoints.openai.api_server", "--model", model]
        command += ["--port", str(port), "--max-model-len", str(MAX_LEN), "--served-model-name", "m", *flags]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.base = f"http://127.0.0.1:{port}"
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {''.join(line for _, line in self.lines)[-2000:]}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line))

    def logged_at(self, text: str) -> float | None:
        return next((t for t, line in self.lines if text in line), None)


def stream_event_times(base: str, times: list[float] | None = None) -> list[float]:
    """The arrival time of each event of a 400-token stream, appended to ``times`` as they come."""
    body = {"model": "m", "prompt": "a b c", "max_tokens": 400, "stream": True, "ignore_eos": True}
    times = [] if times is None else times
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                times.append(time.monotonic())
    return times


def largest_gap(times: list[float], start: float = float("-inf"), end: float = float("inf")) -> float:
    return max((b - a for a, b in zip(times, times[1:]) if b >= start and a <= end), default=0.0)


def burners(count: int) -> list[subprocess.Popen[bytes]]:
    """``count`` CPU-bound processes (the machine otherwise busy)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def big_prompt(model: str, repeats: int, busy: int) -> list[dict[str, Any]]:
    server = Server(model)
    burning = burners(busy)
    big = json.dumps({"model": "m", "prompt": "x" * 10_000_000, "max_tokens": 5}).encode()
    runs = []
    try:
        for _ in range(repeats):
            alone = largest_gap(stream_event_times(server.base))
            answer: dict[str, Any] = {}

            def post(answer: dict[str, Any] = answer) -> None:
                time.sleep(0.3)  # into the stream
                answer["start"] = time.monotonic()
                headers = {"content-type": "application/json"}
                response = httpx.post(server.base + "/v1/completions", content=big, headers=headers, timeout=120)
                answer.update(end=time.monotonic(), status=response.status_code)

            poster = threading.Thread(target=post)
            poster.start()
            times = stream_event_times(server.base)
            poster.join()
            during = largest_gap(times, answer["start"], answer["end"])
            runs.append(
                {
                    "status": answer["status"],
                    "answered_s": answer["end"] - answer["start"],
                    "largest_gap_alone_s": alone,
                    "largest_gap_during_s": during,
                }
            )
            logger.info("10 MB prompt: %s", runs[-1])
    finally:
        for proc in burning:
            proc.kill()
        server.proc.terminate()
        server.proc.wait(60)
    return runs


def enum_schema(values: int, tag: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"x": {"enum": [f"{tag} value {i}" for i in range(values)]}}}


def structured_body(schema: dict[str, Any]) -> bytes:
    """A short completion held to ``schema``, encoded ahead: this process's own JSON work must not land inside the
    streams it times (their reader threads share its GIL)."""
    return json.dumps({"model": "m", "prompt": "x", "max_tokens": 8, "structured_outputs": {"json": schema}}).encode()


def structured(
    base: str, body: bytes | dict[str, Any], timeout: float = 120, client: httpx.Client | None = None
) -> tuple[int, float]:
    """(status, seconds) of a completion with ``body`` (encoded by ``structured_body``, or a schema encoded now);
    status 0 when the client gave up first. ``client``: one made ahead, as a timed attack needs (making one is
    ~20 ms of this process's CPU, on the cores the server shares)."""
    content = body if isinstance(body, bytes) else structured_body(body)
    client = client or httpx.Client()
    start = time.monotonic()
    try:
        status = client.post(
            base + "/v1/completions", content=content, headers={"content-type": "application/json"}, timeout=timeout
        ).status_code
    except httpx.TimeoutException:
        status = 0
    return status, time.monotonic() - start


def _streams(base: str, count: int, conn: Connection) -> None:
    """In a process of its own: ``count`` streams; "started" once each has an event, then their event times."""
    times: list[list[float]] = [[] for _ in range(count)]
    threads = [threading.Thread(target=stream_event_times, args=(base, times[i])) for i in range(count)]
    for thread in threads:
        thread.start()
    while not all(times):
        time.sleep(0.01)
    conn.send("started")
    for thread in threads:
        thread.join()
    conn.send(times)


def four_streams(base: str, during: Callable[[], Any] | None = None) -> tuple[list[list[float]], Any]:
    """Four streams' event times, and what ``during`` returned (run here once they have started). The streams
    are read in another process: this one's threads posting large bodies would otherwise hold the GIL that
    their reader threads need, and the gaps measured would be the client's (``time.monotonic`` is the system's
    clock, the same in both)."""
    parent, child = multiprocessing.get_context("spawn").Pipe()
    reader = multiprocessing.get_context("spawn").Process(target=_streams, args=(base, 4, child))
    reader.start()
    child.close()
    parent.recv()
    result = during() if during is not None else None
    times: list[list[float]] = parent.recv()
    reader.join()
    return times, result


def adversarial_compiles(model: str, repeats: int) -> dict[str, Any]:
    refused = Server(model)
    try:
        status, seconds = structured(refused.base, enum_schema(20_000, "default"))
        default_caps = {"status": status, "answered_s": seconds}
    finally:
        refused.proc.terminate()
        refused.proc.wait(60)
    server = Server(model, "--max-grammar-choices", "100000", "--max-grammar-bytes", "4000000")
    runs = []
    try:
        structured(server.base, enum_schema(2, "warm-up"))
        for r in range(repeats):
            alone_small = structured(server.base, enum_schema(3, f"small alone {r}"))[1]
            alone, _ = four_streams(server.base)

            big_body = structured_body(enum_schema(20_000, f"big {r}"))
            left_bodies = [structured_body(enum_schema(15_000, f"left {r} {i}")) for i in range(6)]
            small_body = structured_body(enum_schema(3, f"small during {r}"))

            clients = [httpx.Client() for _ in range(8)]

            def attack(
                big_body: bytes = big_body,
                left_bodies: list[bytes] = left_bodies,
                small_body: bytes = small_body,
                clients: list[httpx.Client] = clients,
            ) -> dict[str, Any]:
                start = time.monotonic()
                big: list[tuple[int, float]] = []
                threads = [
                    threading.Thread(target=lambda: big.append(structured(server.base, big_body, client=clients[0])))
                ]
                threads += [
                    threading.Thread(target=structured, args=(server.base, b, 0.5, clients[i + 1]))
                    for i, b in enumerate(left_bodies)
                ]
                for thread in threads:
                    thread.start()
                time.sleep(1.0)
                small = structured(server.base, small_body, client=clients[7])
                for thread in threads:
                    thread.join()
                return {"start": start, "end": time.monotonic(), "small": small, "big": big[0]}

            during, attacked = four_streams(server.base, attack)
            gaps_alone = [largest_gap(t) for t in alone]
            gaps_during = [largest_gap(t, attacked["start"], attacked["end"]) for t in during]
            runs.append(
                {
                    "largest_gap_alone_s": gaps_alone,
                    "largest_gap_during_s": gaps_during,
                    "gap_growth_s": max(gaps_during) - max(gaps_alone),
                    "small_schema_alone_s": alone_small,
                    "small_schema_during_s": attacked["small"][1],
                    "small_schema_status": attacked["small"][0],
                    "big_schema": {"status": attacked["big"][0], "answered_s": attacked["big"][1]},
                }
            )
            logger.info("adversarial compiles: %s", runs[-1])
    finally:
        server.proc.terminate()
        server.proc.wait(60)
    return {"default_caps_20000_values": default_caps, "raised_caps": runs}


def sigterm(model: str, grace: float, streams: int) -> dict[str, Any]:
    server = Server(model, "--shutdown-timeout", str(grace))

    async def main() -> tuple[float, float, list[str]]:
        started: set[int] = set()
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=streams + 8)) as client:

            async def one(i: int) -> str:
                body = {"model": "m", "prompt": f"s {i}", "max_tokens": MAX_LEN - 16, "stream": True}
                body["ignore_eos"] = True
                last = ""
                async with client.stream("POST", server.base + "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            started.add(i)
                            last = line[6:]
                return last

            tasks = [asyncio.create_task(one(i)) for i in range(streams)]
            while len(started) < streams:
                await asyncio.sleep(0.02)
            sent = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            lasts = await asyncio.gather(*tasks)
            return sent, time.monotonic(), lasts

    sent, ended, lasts = asyncio.run(main())
    rc = server.proc.wait(120)
    exited = time.monotonic()
    finished = server.logged_at("Finished server process")
    endings = [json.loads(last)["error"]["code"] if "error" in last else "finished" for last in lasts]
    result = {
        "grace_s": grace,
        "streams_ended_s": ended - sent,
        "server_finished_s": None if finished is None else finished - sent,
        "process_exit_s": exited - sent,
        "returncode": rc,
        "traceback": any("Traceback" in line for _, line in server.lines),
        "stream_endings": {str(k): endings.count(k) for k in set(endings)},
    }
    logger.info("SIGTERM: %s", result)
    return result


def common_args(description: str | None) -> argparse.ArgumentParser:
    """The flags every server benchmark takes (``--repeats``, ``--json``, ``--commit``)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", required=True)
    parser.add_argument("--commit", default=None, help="the commit measured (recorded in the JSON)")
    return parser


def setup(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """Logging on, and (the demo checkpoint's path, the JSON's header: command, commit, CPUs, Python)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from paged_backend.demo_checkpoint import default_cache_dir, demo_checkpoint

    header = {
        "command": " ".join(sys.argv),
        "commit": args.commit,
        "cpus": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
    }
    return str(demo_checkpoint(default_cache_dir())), header


def main() -> None:
    parser = common_args(__doc__)
    parser.add_argument("--grace", type=float, default=1.0, help="--shutdown-timeout of the SIGTERM runs")
    parser.add_argument("--busy", type=int, default=0, help="CPU-bound processes beside the 10 MB prompt runs")
    args = parser.parse_args()
    model, header = setup(args)
    result = {
        **header,
        "busy_processes": args.busy,
        "big_prompt": big_prompt(model, args.repeats, args.busy),
        "adversarial_compiles": adversarial_compiles(model, args.repeats),
        "sigterm_32_streams": [sigterm(model, args.grace, 32) for _ in range(args.repeats)],
    }
    Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
