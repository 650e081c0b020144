"""Drop-in for Hugging Face code: ``patch(model)`` makes ``model.generate`` run on the paged engine.

The replacement takes HF's arguments and returns what HF returns. HF's own ``_prepare_generation_config`` merges
``generation_config``, the model's defaults and keyword arguments, so invalid combinations raise HF's errors.
What the engine cannot do (beam search, custom logits processors or stopping criteria, right padding, ...) runs on
the original ``generate`` after one warning naming the reason, or raises with ``fallback="error"``. Callers on
several threads share the engine: whichever holds the lock steps it for all, so their requests batch together.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import threading
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.generation.utils import GenerateDecoderOnlyOutput

from paged_backend.integrations.hf_args import DEFAULT_MAX_LENGTH, OBJECT_ARGUMENTS, plan_call, static_cache_call
from paged_backend.integrations.hf_assisted import assisted_speculation
from paged_backend.integrations.hf_outputs import Replay, hf_output, hf_replay, static_cache, step_logits
from paged_backend.model_structure import set_module_attribute
from paged_backend.outputs import RequestOutput
from paged_backend.sampling_params import SamplingParams

if TYPE_CHECKING:
    from paged_backend.engine.llm_engine import LLMEngine
    from paged_backend.entrypoints.llm import LLM

logger = logging.getLogger(__name__)

FALLBACKS = ("warn", "error")
_MARK = "__paged_backend_generate__"


class PagedGenerate:
    """What ``model.generate`` becomes: the engine (built on the first call, over the model's own weights) and
    the original method for fallbacks."""

    def __init__(self, model: PreTrainedModel, tokenizer: Any, fallback: str, engine_kwargs: dict[str, Any]) -> None:
        if fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {list(FALLBACKS)}, got {fallback!r}")
        if not isinstance(model, GenerationMixin):  # transformers 5: a PreTrainedModel alone has no generate
            raise TypeError(f"{type(model).__name__} has no generate to replace: it is not a GenerationMixin")
        self.model = model
        self.tokenizer = tokenizer
        self.fallback = fallback
        if engine_kwargs.get("tensor_parallel_size", 1) == 1:  # HF's inputs_embeds become prompt embeddings
            engine_kwargs = {"enable_prompt_embeds": True, **engine_kwargs}
        self.engine_kwargs = engine_kwargs
        self.previous = model.__dict__.get("generate")  # an instance attribute to restore, if there was one
        self.original = self.previous or type(model).generate.__get__(model)
        self.llm: LLM | None = None
        # the speculative_config the first call's assisted decoding asked for (patch() named none), tried when the
        # engine is built; an assisted call that runs without proposals is said once
        self.asked_speculation: dict[str, Any] | None = None
        self.told_speculation = False
        # Guards building the engine, and HF's generate run before there is one. Reentrant: HF's generate may call
        # generate on the same model from inside (a model that is its own assistant_model).
        self.lock = threading.RLock()

    def built_llm(self) -> LLM:
        """The engine's ``LLM``, built on first use over the model's own weights. Every call steps it through its
        engine loop, so calls from several threads share steps."""
        with self.lock:
            if self.llm is None:
                from paged_backend.entrypoints.llm import LLM

                if self.asked_speculation is not None:  # refused (TP, batch_invariant, a short draft): built without
                    kwargs = {**self.engine_kwargs, "speculative_config": self.asked_speculation}
                    try:
                        self.llm = LLM(self.model, tokenizer=self.tokenizer, **kwargs)
                    except (ValueError, TypeError) as exc:
                        self._tell(f"the engine takes no such proposals ({exc})")
                if self.llm is None:
                    self.llm = LLM(self.model, tokenizer=self.tokenizer, **self.engine_kwargs)
            return self.llm

    @property
    def engine(self) -> LLMEngine:
        """The ``LLMEngine`` behind the patched ``generate`` (built on first use)."""
        return self.built_llm().llm_engine

    def close(self) -> None:
        """Give the engine's memory back (``LLM.shutdown``); a later call builds a new engine."""
        with self.lock:
            llm, self.llm = self.llm, None
            self.asked_speculation, self.told_speculation = None, False  # the next engine's first call decides
        if llm is not None:
            llm.shutdown()

    # ------------------------------------------------------------------ the call
    def __call__(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        streamer: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor | GenerateDecoderOnlyOutput:
        reason = next((f"{name} is set" for name in OBJECT_ARGUMENTS if kwargs.get(name)), None)
        if reason is not None:
            return self._fall_back(reason, inputs, generation_config, streamer, kwargs)
        hf_kwargs = {k: v for k, v in kwargs.items() if k not in OBJECT_ARGUMENTS and k != "assistant_model"}
        rng = torch.get_rng_state()  # sampled rows draw their seeds from it: a late fall-back restores it
        # As HF decides before merging: no max_length anywhere means "20 new tokens", not 20 in all.
        configs = (generation_config, self.model.generation_config)
        default_length = kwargs.get("max_length") is None and all(
            c is None or c.max_length in (None, DEFAULT_MAX_LENGTH) for c in configs
        )
        prepare = self.model._prepare_generation_config  # type: ignore[misc]  # a self Protocol no model meets
        config, model_kwargs = prepare(copy.deepcopy(generation_config), **hf_kwargs)
        if model_kwargs.get("inputs_embeds") is not None and not self.engine_kwargs.get("enable_prompt_embeds"):
            return self._fall_back("inputs_embeds is set", inputs, generation_config, streamer, kwargs)
        if config.stop_strings and self.tokenizer is None:
            if self.llm is None and model_kwargs.get("tokenizer") is not None:
                self.tokenizer = model_kwargs["tokenizer"]  # the engine, built now, detokenizes with it
            else:
                reason = "stop_strings need the tokenizer: pass it to patch()"
                return self._fall_back(reason, inputs, generation_config, streamer, kwargs)
        keep_logits = bool(config.return_dict_in_generate and (config.output_scores or config.output_logits))
        if keep_logits and streamer is not None:  # a late fall-back (rows ending apart) would stream twice
            reason = "a streamer with output_scores or output_logits"
            return self._fall_back(reason, inputs, generation_config, streamer, kwargs)
        call = plan_call(self.model, inputs, config, model_kwargs, default_length, kwargs.get("assistant_model"))
        if isinstance(call, str):
            return self._fall_back(call, inputs, generation_config, streamer, kwargs)
        self._speculate_as_asked(assisted_speculation(config, kwargs.get("assistant_model")))
        if "prompt_embeds" in call.prompts[0] and self.built_llm().llm_engine.input_processor.embedding is None:
            torch.set_rng_state(rng)
            reason = "inputs_embeds on a model whose input embedding is not an nn.Embedding"
            return self._fall_back(reason, inputs, generation_config, streamer, kwargs)
        if streamer is not None:
            streamer.put(call.prefix.cpu())
        outputs = self._run(call.prompts, call.params, streamer, keep_logits)
        if streamer is not None:
            streamer.end()
        completions = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]
        n = config.num_return_sequences or 1
        new = max(len(c.token_ids) for c in completions)
        if keep_logits and any(len(c.token_ids) < new for c in completions):
            # HF keeps computing a finished row, fed padding, and reports those logits; the engine ended it
            torch.set_rng_state(rng)
            reason = "a row ended before the others and its scores/logits after that are HF's of feeding it padding"
            return self._fall_back(reason, inputs, generation_config, streamer, kwargs)
        width = call.prefix.shape[1]
        sequences = torch.full((len(completions), width + new), call.pad, dtype=torch.long, device=call.prefix.device)
        sequences[:, :width] = call.prefix.repeat_interleave(n, dim=0)
        for r, c in enumerate(completions):
            sequences[r, width : width + len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long)
        replay = None
        # HF's generate extends a passed-in cache in place (and returns it), and returns its cache, attentions and
        # hidden states: a forward of the model as HF runs it, on the loop thread, between the engine's steps
        details = config.return_dict_in_generate and (config.output_attentions or config.output_hidden_states)
        if call.past is not None or details or (config.return_dict_in_generate and config.use_cache is not False):
            prompt, mask = (t.repeat_interleave(n, dim=0).to(sequences.device) for t in (call.prompt, call.mask))
            past = static_cache(self.model, config, len(completions)) if static_cache_call(config) else call.past
            forward = functools.partial(_replay, self.model, prompt, sequences[:, width:], mask, past, config)
            replay = self.built_llm().engine_loop.call_sync(forward)
            if config.use_cache is False:
                replay = replay._replace(cache=None)
        if not config.return_dict_in_generate:
            return sequences
        if not keep_logits:
            return hf_output(sequences, replay=replay)
        logits = step_logits(completions, new, sequences.device)
        scores = None
        if config.output_scores:
            scores = tuple(
                call.processors(sequences[:, : width + t], row.clone())  # type: ignore[arg-type]  # see hf_output
                for t, row in enumerate(logits)
            )
        return hf_output(sequences, scores, logits if config.output_logits else None, replay)

    def _speculate_as_asked(self, spec: dict[str, Any] | None) -> None:
        """An assisted call (``spec``, from ``assisted_speculation``) that builds the engine builds it with those
        proposals (``built_llm``), unless ``patch`` named a ``speculative_config``; settings the engine refuses,
        or an engine already built without proposals, decode the same tokens without them, said once."""
        with self.lock:
            if spec is None or "speculative_config" in self.engine_kwargs:
                return
            if self.llm is None:
                self.asked_speculation = spec
            elif self.llm.llm_engine.config.speculative_config is None:
                self._tell("the engine was built without proposals (patch(model, speculative_config=...) sets them)")

    def _tell(self, why: str) -> None:
        if not self.told_speculation:
            self.told_speculation = True
            logger.warning("assisted decoding runs on the engine without proposals: %s", why)

    def _run(
        self, prompts: list[dict[str, Any]], params: list[SamplingParams], streamer: Any, keep_logits: bool = False
    ) -> list[RequestOutput]:
        """All requests in one engine call; the first one's new tokens go to the streamer as they come."""
        streamed = [0]

        def stream_first(i: int, out: RequestOutput) -> None:
            tokens = out.outputs[0].token_ids
            if i == 0:
                for token in tokens[streamed[0] :]:
                    streamer.put(torch.tensor([token]))
                streamed[0] = len(tokens)

        return self.built_llm().run_on_loop(
            prompts,
            params,
            prefix="hf-",
            on_output=stream_first if streamer is not None else None,
            keep_logits=keep_logits,
        )

    def _fall_back(
        self, reason: str, inputs: Any, generation_config: Any, streamer: Any, kwargs: dict[str, Any]
    ) -> Any:
        if self.fallback == "error":
            raise NotImplementedError(f"the paged engine cannot run this generate call: {reason}")
        warnings.warn(f"paged_backend: {reason}; running the original generate", stacklevel=3)

        def original(_: Any = None) -> Any:
            return self.original(inputs, generation_config=generation_config, streamer=streamer, **kwargs)

        with self.lock:
            llm = self.llm
            if llm is None:  # no engine yet: nothing else can be using the model
                return original()
        # The engine's steps switch the model's attention: HF's generate runs on the loop thread, between steps.
        return llm.engine_loop.call_sync(original)


def _replay(
    model: PreTrainedModel,
    prompt: torch.Tensor,
    new: torch.Tensor,
    mask: torch.Tensor,
    past: Any,
    config: Any,
    _: object,
) -> Replay:
    return hf_replay(model, prompt, new, mask, past, config)


# ---------------------------------------------------------------------------------------------------- public
def patch(model: PreTrainedModel, tokenizer: Any = None, fallback: str = "warn", **engine_kwargs: Any) -> PagedGenerate:
    """Replace ``model.generate`` with the paged engine's; returns the handle (its ``engine`` is built on the first
    call). Patching a patched model returns the existing handle."""
    current = model.__dict__.get("generate")
    if current is not None and hasattr(current, _MARK):
        return getattr(current, _MARK)
    handle = PagedGenerate(model, tokenizer, fallback, engine_kwargs)

    @functools.wraps(handle.original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        return handle(*args, **kwargs)

    setattr(generate, _MARK, handle)
    set_module_attribute(model, "generate", generate)
    return handle


def unpatch(model: PreTrainedModel) -> None:
    """Restore the ``generate`` the model had before ``patch`` and give the engine's memory back (its KV cache,
    threads, workers); a model that is not patched is left alone."""
    current = model.__dict__.get("generate")
    if current is None or not hasattr(current, _MARK):
        return
    handle: PagedGenerate = getattr(current, _MARK)
    if handle.previous is None:
        del model.generate
    else:
        model.generate = handle.previous
    handle.close()


@contextlib.contextmanager
def patched(
    model: PreTrainedModel, tokenizer: Any = None, fallback: str = "warn", **engine_kwargs: Any
) -> Iterator[PagedGenerate]:
    """``with patched(model): ...`` runs ``model.generate`` on the paged engine inside the block; leaving it
    restores ``generate`` and gives the engine's memory back."""
    handle = patch(model, tokenizer, fallback, **engine_kwargs)
    try:
        yield handle
    finally:
        unpatch(model)
