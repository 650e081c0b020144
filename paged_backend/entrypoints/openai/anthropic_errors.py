"""Errors of ``/v1/messages`` in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``.

Pure ASGI middleware, outermost, so that every error of that path is rewritten whoever answered it (the API key
check, the body limit, validation, the handler): an error response's OpenAI body becomes Anthropic's, its status
kept and its ``param`` leading the message. Other paths, and successful responses (streams included), pass
through untouched."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from paged_backend.entrypoints.openai.serving_messages import anthropic_error

MESSAGES_PATH = "/v1/messages"


class AnthropicErrors:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].rstrip("/") != MESSAGES_PATH:
            await self.app(scope, receive, send)
            return
        held: Message | None = None  # an error's response start, sent once its body is rewritten
        passing = False
        body = b""

        async def rewrite(message: Message) -> None:
            nonlocal held, passing, body
            if message["type"] == "http.response.start":
                if message["status"] < 400:
                    passing = True
                    await send(message)
                else:
                    held = message
                return
            if passing or held is None:
                await send(message)
                return
            body += message.get("body", b"")
            if message.get("more_body"):
                return
            try:
                error = json.loads(body)["error"]
                text, param = str(error["message"]), error.get("param")
                if param and not text.startswith(str(param)):  # Anthropic's body has no param: the text names it
                    text = f"{param}: {text}"
                new = json.dumps(anthropic_error(held["status"], text)).encode()
            except (ValueError, KeyError, TypeError):
                new = body  # not an OpenAI error body: as it was
            headers = [(k, v) for k, v in held["headers"] if k.lower() != b"content-length"]
            await send({**held, "headers": [*headers, (b"content-length", str(len(new)).encode())]})
            await send({"type": "http.response.body", "body": new})

        await self.app(scope, receive, rewrite)
