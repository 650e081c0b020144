"""The server process: bind the port, load the model, serve until a signal, shut down (``run``). The port is
bound before the model loads (minutes for a large one), so a port in use is said at once."""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from paged_backend.config import SchedulerConfig
from paged_backend.entrypoints.openai.cli_args import ServerArgs

if TYPE_CHECKING:
    from paged_backend.entrypoints.data_parallel.llm import DataParallelLLM
    from paged_backend.entrypoints.llm import LLM

logger = logging.getLogger(__name__)

# A served step's length is a gap in every running stream: prompts go in chunks that keep a step of the 8B shape
# under 15 ms at p99 on an H100 at 4 req/s, and inside the graphs of steps with prompt tokens
# (worker/mixed_graphs.py). 512 kept p99 near 16 ms, 256 lengthened the wait for a first token at 16 req/s.
# LLM's own default, 8192, serves a batch's throughput. Measured in docs/benchmarks.md, section
# "NVIDIA H100, 2026-12-06, 16:30 UTC".
SERVER_MAX_NUM_BATCHED_TOKENS = 384
# A request that arrives during a multi-step round waits for its end: rounds of 2 decode steps instead of LLM's 8
# gave a lower TTFT p50 at 4 and at 16 req/s and a p99 lower or equal, with the same ITL and throughput (rounds of 4
# against 8, then 2 against 4: docs/benchmarks.md, "NVIDIA H100, 2026-12-06, 23:10 UTC" and "..., 2026-12-07, 04:00
# UTC").
SERVER_NUM_SCHEDULER_STEPS = 2


def run(args: ServerArgs, engine_kwargs: dict[str, Any], prog: str = "paged-backend serve") -> int:
    """Load the model and serve until SIGTERM or Ctrl-C (``GracefulServer``: requests in flight get
    ``--shutdown-timeout`` seconds), then join the engine's thread and return 0. A model that cannot be loaded (a
    mistyped path, a folder without a checkpoint, a bad engine argument) ends the process with one line naming it
    and the reason, exit status 1: its traceback says nothing more to someone typing a command (it is logged at
    DEBUG)."""
    import uvicorn

    from paged_backend.entrypoints.llm import LLM
    from paged_backend.entrypoints.openai.api_server import build_app
    from paged_backend.entrypoints.openai.header_timeout import http_protocol
    from paged_backend.entrypoints.openai.shutdown import GracefulServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    listener = bind(args.host, args.port, prog)  # a busy port is said now, not once the model has loaded
    try:
        llm = load(args, engine_kwargs)
    except (OSError, ValueError) as exc:
        listener.close()
        logger.debug("loading %s failed", args.model, exc_info=True)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(exc, FileNotFoundError) and exc.filename == args.model:
            reason = str(exc.strerror)  # the path itself is in the line already
        raise SystemExit(f"{prog}: cannot load the model {args.model!r}: {reason}") from None
    except KeyboardInterrupt:
        listener.close()
        raise SystemExit(f"{prog}: interrupted while loading the model") from None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    device = llm.llm_engine.device.type if isinstance(llm, LLM) else "replicas"  # replicas compute elsewhere
    threads = engine_cpu_threads(device, os.environ, cores)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)  # the engine's thread, started next, makes its team of this many
        logger.info("CPU: the engine computes on %d threads, one core is left to the HTTP server", threads)
    app = build_app(llm, args)
    server = app.state.server
    # What exists now (the model, torch, transformers: millions of objects) lives as long as the process: frozen
    # out of the collector's reach, a full collection walks only what requests made, not the whole heap, whose
    # walk would stall every stream while it runs.
    gc.collect()
    gc.freeze()
    http = GracefulServer(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            http=http_protocol(args.header_read_timeout),
            timeout_keep_alive=args.timeout_keep_alive,
        ),
        drain=server.drain,
        abort=server.abort_all,
        timeout_s=args.shutdown_timeout,
    )
    try:
        http.run(sockets=[listener])
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # one more Ctrl-C while winding down: gone, no traceback
        server.close()  # a forced exit skips the app's own shutdown
    return 0


def load(args: ServerArgs, engine_kwargs: dict[str, Any]) -> LLM | DataParallelLLM:
    """The engine this server runs: one ``LLM`` here, or ``--data-parallel-size`` replicas on Ray (each loads
    the model itself; this process only routes)."""
    # a budget below max_num_seqs would leave running decodes without a token in a full batch
    budget = max(SERVER_MAX_NUM_BATCHED_TOKENS, engine_kwargs.get("max_num_seqs", SchedulerConfig.max_num_seqs))
    server_defaults = {"max_num_batched_tokens": budget, "num_scheduler_steps": SERVER_NUM_SCHEDULER_STEPS}
    engine_kwargs = {**server_defaults, **engine_kwargs}
    if args.data_parallel is not None:
        from paged_backend.entrypoints.data_parallel.llm import DataParallelLLM

        return DataParallelLLM(
            args.model,
            config=args.data_parallel,
            max_waiting_requests=args.max_waiting_requests,
            grammar_budget=args.grammar_budget,
            **engine_kwargs,
        )
    from paged_backend.engine.fresh_thread import call_in_fresh_thread
    from paged_backend.entrypoints.llm import LLM

    # Built on a thread that then ends, so the engine loop's thread holds the process's only OpenMP team.
    return call_in_fresh_thread(lambda: LLM(args.model, **engine_kwargs))


def bind(host: str, port: int, prog: str) -> socket.socket:
    """The server's listening socket, bound before the model loads (which takes minutes for a large one): a port
    in use ends the command at once with one line saying so."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        raise SystemExit(
            f"{prog}: cannot listen on {host}:{port}: {exc.strerror or exc} (another server on that port? --port "
            "picks another)"
        ) from None
    listener.set_inheritable(True)
    return listener


def engine_cpu_threads(device_type: str, environ: Mapping[str, str], cores: int) -> int | None:
    """The intra-op threads of an engine serving on CPU: one core fewer than this process may use, unless
    ``OMP_NUM_THREADS`` says otherwise (None: leave torch's choice). The event loop, the tokenizer's thread and
    the grammar workers need a core now and then; a matrix product whose threads fill every core waits at its
    barrier for the one that lost its core, so each such moment would stall every stream for a whole time slice."""
    if device_type != "cpu" or "OMP_NUM_THREADS" in environ:
        return None
    return max(1, cores - 1)
