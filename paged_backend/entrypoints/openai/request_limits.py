"""Whether a request fits before the engine sees it: its prompts within ``max_model_len`` (a text's length bound
before it is tokenized, its token count after) and the logprob entries its response could hold within
``--max-logprob-entries``.

A response holds an entry per token and per alternative asked for, so a small body (64 prompts of 2,000 ids with
``prompt_logprobs: 20``) can ask for a response of hundreds of megabytes and gigabytes of the server's memory
while it is built: the entries are counted from the request itself, before any work.
"""

from __future__ import annotations

from dataclasses import dataclass

from paged_backend.entrypoints.openai.errors import APIError
from paged_backend.entrypoints.openai.tokenization import ServerTokenizer
from paged_backend.sampling_params import SamplingParams


def _too_long(message: str, param: str) -> APIError:
    return APIError(400, f"This model's maximum context length (max_model_len) is {message}", "invalid_request_error",
                    param)  # fmt: skip


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int
    max_logprob_entries: int
    tokenization: ServerTokenizer | None

    def check_text(self, text: str, max_tokens: int | None, param: str) -> None:
        """A 400 for a text whose length alone proves it too long: before tokenizing it. It names the text's
        field when the text alone is too long, else ``max_tokens``, as ``check_ids`` does after tokenizing."""
        if self.tokenization is None:
            return
        at_least = self.tokenization.min_tokens(text)
        if at_least + (max_tokens or 0) > self.max_model_len:
            completion = f", plus {max_tokens} in the completion" if max_tokens else ""
            raise _too_long(
                f"{self.max_model_len} tokens. However, the prompt has {len(text)} characters, so at least "
                f"{at_least} tokens (no token of this tokenizer spans more than "
                f"{self.tokenization.max_chars_per_token} characters){completion}. Please reduce the length of the "
                "prompt or completion.",
                param if at_least > self.max_model_len else "max_tokens",
            )

    def check_ids(self, length: int, max_tokens: int | None) -> None:
        """A 400 for a prompt of ``length`` tokens past ``max_model_len`` (whatever ``max_tokens`` says), or that
        with the ``max_tokens`` a client asked for does not fit (as vLLM; an unset ``max_tokens`` stops there)."""
        if length > self.max_model_len:
            raise _too_long(
                f"{self.max_model_len} tokens. However, the prompt has {length} tokens. Please reduce the length of "
                "the prompt.",
                "prompt",
            )
        if max_tokens is not None and length + max_tokens > self.max_model_len:
            raise _too_long(
                f"{self.max_model_len} tokens. However, you requested {length + max_tokens} tokens ({length} in the "
                f"prompt, {max_tokens} in the completion). Please reduce the length of the prompt or completion.",
                "max_tokens",
            )

    def check_logprobs(self, params: SamplingParams, lengths: list[int], max_tokens: int | None) -> None:
        """A 400 for prompts of these lengths whose logprobs could pass ``max_logprob_entries``: each prompt token
        has ``prompt_logprobs`` alternatives and its own, each of the samples' new tokens ``logprobs`` and its own."""
        cap = max_tokens if max_tokens is not None else params.max_tokens  # the engine's default when unset
        room = [self.max_model_len - length for length in lengths]
        new_tokens = room if cap is None else [min(cap, r) for r in room]
        prompt = 0 if params.prompt_logprobs is None else sum(lengths) * (params.prompt_logprobs + 1)
        n = params.best_of or params.n
        sampled = 0 if params.logprobs is None else n * sum(new_tokens) * (params.logprobs + 1)
        if prompt + sampled > self.max_logprob_entries:
            param = "prompt_logprobs" if prompt >= sampled else "logprobs"
            raise APIError(
                400,
                f"{param}: this request could return {prompt + sampled} logprob entries ({prompt} for its prompt "
                f"tokens, {sampled} for the tokens it generates, each token's alternatives and its own); this server "
                f"returns at most {self.max_logprob_entries} (--max-logprob-entries): ask for fewer alternatives, "
                "tokens or prompts",
                "invalid_request_error",
                param,
            )
