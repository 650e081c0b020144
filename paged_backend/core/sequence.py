"""Per-request and per-sample state: token ids, how many are in the KV cache, text, finish state.

The scheduler owns the token ids, ``num_computed_tokens`` and the status; the output processor owns what is
shown to the user (text, detokenization offsets, logprobs, kept logits).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from paged_backend.logprobs import Logprob, LogprobsArrays
from paged_backend.lora.request import LoRARequest
from paged_backend.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from paged_backend.lora.adapter import LoRAAdapter


class GrammarState(Protocol):
    """Where a sample stands in its structured-output grammar (xgrammar's ``GrammarMatcher``): the scheduler
    advances it with each token it appends, the worker's sampler masks the tokens it does not allow."""

    def accept_token(self, token_id: int) -> bool: ...

    def is_terminated(self) -> bool: ...

    def fill_next_token_bitmask(self, bitmask: Any, index: int) -> Any: ...

    def fork(self) -> GrammarState: ...  # an independent copy at the same place (a multi-step round's own)


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()  # preempted, its KV blocks in CPU memory
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self in (
            SequenceStatus.FINISHED_STOPPED,
            SequenceStatus.FINISHED_LENGTH,
            SequenceStatus.FINISHED_ABORTED,
        )


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Sequence:
    """One sample of a request. ``token_ids`` is prompt + output; the first ``num_computed_tokens`` are cached."""

    seq_id: int
    index: int
    request: Request = field(repr=False)
    token_ids: list[int]
    num_prompt_tokens: int
    arrival: int
    generator: torch.Generator | None = None  # a seeded request's own, so its draws ignore the rest of the batch
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    output_text: str = ""
    stop_reason: int | str | None = None
    num_cached_prompt_tokens: int | None = None  # prompt tokens reused from the prefix cache at first admission
    logits: list[torch.Tensor] | None = None  # raw logits row of each generated token, when the request keeps them
    grammar: GrammarState | None = None  # with structured_outputs: this sample's own place in the grammar
    # incremental detokenization offsets into token_ids (vLLM's prefix_offset / read_offset)
    prefix_offset: int = 0
    read_offset: int = 0
    # with stop strings: how much of each the text's tail spells (engine/stop_strings.py), and the characters of
    # the tail held back from a stream because they may still become one
    stop_states: list[int] | None = None
    stop_held: int = 0
    # speculative decoding (core/spec_decode.py): tokens proposed for this sample and taken, over its life; the
    # window the planner judges it by (steps, proposals taken); the length below which it gets no proposals
    # (paused) and the length of its last pause; while paused, the last lookup made for it and where
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verified_steps: int = 0  # the steps that verified proposals of its
    spec_window: tuple[int, int] = (0, 0)
    spec_paused_until: int = 0
    spec_pause: int = 0
    spec_shadow: tuple[int, list[int]] = field(default_factory=lambda: (0, []))
    spec_shadow_holds: bool = False  # its shadow guess matched SHADOW_HOLD_MATCH tokens: rounds wait for its check
    spec_took_all: bool = True  # its last verifying step took every proposal: core/spec_chain.py chains only then
    # its last step was a lookup round, read, that yielded enough a step to go on (core/lookup_round.py)
    lookup_round_paid: bool = False

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def lora_id(self) -> int:
        """Part of every prefix-cache key: KV computed under one adapter is not reused under another."""
        lora = self.request.lora_request
        return 0 if lora is None else int(lora.lora_int_id)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)


@dataclass(eq=False)
class Request:
    """A user request: one prompt, its sampling parameters, ``best_of`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_request: LoRARequest | None = None
    lora_adapter: LoRAAdapter | None = None  # read when the request is added: a step never reads a disk
    eos_token_ids: frozenset[int] = frozenset()  # the model's EOS ids that stop it (none with ignore_eos)
    keep_logits: bool = False  # each generated token's raw logits row goes to the output (HF's output_logits)
    seqs: list[Sequence] = field(default_factory=list)
    unforked: list[Sequence] = field(default_factory=list)  # samples waiting for the first one's prefill
    arrival_time: float = 0.0
    first_token_time: float | None = None
    num_failed_steps: int = 0  # steps that failed with this request in them (see engine/step_failures.py)
    # With params.prompt_logprobs: prompt tokens 1.. in order, a chunk of arrays each prefill chunk (token 0 has none)
    prompt_logprobs: list[LogprobsArrays] | None = None
    num_prompt_logprobs: int = 0  # prompt tokens with their entry so far
    own_stop_token_ids: frozenset[int] = field(init=False)  # the request's stop_token_ids, as a set
    # [L, hidden] on the host: the prompt as embeddings (prompt_token_ids then hold L placeholder ids, which no
    # forward reads and no prefix-cache hash may use)
    prompt_embeds: torch.Tensor | None = None
    # per layer (keys, values) [P, Hkv, D] on the host: the KV of the prompt's first P tokens, given with the
    # request (HF's past_key_values); written into its blocks when it is admitted, never computed
    prompt_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def __post_init__(self) -> None:
        self.own_stop_token_ids = frozenset(self.params.stop_token_id_list)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = []

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet (a preempted request keeps those it has)."""
        return self.prompt_logprobs is not None and self.num_prompt_logprobs < len(self.prompt_token_ids) - 1

    @property
    def finished(self) -> bool:
        return all(seq.status.finished for seq in self.seqs)

    @property
    def cacheable(self) -> bool:
        """Whether its blocks may enter or come from the prefix cache: not when its prompt is embeddings or brings
        its own keys and values (which need not be what the model computes)."""
        return self.prompt_embeds is None and self.prompt_kv is None

    @property
    def num_imported_tokens(self) -> int:
        """The prompt tokens whose KV the request brings (``prompt_kv``)."""
        return 0 if self.prompt_kv is None else int(self.prompt_kv[0][0].shape[0])

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Tokens that end a sample once it has ``min_tokens`` tokens (and are barred until then)."""
        return self.eos_token_ids | self.own_stop_token_ids
