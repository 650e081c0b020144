"""``LLM`` (alias ``PagedGenerationBackend``): vLLM's offline API over the paged engine."""

from __future__ import annotations

import gc
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from paged_backend.chat_template import chat_template_kwargs as template_variables
from paged_backend.config import EngineConfig
from paged_backend.engine.engine_loop import EngineLoop
from paged_backend.engine.input_processor import check_text
from paged_backend.engine.llm_engine import LLMEngine, PromptType
from paged_backend.outputs import RequestOutput
from paged_backend.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Message = Mapping[str, Any]


class LLM:
    """Generate with a Hugging Face causal LM through a paged KV cache and continuous batching.

    ``model`` is a path, a hub id or a loaded ``PreTrainedModel`` (pass ``tokenizer=`` with it). Other keyword
    arguments are vLLM's engine arguments (see ``EngineConfig``); an unknown one is a TypeError.

    The engine's memory (KV cache, graph pools, worker processes, its thread) is given back by ``shutdown()``,
    by leaving ``with LLM(...) as llm:``, or once the ``LLM`` is garbage (``del llm``); the user's model object
    is left as it was.
    """

    def __init__(self, model: str | PreTrainedModel, tokenizer: Any = None, **kwargs: Any) -> None:
        name = (
            model
            if isinstance(model, str)
            else getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
        )
        tokenizer_name = tokenizer if isinstance(tokenizer, str) else None
        config = EngineConfig.from_kwargs(name, tokenizer=tokenizer_name, **kwargs)
        self._engine: LLMEngine | None = LLMEngine(config, model, tokenizer)
        self._request_counter = itertools.count()
        self._engine_loop: EngineLoop | None = None
        self._stepping = threading.Lock()  # held by a direct run (generate before any loop exists)
        self._loop_finalizer: weakref.finalize[Any, Any]

    @property
    def llm_engine(self) -> LLMEngine:
        if self._engine is None:
            raise RuntimeError("this LLM was shut down: its engine and memory are gone; make a new LLM")
        return self._engine

    def shutdown(self) -> None:
        """Give the engine's memory back now: the engine loop stops (requests in flight on it end with
        ``EngineDeadError``), tensor-parallel workers exit, LoRA's hooks come off the model, and the engine (its
        KV cache and CUDA graphs) is dropped. The ``LLM`` is unusable afterwards; a second call does nothing."""
        with self._stepping:  # after a direct run in progress on another thread
            loop, self._engine_loop = self._engine_loop, None
            engine, self._engine = self._engine, None
        if loop is not None:
            self._loop_finalizer.detach()  # it holds the loop, and so the engine
            loop.shutdown(wait=True)
        if engine is not None:
            engine.shutdown()
            device = engine.device
            del engine, loop
            gc.collect()  # the engine's own reference cycles, so that its tensors are freed before the next line
            if device.type == "cuda":
                torch.cuda.empty_cache()

    def reset_prefix_cache(self) -> None:
        """Forget the cached prompt prefixes (vLLM's name). The engine does this itself when a parameter is
        updated in place through the tensor (``optimizer.step()``, ``param.copy_``); a write through ``.data``
        bypasses the tensor's version, so after one call this before the next ``generate``."""
        self._on_engine(lambda engine: engine.scheduler.reset_prefix_cache())

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode: free the KV cache and the CUDA graphs, keeping the weights (they are the user's
        model's), e.g. while a trainer needs the memory. Only while no request is in flight; until ``wake_up()``
        requests are refused with an error saying so."""
        self._on_engine(lambda engine: engine.sleep(level))

    def wake_up(self) -> None:
        """Allocate the KV cache again (CUDA graphs are captured again) after ``sleep()``."""
        self._on_engine(lambda engine: engine.wake_up())

    def _on_engine(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """``fn(engine)`` between steps: on the engine loop's thread once it runs, else here."""
        if self._engine_loop is not None:
            return self._engine_loop.call_sync(fn)
        with self._stepping:
            return fn(self.llm_engine)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def engine_loop(self) -> EngineLoop:
        """The background thread that steps this engine for async and multi-threaded callers (the LangChain and
        LlamaIndex adapters share one ``LLM`` through it), started on first use. From then on ``generate`` goes
        through it as well, so that exactly one thread ever steps the engine."""
        return self._engine_loop or self.start_engine_loop()

    def start_engine_loop(self, **loop_kwargs: Any) -> EngineLoop:
        """Start the engine loop with ``EngineLoop``'s options (the server sets a queue limit and metrics
        callbacks). It waits for a ``generate`` that is stepping the engine directly; a second start is an
        error, as is a start after the loop has stopped."""
        with self._stepping:
            if self._engine_loop is not None:
                if not loop_kwargs:
                    return self._engine_loop
                raise RuntimeError("this LLM's engine loop is already running: start it once, before other users")
            self._engine_loop = EngineLoop(self.llm_engine, **loop_kwargs)
            # The loop's thread holds the engine: once this LLM is garbage, stop it so the engine can go too.
            self._loop_finalizer = weakref.finalize(self, self._engine_loop.shutdown, False)
            return self._engine_loop

    def next_request_id(self, prefix: str = "") -> str:
        return f"{prefix}{next(self._request_counter)}"

    def get_tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self.llm_engine.tokenizer

    def stats(self) -> dict[str, Any]:
        """KV blocks, queue lengths, preemptions, prefix-cache hit rate, KV waste (see ``LLMEngine.stats``)."""
        return self.llm_engine.stats()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: Any = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        prompts = prompt_list(prompts)
        params = [
            SamplingParams() if p is None else p
            for p in per_prompt("sampling_params", sampling_params, len(prompts), "one SamplingParams")
        ]
        loras = per_prompt("lora_request", lora_request, len(prompts), "one LoRARequest (None: the base model)")
        return self._run(prompts, params, use_tqdm, loras)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate. As vLLM's:
        ``continue_final_message`` continues the last (assistant) message instead of opening a new one, ``tools``
        (OpenAI's tool dicts) and ``chat_template_kwargs`` reach the template."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer: pass tokenizer=... to LLM")
        if not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts or of conversations")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be True")
        extra = template_variables(chat_template_kwargs)
        if tools:
            extra["tools"] = tools
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                list(conversation),  # type: ignore[arg-type]  # transformers says dict[str, str]; content may be parts
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                **extra,
            )
            if not isinstance(text, str):  # tokenize=False renders text
                raise TypeError(f"the chat template rendered {type(text).__name__}, not text")
            check_text("messages", text)
            # The template already holds any BOS: do not add special tokens a second time.
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids})
        return self.generate(prompts, sampling_params, lora_request=lora_request, use_tqdm=use_tqdm)

    def _run(
        self, prompts: list[PromptType], params: list[SamplingParams], use_tqdm: bool, loras: list[Any]
    ) -> list[RequestOutput]:
        with self._stepping:
            if self._engine_loop is None:
                return self._run_direct(prompts, params, use_tqdm, loras)
        return self.run_on_loop(prompts, params, use_tqdm=use_tqdm, lora_request=loras)

    def _run_direct(
        self, prompts: list[PromptType], params: list[SamplingParams], use_tqdm: bool, loras: list[Any]
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                request_id = str(next(self._request_counter))
                engine.add_request(request_id, prompt, p, lora_request=lora)
                ids.append(request_id)
        except Exception:
            engine.abort_request(ids)  # a bad prompt queues nothing
            raise
        finished: dict[str, RequestOutput] = {}
        start, generated = time.perf_counter(), engine.num_generated_tokens
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True) as bar:
            try:
                while len(finished) < len(ids):
                    for output in engine.step(finished_only=True):
                        if output.finished:
                            finished[output.request_id] = output
                            bar.update(1)
                    if use_tqdm:
                        elapsed = max(time.perf_counter() - start, 1e-9)
                        bar.set_postfix_str(
                            f"output: {(engine.num_generated_tokens - generated) / elapsed:.1f} toks/s",
                            refresh=False,
                        )
            except BaseException:
                engine.abort_request([i for i in ids if i not in finished])
                raise
        return [finished[i] for i in ids]

    def run_on_loop(
        self,
        prompts: list[Any],
        params: SamplingParams | list[SamplingParams],
        use_tqdm: bool = False,
        timeout: float | None = None,
        prefix: str = "",
        on_output: Callable[[int, RequestOutput], None] | None = None,
        **add_kwargs: Any,
    ) -> list[RequestOutput]:
        """Every prompt through the engine loop in one call (sharing steps with other callers); the final output
        of each. Past ``timeout`` seconds the unfinished ones are aborted and TimeoutError is raised.
        ``on_output(i, output)`` sees each step's output of prompt ``i`` as it comes (a streamer); ``add_kwargs``
        go to the engine's ``add_request``."""
        loop = self.engine_loop
        requests = [(self.next_request_id(prefix), prompt) for prompt in prompts]
        queues = loop.add_sync(requests, params, stream=on_output is not None, **add_kwargs)
        deadline = None if timeout is None else time.monotonic() + timeout
        finished: list[RequestOutput] = []
        with tqdm(total=len(requests), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True) as bar:
            try:
                for i, ((request_id, _), queue) in enumerate(zip(requests, queues)):
                    for final in loop.stream_sync(request_id, queue, deadline):
                        if on_output is not None:
                            on_output(i, final)
                    finished.append(final)
                    bar.update(1)
            except BaseException:
                for request_id, _ in requests[len(finished) :]:
                    loop.abort(request_id)
                raise
        return finished


PagedGenerationBackend = LLM


def prompt_list(prompts: object) -> list[PromptType]:
    """One prompt (a str or a dict) or a list of them, as a list; any other type is a TypeError naming it (bytes
    and None included: iterating them would give a confusing error about their items)."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, Sequence) and not isinstance(prompts, (bytes, bytearray)):
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, (str, Mapping)):
                raise TypeError(
                    f"prompts[{i}] must be a str or a dict with 'prompt' or 'prompt_token_ids', "
                    f"got {type(prompt).__name__}"
                )
        return list(prompts)
    raise TypeError(
        "prompts must be a str, a dict with 'prompt' or 'prompt_token_ids', or a list of them, "
        f"got {type(prompts).__name__}"
    )


def per_prompt(name: str, value: Any, num_prompts: int, one: str) -> list[Any]:
    """``value`` for every prompt, or a list holding exactly one per prompt."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        values = list(value)
        if len(values) != num_prompts:
            raise ValueError(
                f"{name} must be {one} or a list of {num_prompts} (one per prompt), got a list of {len(values)}"
            )
        return values
    return [value] * num_prompts
