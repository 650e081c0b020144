"""``paged-backend`` command line: ``demo`` compares HF ``generate`` with the engine on one batch (an embedded
model by default: no download, no GPU); ``serve MODEL``
starts the OpenAI-compatible server with vLLM's flags."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paged-backend", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="one batch through HF generate and through the engine, side by side")
    demo.add_argument("--model", default=None, help="checkpoint path or hub id (default: the embedded demo Llama)")
    demo.add_argument("--num-prompts", type=int, default=32)
    demo.add_argument("--max-tokens", type=int, default=64, help="new tokens a prompt (greedy, EOS ignored)")
    demo.add_argument("--batch-size", type=int, default=None, help="HF generate's batch (default: all prompts)")
    demo.add_argument("--cache-dir", type=Path, default=None, help="where the demo checkpoint is built once")
    demo.add_argument("--num-kv-blocks", type=int, default=None, help="the engine's KV cache size in blocks")
    demo.add_argument("--block-size", type=int, default=16)
    serve = sub.add_parser(
        "serve", help="OpenAI-compatible server (vLLM's flags; needs the [server] extra)", add_help=False
    )
    serve.add_argument("model", help="model path or hub id")
    serve.add_argument("flags", nargs=argparse.REMAINDER, help="vLLM's server flags; see serve MODEL --help")
    args = parser.parse_args(argv)
    if args.command == "serve":
        from paged_backend.entrypoints.openai.api_server import main as serve_main

        serve_main(["--model", args.model, *args.flags], prog="paged-backend serve")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if args.command == "demo":
        from paged_backend.entrypoints.demo import run_demo

        engine_args = {"block_size": args.block_size}
        if args.num_kv_blocks is not None:
            engine_args["num_kv_blocks"] = args.num_kv_blocks
        run_demo(args.model, args.num_prompts, args.max_tokens, args.batch_size, args.cache_dir, **engine_args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
