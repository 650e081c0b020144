"""HF's ``generate`` arguments as engine requests: which settings the engine honours, the prompts (token ids or
embeddings, left padding dropped), each row's SamplingParams, and why a call goes to HF's own ``generate``."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList

from paged_backend.integrations.hf_outputs import RowProcessors, hf_processors
from paged_backend.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_LENGTH = 20  # GenerationConfig's historic default: HF reads it as 20 new tokens

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
    "output_attentions",  # recomputed by one forward (hf_outputs.hf_replay)
    "output_hidden_states",
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
# Fields that only act with beam search (which falls back on its own) or in assisted decoding (assisted_reason), or
# on how HF compiles.
_NO_EFFECT = {
    "prompt_lookup_num_tokens",
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
    "prefill_chunk_size",
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
    "cache_implementation": "dynamic",  # the cache HF returns by default (hf_replay); static ones: STATIC_CACHES
}
# Static caches: the engine runs the call and hf_replay fills the cache HF would have made (hf_outputs.static_cache).
STATIC_CACHES = ("static", "offloaded_static")
# generate() arguments that carry objects the engine cannot run.
OBJECT_ARGUMENTS = (
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "custom_generate",
    "synced_gpus",
)
_MODEL_KWARGS = {"attention_mask", "tokenizer", "use_cache", "inputs_embeds", "past_key_values", "cache"}
_MODEL_KWARGS |= {"output_attentions", "output_hidden_states"}  # also in the config, honoured there
_MODEL_KWARGS |= {"logits_to_keep"}  # which positions' logits the forward computes: generate reads the last only


def unsupported(config: GenerationConfig, model_kwargs: dict[str, Any]) -> str | None:
    """Why the engine cannot run this call's settings, or None."""
    if config.num_beams != 1:
        return f"num_beams={config.num_beams} (beam search)"
    for name, value in config.to_diff_dict().items():
        if name in _HONOURED or name in _NO_EFFECT or value is None or value is False:
            continue
        if name in ("cache_implementation", "max_cache_len") and static_cache_call(config):
            continue
        if name not in _NEUTRAL or value != _NEUTRAL[name]:
            return f"{name}={value!r}"
    penalty = config.repetition_penalty not in (None, 1.0)
    if penalty and config.exponential_decay_length_penalty is not None:  # see hf_outputs.RowProcessors
        return "exponential_decay_length_penalty with repetition_penalty"
    extra = sorted(k for k, v in model_kwargs.items() if k not in _MODEL_KWARGS and v is not None)
    if extra:
        return f"model arguments {extra}"
    passed = model_kwargs.get("cache", model_kwargs.get("past_key_values")) is not None
    if static_cache_call(config) and passed:  # HF refuses a cache with a cache_implementation
        return f"cache_implementation={config.cache_implementation!r} with a passed-in cache"
    if passed and config.use_cache is False:
        return "a passed-in cache with use_cache=False"
    return None


def padding_reason(model: Any, config: GenerationConfig, real: torch.Tensor, past: Any) -> str | None:
    """Left padding and holes (a 0 between 1s in ``attention_mask``) run on the engine: HF's positions count a row's
    real tokens and no real token attends to a masked one, so HF's tokens are those of the row's real tokens alone,
    which the engine decodes. Right padding does not: HF predicts the first new token at the last position, a pad,
    and continues the row at positions counted on from that pad's. Nor do holes where HF reads the masked slots: a
    sliding window (it spans cache slots, holes included), a repetition penalty (HF's penalises the masked tokens'
    ids) or a passed-in cache (whose slots hold the holes). None: the engine runs it."""
    if not bool(real[:, -1].all()):
        return "attention_mask pads a row on the right (HF generates after the padding)"
    if not bool((real.cummax(dim=1).values > real).any()):
        return None
    refusals = {
        "a model with sliding-window layers": sliding_layers(model),
        "repetition_penalty": config.repetition_penalty not in (None, 1.0),
        "a passed-in cache": past is not None,
    }
    reason = next((name for name, hit in refusals.items() if hit), None)
    return None if reason is None else f"attention_mask with holes (a 0 between 1s) and {reason}"


def sliding_layers(model: Any) -> bool:
    """Whether any layer of the model attends over a sliding window (or another pattern than full attention)."""
    text = model.config.get_text_config()
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        return any(t != "full_attention" for t in layer_types)
    return getattr(text, "sliding_window", None) is not None


def assisted_reason(model: Any, config: GenerationConfig, assistant: Any, batch_size: int, embeds: bool) -> str | None:
    """Assisted decoding (an ``assistant_model``, prompt lookup, early exit) is a way of finding the model's own
    tokens: the engine decodes them directly (HF splits its verification forwards' attentions and hidden states
    into greedy's steps, which the replay gives). What HF refuses, or runs as something else (another
    tokenizer's assistant), goes to HF's ``generate``. None: the engine runs it (or it is not assisted)."""
    if assistant is None and config.prompt_lookup_num_tokens is None and config.assistant_early_exit is None:
        return None
    text = model.config.get_text_config()
    other_vocab = assistant is not None and assistant.config.get_text_config().vocab_size != text.vocab_size
    refusals = {
        "a batch of several rows": batch_size != 1,
        "num_return_sequences > 1": (config.num_return_sequences or 1) > 1,
        "use_cache=False": config.use_cache is False,
        "a stateful model": bool(getattr(model, "_is_stateful", False)),
        "a static cache": config.cache_implementation in STATIC_CACHES,
        "an assistant of another vocabulary": other_vocab,
        "layers other than full attention (a cache HF may not crop)": sliding_layers(model),
        "assistant_ensemble_weight": getattr(config, "assistant_ensemble_weight", None) is not None,
        "inputs_embeds": embeds,
    }
    reason = next((name for name, hit in refusals.items() if hit), None)
    return None if reason is None else f"assisted decoding with {reason}"


def static_cache_call(config: GenerationConfig) -> bool:
    return config.cache_implementation in STATIC_CACHES and config.use_cache is not False


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
        top_p=top_p if 0 < top_p < 1 else 1.0,  # HF filters only below 1
        min_p=config.min_p or 0.0,
        seed=int(torch.randint(0, 2**62, (1,)).item()),
        **common,
    )


@dataclass
class GenerateCall:
    """One ``generate`` call as engine requests, and what HF's output is built from."""

    prompts: list[dict[str, Any]]  # engine prompts: token ids, or embeddings
    params: list[SamplingParams]
    prefix: torch.Tensor  # [B, W] the ids HF's sequences start with (the input ids; none for embeddings alone)
    prompt: torch.Tensor  # [B, L] input ids or [B, L, hidden] embeddings, padding included (HF's cache covers it)
    mask: torch.Tensor  # [B, L] attention mask
    processors: LogitsProcessorList  # HF's, for the call's scores
    pad: int
    past: Any = None  # the cache the caller passed (HF's generate extends it in place, so does the patch)


def plan_call(
    model: Any,
    inputs: Any,
    config: GenerationConfig,
    model_kwargs: dict[str, Any],
    default_length: bool,
    assistant: Any = None,
) -> GenerateCall | str:
    """The call's requests, or why the engine cannot run it. ``config`` is HF's merged config (its
    ``max_length`` set as HF sets it); ``default_length``: no max_length was given anywhere; ``assistant``: the
    call's ``assistant_model``."""
    input_ids = inputs if inputs is not None else model_kwargs.pop("input_ids", None)
    reason = unsupported(config, model_kwargs)
    if reason is not None:
        return reason
    embeds = model_kwargs.get("inputs_embeds")
    if input_ids is None and embeds is None:  # HF starts from its BOS token, by its own function
        if any(isinstance(value, torch.Tensor) for value in model_kwargs.values()):
            return "no input ids, with tensor arguments (HF takes its batch size from them)"
        start = getattr(model, "_maybe_initialize_input_ids_for_generation", None)
        try:
            input_ids = start(None, config.bos_token_id, model_kwargs) if callable(start) else None
        except ValueError as exc:  # HF's generate raises it again
            return f"no input ids: {exc}"
    prompt = embeds if embeds is not None else input_ids
    if embeds is not None and input_ids is not None and config.repetition_penalty != 1:
        return "inputs_embeds with input_ids and repetition_penalty"
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != (3 if embeds is not None else 2) or not prompt.numel():
        return "input_ids must be a 2-D tensor of token ids [batch, length] (inputs_embeds: [batch, length, hidden])"
    reason = assisted_reason(model, config, assistant, prompt.shape[0], embeds is not None)
    if reason is not None:
        return reason
    ids_for_mask = prompt if embeds is None else torch.ones(prompt.shape[:2], dtype=torch.long, device=prompt.device)
    mask = attention_mask(ids_for_mask, model_kwargs.get("attention_mask"), config)
    real = mask.ne(0).int()
    reason = padding_reason(model, config, real, model_kwargs.get("cache", model_kwargs.get("past_key_values")))
    if reason is not None:
        return reason
    width = prompt.shape[1]
    if config.max_new_tokens is not None:
        max_new = config.max_new_tokens
    elif default_length:
        limit = getattr(model.config, "max_position_embeddings", None)
        max_new = config.max_length if limit is None else min(config.max_length, limit - width)
    else:
        max_new = config.max_length - width
    if max_new < 1:  # HF's own generate says what is wrong with the lengths
        return "no tokens left to generate"
    config.max_length = width + max_new  # as HF sets it (its forced EOS comes at the last token)
    pads = real.argmax(dim=1)
    padding = pads.repeat_interleave(config.num_return_sequences or 1)
    processors = call_processors(config, width, padding.to(prompt.device), embeds is not None and input_ids is None)
    eos = eos_token_ids(config)
    rows = [row[m.bool()] for row, m in zip(prompt, mask)]
    past = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    allowed = embeds is None and (config.num_return_sequences or 1) == 1
    prompt_kv = cache_rows(model, past, pads.tolist(), width, allowed)
    if isinstance(prompt_kv, str):
        return prompt_kv
    if embeds is not None:
        if RowProcessors.of(processors, []) is not None:  # they would read the prompt's ids
            return "inputs_embeds with generation settings run by HF's processors"
        prompts = [{"prompt_embeds": row} for row in rows]
        row_processors: list[RowProcessors | None] = [None] * len(rows)
    else:
        prompts = [{"prompt_token_ids": row.tolist()} for row in rows]
        for entry, kv in zip(prompts, prompt_kv):
            if kv is not None:
                entry["prompt_kv"] = kv
        row_processors = [RowProcessors.of(processors, row.tolist()) for row in prompt]
    params = [sampling_params(config, eos, max_new, width, rp) for rp in row_processors]
    prefix = input_ids if input_ids is not None else torch.zeros(len(rows), 0, dtype=torch.long, device=prompt.device)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
    return GenerateCall(prompts, params, prefix, prompt, mask, processors, pad, past)


def call_processors(
    config: GenerationConfig, width: int, padding: torch.Tensor, embeds_only: bool
) -> LogitsProcessorList:
    """HF's processors for the call (building them raises what HF's would). With ``inputs_embeds`` alone HF's
    input ids start empty: its lengths count from there (``max_length`` and ``min_length`` lose the prompt's
    width), and no row has padding among them."""
    if not embeds_only:
        return hf_processors(config, width, padding)
    counted = copy.copy(config)
    counted.max_length = config.max_length - width
    counted.min_length = max((config.min_length or 0) - width, 0)
    return hf_processors(counted, 0, torch.zeros_like(padding))


def cache_rows(
    model: Any, past: Any, pads: list[int], width: int, allowed: bool
) -> list[list[tuple[torch.Tensor, torch.Tensor]] | None] | str:
    """Each row's keys and values from a passed-in cache (HF's ``past_key_values``), as the engine's
    ``prompt_kv`` (per layer ``[P, KV heads, head dim]``, the row's left padding cut off), or why the engine
    cannot take the cache. Only a ``DynamicCache`` whose every layer holds all its tokens qualifies, for token
    ids with one sequence per row; it must leave at least one input token uncovered (the last is computed)."""
    if past is None:
        return [None] * len(pads)
    if not allowed:
        return "a passed-in cache with inputs_embeds or num_return_sequences > 1"
    layers = getattr(past, "layers", None)
    full = isinstance(layers, list) and all(type(layer).__name__ == "DynamicLayer" for layer in layers)
    if not full or not layers or len(layers) != model.config.get_text_config().num_hidden_layers:
        return f"a passed-in {type(past).__name__} that is not a DynamicCache with every layer's tokens"
    length = int(past.get_seq_length())
    if length >= width:
        return "a passed-in cache that covers every input token"
    if any(layer.keys is None or layer.keys.dim() != 4 or layer.keys.shape[0] != len(pads) for layer in layers):
        return "a passed-in cache whose batch differs from the input's"
    rows: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = []
    for i, pad in enumerate(pads):
        if length <= pad:  # the cache holds only this row's padding
            rows.append(None)
            continue
        rows.append(
            [
                (layer.keys[i, :, pad:length].transpose(0, 1), layer.values[i, :, pad:length].transpose(0, 1))
                for layer in layers
            ]
        )
    return rows
