"""OpenAI-compatible HTTP server over the paged engine (``[server]`` extra: FastAPI, uvicorn).

    paged-backend serve MODEL [vLLM's flags]
    python -m paged_backend.entrypoints.openai.api_server --model MODEL [vLLM's flags]

Endpoints: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/completions``, ``POST /v1/chat/completions``
and ``POST /v1/responses`` (each streaming with server-sent events), ``/tokenize``, ``/detokenize``, ``GET
/health``, ``GET /metrics`` (Prometheus). Errors are OpenAI error bodies
(``errors.py``): 400 naming the field for invalid parameters and prompts longer than ``max_model_len``, 401 for
a missing or wrong API key (``auth.py``, checked before the body is read), 404 for an unknown model, 413 for a
body over ``--max-request-body-mb`` (``limits.py``), 429 when ``--max-waiting-requests`` are already waiting,
500 when the engine failed a request, 503 when the engine loop has died or the server is shutting down;
``/openapi.json`` documents each (``openapi.py``). A client that disconnects (mid-stream, or while it waits for a
whole response) aborts its request, which frees its blocks at once. SIGTERM and Ctrl-C shut down gracefully
(``shutdown.py``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

MODULE_PROG = "python -m paged_backend.entrypoints.openai.api_server"

try:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST
    from pydantic import BaseModel
    from starlette.background import BackgroundTask

    from paged_backend.engine.engine_loop import EngineDeadError, QueueFullError
    from paged_backend.entrypoints.data_parallel.replica_set import ReplicaSet
    from paged_backend.entrypoints.openai import openapi
    from paged_backend.entrypoints.openai.anthropic_api import MessagesRequest
    from paged_backend.entrypoints.openai.anthropic_errors import AnthropicErrors
    from paged_backend.entrypoints.openai.auth import APIKeyMiddleware
    from paged_backend.entrypoints.openai.cli_args import ServerArgs, parse_args
    from paged_backend.entrypoints.openai.disconnect import with_cancellation
    from paged_backend.entrypoints.openai.engines import served
    from paged_backend.entrypoints.openai.errors import (
        AnthropicErrorResponse,
        APIError,
        SafeJSONResponse,
        install_error_handlers,
    )
    from paged_backend.entrypoints.openai.launch import run
    from paged_backend.entrypoints.openai.limits import MIB, RequestBodyLimit
    from paged_backend.entrypoints.openai.metrics import ServerMetrics
    from paged_backend.entrypoints.openai.protocol import (
        ChatCompletionRequest,
        CompletionRequest,
        DetokenizeRequest,
        TokenizeChatRequest,
        TokenizeCompletionRequest,
    )
    from paged_backend.entrypoints.openai.request_limits import RequestLimits
    from paged_backend.entrypoints.openai.responses import (
        AnthropicEvent,
        AnthropicMessage,
        ChatCompletionChunk,
        ChatCompletionResponse,
        CompletionChunk,
        CompletionResponse,
        DetokenizeResponse,
        Health,
        ModelCard,
        ModelList,
        ResponseEvent,
        ResponseObject,
        TokenizeResponse,
    )
    from paged_backend.entrypoints.openai.responses_api import ResponsesRequest
    from paged_backend.entrypoints.openai.serving_chat import OpenAIServingChat
    from paged_backend.entrypoints.openai.serving_completion import OpenAIServingCompletion
    from paged_backend.entrypoints.openai.serving_messages import AnthropicServingMessages
    from paged_backend.entrypoints.openai.serving_responses import OpenAIServingResponses
    from paged_backend.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
    from paged_backend.entrypoints.openai.streams import guarded, merge
    from paged_backend.entrypoints.openai.tokenization import ServerTokenizer
    from paged_backend.lora.request import LoRARequest
    from paged_backend.outputs import RequestOutput
    from paged_backend.structured_output.compile_pool import CompileQueueFull, CompileUnavailable
except ModuleNotFoundError as exc:  # ``python -m`` without the [server] extra: one line, as ``serve`` gives
    if __name__ != "__main__":
        raise
    from paged_backend.entrypoints.cli import missing_extra

    raise missing_extra(exc, MODULE_PROG) from None

if TYPE_CHECKING:
    from paged_backend.entrypoints.data_parallel import DataParallelLLM
    from paged_backend.entrypoints.llm import LLM
    from paged_backend.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class OpenAIServer:
    """The handlers, around one ``EngineLoop``."""

    def __init__(self, llm: LLM | DataParallelLLM, args: ServerArgs) -> None:
        self.llm = llm
        self.args = args
        self.draining = False  # set on SIGTERM / SIGINT: new requests get 503, those in flight go on
        self.metrics = ServerMetrics(args.model_name)
        self.served = served(llm, args, self.metrics)  # one engine's loop, or data-parallel replicas
        self.loop = self.served.loop
        self.tokenizer = self.served.tokenizer
        self.tokenization = None if self.tokenizer is None else ServerTokenizer(self.tokenizer)
        self.max_model_len = self.served.max_model_len
        self.limits = RequestLimits(self.max_model_len, args.max_logprob_entries, self.tokenization)
        template = args.chat_template
        if template is not None and os.path.isfile(template):
            with open(template, encoding="utf-8") as f:
                template = f.read()
        self.chat_template = template
        # Each --lora-modules adapter is a model of its own name; requests for it run with that adapter.
        self.loras = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(args.lora_modules.items())}
        for lora in self.loras.values():  # a bad adapter stops the server at startup, not at its first request
            self.served.check_lora(lora)

    # ------------------------------------------------------------------ checks
    def check(self, model: str | None = None) -> None:
        """The model a request names (if it names one) exists — its served name, the ``--model`` it was loaded
        from as vLLM names it, or an adapter's name — and the engine runs. The API key was checked before the
        body was read (``auth.py``)."""
        if model is not None and model not in (self.args.model_name, self.args.model, *self.loras):
            served = ", ".join(f"`{name}`" for name in (self.args.model_name, *self.loras))
            raise APIError(404, f"The model `{model}` does not exist; served: {served}.", "not_found_error", "model")
        if not self.loop.alive:
            raise APIError(503, "the engine is not running", "service_unavailable")

    async def start(
        self,
        prompts: list[dict[str, Any]],
        params: SamplingParams,
        prefix: str,
        requested_max_tokens: int | None,
        model: str,
        format_field: str | None = None,
        stream: bool = True,
    ) -> list[AsyncIterator[RequestOutput]]:
        """Queue every prompt now, so the engine batches them and a bad one fails (as a 400, 429 or 503) before
        any response is sent; then return their output streams. As in vLLM, a prompt plus the ``max_tokens`` a
        client asked for must fit in ``max_model_len`` (a default ``max_tokens`` just stops there). Every text's
        length is checked before any is tokenized, so a batch holding one hopeless prompt costs nothing.
        ``stream=False``: the client waits for whole responses, so only final outputs are delivered (and over
        data-parallel replicas a request whose replica died is run again on another)."""
        if self.draining:
            raise APIError(503, "the server is shutting down", "service_unavailable")
        if not prompts:
            raise APIError(400, "prompt must not be empty", "invalid_request_error", "prompt")
        for prompt in prompts:
            if "prompt_token_ids" not in prompt:
                self.limits.check_text(prompt["prompt"], requested_max_tokens, "prompt")
        for prompt in prompts:
            if "prompt_token_ids" not in prompt and self.tokenization is not None:
                prompt["prompt_token_ids"] = await self.tokenization.encode(prompt["prompt"])  # as the engine would
            self.limits.check_ids(len(prompt.get("prompt_token_ids", ())), requested_max_tokens)
        self.limits.check_logprobs(params, [len(p.get("prompt_token_ids", ())) for p in prompts], requested_max_tokens)
        requests = [(f"{prefix}-{i}", prompt) for i, prompt in enumerate(prompts)]
        try:
            queues = await self.loop.add(requests, params, stream=stream, lora_request=self.loras.get(model))
        except (ValueError, QueueFullError, CompileQueueFull, CompileUnavailable, EngineDeadError) as exc:
            if isinstance(exc, QueueFullError | CompileQueueFull):
                raise APIError(429, str(exc), "rate_limit_error") from exc
            if isinstance(exc, EngineDeadError | CompileUnavailable):
                raise APIError(503, str(exc), "service_unavailable") from exc
            if format_field is not None and str(getattr(exc, "field", "")).startswith("structured_outputs."):
                # a grammar that does not compile: named by the request field it came from
                raise APIError(400, f"{format_field}: {exc}", "invalid_request_error", format_field) from exc
            raise APIError(400, str(exc), "invalid_request_error") from exc
        return [self.loop.stream(request_id, queue) for (request_id, _), queue in zip(requests, queues)]

    async def collect(self, streams: list[AsyncIterator[RequestOutput]], prefix: str) -> list[RequestOutput]:
        """Every request's final output. Leaving early aborts them all (the client went away and the handler was
        cancelled, or one request failed): a stream that never started has no cleanup of its own."""
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in merge(streams):
                finals[i] = out
        except BaseException:
            for i in range(len(streams)):
                self.loop.abort(f"{prefix}-{i}")  # finished ones are ignored
            raise
        return [finals[i] for i in range(len(streams))]

    # ------------------------------------------------------------------ shutdown
    def drain(self) -> None:
        """Refuse new requests (503) and fail ``/health``, so that a load balancer sends them elsewhere; requests
        in flight go on."""
        self.draining = True

    def abort_all(self) -> None:
        """Stop the engine loop after its current step: every request in flight ends with EngineDeadError (a stream
        with an error event and ``[DONE]``, any other with a 503) and its blocks are freed. Returns at once."""
        self.loop.shutdown(wait=False)

    def close(self) -> None:
        """Stop the engine loop and join its thread (a step at most), and the tokenizer's thread."""
        self.loop.shutdown(wait=True)
        if self.tokenization is not None:
            self.tokenization.close()

    # ------------------------------------------------------------------ helpers
    def streaming(self, events: AsyncIterator[str], prefix: str, count: int) -> StreamingResponse:
        """An SSE response whose requests are aborted once it ends, however it ends: Starlette may drop a body it
        never started iterating (the client left first), and then the streams' own cleanup never runs."""
        request_ids = [f"{prefix}-{i}" for i in range(count)]

        def abort_all() -> None:
            for request_id in request_ids:
                self.loop.abort(request_id)  # finished ones are ignored

        return StreamingResponse(guarded(events), media_type="text/event-stream", background=BackgroundTask(abort_all))

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(ids)
        return text if isinstance(text, str) else "".join(text)  # one sequence of ids decodes to one string


def build_app(llm: LLM | DataParallelLLM, args: ServerArgs) -> FastAPI:
    """The app over one ``LLM``, or over ``DataParallelLLM``'s replicas (``--data-parallel-size``)."""
    server = OpenAIServer(llm, args)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if server.loop.grammars is not None and importlib.util.find_spec("xgrammar") is not None:
            server.loop.grammars.start()  # the compile workers start now, not at the first structured request
        yield
        server.close()

    app = FastAPI(
        title="paged-backend",
        description="OpenAI-compatible API over the paged engine",
        lifespan=lifespan,
        default_response_class=SafeJSONResponse,
    )
    app.state.server = server
    app.add_middleware(
        RequestBodyLimit, max_bytes=int(args.max_request_body_mb * MIB), read_timeout_s=args.body_read_timeout
    )
    install_error_handlers(app)
    if args.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key)
    app.add_middleware(AnthropicErrors)  # outermost: every error of /v1/messages in Anthropic's shape
    limits = openapi.ModelLimits(server.served.vocab_size, server.max_model_len, server.served.max_num_seqs)
    openapi.install_openapi(app, limits, secured=args.api_key is not None)
    _add_state_routes(app, server, args)
    _add_generation_routes(app, server)
    return app


def _add_state_routes(app: FastAPI, server: OpenAIServer, args: ServerArgs) -> None:
    """/health, /metrics and the model list."""

    @app.get("/health", response_model=None, responses={200: {"model": Health}, 503: {"model": Health}})
    async def health() -> JSONResponse:
        if server.draining:
            return JSONResponse({"status": "shutting down"}, 503)
        ok = server.loop.alive
        body: dict[str, Any] = {"status": "ok" if ok else "engine stopped"}
        if isinstance(server.loop, ReplicaSet):  # each replica's state: running, restarting or dead
            body["replicas"] = server.loop.replicas.describe()
        return JSONResponse(body, 200 if ok else 503)

    @app.get("/metrics", response_class=Response, responses=openapi.PROMETHEUS)
    async def metrics() -> Response:
        return Response(server.metrics.render(await server.loop.stats()), media_type=CONTENT_TYPE_LATEST)

    def model_cards() -> list[dict[str, Any]]:
        card = {
            "id": args.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "paged-backend",
            "max_model_len": server.max_model_len,
        }
        return [card, *({**card, "id": name, "parent": args.model_name} for name in server.loras)]

    @app.get("/v1/models", response_model=None, responses={200: {"model": ModelList}, **openapi.error_responses(503)})
    async def models() -> dict[str, Any]:
        server.check()
        return {"object": "list", "data": model_cards()}

    @app.get(
        "/v1/models/{model_id:path}",
        response_model=None,
        responses={200: {"model": ModelCard}, **openapi.error_responses(404, 503)},
    )
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        """OpenAI's ``models.retrieve``: the card of a served name (or the ``--model`` it was loaded from)."""
        server.check(model_id)
        name = args.model_name if model_id == args.model else model_id
        return next(card for card in model_cards() if card["id"] == name)


def _add_generation_routes(app: FastAPI, server: OpenAIServer) -> None:
    """The APIs that run the model: completions, chat, responses, Anthropic's messages, (de)tokenization."""
    serving_completion, serving_chat = OpenAIServingCompletion(server), OpenAIServingChat(server)
    serving_responses, serving_messages = OpenAIServingResponses(serving_chat), AnthropicServingMessages(serving_chat)
    serving_tokenization = OpenAIServingTokenization(server, server.served.vocab_size)

    @app.post("/v1/completions", response_model=None, responses=openapi.streamed(CompletionResponse, CompletionChunk))
    @with_cancellation
    async def completions(body: CompletionRequest, request: Request) -> Any:
        warn_ignored(body)
        server.check(body.model)
        return await serving_completion.create_completion(body)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses=openapi.streamed(ChatCompletionResponse, ChatCompletionChunk),
    )
    @with_cancellation
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        warn_ignored(body)
        server.check(body.model)
        return await serving_chat.create_chat_completion(body)

    @app.post("/v1/responses", response_model=None, responses=openapi.streamed(ResponseObject, ResponseEvent))
    @with_cancellation
    async def responses(body: ResponsesRequest, request: Request) -> Any:
        warn_ignored(body)
        server.check(body.model)
        return await serving_responses.create_response(body)

    @app.post(
        "/v1/messages",
        response_model=None,
        responses=openapi.streamed(AnthropicMessage, AnthropicEvent, AnthropicErrorResponse),
    )
    @with_cancellation
    async def messages(body: MessagesRequest, request: Request) -> Any:
        warn_ignored(body)
        server.check(body.model)
        return await serving_messages.create_message(body)

    @app.post(
        "/tokenize",
        response_model=None,
        responses={200: {"model": TokenizeResponse}, **openapi.error_responses(400, 404, 413, 503)},
    )
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
        warn_ignored(body)
        return await serving_tokenization.tokenize(body)

    @app.post(
        "/detokenize",
        response_model=None,
        responses={200: {"model": DetokenizeResponse}, **openapi.error_responses(400, 404, 413, 503)},
    )
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        warn_ignored(body)
        return await serving_tokenization.detokenize(body)


_MAX_NAMED, _MAX_NAME = 16, 64  # unknown fields a warning names, and the characters of each


def warn_ignored(body: BaseModel) -> None:
    """One warning naming the request fields this server does not know (vLLM ignores them likewise): at most
    ``_MAX_NAMED`` of them, each cut to ``_MAX_NAME`` characters, so a body of many long keys writes one short line."""
    extra = body.model_extra
    if extra:
        names = [name if len(name) <= _MAX_NAME else name[:_MAX_NAME] + "..." for name in sorted(extra)[:_MAX_NAMED]]
        more = f" and {len(extra) - _MAX_NAMED} more" if len(extra) > _MAX_NAMED else ""
        logger.warning("The following fields were present in the request but ignored: %s%s", names, more)


def main(argv: list[str] | None = None, prog: str = MODULE_PROG) -> int:
    """Parse vLLM's serving flags, then ``run``."""
    args, engine_kwargs = parse_args(argv, prog)
    return run(args, engine_kwargs, prog)


if __name__ == "__main__":
    raise SystemExit(main())
