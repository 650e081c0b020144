"""OpenAI-compatible HTTP server over the paged engine (``[server]`` extra: FastAPI, uvicorn).

    paged-backend serve MODEL [vLLM's flags]
    python -m paged_backend.entrypoints.openai.api_server --model MODEL [vLLM's flags]

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming with
server-sent events), ``GET /health``, ``GET /metrics`` (Prometheus). Errors are OpenAI error bodies
(``errors.py``): 400 naming the field for invalid parameters and prompts longer than ``max_model_len``, 401 for
a missing or wrong API key (``auth.py``), 404 for an unknown model, 429 when ``--max-waiting-requests`` are
already waiting, 500 when the engine failed a request, 503 when the engine loop has died; ``/openapi.json``
documents each (``openapi.py``). A client that disconnects mid-stream aborts its request, which frees its blocks
at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask

from paged_backend.engine.engine_loop import EngineDeadError, QueueFullError
from paged_backend.entrypoints.openai import openapi
from paged_backend.entrypoints.openai.auth import APIKeyMiddleware
from paged_backend.entrypoints.openai.cli_args import ServerArgs, parse_args
from paged_backend.entrypoints.openai.errors import APIError, SafeJSONResponse, install_error_handlers
from paged_backend.entrypoints.openai.logprobs import chat_logprobs, completion_logprobs
from paged_backend.entrypoints.openai.metrics import ServerMetrics
from paged_backend.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from paged_backend.entrypoints.openai.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    Health,
    ModelList,
)
from paged_backend.entrypoints.openai.streams import guarded, merge, sse
from paged_backend.lora.request import LoRARequest
from paged_backend.outputs import RequestOutput

logger = logging.getLogger(__name__)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class OpenAIServer:
    """The handlers, around one ``EngineLoop``."""

    def __init__(self, llm: Any, args: ServerArgs) -> None:
        self.llm = llm
        self.args = args
        self.tokenizer = llm.get_tokenizer()
        self.max_model_len = llm.llm_engine.max_model_len
        self.metrics = ServerMetrics(args.model_name)
        self.loop = llm.start_engine_loop(
            max_waiting_requests=args.max_waiting_requests, on_output=self.metrics.observe, on_abort=self.metrics.forget
        )
        template = args.chat_template
        if template is not None and os.path.isfile(template):
            with open(template, encoding="utf-8") as f:
                template = f.read()
        self.chat_template = template
        # Each --lora-modules adapter is a model of its own name; requests for it run with that adapter.
        self.loras = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(args.lora_modules.items())}
        for lora in self.loras.values():  # a bad adapter stops the server at startup, not at its first request
            llm.llm_engine.lora_manager.get(lora)

    # ------------------------------------------------------------------ checks
    def check(self, body: SamplingFields | None = None) -> None:
        """The model exists (its served name, the ``--model`` it was loaded from as vLLM names it, or an
        adapter's name) and the engine runs. The API key was checked before the body was read (``auth.py``)."""
        if body is not None and body.model not in (self.args.model_name, self.args.model, *self.loras):
            raise APIError(404, f"The model `{body.model}` does not exist.", "not_found_error", "model")
        if not self.loop.alive:
            raise APIError(503, "the engine is not running", "service_unavailable")

    async def start(
        self,
        prompts: list[dict[str, Any]],
        params: Any,
        prefix: str,
        requested_max_tokens: int | None,
        model: str,
    ) -> list[AsyncIterator[RequestOutput]]:
        """Queue every prompt now, so the engine batches them and a bad one fails (as a 400, 429 or 503) before
        any response is sent; then return their output streams. As in vLLM, a prompt plus the ``max_tokens`` a
        client asked for must fit in ``max_model_len`` (a default ``max_tokens`` just stops there)."""
        if not prompts:
            raise APIError(400, "prompt must not be empty", "invalid_request_error", "prompt")
        for prompt in prompts:
            if "prompt_token_ids" not in prompt and self.tokenizer is not None:
                prompt["prompt_token_ids"] = list(self.tokenizer(prompt["prompt"]).input_ids)  # as the engine would
            length = len(prompt.get("prompt_token_ids", ()))
            if requested_max_tokens is not None and length + requested_max_tokens > self.max_model_len:
                raise APIError(
                    400,
                    f"This model's maximum context length (max_model_len) is {self.max_model_len} tokens. "
                    f"However, you requested {length + requested_max_tokens} tokens ({length} in the prompt, "
                    f"{requested_max_tokens} in the completion). Please reduce the length of the prompt or completion.",
                    "invalid_request_error",
                    "max_tokens",
                )
        requests = [(f"{prefix}-{i}", prompt) for i, prompt in enumerate(prompts)]
        try:
            queues = await self.loop.add(requests, params, lora_request=self.loras.get(model))
        except (ValueError, QueueFullError, EngineDeadError) as exc:
            if isinstance(exc, QueueFullError):
                raise APIError(429, str(exc), "rate_limit_error") from exc
            if isinstance(exc, EngineDeadError):
                raise APIError(503, str(exc), "service_unavailable") from exc
            raise APIError(400, str(exc), "invalid_request_error") from exc
        return [self.loop.stream(request_id, queue) for (request_id, _), queue in zip(requests, queues)]

    # ------------------------------------------------------------------ completions
    async def completions(self, body: CompletionRequest) -> Any:
        try:
            params = body.sampling_params(COMPLETION_DEFAULT_MAX_TOKENS, body.logprobs)
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_request_error") from exc
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        streams = await self.start(body.prompts(), params, rid, body.max_tokens, body.model)
        base = {"id": rid, "object": "text_completion", "created": created, "model": body.model}
        if body.stream:
            return self._streaming(self._stream_completions(body, streams, base), rid, len(streams))
        finals: dict[int, RequestOutput] = {}
        async for i, out in merge(streams):
            finals[i] = out
        outputs = [finals[i] for i in range(len(streams))]
        choices = []
        for i, out in enumerate(outputs):
            echo = (out.prompt or self._decode(out.prompt_token_ids)) if body.echo else ""
            for c in out.outputs:
                choices.append(
                    {
                        "index": i * body.n + c.index,
                        "text": echo + c.text,
                        "logprobs": completion_logprobs(c, self._decode) if body.logprobs is not None else None,
                        "finish_reason": c.finish_reason,
                    }
                )
        return {**base, "choices": choices, "usage": usage(outputs)}

    async def _stream_completions(
        self, body: CompletionRequest, streams: list[AsyncIterator[RequestOutput]], base: dict[str, Any]
    ) -> AsyncIterator[str]:
        sent: dict[tuple[int, int], tuple[int, int]] = {}  # (request, sample) -> (characters, tokens) sent
        offsets: dict[tuple[int, int], int] = {}  # where the next token's text starts (as in the whole response)
        finals: dict[int, RequestOutput] = {}
        async for i, out in merge(streams):
            for c in out.outputs:
                key = (i, c.index)
                echo = ""
                if body.echo and key not in sent:
                    echo = out.prompt or self._decode(out.prompt_token_ids)
                chars, tokens = sent.get(key, (0, 0))
                delta = echo + c.text[chars:]
                sent[key] = (len(c.text), len(c.token_ids))
                if delta or c.finish_reason or len(c.token_ids) > tokens:
                    logprobs = None
                    if body.logprobs is not None:
                        logprobs = completion_logprobs(c, self._decode, tokens, offsets.get(key, 0))
                        offsets[key] = offsets.get(key, 0) + sum(len(t) for t in logprobs["tokens"])
                    choice = {
                        "index": i * body.n + c.index,
                        "text": delta,
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                    }
                    yield sse({**base, "choices": [choice]})
            if out.finished:
                finals[i] = out
        if body.stream_options is not None and body.stream_options.include_usage:
            yield sse({**base, "choices": [], "usage": usage([finals[i] for i in sorted(finals)])})
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ chat
    async def chat(self, body: ChatCompletionRequest) -> Any:
        if self.tokenizer is None:
            raise APIError(400, "chat needs a tokenizer", "invalid_request_error")
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, chat_template=self.chat_template
            )
        except Exception as exc:  # noqa: BLE001 - a template error is the request's problem
            raise APIError(400, f"chat template failed: {exc}", "invalid_request_error", "messages") from exc
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, self.max_model_len - len(ids))
        top = body.top_logprobs if body.logprobs else None
        if body.logprobs and top is None:
            top = 0
        try:
            params = body.model_copy(update={"max_tokens": max_tokens}).sampling_params(max_tokens, top)
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_request_error") from exc
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        requested = body.max_completion_tokens or body.max_tokens
        streams = await self.start([{"prompt": text, "prompt_token_ids": ids}], params, rid, requested, body.model)
        base = {"id": rid, "created": created, "model": body.model}
        if body.stream:
            return self._streaming(self._stream_chat(body, streams[0], base), rid, 1)
        final = None
        async for _, out in merge(streams):
            final = out
        assert final is not None, "a request's stream ends with its final output"
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c, self._decode, body.top_logprobs or 0) if body.logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for c in final.outputs
        ]
        return {**base, "object": "chat.completion", "choices": choices, "usage": usage([final])}

    async def _stream_chat(
        self, body: ChatCompletionRequest, stream: AsyncIterator[RequestOutput], base: dict[str, Any]
    ) -> AsyncIterator[str]:
        base = {**base, "object": "chat.completion.chunk"}
        for j in range(body.n):
            delta = {"role": "assistant", "content": ""}
            yield sse({**base, "choices": [{"index": j, "delta": delta, "logprobs": None, "finish_reason": None}]})
        sent: dict[int, tuple[int, int]] = {}  # sample -> (characters, tokens) sent
        final = None
        async for _, out in merge([stream]):
            for c in out.outputs:
                chars, tokens = sent.get(c.index, (0, 0))
                delta_text = c.text[chars:]
                sent[c.index] = (len(c.text), len(c.token_ids))
                if delta_text or c.finish_reason or len(c.token_ids) > tokens:
                    choice = {
                        "index": c.index,
                        "delta": {"content": delta_text} if delta_text else {},
                        "logprobs": (
                            chat_logprobs(c, self._decode, body.top_logprobs or 0, tokens) if body.logprobs else None
                        ),
                        "finish_reason": c.finish_reason,
                    }
                    yield sse({**base, "choices": [choice]})
            final = out
        if body.stream_options is not None and body.stream_options.include_usage and final is not None:
            yield sse({**base, "choices": [], "usage": usage([final])})
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ helpers
    def _streaming(self, events: AsyncIterator[str], prefix: str, count: int) -> StreamingResponse:
        """An SSE response whose requests are aborted once it ends, however it ends: Starlette may drop a body it
        never started iterating (the client left first), and then the streams' own cleanup never runs."""
        request_ids = [f"{prefix}-{i}" for i in range(count)]

        def abort_all() -> None:
            for request_id in request_ids:
                self.loop.abort(request_id)  # finished ones are ignored

        return StreamingResponse(guarded(events), media_type="text/event-stream", background=BackgroundTask(abort_all))

    def _decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)


def usage(outputs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def build_app(llm: Any, args: ServerArgs) -> FastAPI:
    server = OpenAIServer(llm, args)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        server.loop.shutdown()

    app = FastAPI(
        title="paged-backend",
        description="OpenAI-compatible API over the paged engine",
        lifespan=lifespan,
        default_response_class=SafeJSONResponse,
    )
    app.state.server = server
    install_error_handlers(app)
    if args.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key)
    engine = llm.llm_engine
    limits = openapi.ModelLimits(engine.vocab_size, server.max_model_len, engine.config.scheduler_config.max_num_seqs)
    openapi.install_openapi(app, limits, secured=args.api_key is not None)

    @app.get("/health", response_model=None, responses={200: {"model": Health}, 503: {"model": Health}})
    async def health() -> JSONResponse:
        ok = server.loop.alive
        return JSONResponse({"status": "ok" if ok else "engine stopped"}, 200 if ok else 503)

    @app.get("/metrics", response_class=Response, responses=openapi.PROMETHEUS)
    async def metrics() -> Response:
        return Response(server.metrics.render(await server.loop.stats()), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=None, responses={200: {"model": ModelList}, **openapi.error_responses(503)})
    async def models() -> dict[str, Any]:
        server.check()
        card = {
            "id": args.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "paged-backend",
            "max_model_len": server.max_model_len,
        }
        adapters = [{**card, "id": name, "parent": args.model_name} for name in server.loras]
        return {"object": "list", "data": [card, *adapters]}

    @app.post("/v1/completions", response_model=None, responses=openapi.streamed(CompletionResponse, CompletionChunk))
    async def completions(body: CompletionRequest, request: Request) -> Any:
        server.check(body)
        return await server.completions(body)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses=openapi.streamed(ChatCompletionResponse, ChatCompletionChunk),
    )
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        server.check(body)
        return await server.chat(body)

    return app


def main(argv: list[str] | None = None, prog: str = "python -m paged_backend.entrypoints.openai.api_server") -> int:
    """Parse vLLM's serving flags, then ``run``."""
    args, engine_kwargs = parse_args(argv, prog)
    return run(args, engine_kwargs, prog)


def run(args: ServerArgs, engine_kwargs: dict[str, Any], prog: str = "paged-backend serve") -> int:
    """Load the model and serve until interrupted. A model that cannot be loaded (a mistyped path, a folder
    without a checkpoint, a bad engine argument) ends the process with one line naming it and the reason, exit
    status 1: its traceback says nothing more to someone typing a command (it is logged at DEBUG)."""
    import uvicorn

    from paged_backend.entrypoints.llm import LLM

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        llm = LLM(args.model, **engine_kwargs)
    except (OSError, ValueError) as exc:
        logger.debug("loading %s failed", args.model, exc_info=True)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if _looks_local(args.model) and not os.path.exists(os.path.expanduser(args.model)):
            reason = "no such file or folder"  # transformers would call it a malformed Hub id
        raise SystemExit(f"{prog}: cannot load the model {args.model!r}: {reason}") from None
    uvicorn.run(build_app(llm, args), host=args.host, port=args.port)
    return 0


def _looks_local(model: str) -> bool:
    """A path no Hub id can be (``/x``, ``./x``, ``../x``, ``~/x``)."""
    return os.path.isabs(model) or model.startswith(("./", "../", "~"))


if __name__ == "__main__":
    raise SystemExit(main())
