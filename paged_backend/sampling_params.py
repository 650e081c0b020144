"""SamplingParams with vLLM's field names and ranges; every bad value is a ValueError naming the field."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paged_backend import json_limits
from paged_backend.config import FieldError, check_bool, check_float, check_int
from paged_backend.json_limits import JSONTooDeep

MAX_LOGPROBS = 20
MAX_INT64 = 2**63 - 1
MAX_FLOAT32 = 3.4028234663852886e38
MAX_LOGIT_BIAS = 100  # OpenAI's bound
# The stop strings' characters together: each may hold back as much of a stream, and their failure tables are
# built per request (engine/stop_strings.py).
MAX_STOP_CHARS = 16384
# The penalty divides or multiplies float32 logits: both it and its inverse stay finite there.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-30, 1e30
# Temperatures below this are greedy (as in vLLM): dividing by them overflows the logits.
SAMPLING_EPS = 1e-5

if TYPE_CHECKING:
    import torch

    # vLLM's (v0) per-request logits processor: (output token ids, logits [V]) or (prompt token ids, output token
    # ids, logits [V]) -> logits [V], called on the host for the request's row at every step, before penalties.
    LogitsProcessor = (
        Callable[[list[int], torch.Tensor], torch.Tensor] | Callable[[list[int], list[int], torch.Tensor], torch.Tensor]
    )


_KINDS = ("json", "regex", "choice", "grammar", "json_object")  # json_object=False asks for nothing


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must be, as vLLM's: exactly one of ``json`` (a JSON schema, as a dict or JSON
    text), ``regex``, ``choice`` (one of these strings), ``grammar`` (EBNF, GBNF-style) or ``json_object`` (any JSON
    object). ``disable_any_whitespace``: JSON without optional whitespace between its tokens."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in _KINDS if getattr(self, name) is not None and getattr(self, name) is not False]
        if len(given) != 1:
            raise FieldError(
                "structured_outputs",
                f"structured_outputs must set exactly one of json, regex, choice, grammar, json_object; got {given}",
            )
        if isinstance(self.json, str):
            try:
                json_limits.loads(self.json)
            except JSONTooDeep as exc:
                raise _bad("json", str(exc)) from None
            except ValueError as exc:
                raise _bad("json", f"is not valid JSON: {exc}") from None
        elif isinstance(self.json, dict):
            try:
                json_limits.check_depth(self.json)
            except JSONTooDeep as exc:
                raise _bad("json", str(exc)) from None
        elif self.json is not None:
            raise _bad("json", f"must be a dict or JSON text, got {self.json!r}")
        for name in ("regex", "grammar"):
            if not isinstance(getattr(self, name), (str, type(None))):
                raise _bad(name, f"must be a string, got {getattr(self, name)!r}")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise _bad("choice", f"must be a non-empty list of non-empty strings, got {self.choice!r}")
        if self.json_object not in (None, True, False):
            raise _bad("json_object", f"must be True or False, got {self.json_object!r}")
        check_bool("structured_outputs.disable_any_whitespace", self.disable_any_whitespace)

    @property
    def kind(self) -> str:
        """The one field that is set: json, regex, choice, grammar or json_object."""
        return next(name for name in _KINDS if getattr(self, name) is not None and getattr(self, name) is not False)


def _bad(name: str, problem: str) -> FieldError:
    return FieldError(f"structured_outputs.{name}", f"structured_outputs.{name} {problem}")


class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's older name of ``StructuredOutputsParams`` (``SamplingParams(guided_decoding=...)``), kept so that
    scripts written for vLLM before 0.12 run; deprecated."""


@dataclass
class SamplingParams:
    """How to sample one request. ``temperature=0`` (or below 1e-5) means greedy; ``top_k`` -1 or 0 means off."""

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: GuidedDecodingParams | None = None  # deprecated: vLLM's older name, moved to structured_outputs
    logits_processors: list[LogitsProcessor] | None = None  # vLLM v0's: each runs on the host at every step
    # OpenAI's and vLLM's: token id -> a number in [-100, 100] added to its logit before sampling (+100 all but
    # forces it, -100 all but bars it); the model's raw logprobs are reported without it
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if self.guided_decoding is not None:
            warnings.warn(
                "SamplingParams(guided_decoding=...) is deprecated: "
                "use structured_outputs=StructuredOutputsParams(...)",
                DeprecationWarning,
                stacklevel=3,
            )
            if self.structured_outputs is not None:
                raise FieldError("guided_decoding", "give structured_outputs or guided_decoding, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        self.validate()

    def validate(self) -> None:
        """Resolve the defaults (``best_of`` from ``n``, one ``stop`` string to a list), then raise a
        ``FieldError`` (a ValueError) naming the first bad field. The engine calls this again on its own copy
        when a request is added, so fields changed after construction are checked too. Every bound is what the
        sampler's tensors hold: counts and ids fit int64, float fields are finite in float32."""
        check_int("n", self.n, 1, MAX_INT64)
        if self.best_of is None:
            self.best_of = self.n
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        best_of = self.best_of
        check_int("best_of", best_of, self.n, MAX_INT64)
        check_float("temperature", self.temperature, 0.0, MAX_FLOAT32)
        check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not -1 <= self.top_k <= MAX_INT64:
            raise FieldError(
                "top_k", f"top_k must be -1 or 0 (disabled) or an integer in [1, {MAX_INT64}], got {self.top_k!r}"
            )
        check_float("min_p", self.min_p, 0.0, 1.0)
        check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        check_float("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
        # each sample i draws from seed + i, which must fit torch's 64-bit seeds
        check_int("seed", self.seed, 0, MAX_INT64 + 1 - best_of, allow_none=True)
        if not isinstance(self.stop, (list, tuple, type(None))) or not all(
            isinstance(s, str) and s for s in self.stop or []
        ):
            raise FieldError(
                "stop", f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}"
            )
        self.stop = list(self.stop or [])
        if sum(map(len, self.stop)) > MAX_STOP_CHARS:
            raise FieldError(
                "stop", f"stop strings may have {MAX_STOP_CHARS} characters together, got {sum(map(len, self.stop))}"
            )
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise FieldError(
                "stop_token_ids", f"stop_token_ids must be a list of integers >= 0, got {self.stop_token_ids!r}"
            )
        self.stop_token_ids = list(self.stop_token_ids or [])
        for token_id in self.stop_token_ids:
            check_int("stop_token_ids[i]", token_id, 0, MAX_INT64)
        check_bool("ignore_eos", self.ignore_eos)
        check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS, allow_none=True)
        # max_tokens=0 scores a prompt without generating: only with prompt_logprobs, as there is nothing else
        check_int(
            "max_tokens", self.max_tokens, 0 if self.prompt_logprobs is not None else 1, MAX_INT64, allow_none=True
        )
        check_int("min_tokens", self.min_tokens, 0, MAX_INT64)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise FieldError(
                "min_tokens", f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS, allow_none=True)
        check_bool("skip_special_tokens", self.skip_special_tokens)
        check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        if not isinstance(self.logits_processors, (list, tuple, type(None))) or not all(
            callable(f) for f in self.logits_processors or []
        ):
            raise FieldError(
                "logits_processors", f"logits_processors must be a list of callables, got {self.logits_processors!r}"
            )
        self.logits_processors = list(self.logits_processors or [])
        if not isinstance(self.logit_bias, (dict, type(None))):
            raise FieldError("logit_bias", f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
        for token_id, bias in (self.logit_bias or {}).items():
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id <= MAX_INT64:
                raise FieldError("logit_bias", f"logit_bias's keys must be token ids (integers >= 0), got {token_id!r}")
            ok = isinstance(bias, (int, float)) and not isinstance(bias, bool)
            if not ok or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise FieldError(
                    "logit_bias",
                    f"logit_bias[{token_id}] must be a number in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {bias!r}",
                )
        self.logit_bias = dict(self.logit_bias or {})
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise FieldError(
                "structured_outputs",
                f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}",
            )
        if best_of > self.n and self.greedy:
            raise FieldError(
                "best_of", f"best_of must equal n when temperature is 0 (greedy), got best_of={self.best_of}"
            )

    def clone(self) -> SamplingParams:
        """A validated copy that later changes to this object cannot reach (what a request keeps)."""
        return dataclasses.replace(self)  # runs the validation again, and copies the lists

    # What validation resolved the fields to (the constructor also takes None or a single string for them).
    @property
    def num_samples(self) -> int:
        """``best_of``, which defaults to ``n``."""
        return self.n if self.best_of is None else self.best_of

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def stop_token_id_list(self) -> list[int]:
        return list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
