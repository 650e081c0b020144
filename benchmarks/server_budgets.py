"""What one request can cost everyone else on ``paged-backend serve`` (a real server process over the demo
checkpoint, CPU is enough), against the budgets that bound it:

- memory: the server's peak RSS (``VmHWM``) under a logprob flood (64 prompts of 500 ids with
  ``prompt_logprobs: 20``, each request 672,000 entries) and a schema flood (distinct 2,000-property
  ``response_format`` schemas), against its RSS before;
- step time: another client's stream beside a request with four stop strings of ``MAX_STOP_CHARS / 4``
  characters and ``n: 64``, against the same stream alone;
- shutdown: SIGTERM while a 200,000-value enum schema compiles (caps raised so that it does): when the server
  process has finished and its exit status.

    python benchmarks/server_budgets.py --repeats 3 --json benchmarks/results/server_budgets.json
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.server_robustness import (  # noqa: E402
    Server,
    common_args,
    largest_gap,
    setup,
    stream_event_times,
)
from paged_backend.sampling_params import MAX_STOP_CHARS  # noqa: E402

logger = logging.getLogger("benchmarks.server_budgets")


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """A process's resident memory (``VmHWM``: its peak so far), from /proc, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for process {pid}")


def floods(model: str, rounds: int) -> dict[str, Any]:
    server = Server(model)
    pid = server.proc.pid
    try:
        before = rss_mib(pid)
        prompts = [[5 + (i + j) % 50 for j in range(500)] for i in range(64)]
        body = {"model": "m", "prompt": prompts, "max_tokens": 1, "prompt_logprobs": 20}
        statuses = [
            httpx.post(server.base + "/v1/completions", json=body, timeout=300).status_code for _ in range(rounds)
        ]
        after_logprobs = rss_mib(pid, "VmHWM")
        schema_statuses = []
        for r in range(18):
            properties = {f"p{r}_{i}": {"type": "integer"} for i in range(2000)}
            schema = {"type": "object", "properties": properties}
            fmt = {"type": "json_schema", "json_schema": {"name": f"s{r}", "schema": schema}}
            chat = {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 2,
                "response_format": fmt,
            }
            schema_statuses.append(httpx.post(server.base + "/v1/chat/completions", json=chat, timeout=300).status_code)
        result = {
            "rss_before_mib": before,
            "logprob_flood": {"statuses": statuses, "peak_rss_mib": after_logprobs},
            "schema_flood": {
                "statuses": schema_statuses,
                "peak_rss_mib": rss_mib(pid, "VmHWM"),
                "rss_mib": rss_mib(pid),
            },
        }
    finally:
        server.proc.terminate()
        server.proc.wait(60)
    logger.info("floods: %s", result)
    return result


def stream_beside(base: str, heavy: dict[str, Any] | None) -> tuple[float, float, int | None]:
    """(seconds, largest gap) of a 400-token stream, beside ``heavy`` (a request running meanwhile), and the heavy
    request's status."""
    answer: dict[str, Any] = {}
    thread = None
    if heavy is not None:
        thread = threading.Thread(target=_post_status, args=(base, heavy, answer))
        thread.start()
        time.sleep(0.3)
    start = time.monotonic()
    times = stream_event_times(base)
    seconds = time.monotonic() - start
    if thread is not None:
        thread.join()
    return seconds, largest_gap(times), answer.get("status")


def stop_strings(model: str, repeats: int) -> list[dict[str, Any]]:
    """A stream alone, beside 64 samples without stop strings, and beside the same with four of the longest."""
    server = Server(model)
    heavy = {"model": "m", "prompt": "x", "max_tokens": 200, "n": 64, "ignore_eos": True}
    stops = [c * (MAX_STOP_CHARS // 4) for c in "abcd"]
    runs = []
    try:
        for _ in range(repeats):
            alone = stream_beside(server.base, None)
            plain = stream_beside(server.base, heavy)
            stopped = stream_beside(server.base, {**heavy, "stop": stops})
            runs.append(
                {
                    "stream_s": {"alone": alone[0], "beside_n64": plain[0], "beside_n64_stops": stopped[0]},
                    "largest_gap_s": {"alone": alone[1], "beside_n64": plain[1], "beside_n64_stops": stopped[1]},
                    "stops_slowdown": stopped[0] / plain[0],
                    "heavy_statuses": [plain[2], stopped[2]],
                }
            )
            logger.info("stop strings: %s", runs[-1])
    finally:
        server.proc.terminate()
        server.proc.wait(60)
    return runs


def sigterm_during_compile(model: str) -> dict[str, Any]:
    flags = ("--max-grammar-choices", "1000000", "--max-grammar-bytes", "100000000", "--grammar-compile-timeout", "600")
    server = Server(model, *flags)
    schema = {"type": "object", "properties": {"x": {"enum": [f"value{i}" for i in range(200_000)]}}}
    body = {"model": "m", "prompt": "x", "max_tokens": 4, "structured_outputs": {"json": schema}}
    poster = threading.Thread(target=lambda: _post_quietly(server.base, body), daemon=True)
    poster.start()
    time.sleep(2.0)
    sent = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    rc = server.proc.wait(120)
    finished = server.logged_at("Finished server process")
    result = {
        "returncode": rc,
        "server_finished_s": None if finished is None else finished - sent,
        "process_exit_s": time.monotonic() - sent,
        "traceback": any("Traceback" in line for _, line in server.lines),
    }
    logger.info("SIGTERM during a compile: %s", result)
    return result


def _post_status(base: str, body: dict[str, Any], answer: dict[str, Any]) -> None:
    answer["status"] = httpx.post(base + "/v1/completions", json=body, timeout=600).status_code


def _post_quietly(base: str, body: dict[str, Any]) -> None:
    try:
        httpx.post(base + "/v1/completions", json=body, timeout=600)
    except httpx.HTTPError:
        pass  # the server went away under it: what is measured


def main() -> None:
    args = common_args(__doc__).parse_args()
    model, header = setup(args)
    result = {
        **header,
        "floods": floods(model, args.repeats),
        "stop_strings_n64": stop_strings(model, args.repeats),
        "sigterm_during_compile": [sigterm_during_compile(model) for _ in range(args.repeats)],
    }
    Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
