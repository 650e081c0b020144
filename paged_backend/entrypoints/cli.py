"""``paged-backend`` command line: ``demo`` runs the embedded tiny model (no download, no GPU); ``serve MODEL``
starts the OpenAI-compatible server with vLLM's flags."""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paged-backend", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="generate with an embedded tiny random model and report tokens/s")
    demo.add_argument("--num-prompts", type=int, default=32)
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.add_argument(
        "--arch",
        default="llama",
        help="llama, mistral, qwen2, qwen3, gpt2, gemma2, gemma3, phi3, opt, gpt_neox or mixtral",
    )
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
        from paged_backend.demo import run_demo

        run_demo(args.num_prompts, args.max_tokens, args.arch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
