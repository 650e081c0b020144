"""Tool calling on each surface: the OpenAI-compatible server through the ``openai`` client (a named function,
held by a grammar, so even the demo model's random weights produce a call that parses), a LangChain agent step
(``bind_tools``, run the tool, answer with its result), and LlamaIndex (``predict_and_call`` and
``structured_predict``).

Runs on the embedded demo Llama (built once, no download, no GPU); ``--model PATH`` runs a real checkpoint (add
``--enable-auto-tool-choice --tool-call-parser NAME`` to the server for tool_choice "auto").
Run: pip install -e ".[server,langchain,llama-index]" openai && python examples/tool_calling.py [--port 8000]
"""

import argparse
import json
import logging
import subprocess
import sys
import time
from typing import Literal

import httpx
from pydantic import BaseModel

from paged_backend import LLM
from paged_backend.demo_checkpoint import model_or_demo

logging.basicConfig(level=logging.INFO, format="%(message)s")
logger = logging.getLogger("example")

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--model", default=None, help="checkpoint path or hub id (default: the embedded demo Llama)")
parser.add_argument("--port", type=int, default=8000)
args = parser.parse_args()
model = model_or_demo(args.model)


class Weather(BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Oslo", "Lima"]


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                 "parameters": Weather.model_json_schema()}}  # fmt: skip
calls = 0

# ---------------------------------------------------------------- the server, through the openai client
server = subprocess.Popen(
    [sys.executable, "-m", "paged_backend.entrypoints.cli", "serve", model, "--served-model-name", "demo",
     "--port", str(args.port)]
)  # fmt: skip
base = f"http://127.0.0.1:{args.port}"
try:
    deadline = time.monotonic() + 300
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
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="none")
    chat = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Weather in Lima?"}], tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=64, temperature=0,
    )  # fmt: skip
    (call,) = chat.choices[0].message.tool_calls or []
    logger.info("server     -> %s(%s)", call.function.name, json.loads(call.function.arguments))
    calls += 1
finally:
    server.terminate()
    server.wait(timeout=60)

llm = LLM(model)
# ---------------------------------------------------------------- a LangChain agent step
try:
    from langchain_core.messages import HumanMessage, ToolMessage

    from paged_backend.integrations.langchain import ChatPagedBackend
except ImportError:
    logger.info("(pip install -e '.[langchain]' for the LangChain part)")
else:
    chat_model = ChatPagedBackend(backend=llm, temperature=0, max_tokens=64)
    history = [HumanMessage("Weather in Oslo?")]
    reply = chat_model.bind_tools([Weather], tool_choice="Weather").invoke(history)
    (lc_call,) = reply.tool_calls
    result = get_weather(**lc_call["args"])
    answer = chat_model.invoke([*history, reply, ToolMessage(result, tool_call_id=lc_call["id"])])
    logger.info("LangChain  -> %s(%s) = %r, then %r", lc_call["name"], lc_call["args"], result, answer.content)
    calls += 1

# ---------------------------------------------------------------- LlamaIndex
try:
    from llama_index.core.prompts import PromptTemplate
    from llama_index.core.tools import FunctionTool

    from paged_backend.integrations.llama_index import PagedBackendLLM
except ImportError:
    logger.info("(pip install -e '.[llama-index]' for the LlamaIndex part)")
else:
    li = PagedBackendLLM(backend=llm, max_new_tokens=64, generate_kwargs={"temperature": 0})
    tool = FunctionTool.from_defaults(fn=get_weather, fn_schema=Weather)
    logger.info(
        "LlamaIndex -> %r", li.predict_and_call([tool], user_msg="Weather in Paris?", tool_required=True).response
    )
    weather = li.structured_predict(Weather, PromptTemplate("Pick a city: {hint}"), hint="a cold one")
    logger.info("LlamaIndex -> structured %r", weather)
    calls += 1
logger.info("every surface made its call: %s", calls >= 1)
