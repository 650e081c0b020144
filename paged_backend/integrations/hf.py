"""Drop-in for Hugging Face code: ``patch(model)`` makes ``model.generate`` run on the paged engine.

The replacement takes HF's arguments and returns what HF returns. HF's own ``_prepare_generation_config`` merges
``generation_config``, the model's defaults and keyword arguments, so invalid combinations raise HF's errors.
What the engine cannot do (beam search, assisted decoding, custom logits processors or stopping criteria,
attentions, hidden states, ...) runs on the original ``generate`` after one warning naming the reason, or raises with
``fallback="error"``. Callers on several threads share the engine: whichever holds the lock steps it for all,
so their requests batch together.
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

from paged_backend.integrations.hf_outputs import RowProcessors, hf_cache, hf_output, hf_processors, step_logits
from paged_backend.model_structure import set_module_attribute
from paged_backend.outputs import RequestOutput
from paged_backend.sampling_params import SamplingParams

if TYPE_CHECKING:
    from paged_backend.engine.llm_engine import LLMEngine
    from paged_backend.entrypoints.llm import LLM

logger = logging.getLogger(__name__)

FALLBACKS = ("warn", "error")
_DEFAULT_MAX_LENGTH = 20  # GenerationConfig's historic default: HF reads it as 20 new tokens
_MARK = "__paged_backend_generate__"
# GenerationConfig fields the engine honours, or that do not change the result.
_HONOURED = {
    "max_new_tokens",
    "max_length",
    "min_new_tokens",
    "min_length",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "num_return_sequences",
    "num_beams",
    "eos_token_id",
    "pad_token_id",
    "bos_token_id",
    "decoder_start_token_id",
    "stop_strings",
    "return_dict_in_generate",
    "output_scores",
    "output_logits",
    "use_cache",
    "transformers_version",
    # run on the engine by HF's own processors, per row (hf_outputs.RowProcessors)
    "sequence_bias",
    "no_repeat_ngram_size",
    "bad_words_ids",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "renormalize_logits",  # scores only: it does not change which token is chosen
    "_from_model_config",
}
# Fields that only act with beam search or an assistant model (both fall back on their own), or on how HF compiles.
_NO_EFFECT = {
    "early_stopping",
    "length_penalty",
    "num_assistant_tokens",
    "num_assistant_tokens_schedule",
    "assistant_confidence_threshold",
    "assistant_lookbehind",
    "target_lookbehind",
    "assistant_early_exit",
    "max_matching_ngram_size",
    "compile_config",
    "disable_compile",
    "cache_config",
    "return_legacy_cache",
}
# Values at which the other logits processors do nothing (besides None and False).
_NEUTRAL = {
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "encoder_repetition_penalty": 1.0,
    "encoder_no_repeat_ngram_size": 0,
    "num_beam_groups": 1,
    "diversity_penalty": 0.0,
    "guidance_scale": 1.0,
    "cache_implementation": "dynamic",  # the cache HF returns by default (hf_cache); others go to HF's generate
}
_FLAGS_OFF = ("output_attentions", "output_hidden_states")
# generate() arguments that carry objects the engine cannot run.
_OBJECT_ARGUMENTS = (
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "assistant_model",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "custom_generate",
    "synced_gpus",
)
_MODEL_KWARGS = {"attention_mask", "tokenizer", "use_cache"}


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
        self.engine_kwargs = engine_kwargs
        self.previous = model.__dict__.get("generate")  # an instance attribute to restore, if there was one
        self.original = self.previous or type(model).generate.__get__(model)
        self.llm: LLM | None = None
        self.lock = threading.Lock()  # guards building the engine

    def built_llm(self) -> LLM:
        """The engine's ``LLM``, built on first use over the model's own weights. Every call steps it through its
        engine loop, so calls from several threads share steps."""
        with self.lock:
            if self.llm is None:
                from paged_backend.entrypoints.llm import LLM

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
        reason = next((f"{name} is set" for name in _OBJECT_ARGUMENTS if kwargs.get(name)), None)
        if reason is None and kwargs.get("inputs_embeds") is not None:
            reason = "inputs_embeds is set"
        if reason is not None:
            return self._fall_back(reason, inputs, generation_config, streamer, kwargs)
        hf_kwargs = {k: v for k, v in kwargs.items() if k not in _OBJECT_ARGUMENTS}
        # As HF decides before merging: no max_length anywhere means "20 new tokens", not 20 in all.
        configs = (generation_config, self.model.generation_config)
        default_length = kwargs.get("max_length") is None and all(
            c is None or c.max_length in (None, _DEFAULT_MAX_LENGTH) for c in configs
        )
        prepare = self.model._prepare_generation_config  # type: ignore[misc]  # a self Protocol no model meets
        config, model_kwargs = prepare(copy.deepcopy(generation_config), **hf_kwargs)
        input_ids = inputs if inputs is not None else model_kwargs.pop("input_ids", None)
        reason = unsupported(config, model_kwargs, input_ids)
        if reason is not None:
            return self._fall_back(reason, inputs, generation_config, streamer, kwargs)
        if config.stop_strings and self.tokenizer is None:
            if self.llm is None and model_kwargs.get("tokenizer") is not None:
                self.tokenizer = model_kwargs["tokenizer"]  # the engine, built now, detokenizes with it
            else:
                reason = "stop_strings need the tokenizer: pass it to patch()"
                return self._fall_back(reason, inputs, generation_config, streamer, kwargs)
        mask = attention_mask(input_ids, model_kwargs.get("attention_mask"), config)
        real = mask.ne(0).int()
        if bool((real.cummax(dim=1).values > real).any()):
            reason = "attention_mask pads a row on the right (HF generates after the padding)"
            return self._fall_back(reason, inputs, generation_config, streamer, kwargs)
        eos = eos_token_ids(config)
        pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
        width = input_ids.shape[1]
        if config.max_new_tokens is not None:
            max_new = config.max_new_tokens
        elif default_length:
            limit = getattr(self.model.config, "max_position_embeddings", None)
            max_new = config.max_length if limit is None else min(config.max_length, limit - width)
        else:
            max_new = config.max_length - width
        if max_new < 1:  # HF's own generate says what is wrong with the lengths
            return self._fall_back("no tokens left to generate", inputs, generation_config, streamer, kwargs)
        config.max_length = width + max_new  # as HF sets it (its forced EOS comes at the last token)
        pads = mask.ne(0).int().argmax(dim=1)
        padding = pads.repeat_interleave(config.num_return_sequences or 1)
        processors = hf_processors(config, width, padding.to(input_ids.device))  # raises what HF's would
        prompts = [row[m.bool()].tolist() for row, m in zip(input_ids, mask)]
        params = [
            sampling_params(config, eos, max_new, width, RowProcessors.of(processors, row[:n].tolist()))
            for row, n in zip(input_ids, pads.tolist())
        ]
        if streamer is not None:
            streamer.put(input_ids.cpu())
        keep_logits = bool(config.return_dict_in_generate and (config.output_scores or config.output_logits))
        outputs = self._run(prompts, params, streamer, keep_logits)
        rows = [
            (i, list(c.token_ids)) for i, out in enumerate(outputs) for c in sorted(out.outputs, key=lambda c: c.index)
        ]
        new = max(len(tokens) for _, tokens in rows)
        sequences = torch.full((len(rows), width + new), pad, dtype=torch.long, device=input_ids.device)
        for r, (i, tokens) in enumerate(rows):
            sequences[r, :width] = input_ids[i]
            sequences[r, width : width + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        if streamer is not None:
            streamer.end()
        if not config.return_dict_in_generate:
            return sequences
        cache = None
        if config.use_cache is not False:
            prompt_mask = mask.repeat_interleave(config.num_return_sequences or 1, dim=0).to(sequences.device)
            # a forward of the model as HF runs it: on the loop thread, between the engine's steps
            loop = self.built_llm().engine_loop
            cache = loop.call_sync(functools.partial(_cache, self.model, sequences, prompt_mask))
        if not keep_logits:
            return hf_output(sequences, cache=cache)
        completions = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]
        logits = step_logits(completions, new, sequences.device)
        scores = None
        if config.output_scores:
            scores = tuple(
                processors(sequences[:, : width + t], row.clone())  # type: ignore[arg-type]  # as in hf_output
                for t, row in enumerate(logits)
            )
        return hf_output(sequences, scores, logits if config.output_logits else None, cache)

    def _run(
        self, prompts: list[list[int]], params: list[SamplingParams], streamer: Any, keep_logits: bool = False
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
            [{"prompt_token_ids": p} for p in prompts],
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


def _cache(model: PreTrainedModel, sequences: torch.Tensor, prompt_mask: torch.Tensor, _: object) -> Any:
    return hf_cache(model, sequences, prompt_mask)


def unsupported(config: GenerationConfig, model_kwargs: dict[str, Any], input_ids: Any) -> str | None:
    """Why the engine cannot run this call, or None."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.numel() == 0:
        return "input_ids must be a 2-D tensor of token ids [batch, length]"
    if config.num_beams != 1:
        return f"num_beams={config.num_beams} (beam search)"
    for flag in _FLAGS_OFF:
        if getattr(config, flag, False):
            return f"{flag}=True"
    for name, value in config.to_diff_dict().items():
        if name in _HONOURED or name in _NO_EFFECT or value is None or value is False:
            continue
        if name not in _NEUTRAL or value != _NEUTRAL[name]:
            return f"{name}={value!r}"
    penalty = config.repetition_penalty not in (None, 1.0)
    if penalty and config.exponential_decay_length_penalty is not None:  # see hf_outputs.RowProcessors
        return "exponential_decay_length_penalty with repetition_penalty"
    extra = sorted(k for k, v in model_kwargs.items() if k not in _MODEL_KWARGS and v is not None)
    if extra:
        return f"model arguments {extra}"
    return None


def attention_mask(input_ids: torch.Tensor, mask: torch.Tensor | None, config: GenerationConfig) -> torch.Tensor:
    """The given mask, or HF's inference: padding where the pad token appears, when it is not also EOS."""
    if mask is not None:
        return mask.view(input_ids.shape)
    pad, eos = config.pad_token_id, config.eos_token_id
    eos_ids = [] if eos is None else torch.tensor(eos).view(-1).tolist()
    if pad is not None and pad not in eos_ids and bool((input_ids == pad).any()):
        return input_ids.ne(pad).long()
    return torch.ones_like(input_ids)


def eos_token_ids(config: GenerationConfig) -> list[int]:
    """The config's EOS ids. A negative id never matches a token: HF warns and generates to the length limit."""
    eos = [] if config.eos_token_id is None else list(torch.tensor(config.eos_token_id).view(-1).tolist())
    if any(token < 0 for token in eos):
        logger.warning(
            "`eos_token_id` should consist of positive integers, but is %s. Your generation will not stop until the "
            "maximum length is reached. Depending on other flags, it may even crash.",
            torch.tensor(eos),
        )
    return [token for token in eos if token >= 0]


def sampling_params(
    config: GenerationConfig, eos: list[int], max_new: int, width: int, row_processors: RowProcessors | None = None
) -> SamplingParams:
    """One row's SamplingParams. EOS comes from the config alone (``ignore_eos`` keeps the engine's own set out).
    Sampled rows draw their seed from torch's global generator, so ``torch.manual_seed`` reproduces them.
    ``row_processors``: HF's processors the sampler has no equivalent of, run on the row at every step."""
    n = config.num_return_sequences or 1
    min_new = config.min_new_tokens if config.min_new_tokens is not None else max(0, (config.min_length or 0) - width)
    common = dict(
        n=n,
        max_tokens=max_new,
        min_tokens=min(min_new, max_new),
        stop_token_ids=eos,
        ignore_eos=True,
        stop=config.stop_strings,
        include_stop_str_in_output=True,
        repetition_penalty=config.repetition_penalty or 1.0,
        logits_processors=None if row_processors is None else [row_processors],
    )
    if not config.do_sample:
        return SamplingParams(temperature=0.0, **common)
    top_p = config.top_p if config.top_p is not None else 1.0
    return SamplingParams(
        temperature=config.temperature if config.temperature is not None else 1.0,
        top_k=1 if top_p == 0 else config.top_k or -1,  # HF's top_p=0 keeps the most likely token alone
        top_p=top_p or 1.0,
        min_p=config.min_p or 0.0,
        seed=int(torch.randint(0, 2**62, (1,)).item()),
        **common,
    )


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
