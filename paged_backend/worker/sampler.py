"""Batched sampling with vLLM's semantics.

Order, as in vLLM: logits processors and ``logit_bias``, penalties (repetition over prompt + output,
presence/frequency over output), min_tokens (stop tokens masked), temperature, min-p, top-k, top-p. Greedy rows
take the argmax. Random rows draw with an exponential race (``argmax(p / q)``, ``q ~ Exp(1)``), from the
request's own generator when it is seeded, so a seeded request samples the same tokens whatever else shares its
batch. Log probabilities are those of the
distribution the token was drawn from (temperature 1 and no filtering for greedy rows).
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from paged_backend.core.scheduler_output import TopLogprobs
from paged_backend.core.sequence import Sequence
from paged_backend.kernels.greedy import greedy_tokens
from paged_backend.worker.batch_invariant import block_rows
from paged_backend.worker.invariant_products import rows_in_blocks
from paged_backend.worker.step_inputs import queued_copy


@dataclass
class SampleResult:
    token_id: int
    logprob: float
    top_logprobs: TopLogprobs | None = None  # when logprobs were requested


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out.to(device)


def apply_penalties(
    logits: torch.Tensor,  # [N, V]
    prompt_tokens: list[list[int]],
    output_tokens: list[list[int]],
    presence: torch.Tensor,  # [N]
    frequency: torch.Tensor,  # [N]
    repetition: torch.Tensor,  # [N]
) -> torch.Tensor:
    """vLLM's penalties: repetition divides positive / multiplies negative logits of seen tokens."""
    n, vocab = logits.shape
    out_ids = _padded(output_tokens, vocab, logits.device)  # [N, Lo], padded with an extra column id
    counts = torch.zeros(n, vocab + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
    counts = counts[:, :vocab]  # [N, V]
    seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, _padded(prompt_tokens, vocab, logits.device), True)
    seen = seen[:, :vocab] | (counts > 0)  # [N, V]
    rep = repetition[:, None].expand_as(logits)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)
    return logits


def sampling_logprobs(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor,  # [N], 0 means greedy (treated as 1)
    top_k: torch.Tensor,  # [N] int, <= 0 means off
    top_p: torch.Tensor,  # [N]
    min_p: torch.Tensor,  # [N]
    filters: tuple[bool, bool, bool] | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Log-probabilities of the distribution actually sampled from; filtered tokens get -inf. [N, V]
    ``filters`` says whether any row uses min-p, top-k, top-p; the caller knows it on the host, which saves a
    device sync per flag. ``batch_invariant``: ties sorted stably, and top-p's running sums taken by fixed blocks
    of rows (a GPU's scan picks its layout by the number of rows)."""
    vocab = logits.shape[-1]
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    logits = logits / temp[:, None]
    if filters is None:
        filters = (bool((min_p > 0).any()), bool((top_k > 0).any()), bool((top_p < 1).any()))
    use_min_p, use_top_k, use_top_p = filters
    if use_min_p:
        probs = logits.softmax(-1)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if use_top_k or use_top_p:
        sorted_logits, order = logits.sort(dim=-1, stable=batch_invariant)  # ascending
        if use_top_k:
            k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
            kth = sorted_logits.gather(1, (vocab - k).long()[:, None])  # [N, 1] k-th largest
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        if use_top_p:
            probs = sorted_logits.softmax(-1)
            if batch_invariant:
                cumulative = rows_in_blocks(probs, lambda rows: rows.cumsum(-1), block_rows(probs))
            else:
                cumulative = probs.cumsum(-1)
            drop = cumulative <= (1 - top_p)[:, None]
            drop[:, -1] = False  # always keep the most likely token
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return logits.log_softmax(-1)


def to_host(tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[list[Any], list[Any]]:
    """One device-to-host read for both, any shape (token ids < 2**53 are exact in float64): ints and floats for
    1-D inputs, lists of them per row for 2-D ones."""
    both = torch.stack([tokens.double(), logprobs.double()]).tolist()
    ints = [int(t) for t in both[0]] if tokens.dim() == 1 else [[int(t) for t in row] for row in both[0]]
    return ints, both[1]


def prompt_tokens(seq: Sequence) -> list[int]:
    """The prompt's token ids; none when the prompt was embeddings (its ids are placeholders)."""
    return seq.token_ids[: seq.num_prompt_tokens] if seq.request.prompt_embeds is None else []


_TAKES_PROMPT: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _takes_prompt(processor: Any) -> bool:
    """Whether a logits processor has vLLM v0's three parameters (read once per processor, not at every step;
    held weakly, so a finished request's processors are not kept alive)."""
    try:
        return _TAKES_PROMPT[processor]
    except (KeyError, TypeError):  # not seen yet, or not weakly referable
        takes = len(inspect.signature(processor).parameters) == 3
        try:
            _TAKES_PROMPT[processor] = takes
        except TypeError:
            pass
        return takes


def apply_logits_processors(seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
    """The request's own logits processors on its row ``logits`` [V], in order (vLLM v0's: a processor with three
    parameters also gets the prompt's tokens)."""
    prompt, output = prompt_tokens(seq), seq.output_token_ids
    for processor in seq.params.logits_processors or []:
        if _takes_prompt(processor):
            logits = processor(prompt, output, logits)  # type: ignore[call-arg,arg-type]
        else:
            logits = processor(output, logits)  # type: ignore[call-arg,arg-type]
        if bool(torch.isnan(logits).any()):  # sampling NaN picks an arbitrary token: the request fails instead
            name = getattr(processor, "__qualname__", None) or type(processor).__qualname__
            raise ValueError(f"the logits processor {name} returned NaN logits")
    return logits


def apply_logit_bias(row: torch.Tensor, bias: dict[int, float]) -> None:
    """OpenAI's ``logit_bias``: each listed token's logit raised or lowered by its bias, in place."""
    ids = torch.tensor(list(bias), dtype=torch.long, device=row.device)
    row.index_add_(0, ids, torch.tensor(list(bias.values()), dtype=row.dtype, device=row.device))


class RoundBias:
    """The logit biases of a multi-step round's rows (``seqs``, in the round's row order), added to every step's
    logits by one scatter before the greedy choice, as the sampler adds them to a single step's."""

    def __init__(self, rows: torch.Tensor, tokens: torch.Tensor, values: torch.Tensor) -> None:
        self.rows, self.tokens, self.values = rows, tokens, values

    @staticmethod
    def of(seqs: list[Sequence], device: torch.device) -> RoundBias | None:
        """None when no row has a bias."""
        entries = [(row, t, b) for row, seq in enumerate(seqs) for t, b in (seq.params.logit_bias or {}).items()]
        if not entries:
            return None
        rows, tokens, values = zip(*entries)
        return RoundBias(
            queued_copy(torch.tensor(rows, dtype=torch.long), device),
            queued_copy(torch.tensor(tokens, dtype=torch.long), device),
            queued_copy(torch.tensor(values, dtype=torch.float32), device),
        )

    def apply(self, logits: torch.Tensor) -> None:  # [B, V], in place
        logits.index_put_((self.rows, self.tokens), self.values.to(logits.dtype), accumulate=True)


class Sampler:
    """Turns the last-token logits of each sampling sequence into a token, its logprob and top-k logprobs."""

    def __init__(
        self, device: torch.device, seed: int, raw_logprobs: bool = True, batch_invariant: bool = False
    ) -> None:
        self.device = device
        self.batch_invariant = batch_invariant
        # Reported logprobs: the model's own distribution (vLLM's default "raw_logprobs"), or the one each token
        # was drawn from. Without requested logprobs, a token's logprob (cumulative_logprob) is the drawn one's.
        self.raw_logprobs = raw_logprobs
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [N, V] -> [N], [N] on the device
        """Each row's argmax and its logprob. With ``batch_invariant`` by the general path's own operations
        (``log_softmax``, ``argmax``, ``gather``; the greedy kernel sums in another order): a greedy row's numbers
        are then the same whichever path its batch takes."""
        if not self.batch_invariant:
            return greedy_tokens(logits)
        logprobs = logits.float().log_softmax(-1)
        tokens = logprobs.argmax(dim=-1)
        return tokens, logprobs.gather(1, tokens[:, None])[:, 0]

    def _greedy(self, logits: torch.Tensor) -> list[SampleResult]:
        """All-greedy batch without penalties or logprobs (the common case): argmax and its logprob, no sort."""
        return [SampleResult(t, lp) for t, lp in zip(*to_host(*self.greedy(logits)))]

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampleResult]:
        """``logits`` [N, V] for ``seqs``. A sequence short of ``min_tokens`` cannot draw its stop tokens."""
        logits = logits.float()
        n, vocab = logits.shape
        params = [s.params for s in seqs]
        reported = None
        if self.raw_logprobs and any(p.logprobs is not None for p in params):
            reported = logits.log_softmax(-1)  # before penalties, stop-token bars, temperature and filters
        dev = logits.device
        for i, seq in enumerate(seqs):
            if params[i].logits_processors:
                logits[i] = apply_logits_processors(seq, logits[i])
            if params[i].logit_bias:
                apply_logit_bias(logits[i], params[i].logit_bias or {})
        barred = [
            i
            for i, (seq, p) in enumerate(zip(seqs, params))
            if seq.num_output_tokens < p.min_tokens and seq.request.stop_token_ids
        ]
        if all(p.greedy and not p.has_penalties and p.logprobs is None for p in params) and not barred:  # argmax
            return self._greedy(logits)

        if any(p.has_penalties for p in params):
            logits = apply_penalties(
                logits,
                [prompt_tokens(s) if p.repetition_penalty != 1 else [] for s, p in zip(seqs, params)],
                [s.output_token_ids for s in seqs],
                torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=dev),
                torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=dev),
                torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=dev),
            )
        for i in barred:
            logits[i, [t for t in seqs[i].request.stop_token_ids if t < vocab]] = float("-inf")

        # Greedy rows: temperature 1 and no filtering, so their logprobs are the model's own distribution.
        logprobs = sampling_logprobs(
            logits,
            torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32, device=dev),
            torch.tensor([-1 if p.greedy else p.top_k for p in params], dtype=torch.long, device=logits.device),
            torch.tensor([1.0 if p.greedy else p.top_p for p in params], dtype=torch.float32, device=dev),
            torch.tensor([0.0 if p.greedy else p.min_p for p in params], dtype=torch.float32, device=dev),
            filters=(
                any(p.min_p > 0 for p in params if not p.greedy),
                any(p.top_k > 0 for p in params if not p.greedy),
                any(p.top_p < 1 for p in params if not p.greedy),
            ),
            batch_invariant=self.batch_invariant,
        )  # [N, V]
        tokens = logprobs.argmax(dim=-1)  # greedy rows; random rows are overwritten below
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            q = torch.empty(len(random_rows), vocab, dtype=torch.float32, device=dev)
            unseeded = [j for j, i in enumerate(random_rows) if seqs[i].generator is None]
            if unseeded:
                draws = torch.empty(len(unseeded), vocab, dtype=torch.float32, device=dev)
                q[unseeded] = draws.exponential_(generator=self.generator)
            for j, i in enumerate(random_rows):
                if seqs[i].generator is not None:
                    q[j].exponential_(generator=seqs[i].generator)
            rows = torch.tensor(random_rows, device=logits.device)
            tokens[rows] = (logprobs[rows].exp() / q).argmax(dim=-1)

        if reported is not None:
            logprobs = reported
        chosen = logprobs.gather(1, tokens[:, None])[:, 0]  # [N]
        token_list, chosen_list = to_host(tokens, chosen)
        results = [SampleResult(t, lp) for t, lp in zip(token_list, chosen_list)]
        wanted = {i: p.logprobs for i, p in enumerate(params) if p.logprobs is not None}  # row -> its k
        if wanted:
            want = list(wanted)
            top_vals, top_ids = logprobs[want].topk(max(1, *wanted.values()), dim=-1)  # [W, k]
            ranks = (logprobs[want] > chosen[want][:, None]).sum(-1) + 1  # [W]
            vals, ids, rank_list = top_vals.tolist(), top_ids.tolist(), ranks.tolist()
            for j, (i, k) in enumerate(wanted.items()):
                entries = [(token_list[i], chosen_list[i], int(rank_list[j]))]
                entries += [(tid, val, r + 1) for r, (tid, val) in enumerate(zip(ids[j][:k], vals[j][:k]))]
                results[i].top_logprobs = entries
        return results
