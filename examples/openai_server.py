"""The OpenAI-compatible server and a client: ``paged-backend serve MODEL`` takes vLLM's flags and answers
``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``, streaming included, so the ``openai`` client
(or anything built on it) talks to it unchanged. This script starts the server, asks it three ways, stops it.

Runs on the embedded demo Llama (built once, no download, no GPU); ``--model PATH`` serves a real checkpoint.
Run: pip install -e ".[server]" openai && python examples/openai_server.py [--model PATH] [--port 8000]
"""

import argparse
import logging
import subprocess
import sys
import time

import httpx
from openai import OpenAI

from paged_backend.demo_checkpoint import model_or_demo

logging.basicConfig(level=logging.INFO, format="%(message)s")
logger = logging.getLogger("example")

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--model", default=None, help="checkpoint path or hub id (default: the embedded demo Llama)")
parser.add_argument("--port", type=int, default=8000)
args = parser.parse_args()

command = [sys.executable, "-m", "paged_backend.entrypoints.cli", "serve", model_or_demo(args.model)]
server = subprocess.Popen([*command, "--served-model-name", "demo", "--port", str(args.port)])
base = f"http://127.0.0.1:{args.port}"
try:
    deadline = time.monotonic() + 300  # a real model takes a while to load
    while True:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode}")
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("the server did not become healthy in 300 s")
        time.sleep(0.5)

    client = OpenAI(base_url=f"{base}/v1", api_key="none")
    logger.info("models: %s", [m.id for m in client.models.list()])
    chat = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Hello!"}], max_tokens=16, temperature=0
    )
    logger.info("chat -> %r (%s)", chat.choices[0].message.content, chat.choices[0].finish_reason)
    text = client.completions.create(model="demo", prompt="The paged KV cache", max_tokens=16, temperature=0)
    logger.info("completion -> %r", text.choices[0].text)
    stream = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Count"}], max_tokens=16, stream=True
    )
    logger.info("streamed -> %r", "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))
finally:
    server.terminate()
    server.wait(timeout=60)
