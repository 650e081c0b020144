"""What a patched ``generate`` (``hf.py``) returns, as HF returns it: the output dataclass, and its ``logits`` and
``scores`` from the logits the engine kept (the raw logits per step, and HF's own processors and warpers to apply
to them for the settings the engine honours)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, NamedTuple

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    ExponentialDecayLengthPenalty,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

_REPETITION_ARGS = inspect.signature(RepetitionPenaltyLogitsProcessor.__init__).parameters


_OUTPUT_FIELDS = {f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput)}
_CACHE_FIELD = "cache" if "cache" in _OUTPUT_FIELDS else "past_key_values"  # renamed in transformers 5.2x


def hf_output(
    sequences: torch.Tensor,
    scores: tuple[torch.Tensor, ...] | None = None,
    logits: tuple[torch.Tensor, ...] | None = None,
    replay: Replay | None = None,
) -> GenerateDecoderOnlyOutput:
    """HF's output dataclass over the engine's tensors (and what ``hf_replay`` recomputed)."""
    replay = replay or Replay(None, None, None)
    # transformers types int64 tensors as torch.LongTensor, which no torch operation is typed to return, and the
    # per-step tuples as 1-tuples
    return GenerateDecoderOnlyOutput(
        sequences=sequences,  # type: ignore[arg-type]
        scores=scores,  # type: ignore[arg-type]
        logits=logits,  # type: ignore[arg-type]
        attentions=replay.attentions,  # type: ignore[arg-type]
        hidden_states=replay.hidden_states,  # type: ignore[arg-type]
        **{_CACHE_FIELD: replay.cache},
    )


class Replay(NamedTuple):
    """What HF's ``generate`` returns besides the tokens, recomputed by one forward (``hf_replay``)."""

    cache: Any
    attentions: tuple[tuple[torch.Tensor, ...], ...] | None  # per step, per layer: [B, heads, queries, keys]
    hidden_states: tuple[tuple[torch.Tensor, ...], ...] | None  # per step, embeddings then each layer: [B, q, hidden]


def hf_replay(
    model: Any,
    prompt: torch.Tensor,
    new: torch.Tensor,
    prompt_mask: torch.Tensor,
    past: Any = None,
    config: GenerationConfig | None = None,
) -> Replay:
    """What HF's ``generate`` returns besides the tokens, recomputed with HF's positions (the mask's running count)
    over the prompt (ids [B, L], or embeddings [B, L, hidden]) and the ``new`` tokens [B, T] but the last: the
    cache — its class and layout, left padding kept, finished rows continued with padding — and, when ``config``
    asks for them, each step's attentions and hidden states. The forwards have the shapes of HF's steps where it
    matters: with a cache, one over the prompt (step 0, whose padding queries see no key) and one over the new
    tokens; without, one per step (each step's padding queries spread evenly over that step's keys). Equal to
    HF's up to the rounding of one forward against HF's step-by-step ones. ``past``: the cache the caller passed,
    extended in place past its own tokens as HF's ``generate`` leaves it (step 0's queries are then the tokens it
    does not hold), or the empty static cache HF would have made (whose attention weights span all its slots)."""
    mask = torch.cat([prompt_mask, prompt_mask.new_ones(new.shape)], dim=1)[:, :-1]
    prepare = getattr(model, "_prepare_position_ids_for_generation", None)  # HF's own where it has one
    if callable(prepare):
        positions = prepare(mask, {"attention_mask": mask})
    else:
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
    if prompt.dim() == 3:
        tokens = torch.cat([prompt, model.get_input_embeddings()(new).to(prompt.dtype)], dim=1)[:, :-1]
    else:
        tokens = torch.cat([prompt, new], dim=1)[:, :-1]
    width, steps = prompt.shape[1], new.shape[1]
    details = config is not None and bool(config.output_attentions or config.output_hidden_states)

    def forward(start: int, end: int, cache: Any = None) -> Any:
        return _forward(model, tokens[:, start:end], mask[:, :end], positions[:, start:end], cache, config)

    start = 0 if past is None else int(past.get_seq_length())
    if not details:
        return Replay(_cache_of(forward(start, tokens.shape[1], past)), None, None)
    if config is not None and config.use_cache is False:
        outs = [forward(0, width + t) for t in range(steps)]
        return _details(config, [(out, slice(None), None) for out in outs], None)
    first = forward(start, width, past)
    rest = forward(width, tokens.shape[1], _cache_of(first)) if steps > 1 else None
    static = type(past).__name__ == "StaticCache"  # its weights span every slot, as HF's
    parts = [(first, slice(None), None if static else width)]
    parts += [(rest, slice(t - 1, t), None if static else width + t) for t in range(1, steps)]
    return _details(config, parts, _cache_of(rest if rest is not None else first))


def static_cache(model: Any, config: GenerationConfig, batch_size: int) -> Any:
    """The empty static cache HF's ``generate`` makes for these settings (``config.max_length``: the prompt's width
    plus the new tokens), by HF's own ``_prepare_static_cache``; its arguments changed across transformers 5.x, so
    each is passed by name where its signature has it."""
    length = config.max_length - 1  # the last token's keys are never cached
    if getattr(config, "max_cache_len", None) is not None:
        length = max(length, config.max_cache_len)
    prepare = model._prepare_static_cache
    wanted = inspect.signature(prepare).parameters
    arguments = dict(
        cache_implementation=config.cache_implementation,
        batch_size=batch_size,
        max_cache_len=length,
        prefill_chunk_size=getattr(config, "prefill_chunk_size", None),
        model_kwargs={},
    )
    return prepare(**{name: value for name, value in arguments.items() if name in wanted})


def _forward(
    model: Any, inputs: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any, config: Any
) -> Any:
    parameters = inspect.signature(model.forward).parameters
    kwargs: dict[str, Any] = {"inputs_embeds" if inputs.dim() == 3 else "input_ids": inputs}
    if cache is not None:  # the argument's name changed in transformers 5.2x
        kwargs["cache" if "cache" in parameters else "past_key_values"] = cache
    if "logits_to_keep" in parameters:
        kwargs["logits_to_keep"] = 1
    if config is not None:
        kwargs |= {"output_attentions": bool(config.output_attentions)}
        kwargs |= {"output_hidden_states": bool(config.output_hidden_states)}
    with torch.no_grad():
        return model(**kwargs, attention_mask=mask, position_ids=positions, use_cache=True)


def _cache_of(out: Any) -> Any:
    return out.get("cache", None) if "cache" in out else out.get("past_key_values", None)


def _details(config: Any, parts: list[tuple[Any, slice, int | None]], cache: Any) -> Replay:
    """Each step's attentions and hidden states: from its forward's output, the step's query rows, over its keys
    up to ``keys`` (None: all)."""
    attentions = hidden = None
    if config.output_attentions:
        attentions = tuple(tuple(a[:, :, rows, :keys] for a in out.attentions) for out, rows, keys in parts)
    if config.output_hidden_states:
        hidden = tuple(tuple(h[:, rows] for h in out.hidden_states) for out, rows, _ in parts)
    return Replay(cache, attentions, hidden)


def step_logits(completions: list[Any], num_steps: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """HF's ``logits``: one ``[rows, V]`` fp32 tensor per step (every row has all steps: a call whose rows end
    at different steps goes to HF, which has the logits of feeding a finished row padding)."""
    return tuple(torch.stack([c.logits[t] for c in completions]).float().to(device) for t in range(num_steps))


def hf_processors(config: GenerationConfig, width: int, padding: torch.Tensor) -> LogitsProcessorList:
    """HF's processors and warpers for the call, in HF's order and with HF's arguments (left padding is not
    penalised; ``min_new_tokens`` overrides ``min_length``), so ``scores`` are what HF reports for the same logits;
    building them raises HF's errors for bad values. ``padding``: each row's number of pad tokens;
    ``config.max_length``: the prompt's width plus the new tokens."""
    eos = config.eos_token_id
    device = padding.device
    processors = LogitsProcessorList()
    if config.sequence_bias is not None:
        processors.append(SequenceBiasLogitsProcessor(sequence_bias=config.sequence_bias))
    if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
        extra = {"prompt_ignore_length": padding} if "prompt_ignore_length" in _REPETITION_ARGS else {}
        processors.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty, **extra))
    if config.no_repeat_ngram_size is not None and config.no_repeat_ngram_size > 0:
        processors.append(NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
    if config.bad_words_ids is not None:
        processors.append(NoBadWordsLogitsProcessor(config.bad_words_ids, eos))
    min_length = config.min_new_tokens + width if config.min_new_tokens is not None else config.min_length
    if eos is not None and min_length is not None and min_length > 0:
        processors.append(MinLengthLogitsProcessor(min_length, eos))
    if eos is not None and config.min_new_tokens is not None and config.min_new_tokens > 0:
        processors.append(MinNewTokensLengthLogitsProcessor(width, config.min_new_tokens, eos))
    processors += _forcing_processors(config, width, device)
    if config.do_sample:
        if config.temperature is not None and config.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k is not None and config.top_k != 0:
            processors.append(TopKLogitsWarper(config.top_k))
        if config.top_p is not None and config.top_p < 1.0:
            processors.append(TopPLogitsWarper(config.top_p))
        if config.min_p is not None:
            processors.append(MinPLogitsWarper(config.min_p))
    if config.renormalize_logits is True:
        processors.append(LogitNormalization())
    return processors


def _forcing_processors(config: GenerationConfig, width: int, device: torch.device) -> list[LogitsProcessor]:
    """HF's processors between the length bars and the warpers: forced tokens, invalid values, the length
    penalty, suppressed tokens."""
    out: list[LogitsProcessor] = []
    if config.forced_bos_token_id is not None:
        out.append(ForcedBOSTokenLogitsProcessor(config.forced_bos_token_id))
    if config.forced_eos_token_id is not None:
        out.append(ForcedEOSTokenLogitsProcessor(config.max_length, config.forced_eos_token_id, device=str(device)))
    if config.remove_invalid_values is True:
        out.append(InfNanRemoveLogitsProcessor())
    if config.exponential_decay_length_penalty is not None:
        out.append(ExponentialDecayLengthPenalty(config.exponential_decay_length_penalty, config.eos_token_id, width))
    if config.suppress_tokens is not None:
        out.append(SuppressTokensLogitsProcessor(config.suppress_tokens, device=str(device)))
    if config.begin_suppress_tokens is not None:
        begin = width if (width > 1 or config.forced_bos_token_id is None) else width + 1
        out.append(SuppressTokensAtBeginLogitsProcessor(config.begin_suppress_tokens, begin, device=str(device)))
    return out


# What the engine's sampler does itself (or what does not change which token is chosen: LogitNormalization).
_NATIVE = (
    RepetitionPenaltyLogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    LogitNormalization,
)


class RowProcessors:
    """HF's processors that the engine's sampler has no equivalent of (n-gram and bad-word bans, sequence bias,
    suppressed and forced tokens), as a request's logits processor: run on its row at every step with the ids HF
    would pass for that row (the call's input ids of the row, padding included, then its output so far). They run
    before the sampler's penalty, temperature and filters; HF runs all but the sequence bias after its repetition
    penalty, which chooses the same tokens: a ban's −inf and a forced token's 0 stay what they are under the penalty
    (the call goes to HF when a length penalty and a repetition penalty would both change the EOS logit)."""

    def __init__(self, processors: LogitsProcessorList, row: list[int]) -> None:
        self.processors, self.row = processors, row

    @staticmethod
    def of(processors: LogitsProcessorList, row: list[int]) -> RowProcessors | None:
        """None when every processor is one the engine does itself."""
        rest = LogitsProcessorList(p for p in processors if not isinstance(p, _NATIVE))
        return RowProcessors(rest, row) if rest else None

    def __call__(self, prompt: list[int], output: list[int], logits: torch.Tensor) -> torch.Tensor:
        """``prompt``: the request's (the row's unmasked ids), which ``self.row`` holds with its padding."""
        ids = torch.tensor([self.row + output], dtype=torch.long, device=logits.device)
        return self.processors(ids, logits[None])[0]  # type: ignore[arg-type]  # a LongTensor, as in hf_output
