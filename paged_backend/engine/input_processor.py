"""From a prompt and its parameters to a validated ``Request``: every check runs before anything is queued, so a
bad request fails alone."""

from __future__ import annotations

import itertools
import operator
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

from paged_backend.config import EngineConfig, FieldError
from paged_backend.core.sequence import GrammarState, Request, Sequence
from paged_backend.lora.adapter import LoRAAdapter
from paged_backend.lora.request import LoRARequest
from paged_backend.sampling_params import SamplingParams

if TYPE_CHECKING:
    from paged_backend.structured_output.grammar import GrammarCompiler

PromptType = str | Mapping[str, object]


class PromptTokenizer(Protocol):
    """What tokenizing a prompt needs of a Hugging Face tokenizer."""

    def __call__(self, text: str) -> Mapping[str, list[int]]: ...


class AdapterSource(Protocol):
    def get(self, request: LoRARequest) -> LoRAAdapter: ...


def check_text(name: str, text: str) -> None:
    """Text a tokenizer can take: valid Unicode (a lone UTF-16 surrogate, as JSON's ``"\\ud800"`` decodes to,
    is not, and tokenizers fail on it with an unrelated TypeError)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise FieldError(
            name, f"{name} is not valid Unicode: a lone surrogate {text[exc.start]!r} at character {exc.start}"
        ) from None


def token_id_list(ids: object) -> list[int]:
    """Token ids as Python ints, from a list or tuple of integers (numpy's included), a 1-D numpy array or a
    1-D tensor; anything else is a TypeError naming ``prompt_token_ids``."""
    if not isinstance(ids, (list, tuple)) and hasattr(ids, "tolist") and getattr(ids, "ndim", None) == 1:
        ids = ids.tolist()  # numpy array or tensor, without importing numpy
    if not isinstance(ids, (list, tuple)) or any(isinstance(t, bool) for t in ids):
        raise TypeError(f"prompt_token_ids must be a list of integers, got {type(ids).__name__}")
    try:
        return [operator.index(t) for t in ids]
    except TypeError:
        bad = next(t for t in ids if not hasattr(t, "__index__"))
        raise TypeError(f"prompt_token_ids must be a list of integers, got an element {bad!r}") from None


class InputProcessor:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: PromptTokenizer | None,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        device: torch.device,
        adapters: AdapterSource | None,
        hf_tokenizer: Any = None,
        embedding: torch.nn.Embedding | None = None,
        kv_shape: tuple[int, int, int] | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device  # where a seeded request's generator lives: it draws on the logits' device
        self.adapters = adapters
        self.hf_tokenizer = hf_tokenizer  # what structured outputs read the vocabulary from
        self.embedding = embedding  # the model's input embedding: the width and dtype prompt embeddings take
        self.kv_shape = kv_shape  # (layers, KV heads, head dim) of the cache: what prompt_kv must match
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self._seq_ids = itertools.count()

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """A prompt is a string or ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}`` (a list, tuple, numpy
        array or tensor of integers). A wrong type is a TypeError naming the prompt; bad contents a ValueError."""
        text: object = prompt
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = token_id_list(prompt["prompt_token_ids"])
                text = prompt.get("prompt")
                return text if isinstance(text, str) else None, ids
            if "prompt" not in prompt:
                raise FieldError("prompt", "a prompt dict must have a 'prompt' or a 'prompt_token_ids' key")
            text = prompt["prompt"]
        if not isinstance(text, str):
            raise TypeError(
                f"prompt must be a str or a dict with 'prompt' or 'prompt_token_ids', got {type(text).__name__}"
            )
        check_text("prompt", text)
        if self.tokenizer is None:
            raise FieldError("prompt", "text prompts need a tokenizer: pass tokenizer=... or use prompt_token_ids")
        return text, list(self.tokenizer(text)["input_ids"])

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None,
        lora_request: LoRARequest | None,
        keep_logits: bool,
    ) -> Request:
        adapter = self._adapter(lora_request)
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise FieldError(
                "sampling_params", f"sampling_params must be a SamplingParams, got {type(params).__name__}"
            )
        else:
            params = params.clone()  # checked again (fields may have changed), and out of the caller's reach
        embeds = self.prompt_embeds(prompt, params)
        text, ids = (None, [0] * embeds.shape[0]) if embeds is not None else self.tokenize(prompt)
        self._check(ids, params)
        prompt_kv = self.prompt_kv(prompt, params, len(ids))
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammar_compiler().compile(params.structured_outputs)  # before anything runs
        request = Request(
            request_id,
            text,
            ids,
            params,
            lora_request,
            lora_adapter=adapter,
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            keep_logits=keep_logits,
            arrival_time=time.monotonic(),
            prompt_embeds=embeds,
            prompt_kv=prompt_kv,
        )
        for index in range(params.num_samples):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed + index)
            seq_id = next(self._seq_ids)
            seq = Sequence(seq_id, index, request, list(ids), len(ids), seq_id, generator)
            if grammar is not None:
                seq.grammar = self._gated(self.grammar_compiler().matcher(grammar), ids)
            request.seqs.append(seq)
        return request

    def prompt_embeds(self, prompt: PromptType, params: SamplingParams) -> torch.Tensor | None:
        """``{"prompt_embeds": tensor}``'s embeddings ([L, hidden], floating point), a host copy in the model's
        dtype; None for a prompt of text or token ids."""
        if not isinstance(prompt, Mapping) or "prompt_embeds" not in prompt:
            return None
        if not self.config.model_config.enable_prompt_embeds:
            raise FieldError("prompt_embeds", "prompt_embeds need LLM(..., enable_prompt_embeds=True)")
        if self.embedding is None:
            raise FieldError("prompt_embeds", "prompt_embeds need a model whose input embedding is an nn.Embedding")
        if params.structured_outputs is not None and self.config.model_config.reasoning_parser is not None:
            raise FieldError(  # the gate reads the prompt's tokens to see whether its thinking is closed
                "prompt_embeds", "prompt_embeds cannot take structured_outputs under a reasoning_parser"
            )
        embeds = prompt["prompt_embeds"]
        if not isinstance(embeds, torch.Tensor) or not embeds.is_floating_point() or embeds.dim() != 2:
            raise FieldError("prompt_embeds", "prompt_embeds must be a 2-D floating-point tensor [tokens, hidden]")
        weight = self.embedding.weight
        if embeds.shape[1] != weight.shape[1] or embeds.shape[0] == 0:
            raise FieldError(
                "prompt_embeds",
                f"prompt_embeds must have shape [tokens >= 1, {weight.shape[1]}], got {list(embeds.shape)}",
            )
        if params.prompt_logprobs is not None:
            raise FieldError("prompt_logprobs", "prompt_logprobs need the prompt's tokens: prompt_embeds have none")
        # a copy on the host, out of the caller's reach (chunks and recomputes read it later); each step moves
        # its rows to the device, so queued requests hold no device memory the KV sizing did not count
        return embeds.detach().to(device="cpu", dtype=weight.dtype, copy=True)

    def prompt_kv(
        self, prompt: PromptType, params: SamplingParams, num_tokens: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """``{"prompt_token_ids": [...], "prompt_kv": [(keys, values), ...]}``: the keys and values (per layer,
        ``[P, KV heads, head dim]``) of the prompt's first P tokens, as HF's cache holds them (keys after the
        rotary embedding), at least one token short of the prompt; a host copy. None without them."""
        if not isinstance(prompt, Mapping) or "prompt_kv" not in prompt:
            return None
        if "prompt_token_ids" not in prompt:
            raise FieldError("prompt_kv", "prompt_kv goes with prompt_token_ids (the tokens it covers come first)")
        if self.kv_shape is None or self.config.parallel_config.tensor_parallel_size > 1:
            raise FieldError("prompt_kv", "prompt_kv needs tensor_parallel_size=1 (the keys and values stay on rank 0)")
        if params.prompt_logprobs is not None:
            raise FieldError(
                "prompt_logprobs", "prompt_logprobs need the logits of every prompt token: prompt_kv's are not computed"
            )
        layers, heads, dim = self.kv_shape
        kv = prompt["prompt_kv"]
        pairs = list(kv) if isinstance(kv, (list, tuple)) else []
        tensors = [t for pair in pairs if isinstance(pair, (list, tuple)) and len(pair) == 2 for t in pair]
        count = tensors[0].shape[0] if tensors and isinstance(tensors[0], torch.Tensor) else -1
        if (
            len(pairs) != layers
            or len(tensors) != 2 * layers
            or not all(
                isinstance(t, torch.Tensor) and t.is_floating_point() and tuple(t.shape) == (count, heads, dim)
                for t in tensors
            )
        ):
            raise FieldError(
                "prompt_kv",
                f"prompt_kv must be {layers} (keys, values) pairs of floating-point tensors [tokens, {heads}, {dim}]",
            )
        if not 1 <= count < num_tokens:
            raise FieldError(
                "prompt_kv",
                f"prompt_kv must cover 1 to {num_tokens - 1} of the prompt's {num_tokens} tokens (the last is "
                f"computed), got {count}",
            )
        return [(k.detach().to("cpu", copy=True), v.detach().to("cpu", copy=True)) for k, v in pairs]

    def _gated(self, matcher: GrammarState, prompt_ids: list[int]) -> GrammarState:
        """With a reasoning parser, the grammar waits for the end of the model's thinking
        (``structured_output/reasoning_gate.py``)."""
        if self.config.model_config.reasoning_parser is None:
            return matcher
        from paged_backend.structured_output.reasoning_gate import END_OF_THINKING, ReasoningGate, contains

        end_ids = tuple(self.hf_tokenizer.encode(END_OF_THINKING, add_special_tokens=False))
        return ReasoningGate(matcher, end_ids, ended=contains(prompt_ids, end_ids))

    def grammar_compiler(self) -> GrammarCompiler:
        """Made for the first structured request (it reads the whole vocabulary), once, whichever thread asks."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.hf_tokenizer is None:
                    raise FieldError("structured_outputs", "structured_outputs need a tokenizer: pass tokenizer=...")
                from paged_backend.structured_output.grammar import GrammarCompiler

                self._grammars = GrammarCompiler(self.hf_tokenizer, self.vocab_size, sorted(self.eos_token_ids))
            return self._grammars

    def _adapter(self, lora_request: LoRARequest | None) -> LoRAAdapter | None:
        """The request's adapter, read and checked now: a bad one fails this request only."""
        if lora_request is None:
            return None
        if self.adapters is None:
            raise FieldError("lora_request", "lora_request needs LLM(..., enable_lora=True)")
        if not isinstance(lora_request, LoRARequest):
            raise FieldError(
                "lora_request", f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}"
            )
        return self.adapters.get(lora_request)

    def _check(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise FieldError("prompt", "prompt must contain at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise FieldError("prompt", f"prompt_token_ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        max_model_len = self.config.max_model_len
        if len(ids) > max_model_len:
            raise FieldError("prompt", f"prompt has {len(ids)} tokens, more than max_model_len={max_model_len}")
        if params.stop and self.tokenizer is None:
            raise FieldError("stop", "stop strings need a tokenizer: pass tokenizer=... or use stop_token_ids")
        bad = [t for t in params.stop_token_id_list if t >= self.vocab_size]
        if bad:
            raise FieldError("stop_token_ids", f"stop_token_ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        bad = [t for t in params.logit_bias or {} if t >= self.vocab_size]
        if bad:
            raise FieldError("logit_bias", f"logit_bias's token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        max_num_seqs = self.config.scheduler_config.max_num_seqs
        if params.num_samples > max_num_seqs:
            raise FieldError(
                "best_of",
                f"best_of must be <= max_num_seqs={max_num_seqs} (its samples run together), got {params.num_samples}",
            )
