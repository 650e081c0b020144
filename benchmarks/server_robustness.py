"""Two behaviours of ``paged-backend serve`` under a hostile or departing client, measured on a real server
process over the demo checkpoint (CPU is enough):

- a 10 MB prompt posted while another client streams: how long the big request takes to be refused, and the
  largest gap between the stream's events while it is handled, against the same stream's largest gap alone;
- SIGTERM under 32 long streams with ``--shutdown-timeout``: when the streams end, when the server has finished
  (its "Finished server process" line, after the engine thread is joined), when the process exits, its status,
  and whether anything printed a traceback.

    python benchmarks/server_robustness.py --repeats 3 --json benchmarks/results/server_robustness.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
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


def stream_event_times(base: str) -> list[float]:
    body = {"model": "m", "prompt": "a b c", "max_tokens": 400, "stream": True, "ignore_eos": True}
    times = []
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                times.append(time.monotonic())
    return times


def largest_gap(times: list[float], start: float = float("-inf"), end: float = float("inf")) -> float:
    return max((b - a for a, b in zip(times, times[1:]) if b >= start and a <= end), default=0.0)


def big_prompt(model: str, repeats: int) -> list[dict[str, Any]]:
    server = Server(model)
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
        server.proc.terminate()
        server.proc.wait(60)
    return runs


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--grace", type=float, default=1.0, help="--shutdown-timeout of the SIGTERM runs")
    parser.add_argument("--json", required=True)
    parser.add_argument("--commit", default=None, help="the commit measured (recorded in the JSON)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from paged_backend.demo_checkpoint import default_cache_dir, demo_checkpoint

    model = str(demo_checkpoint(default_cache_dir()))
    result = {
        "command": " ".join(sys.argv),
        "commit": args.commit,
        "cpus": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "big_prompt": big_prompt(model, args.repeats),
        "sigterm_32_streams": [sigterm(model, args.grace, 32) for _ in range(args.repeats)],
    }
    Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
