"""The scheduler's side of speculative decoding: which decoding sequences get proposed tokens this step, and
how many (``DraftPlanner``).

A sequence with d proposals runs d + 1 tokens in the step's forward — its last sampled token, then the
proposals — and the sampler verifies them (worker/rejection_sampler.py): it takes the proposals up to the first
one the model would not have produced, then one token of the model's own. Each token taken counts one more
computed token (the forward that produced it cached its input), as in a multi-step round; the KV written for
rejected proposals lies past ``num_computed_tokens`` in the sequence's own blocks and is written over later.

Proposals stop where they do not pay: in a step where ``disable_by_batch_size`` sequences or more run, and for a
sample whose proposals seldom pay (``judge``): it is paused for a number of tokens. A step without proposals may
be a multi-step round (core/multi_step.py), the cheapest way to decode a token where nothing is proposed; async
scheduling queues the next round only when no sample of the round would be proposed for after it nor, in a
small batch, a paused sample's guess awaits its tokens (``holds_round``), and a verifying step's successor on the
guess that every proposal is taken (core/spec_chain.py). Not proposed
for either: requests that keep logits (one row per step), which decode a token a step in the same batch. Each
sample of a request with several (``n``, ``best_of``) is proposed for on its own; a sample under a grammar only
the tokens its grammar allows, up to the first it does not.
"""

from __future__ import annotations

import logging
from typing import Protocol

from paged_backend.config import SpeculativeConfig
from paged_backend.core.sequence import GrammarState, Sequence
from paged_backend.spec_decode.ngram_proposer import NgramProposer

logger = logging.getLogger(__name__)


class Proposer(Protocol):
    """Where proposals come from: prompt lookup (spec_decode/ngram_proposer.py) or a draft model's, made by the
    worker after the step before (``DraftModelProposals``)."""

    def propose(self, token_ids: list[int], max_tokens: int | None = None, seq_id: int = 0) -> list[int]: ...


class DraftModelProposals:
    """``method: draft_model``: the draft model runs on the worker, after each step, over every row at once
    (worker/draft_runner.py); its guesses come back with the step's output and wait here for the sequence's
    next step. A guess is for the tokens the sequence had when it was made, and is used once."""

    def __init__(self) -> None:
        self.proposals: dict[int, tuple[int, list[int]]] = {}  # seq id -> (its length then, the guesses)

    def put(self, seq_id: int, length: int, proposals: list[int]) -> None:
        if proposals:
            self.proposals[seq_id] = (length, proposals)
        else:
            self.proposals.pop(seq_id, None)

    def propose(self, token_ids: list[int], max_tokens: int | None = None, seq_id: int = 0) -> list[int]:
        length, proposals = self.proposals.pop(seq_id, (-1, []))
        if length != len(token_ids):
            return []
        return proposals if max_tokens is None else proposals[:max_tokens]

    def forget(self, seq_id: int) -> None:
        self.proposals.pop(seq_id, None)


# A sample is judged over windows of WINDOW_STEPS steps that verified proposals of its. A verifying step costs a GPU
# about as much as two tokens of a multi-step round (docs/benchmarks.md), so under MIN_TAKEN_PER_STEP taken
# proposals a step the sample is paused: PAUSE_TOKENS tokens, doubled after each window that fails again up to
# MAX_PAUSE_TOKENS (open chat seldom copies), back to PAUSE_TOKENS after a window that pays. A paused sample is
# still watched where proposals cost nothing to make (prompt lookup): the lookup is made as if it were proposed
# for, and compared with the tokens it then decodes; when SHADOW_MIN_TAKEN of them (all k, when k is smaller)
# would have been taken (text that copies has started), the pause ends. Three rather than two, by the real model's
# traces: code rewrites verify more of their tokens, the other workloads as many (docs/benchmarks.md, "Prompt
# lookup's shortest n-gram").
WINDOW_STEPS = 2
MIN_TAKEN_PER_STEP = 1.0
PAUSE_TOKENS = 32
MAX_PAUSE_TOKENS = 512
SHADOW_MIN_TAKEN = 3
# Under async scheduling the round after the one in flight is queued before that round's tokens are read, so a
# shadow guess learns a round late that it would have been taken. A guess whose lookup matched SHADOW_HOLD_MATCH
# tokens or more (text that copies: code, quoted passages) holds the next round until its tokens are read; a
# one-token match (open chat makes many, seldom taken) does not. A held round stalls every row while one sample
# gains, so rounds are held only in batches of up to SHADOW_HOLD_MAX_ROWS rows.
SHADOW_HOLD_MATCH = 2
SHADOW_HOLD_MAX_ROWS = 4
# A sample proposed for has each multi-step round read before the next is planned (its proposals need the round's
# tokens): the device waits for the host between rounds, which a plain engine's queued rounds never do. Until its
# text is seen to copy (its verifying steps took COPYING_TAKEN proposals a step on average, or half of k when that
# is less: no step takes more than k; a verifying step costs about three tokens of a round on a small model,
# docs/benchmarks.md) and while a lookup over the tokens known finds nothing, its next round is queued behind the
# one in flight: open chat seldom copies, and a copy that starts inside the round in flight is verified a round
# later.
COPYING_TAKEN = 4.0


class DraftPlanner:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer | None = None) -> None:
        if proposer is None and config.method == "draft_model":
            proposer = DraftModelProposals()
        self.proposer: Proposer = proposer or NgramProposer(*config.ngram_sizes(), config.num_speculative_tokens)
        self.max_model_len = max_model_len
        self.k = config.num_speculative_tokens
        # a lookup costs no forward: a paused sample's proposals can be made and checked without verifying them
        self.watches = isinstance(self.proposer, NgramProposer)
        self.disable_by_batch_size = config.disable_by_batch_size
        # over the engine's life: rows verified, tokens proposed in them, and those taken (in all, and by position:
        # vLLM's num_accepted_tokens_per_pos, how often the i-th proposal of a row was taken)
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * self.k

    def active(self, num_running: int) -> bool:
        """Whether this step makes proposals at all: not once the batch is large."""
        return self.disable_by_batch_size is None or num_running < self.disable_by_batch_size

    def speculates(self, seq: Sequence, ahead: int = 0) -> bool:
        """Whether ``seq`` is proposed for once ``ahead`` more tokens are in (when its lookup finds something)."""
        return speculates(seq, ahead)

    def drafts(self, seq: Sequence, budget: int) -> list[int]:
        """The proposals for ``seq``'s next step, within ``budget`` tokens for the whole row (its last sampled
        token needs one), its ``max_tokens`` and ``max_model_len`` (the token after the last proposal is the
        model's own, and must fit too)."""
        params = seq.params
        if seq.num_uncomputed_tokens != 1 or not self.speculates(seq):
            return []
        max_len = self.max_model_len
        if params.max_tokens is not None:
            max_len = min(max_len, seq.num_prompt_tokens + params.max_tokens)
        room = min(budget - 1, max_len - len(seq.token_ids) - 1, self.k)
        if room <= 0:
            return []
        try:
            drafts = self.proposer.propose(seq.token_ids, room, seq_id=seq.seq_id)
        except Exception:  # a draft model's failure (out of memory, ...) costs proposals, not the step
            logger.warning("the proposer failed for sequence %d: it decodes without proposals", seq.seq_id,
                           exc_info=True)  # fmt: skip
            self.forget(seq)
            return []
        return drafts if seq.grammar is None or not drafts else grammatical(seq.grammar, drafts)

    def observe(
        self, seq: Sequence, proposed: list[int], taken: list[int], goes_on: bool, num_running: int, guesses: list[int]
    ) -> None:
        """After ``seq`` took ``taken`` in a step: a row that verified ``proposed`` is counted; a sample that goes
        on without having been proposed for is watched (while proposals are made at all); a draft model's
        ``guesses`` for its next tokens are kept for its next step."""
        if isinstance(self.proposer, DraftModelProposals) and goes_on:
            self.proposer.put(seq.seq_id, len(seq.token_ids), guesses)
        seq.lookup_round_paid = False  # a step planned on the host: no round of the device's was read last
        if proposed:
            self.count(seq, len(proposed), taken_proposals(taken, proposed))
        elif goes_on and self.active(num_running):
            self.watch(seq)

    def watch(self, seq: Sequence) -> None:
        """After a step that gave a paused sample tokens of its own: what a lookup guessed before them is
        compared with them, the pause ended if enough would have been taken (see SHADOW_MIN_TAKEN), and a new
        guess made once the last one is decided."""
        if not self.watches or len(seq.token_ids) >= seq.spec_paused_until:
            return
        start, guess = seq.spec_shadow
        if guess:
            got = seq.token_ids[start : start + len(guess)]
            taken = taken_proposals(got, guess)
            if taken >= min(SHADOW_MIN_TAKEN, self.k):  # decided, whatever the rest of the guess would have been
                seq.spec_paused_until = seq.spec_pause = 0
                seq.spec_shadow, seq.spec_shadow_holds = (0, []), False
                return
            if taken == len(got) < len(guess):
                return  # right so far, not all seen yet
        seq.spec_shadow = (len(seq.token_ids), self.proposer.propose(seq.token_ids, self.k, seq_id=seq.seq_id))
        matched = self.proposer.last_match if isinstance(self.proposer, NgramProposer) else 0
        seq.spec_shadow_holds = matched >= SHADOW_HOLD_MATCH

    def holds_round(self, seqs: list[Sequence]) -> bool:
        """Whether the round after the one in flight (over ``seqs``) waits for that round's tokens: a paused
        sample's shadow guess is decided by them (see SHADOW_HOLD_MATCH)."""
        if not self.watches or len(seqs) > SHADOW_HOLD_MAX_ROWS:
            return False
        paused = [seq for seq in seqs if len(seq.token_ids) < seq.spec_paused_until]  # a pause's guess only
        return any(seq.spec_shadow_holds and seq.spec_shadow[1] for seq in paused)

    def runs_ahead(self, seq: Sequence) -> bool:
        """Whether ``seq``, proposed for, may have its next multi-step round queued before the one in flight is
        read (see COPYING_TAKEN)."""
        bar = min(COPYING_TAKEN, self.k / 2)
        if not self.watches or seq.num_accepted_tokens >= bar * max(1, seq.num_verified_steps):
            return False
        return not self.proposer.propose(seq.token_ids, 1, seq_id=seq.seq_id)

    def forget(self, seq: Sequence) -> None:
        """The sample ended: a proposer with state per sequence drops its own."""
        forget = getattr(self.proposer, "forget", None)
        if forget is not None:
            forget(seq.seq_id)

    def count(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """A verified row: the engine's and the sample's counts, and the sample judged."""
        seq.num_draft_tokens += proposed
        seq.num_accepted_tokens += accepted
        seq.num_verified_steps += 1
        seq.spec_took_all = accepted == proposed
        judge(seq, accepted)
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.num_accepted_tokens_per_pos[position] += 1


def speculates(seq: Sequence, ahead: int = 0) -> bool:
    """Whether ``seq`` is proposed for once ``ahead`` more tokens are in: not while it waits to fork its other
    samples (they fork from one computed token), keeps logits (one row a step) or is paused (``judge``)."""
    request = seq.request
    return not request.unforked and not request.keep_logits and len(seq.token_ids) + ahead >= seq.spec_paused_until


def judge(seq: Sequence, taken: int) -> None:
    """One more step verified proposals of the sample, of which it took ``taken``: at the end of a window, the
    sample is paused if the window's steps took too few (see WINDOW_STEPS)."""
    steps, total = seq.spec_window[0] + 1, seq.spec_window[1] + taken
    if steps >= WINDOW_STEPS:
        if total < MIN_TAKEN_PER_STEP * steps:
            seq.spec_pause = min(MAX_PAUSE_TOKENS, 2 * seq.spec_pause) if seq.spec_pause else PAUSE_TOKENS
            seq.spec_paused_until = len(seq.token_ids) + seq.spec_pause
            seq.spec_shadow, seq.spec_shadow_holds = (0, []), False
        else:
            seq.spec_pause = 0
        steps = total = 0
    seq.spec_window = (steps, total)


def grammatical(grammar: GrammarState, drafts: list[int]) -> list[int]:
    """The proposals a copy of ``grammar`` takes in order, up to the first it refuses or the one that ends it."""
    copy = grammar.fork()
    for i, token in enumerate(drafts):
        if not copy.accept_token(token):
            return drafts[:i]
        if copy.is_terminated():
            return drafts[: i + 1]
    return drafts


def taken_proposals(taken: list[int], proposed: list[int]) -> int:
    """How many of a row's taken tokens were its proposals: the run they share from the start (all of them when
    the row stopped on a proposal)."""
    count = 0
    for token, guess in zip(taken, proposed):
        if token != guess:
            break
        count += 1
    return count
