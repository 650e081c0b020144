"""``POST /tokenize`` and ``POST /detokenize``, with vLLM's request and response shapes: what a prompt is in this
model's tokens (a text, or a conversation through the chat template), and back. Both run on the tokenizer's
thread, after the same length bound as a completion's prompt."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from paged_backend.entrypoints.openai.errors import APIError
from paged_backend.entrypoints.openai.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from paged_backend.entrypoints.openai.tokenization import ServerTokenizer

if TYPE_CHECKING:
    from paged_backend.entrypoints.openai.api_server import OpenAIServer


class OpenAIServingTokenization:
    def __init__(self, server: OpenAIServer, vocab_size: int) -> None:
        self.server = server
        self.vocab_size = vocab_size

    def _tokenizer(self, model: str | None) -> ServerTokenizer:
        self.server.check(model)
        if self.server.tokenization is None:
            raise APIError(400, "this server has no tokenizer", "invalid_request_error")
        return self.server.tokenization

    async def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
        tokenization = self._tokenizer(body.model)
        if isinstance(body, TokenizeChatRequest):
            messages = [m.for_template() for m in body.messages]
            try:
                text = await tokenization.render_chat(messages, self.server.chat_template, body.add_generation_prompt)
            except Exception as exc:  # noqa: BLE001 - a template error is the request's problem
                raise APIError(400, f"chat template failed: {exc}", "invalid_request_error", "messages") from exc
            param = "messages"
        else:
            text, param = body.prompt, "prompt"
        self.server.limits.check_text(text, None, param)
        ids = await tokenization.encode(text, add_special_tokens=body.add_special_tokens)
        strs = await tokenization.token_strs(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.server.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        tokenization = self._tokenizer(body.model)
        bad = [t for t in body.tokens if t >= self.vocab_size]
        if bad:
            raise APIError(
                400, f"tokens must be in [0, {self.vocab_size}), got {bad[:5]}", "invalid_request_error", "tokens"
            )
        return {"prompt": await tokenization.decode(body.tokens)}
