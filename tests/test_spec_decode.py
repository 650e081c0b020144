"""Speculative decoding (``speculative_config``, prompt lookup): greedy output equals HF ``generate`` token for
token whatever is proposed, sampled output keeps the target distribution, and proposals were made and both
taken and refused (a test where none were would prove nothing)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from paged_backend import LLM, SamplingParams
from paged_backend.config import EngineConfig
from paged_backend.core.sequence import Request, Sequence
from paged_backend.spec_decode.ngram_proposer import NgramProposer
from paged_backend.worker.rejection_sampler import draft_views, take_verified
from paged_backend.worker.sampler import Sampler
from tests.conftest import assert_idle, hf_greedy, tiny_model
from tests.fixtures.tiny_models import build_tiny_model

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def repetitive_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts that repeat pieces of themselves, so that prompt lookup finds something to propose."""
    rng = random.Random(seed)
    prompts = []
    for length in (3, 5, 7, 9):
        piece = [rng.randrange(3, 500) for _ in range(length)]
        prompts.append(piece * 3 + piece[: length // 2])
    return prompts


def test_prompt_lookup_proposes_what_followed_the_last_occurrence_of_the_longest_suffix() -> None:
    proposer = NgramProposer(1, 3, 3)
    assert proposer.propose([1, 2, 3, 4, 9, 1, 2, 3]) == [4, 9, 1]  # the 3-gram (1, 2, 3) occurred at 0
    assert proposer.propose([5, 1, 8, 2, 1, 9, 2, 1]) == [9, 2, 1]  # (2, 1) last at 4, not (1) at 1
    assert proposer.propose([1, 2, 3, 1, 2, 3, 4, 1, 2, 3], max_tokens=2) == [4, 1]
    assert proposer.propose([5, 6, 7]) == [] and proposer.propose([5]) == []
    assert NgramProposer(2, 3, 3).propose([4, 1, 7, 1]) == []  # (1) repeats, but no 2-gram does
    # (7, 8) last at 3: what followed runs out after (9, 7, 8), and repeats as that period
    assert NgramProposer(2, 2, 7).propose([1, 2, 7, 8, 9, 7, 8]) == [9, 7, 8, 9, 7, 8, 9]
    assert NgramProposer(1, 2, 4).propose([3, 5, 5, 5]) == [5, 5, 5, 5]  # a loop of one token: k of them
    assert NgramProposer(1, 2, 4).propose([3, 5, 5, 5], max_tokens=2) == [5, 5]


def test_prompt_lookup_equals_a_plain_search_on_random_ids() -> None:
    """The proposer's one-pass search against the definition, written out: the longest suffix first, its last
    earlier occurrence, the tokens after it continued as an overlapping copy (each the one a period back) where
    they run out; ``last_match`` is that suffix's length (0 when nothing is proposed)."""

    def plain(ids: list[int], min_n: int, max_n: int, k: int) -> tuple[list[int], int]:
        for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
            for end in range(len(ids) - 2, n - 2, -1):
                if ids[end - n + 1 : end + 1] == ids[len(ids) - n :]:
                    after = list(ids[end + 1 :])
                    while len(after) < k:  # the text goes on repeating with the period the match stands for
                        after.append(after[len(after) - (len(ids) - end - 1)])
                    return after[:k], n
        return [], 0

    rng = random.Random(0)
    for _ in range(3000):
        ids = [rng.randrange(rng.choice([2, 3, 20])) for _ in range(rng.randrange(40))]
        min_n = rng.randrange(1, 4)
        max_n, k = rng.randrange(min_n, 6), rng.randrange(1, 6)
        proposer = NgramProposer(min_n, max_n, k)
        proposer.last_match = 7  # a lookup that finds nothing must not leave an earlier one's
        proposals = proposer.propose(ids)
        assert (proposals, proposer.last_match) == plain(ids, min_n, max_n, k), (ids, min_n, max_n, k)
        room = rng.randrange(1, 7)  # a step's room (budget, max_tokens, max_model_len) cuts the same guess
        assert proposer.propose(ids, room) == plain(ids, min_n, max_n, k)[0][:room], (ids, min_n, max_n, k, room)


def test_prompt_lookup_keeps_each_sequence_as_an_array_that_grows_with_it() -> None:
    """Lookups by sequence id read an array grown by each step's new tokens (one to several, past the array's
    size too): the proposals are those of a fresh lookup over the whole list. Ids that are not the same sequence
    any more (shorter, or another last known token) start the array again; ``forget`` drops it."""
    rng = random.Random(1)
    held, fresh = NgramProposer(1, 4, 5), NgramProposer(1, 4, 5)
    sequences: dict[int, list[int]] = {seq_id: [rng.randrange(6) for _ in range(3)] for seq_id in range(3)}
    for _ in range(400):
        seq_id = rng.randrange(3)
        ids = sequences[seq_id]
        ids += [rng.randrange(6) for _ in range(rng.randrange(1, 10))]
        assert held.propose(ids, seq_id=seq_id) == fresh.propose(ids), seq_id
    assert max(array.size for array, _ in held.arrays.values()) > 64  # they grew past their first size
    other = [5, 4, 3, 2, 1, 0, 5, 4]  # the same id, other ids: shorter, then as long with another last token
    assert held.propose(other, seq_id=0) == fresh.propose(other)
    changed = [rng.randrange(6) for _ in sequences[1][:-1]] + [(sequences[1][-1] + 1) % 6]
    assert held.propose(changed, seq_id=1) == fresh.propose(changed)
    held.forget(2)
    assert 2 not in held.arrays and held.propose(sequences[2], seq_id=2) == fresh.propose(sequences[2])


class TruthProposer:
    """A test double for prompt lookup: it proposes what follows in each given full sequence (prompt and its
    true output), with every third proposal changed, so that steps take several proposals, refuse some, and
    cross block boundaries."""

    def __init__(self, truths: list[list[int]], k: int = 4) -> None:
        self.truths, self.k, self.calls = truths, k, 0

    def propose(self, token_ids: list[int], max_tokens: int | None = None, seq_id: int = 0) -> list[int]:
        self.calls += 1
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        for full in self.truths:
            if full[: len(token_ids)] == token_ids:
                guess = full[len(token_ids) : len(token_ids) + k]
                if self.calls % 3 == 0 and guess:
                    guess[len(guess) // 2] = (guess[len(guess) // 2] + 1) % 500 + 3
                return guess
        return []


def oracle_proposer(model, prompts: list[list[int]]) -> TruthProposer:
    """The truth is HF's greedy continuation of each prompt."""
    return TruthProposer([prompt + hf_greedy(model, prompt, 60) for prompt in prompts])


def spec_llm(model, tokenizer, prompts: list[list[int]] | None = None, **kwargs) -> LLM:
    """An engine with prompt lookup, or with the oracle in its place when ``prompts`` are given."""
    kwargs = {"block_size": 4, "num_kv_blocks": 256, "max_model_len": 128, **kwargs}
    llm = LLM(model, tokenizer=tokenizer, speculative_config=SPEC, **kwargs)
    if prompts is not None:
        llm.llm_engine.scheduler.drafter.proposer = oracle_proposer(model, prompts)
    return llm


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "mistral"])
def test_greedy_output_equals_hf_with_proposals(tokenizer, arch: str) -> None:
    model = tiny_model(arch)
    prompts = repetitive_prompts()
    # prompt lookup (a random model's output seldom repeats its prompt: few proposals), then the oracle
    for llm in (spec_llm(model, tokenizer), spec_llm(model, tokenizer, prompts)):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)  # fmt: skip
        for prompt, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == hf_greedy(model, prompt, 40), (arch, prompt)
        assert_idle(llm)
    drafter = llm.llm_engine.scheduler.drafter
    assert 0 < drafter.num_accepted_tokens < drafter.num_draft_tokens, vars(drafter)


def test_greedy_equality_through_preemption_prefix_hits_and_chunked_prefill(tokenizer) -> None:
    """Few blocks (sequences preempted and recomputed), a shared prefix (cache hits), chunked prompts."""
    preemption_prefix_hits_and_chunks(tokenizer)


def preemption_prefix_hits_and_chunks(tokenizer, watch=None, **engine_args) -> None:
    """The case above, run and checked, ``watch(llm)`` called before it generates (``tests/test_spec_chain.py``
    runs it chained)."""
    model = tiny_model("llama")
    shared = repetitive_prompts(1)[2]
    prompts = [shared + tail for tail in ([7], [8, 9], [10, 11, 12], [13])] + repetitive_prompts(2)
    llm = spec_llm(model, tokenizer, prompts, num_kv_blocks=40, enable_prefix_caching=True,
                   long_prefill_token_threshold=8, **engine_args)  # fmt: skip
    if watch is not None:
        watch(llm)
    params = SamplingParams(temperature=0, max_tokens=32)
    first = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)  # its blocks stay cached
    outs = first + llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 32)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_prompt_tokens_cached"] > 0, stats
    assert llm.llm_engine.scheduler.drafter.num_accepted_tokens > 0
    assert_idle(llm)


def test_stops_and_max_tokens_cut_taken_proposals(tokenizer) -> None:
    """A stop token or max_tokens inside a row's taken proposals ends it there, as without proposals."""
    model = tiny_model("llama")
    plain = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=128, max_model_len=128)
    spec = spec_llm(model, tokenizer, repetitive_prompts()[1:2])
    prompt = {"prompt_token_ids": repetitive_prompts()[1]}
    full = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    stop = full.token_ids[17]
    for params in (SamplingParams(temperature=0, max_tokens=13), SamplingParams(temperature=0, max_tokens=40,
                                                                                stop_token_ids=[stop])):  # fmt: skip
        want = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        got = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
    assert spec.llm_engine.scheduler.drafter.num_accepted_tokens > 0
    assert_idle(spec)


def test_stop_strings_cut_taken_proposals_as_without_them(tokenizer) -> None:
    """A stop string that ends inside a row's taken proposals ends the output where it does without proposals,
    with and without the stop string in the text."""
    model = tiny_model("llama")
    plain = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=128, max_model_len=128)
    spec = spec_llm(model, tokenizer, repetitive_prompts()[1:2])
    prompt = {"prompt_token_ids": repetitive_prompts()[1]}
    text = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=40, stop=[stop], include_stop_str_in_output=include)
        want = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        got = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            want.text, want.token_ids, want.finish_reason, want.stop_reason)  # fmt: skip
        assert want.finish_reason == "stop" and want.stop_reason == stop
    assert spec.llm_engine.scheduler.drafter.num_accepted_tokens > 0


def test_seeded_sampling_with_proposals_repeats_itself(tokenizer) -> None:
    llm = spec_llm(tiny_model("llama"), tokenizer)
    prompt = {"prompt_token_ids": repetitive_prompts()[0]}
    params = SamplingParams(temperature=0.3, max_tokens=30, seed=11, repetition_penalty=1.1)
    first = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == first
    assert llm.llm_engine.scheduler.drafter.num_draft_tokens > 0


def _verify_first_token(logits: torch.Tensor, draft: int, n: int, take=take_verified) -> list[int]:
    """The first token ``n`` unseeded samples take when a step proposes ``draft`` after rows of ``logits``."""
    params = SamplingParams(temperature=1.0)
    request = Request("r", None, [5, 6], params)
    seqs = [Sequence(i, 0, request, [5, 6], 2, arrival=i) for i in range(n)]
    views, _ = draft_views(seqs, [[draft]] * n)
    rows = logits.repeat(n, 1)  # [2n, V]: each sequence's row before and after the proposal
    results = take(Sampler(torch.device("cpu"), seed=3)(rows, views), [[draft]] * n)
    return [taken[0].token_id for taken in results]


def _follows(firsts: list[int], p: list[float]) -> bool:
    n = len(firsts)
    return all(abs(firsts.count(t) - n * q) <= 5 * math.sqrt(n * q * (1 - q)) for t, q in enumerate(p))


def test_verified_tokens_keep_the_target_distribution() -> None:
    """The first token taken follows p, whatever the proposal; a verifier that reads the wrong row does not."""
    p = [0.5, 0.3, 0.15, 0.05]
    logits = torch.stack([torch.tensor(p).log(), torch.tensor([0.1, 0.2, 0.3, 0.4]).log()])
    for draft in (0, 2):
        assert _follows(_verify_first_token(logits, draft, 20000), p), draft

    def off_by_one_row(results, drafts):
        return [[results[2 * i + 1]] for i in range(len(drafts))]

    assert not _follows(_verify_first_token(logits, 2, 20000, take=off_by_one_row), p)


class _Continuations:
    """Proposes, once a sequence holds ``length`` tokens, the two tokens a table gives for its last one."""

    def __init__(self, length: int, table: dict[int, list[int]]) -> None:
        self.length, self.table = length, table

    def propose(self, token_ids: list[int], max_tokens: int | None = None, seq_id: int = 0) -> list[int]:
        return self.table[token_ids[-1]][:max_tokens] if len(token_ids) == self.length else []


def _pairs_after_proposals(model, prompt: list[int], table: dict[int, list[int]], n: int) -> tuple[torch.Tensor, int]:
    """Counts [V, V] of the second and third tokens of ``n`` samples (temperature 1, no request seed: the draws
    follow the engine's own seed, so the test repeats itself) through an engine whose second step verifies the two
    proposals ``table`` gives for the first token, and the proposals taken; the engine's count of proposals taken
    by position is checked against the samples' own tokens."""
    spec = {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": None}
    llm = LLM(model, skip_tokenizer_init=True, max_model_len=32, block_size=4, num_kv_blocks=512,
              speculative_config=spec)  # fmt: skip
    drafter = llm.llm_engine.scheduler.drafter
    drafter.proposer = _Continuations(len(prompt) + 1, table)
    params = SamplingParams(n=250, temperature=1.0, max_tokens=4, ignore_eos=True)  # room for both proposals
    outs = llm.generate([{"prompt_token_ids": prompt}] * (n // 250), params, use_tqdm=False)
    assert (drafter.num_drafts, drafter.num_draft_tokens) == (n, 2 * n), vars(drafter)
    vocab = model.config.vocab_size
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    taken_at = [0, 0]  # samples whose first proposal was taken, and both
    for out in outs:
        for sample in out.outputs:
            first, second, third = sample.token_ids[:3]
            counts[second, third] += 1
            taken_at[0] += second == table[first][0]
            taken_at[1] += second == table[first][0] and third == table[first][1]
    assert drafter.num_accepted_tokens_per_pos == taken_at, (drafter.num_accepted_tokens_per_pos, taken_at)
    return counts, drafter.num_accepted_tokens


def _largest_deviation(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest |z| over the cells expected 10 times or more, the others pooled into one cell."""
    n = float(counts.sum())
    kept = expected * n >= 10
    observed = torch.cat([counts[kept], counts[~kept].sum()[None]])
    probs = torch.cat([expected[kept], expected[~kept].sum()[None]])
    return float(((observed - n * probs) / (n * probs * (1 - probs)).clamp_min(1e-12).sqrt()).abs().max())


def test_sampled_tokens_through_the_engine_keep_the_target_distribution(monkeypatch) -> None:
    """Two proposals verified at temperature 1: the pair of tokens the samples then take follows the model's own
    joint distribution (from HF's forwards over every continuation); a verifier that keeps drawing past a refused
    proposal, takes the proposals whatever was drawn, or reads the draws one row late does not."""
    from dataclasses import replace

    import paged_backend.worker.step_sampler as step_sampler

    vocab, prompt, n = 8, [3, 5, 1, 6, 4, 7], 2000
    model = build_tiny_model("llama", vocab_size=vocab, seed=1)
    with torch.no_grad():  # logits that differ from one context to the next, none of them near one-hot
        model.lm_head.weight.mul_(3.0)

    def probs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.softmax(model(torch.tensor([ids])).logits[0, -1].double(), dim=-1)

    first = probs(prompt)
    second = {x: probs(prompt + [x]) for x in range(vocab)}
    joint = sum(first[x] * torch.stack([second[x][y] * probs(prompt + [x, y]) for y in range(vocab)])
                for x in range(vocab))  # fmt: skip
    table = {x: [int(second[x].argmax()), int(probs(prompt + [x, int(second[x].argmax())]).argmax())]
             for x in range(vocab)}  # fmt: skip
    counts, taken = _pairs_after_proposals(model, prompt, table, n)
    assert _largest_deviation(counts, joint) <= 5 and n // 2 < taken < 2 * n, taken  # proposals taken and refused

    def past_refusals(results, drafts):
        spans = [len(d) + 1 for d in drafts] if drafts is not None else [1] * len(results)
        return [results[sum(spans[:i]) : sum(spans[: i + 1])] for i in range(len(spans))]

    def proposals_taken(results, drafts):
        return [[replace(r, token_id=t) for r, t in zip(draws, d)] + draws[len(d) :]
                for draws, d in zip(past_refusals(results, drafts), drafts or [[]] * len(results))]  # fmt: skip

    def one_row_late(results, drafts):
        return take_verified(results[1:] + results[:1], drafts)

    for wrong in (past_refusals, proposals_taken, one_row_late):
        monkeypatch.setattr(step_sampler, "take_verified", wrong)
        assert _largest_deviation(_pairs_after_proposals(model, prompt, table, n)[0], joint) > 5, wrong.__name__


def test_ngram_sizes_follow_vllm() -> None:
    """One of prompt_lookup_min / prompt_lookup_max given stands for both, as in vLLM (a script that names only
    ``prompt_lookup_max`` looks up n-grams of that length alone); neither given: the library's default."""
    from paged_backend.config import DEFAULT_PROMPT_LOOKUP, SpeculativeConfig

    both = {"prompt_lookup_min": 1, "prompt_lookup_max": 6}
    for given, sizes in [({}, DEFAULT_PROMPT_LOOKUP), ({"prompt_lookup_max": 3}, (3, 3)),
                         ({"prompt_lookup_min": 5}, (5, 5)), (both, (1, 6))]:  # fmt: skip
        config = SpeculativeConfig.of(given)
        assert config is not None and config.ngram_sizes() == sizes
        assert (config.prompt_lookup_min, config.prompt_lookup_max) == sizes


def test_speculative_config_is_checked_by_name() -> None:
    config = EngineConfig.from_kwargs("m", speculative_config={"num_speculative_tokens": 3})
    assert config.speculative_config.num_speculative_tokens == 3
    for bad, field in [({"method": "eagle"}, "speculative_config.method"),
                       ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
                       ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_max"),
                       ({"k": 2}, "speculative_config")]:  # fmt: skip
        with pytest.raises(ValueError) as info:
            EngineConfig.from_kwargs("m", speculative_config=bad)
        assert info.value.field == field, info.value
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        EngineConfig.from_kwargs("m", speculative_config={}, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="batch_invariant=True") as info:
        EngineConfig.from_kwargs("m", speculative_config={}, batch_invariant=True)
    assert info.value.field == "speculative_config"


def test_verifying_graphs_hold_what_the_step_budget_does() -> None:
    """Rows of k + 1 tokens: as many as the batch has, but no more than the token budget holds (the server's 384)."""
    from paged_backend.worker.worker import verify_shape

    def shape(**kwargs):
        return verify_shape(EngineConfig.from_kwargs("m", **kwargs).resolve(2048))

    large = {"num_speculative_tokens": 8, "disable_by_batch_size": 1000}  # proposals at any batch size
    assert shape(speculative_config=large, max_num_seqs=256) == (9, 256)  # budget 8192
    assert shape(speculative_config=large, max_num_batched_tokens=512) == (9, 56)
    assert shape(speculative_config=large, max_num_batched_tokens=4) == (9, 1)
    spec = {"num_speculative_tokens": 4, "disable_by_batch_size": 9}
    assert shape(speculative_config=spec, max_num_batched_tokens=512) == (5, 8)
    assert shape(speculative_config=spec, enable_lora=True) is None


def test_counters_reach_stats_and_the_server_metrics(tokenizer) -> None:
    pytest.importorskip("prometheus_client")
    from paged_backend.entrypoints.openai.metrics import ServerMetrics

    model = tiny_model("llama")
    prompts = repetitive_prompts()[:2]
    llm = spec_llm(model, tokenizer, prompts)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=20),
                        use_tqdm=False)  # fmt: skip
    stats, drafter = llm.stats(), llm.llm_engine.scheduler.drafter
    assert (stats["spec_decode_num_drafts"], stats["spec_decode_num_draft_tokens"]) == (
        drafter.num_drafts, drafter.num_draft_tokens)  # fmt: skip
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]  # checked against samples' tokens: test above
    assert per_pos == drafter.num_accepted_tokens_per_pos and len(per_pos) == SPEC["num_speculative_tokens"]
    requests = [out.metrics for out in outs]  # each request's own, adding up to the engine's
    assert sum(m["spec_num_drafts"] for m in requests) == drafter.num_drafts
    assert sum(m["spec_num_accepted_tokens"] for m in requests) == drafter.num_accepted_tokens
    for m in requests:
        assert m["spec_mean_accepted_length"] == 1 + m["spec_num_accepted_tokens"] / m["spec_num_drafts"]
    metrics = ServerMetrics("m")
    metrics.render(stats)
    text = metrics.render(stats).decode()  # rendered twice: a counter grows by what changed, not by the total
    line = f'paged_backend:spec_decode_num_draft_tokens_total{{model_name="m"}} {float(drafter.num_draft_tokens)}'
    assert line in text, text
    for position, count in enumerate(per_pos):
        name = "paged_backend:spec_decode_num_accepted_tokens_per_pos_total"
        assert f'{name}{{model_name="m",position="{position}"}} {float(count)}' in text, text


class WrongProposer:
    """Proposes k tokens that are never the model's (they are out of the tiny vocabulary's used range)."""

    def propose(self, token_ids: list[int], max_tokens: int | None = None, seq_id: int = 0) -> list[int]:
        return [2] * min(4, 4 if max_tokens is None else max_tokens)  # </s>, which greedy never picks here


def test_a_sample_whose_proposals_are_refused_gets_none_for_a_while(tokenizer) -> None:
    """Every proposal refused: after one window (4 steps of 4 proposed tokens) the sample is paused for 32
    tokens, so 40 tokens cost at most two windows of proposals, not 160; the output is still greedy's; the
    request's metrics count what it was proposed and took."""
    from paged_backend.core.spec_decode import WINDOW_STEPS

    model = tiny_model("llama")
    llm = spec_llm(model, tokenizer)
    llm.llm_engine.scheduler.drafter.proposer = WrongProposer()
    prompt = repetitive_prompts()[0]
    (out,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                          use_tqdm=False)  # fmt: skip
    assert out.outputs[0].token_ids == hf_greedy(model, prompt, 40)[: len(out.outputs[0].token_ids)]
    proposed = llm.llm_engine.scheduler.drafter.num_draft_tokens
    assert 4 * WINDOW_STEPS <= proposed <= 8 * WINDOW_STEPS, proposed  # 40 tokens: one pause of PAUSE_TOKENS
    assert out.metrics["spec_num_draft_tokens"] == proposed and out.metrics["spec_acceptance_rate"] == 0


def test_a_sample_that_keeps_failing_is_paused_longer_each_time() -> None:
    """Pauses double while windows keep failing (open chat seldom copies), up to a cap, and start over after a
    window that pays."""
    from paged_backend.core.spec_decode import MAX_PAUSE_TOKENS, PAUSE_TOKENS, WINDOW_STEPS, judge

    seq = Sequence(0, 0, Request("r", None, [5, 6], SamplingParams()), [5, 6], 2, arrival=0)

    def window(taken_per_step: int) -> int:
        for _ in range(WINDOW_STEPS):
            judge(seq, taken_per_step)
        return seq.spec_paused_until - len(seq.token_ids)

    pauses = [window(0) for _ in range(6)]
    assert pauses == [min(MAX_PAUSE_TOKENS, PAUSE_TOKENS * 2**i) for i in range(6)], pauses
    seq.spec_paused_until = 0
    assert window(1) <= 0 and window(0) == PAUSE_TOKENS  # one taken a step pays: the next pause is short again


def test_a_paused_sample_whose_text_starts_copying_is_proposed_for_again() -> None:
    """While paused, prompt lookup's guesses are made and checked against the tokens that follow: one that
    would have had SHADOW_MIN_TAKEN proposals taken ends the pause (as soon as they are seen); one refused at once
    is replaced by a new guess, and the pause goes on."""
    from paged_backend.config import SpeculativeConfig
    from paged_backend.core.spec_decode import SHADOW_MIN_TAKEN, DraftPlanner

    planner = DraftPlanner(
        SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3), max_model_len=1000
    )
    request = Request("r", None, [5, 6], SamplingParams())
    copying, wandering = (Sequence(i, 0, request, [10, 11, 12, 13, 14, 15, 20, 10, 11], 2, arrival=i) for i in (0, 1))
    for seq, tokens in ((copying, [[12, 13], [14, 99]]), (wandering, [[50, 51, 52, 53]])):
        seq.spec_paused_until = 10**6
        planner.watch(seq)  # the first guess, from where it stands
        assert seq.spec_shadow == (9, [12, 13, 14, 15])
        for new in tokens:
            seq.token_ids += new
            planner.watch(seq)
    assert SHADOW_MIN_TAKEN <= 3 and copying.spec_paused_until == 0  # 12, 13, 14 would have been taken
    assert wandering.spec_paused_until == 10**6 and wandering.spec_shadow[0] == len(wandering.token_ids)
    # the pause ends as soon as SHADOW_MIN_TAKEN of a guess are seen taken, before the rest of it is decoded
    early = Sequence(2, 0, request, [10, 11, 12, 13, 14, 15, 20, 10, 11], 2, arrival=2)
    early.spec_paused_until = 10**6
    planner.watch(early)
    early.token_ids += [12, 13]
    planner.watch(early)
    assert early.spec_paused_until == 10**6  # two taken: not yet
    early.token_ids += [14]
    planner.watch(early)
    assert early.spec_paused_until == 0  # 12, 13, 14 taken; 15 not decoded yet
    # a loop shorter than SHADOW_MIN_TAKEN: its guess goes on as the loop would, and the pause ends
    looping = Sequence(3, 0, request, [9, 40, 41, 40, 41], 2, arrival=3)
    looping.spec_paused_until = 10**6
    planner.watch(looping)
    assert looping.spec_shadow == (5, [40, 41, 40, 41])
    looping.token_ids += [40, 41, 40]
    planner.watch(looping)
    assert looping.spec_paused_until == 0
    # k below SHADOW_MIN_TAKEN: a guess taken whole ends the pause (else none ever could, and rounds held for it)
    short = DraftPlanner(
        SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=3), max_model_len=1000
    )
    looping = Sequence(4, 0, request, [9, 40, 41, 40, 41], 2, arrival=4)
    looping.spec_paused_until = 10**6
    short.watch(looping)
    looping.token_ids += [40, 41]
    short.watch(looping)
    assert looping.spec_paused_until == 0 and not short.holds_round([looping])


def test_a_shadow_guess_holds_the_next_round_only_where_its_lookup_matched_several_tokens() -> None:
    """A paused sample's guess from a match of SHADOW_HOLD_MATCH tokens or more (text that copies) makes async
    scheduling wait for the round in flight before queuing the next (its tokens decide the guess), in batches of
    up to SHADOW_HOLD_MAX_ROWS; a one-token match (frequent in open chat, seldom taken) does not hold rounds
    back, nor does a sample with no guess."""
    from paged_backend.config import SpeculativeConfig
    from paged_backend.core.spec_decode import SHADOW_HOLD_MATCH, SHADOW_HOLD_MAX_ROWS, DraftPlanner

    planner = DraftPlanner(
        SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3), max_model_len=1000
    )
    request = Request("r", None, [5, 6], SamplingParams())
    held = {}
    for tokens in ([10, 11, 12, 13, 14, 20, 10, 11], [10, 11, 12, 13, 14, 20, 30, 10], [10, 11, 12, 13, 14, 40]):
        seq = Sequence(0, 0, request, list(tokens), 2, arrival=0)
        seq.spec_paused_until = 10**6
        planner.watch(seq)
        held[len(seq.spec_shadow[1]) and planner.proposer.last_match] = planner.holds_round([seq])
        if planner.holds_round([seq]):
            assert not planner.holds_round([seq] * (SHADOW_HOLD_MAX_ROWS + 1))  # a batch is not stalled for it
            seq.spec_paused_until = len(seq.token_ids)  # the pause ran out: its guess decides nothing now
            assert not planner.holds_round([seq])
    assert SHADOW_HOLD_MATCH == 2 and held == {2: True, 1: False, 0: False}, held


class NoProposer:
    def propose(self, token_ids: list[int], max_tokens: int | None = None, seq_id: int = 0) -> list[int]:
        return []


class CopiesThenStops:
    """The truth for a sample's first ``copied`` tokens (every proposal taken: its text copies), then nothing."""

    def __init__(self, truth: TruthProposer, prompts: list[list[int]], copied: int = 16) -> None:
        self.truth, self.prompts, self.copied = truth, prompts, copied

    def propose(self, token_ids: list[int], max_tokens: int | None = None, seq_id: int = 0) -> list[int]:
        prompt = next(p for p in self.prompts if token_ids[: len(p)] == p)
        return self.truth.propose(token_ids, max_tokens, seq_id) if len(token_ids) < len(prompt) + self.copied else []


@pytest.mark.parametrize("proposer", ["none", "wrong", "oracle", "copied"])
def test_steps_without_proposals_run_as_rounds_queued_ahead_only_past_speculation(tokenizer, proposer: str) -> None:
    """A step without proposals may be a multi-step round; async scheduling queues the round after it when no
    sample of it is proposed for next (a paused one), or when those that are have not been seen to copy and a
    lookup over their tokens finds nothing (``DraftPlanner.runs_ahead``); a sample whose proposals were all taken
    (``copied``) has each round read, its next step proposing from its tokens. Greedy output stays HF's."""
    model = tiny_model("llama")
    prompts = repetitive_prompts()[:2]
    llm = spec_llm(model, tokenizer, async_scheduling=True)
    drafter = llm.llm_engine.scheduler.drafter
    oracle = oracle_proposer(model, prompts)
    drafter.proposer = {"none": NoProposer(), "wrong": WrongProposer(), "oracle": oracle,
                        "copied": CopiesThenStops(oracle, prompts)}[proposer]  # fmt: skip
    executor, batches = llm.llm_engine.executor, []
    execute = executor.execute_model_async
    executor.execute_model_async = lambda out: batches.append(out.batch) or execute(out)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)  # fmt: skip
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 48)[:48] for p in prompts]
    rounds = [b for b in batches if b.num_steps is not None]
    queued = [b for b in rounds if b.prev_rows is not None]
    verified = [b for b in batches if b.draft_token_ids]
    assert bool(rounds) == (proposer != "oracle") and bool(verified) == (proposer != "none")  # oracle: every step
    assert bool(queued) == (proposer in ("none", "wrong")), proposer


def test_no_round_is_queued_behind_one_whose_tokens_a_shadow_guess_awaits(tokenizer, monkeypatch) -> None:
    """Paused samples (wrong proposals) get rounds queued ahead, unless a shadow guess holds them
    (``DraftPlanner.holds_round``); greedy output stays HF's either way."""
    from paged_backend.core.spec_decode import DraftPlanner

    model = tiny_model("llama")
    prompts = repetitive_prompts()[:2]
    queued = {}
    for holds in (False, True):
        monkeypatch.setattr(DraftPlanner, "holds_round", lambda self, seqs, holds=holds: holds)
        llm = spec_llm(model, tokenizer, async_scheduling=True)
        llm.llm_engine.scheduler.drafter.proposer = WrongProposer()
        executor, batches = llm.llm_engine.executor, []
        execute = executor.execute_model_async
        executor.execute_model_async = lambda out, execute=execute, batches=batches: (
            batches.append(out.batch) or execute(out)
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)  # fmt: skip
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 48)[:48] for p in prompts]
        queued[holds] = sum(b.num_steps is not None and b.prev_rows is not None for b in batches)
    assert queued[False] > 0 and queued[True] == 0, queued


def test_no_proposals_while_the_batch_is_large(tokenizer) -> None:
    model = tiny_model("llama")
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=256, max_model_len=128,
              speculative_config={**SPEC, "disable_by_batch_size": 3})  # fmt: skip
    prompts = repetitive_prompts()
    llm.llm_engine.scheduler.drafter.proposer = oracle_proposer(model, prompts)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)  # 4 running: none
    assert llm.stats()["spec_decode_num_drafts"] == 0
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 16)[:16] for p in prompts]
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # 2 running: proposals
    assert llm.stats()["spec_decode_num_drafts"] > 0


def replayed_verify_graphs(llm: LLM, record) -> None:
    """The engine's verifying steps through a graph runner of 8 rows whose graphs are replaced by re-running the
    forward on the static buffers (``replay_in_python``), ``record(inputs, keywords)`` called at each run."""
    from paged_backend.worker.cuda_graphs import CUDAGraphRunner
    from tests.conftest import replay_in_python

    runner = llm.llm_engine.executor.model_runner
    graphs = CUDAGraphRunner(runner._model_forward, 8, runner._graph_shape[1], torch.device("cpu"),
                             q_len=SPEC["num_speculative_tokens"] + 1)  # fmt: skip
    replay_in_python(graphs)
    replay = graphs.run
    graphs.run = lambda inputs, *args, **kw: record(inputs, kw) or replay(inputs, *args, **kw)
    runner.verify_graphs = graphs


def test_verifying_steps_through_the_graph_runner_give_hf_greedy(tokenizer) -> None:
    """The verify-graph path (rows padded to k + 1 tokens, every token's logits, the step's picked back, padding
    sequences of a bucket) feeds the forward what the eager path does: greedy output equals HF's. Graphs are
    replaced by re-running the forward on the static buffers, so this runs on CPU."""
    model = tiny_model("llama")
    prompts = repetitive_prompts()
    llm = spec_llm(model, tokenizer, prompts, max_num_seqs=8)
    used: list[int] = []
    replayed_verify_graphs(llm, lambda inputs, kw: used.append(inputs.num_seqs))
    lengths = (9, 17, 26, 40)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out, n in zip(prompts, outs, lengths):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, n)
    assert len(used) > 5 and {4, 3, 2, 1} <= set(used), used  # the batch shrank through buckets 4, 2 and 1
    assert llm.llm_engine.scheduler.drafter.num_accepted_tokens > 0
    assert_idle(llm)


def test_rows_padded_for_the_verify_graphs_keep_their_positions_and_logits() -> None:
    from paged_backend.worker.step_inputs import StepInputs
    from paged_backend.worker.verify_inputs import pad_rows

    inputs = StepInputs(  # a decode (1 token at 7), a row with 2 proposals (at 10..12), a 2-token prompt chunk
        input_ids=torch.tensor([5, 6, 7, 8, 9, 10]),
        positions=torch.tensor([7, 10, 11, 12, 0, 1]),
        slot_mapping=torch.tensor([70, 100, 101, 102, 200, 201]),
        block_tables=torch.zeros(3, 4, dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 1, 4, 6], dtype=torch.int32),
        context_lens=torch.tensor([8, 13, 2]),
        logits_indices=torch.tensor([0, 1, 2, 3, 5]),
    )
    padded, keep = pad_rows(inputs, 4, block_size=4, max_blocks=4)
    assert padded.input_ids.tolist() == [5, 0, 0, 0, 6, 7, 8, 0, 9, 10, 0, 0]
    assert padded.positions.tolist() == [7, 7, 7, 7, 10, 11, 12, 12, 0, 1, 1, 1]  # a pad at its row's last
    assert padded.slot_mapping.tolist() == [70, -1, -1, -1, 100, 101, 102, -1, 200, 201, -1, -1]
    assert padded.context_lens.tolist() == [11, 14, 4]  # the pads counted: each real query keeps its position
    assert padded.cu_seqlens_q.tolist() == [0, 4, 8, 12] and keep.tolist() == [0, 4, 5, 6, 9]
    assert pad_rows(inputs, 2, block_size=4, max_blocks=4) is None  # a row of 3 tokens does not fit rows of 2
    assert pad_rows(inputs, 4, block_size=4, max_blocks=3) is None  # the pads of row 1 reach its 4th block


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs are captured on a GPU only")
def test_a_gpu_engine_verifies_in_captured_graphs_with_hf_greedy(tokenizer) -> None:
    import copy

    model = copy.deepcopy(tiny_model("llama")).cuda()  # the session's CPU model stays on the CPU
    prompts = repetitive_prompts()
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=256, max_model_len=128, speculative_config=SPEC)
    runner = llm.llm_engine.executor.model_runner
    assert runner.verify_graphs is not None and runner.verify_graphs.graphs
    llm.llm_engine.scheduler.drafter.proposer = oracle_proposer(model, prompts)
    replays = []
    replay = runner.verify_graphs.run
    runner.verify_graphs.run = lambda inputs, *args, **kw: (
        replays.append(inputs.num_seqs) or replay(inputs, *args, **kw)
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=30),
                        use_tqdm=False)  # fmt: skip
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 30)
    assert replays and llm.llm_engine.scheduler.drafter.num_accepted_tokens > 0


def plain_and_replayed(model, tokenizer, prompts: list[list[int]], params: SamplingParams) -> tuple[LLM, list, list]:
    """(the speculating engine, the plain engine's outputs, the speculating engine's, proposed those outputs)."""
    plain = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=256, max_model_len=128, num_scheduler_steps=1)
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                           use_tqdm=False)]  # fmt: skip
    spec = spec_llm(model, tokenizer)
    spec.llm_engine.scheduler.drafter.proposer = TruthProposer([p + w for p, w in zip(prompts, want)])
    got = [o.outputs[0].token_ids for o in spec.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]  # fmt: skip
    return spec, want, got


def test_penalties_min_tokens_and_logits_processors_see_the_proposals_before_each_position(tokenizer) -> None:
    """Greedy under penalties, ``min_tokens`` and a logits processor that reads the tokens so far: each verified
    position is sampled as if the proposals before it had been taken, so the output is the plain engine's
    (proposed from that very output, every third proposal wrong)."""
    model = tiny_model("llama")
    prompts = repetitive_prompts()

    def no_repeat(token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if token_ids:
            logits[token_ids[-1]] = float("-inf")  # never the same token twice in a row
        return logits

    params = SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3, frequency_penalty=0.4,
                            min_tokens=20, logits_processors=[no_repeat])  # fmt: skip
    spec, want, got = plain_and_replayed(model, tokenizer, prompts, params)
    assert got == want
    drafter = spec.llm_engine.scheduler.drafter
    assert 0 < drafter.num_accepted_tokens < drafter.num_draft_tokens


def test_logprobs_of_taken_proposals_are_the_models(tokenizer) -> None:
    """A request asking for logprobs is proposed for too: each taken token has its own entry (the target's
    logprob, rank and top k), as decoding without proposals gives them."""
    model = tiny_model("llama")
    prompts = repetitive_prompts()[:2]
    plain = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=256, max_model_len=128, num_scheduler_steps=1)
    spec = spec_llm(model, tokenizer, prompts)
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=2)
    for prompt in prompts:
        want = plain.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        got = spec.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want.token_ids and len(got.logprobs) == len(want.logprobs) == len(want.token_ids)
        for mine, theirs in zip(got.logprobs, want.logprobs):
            assert mine.keys() == theirs.keys()
            for token, entry in mine.items():
                assert entry.rank == theirs[token].rank
                assert entry.logprob == pytest.approx(theirs[token].logprob, abs=1e-4)
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)
    assert spec.llm_engine.scheduler.drafter.num_accepted_tokens > 0


def test_structured_output_with_proposals_equals_it_without(tokenizer) -> None:
    """A grammar's sample is proposed only what its grammar allows (cut at the first token it refuses); each
    position is masked by the grammar as it would stand; the output equals greedy under the grammar alone."""
    pytest.importorskip("xgrammar")
    from paged_backend import StructuredOutputsParams

    model = tiny_model("llama")
    prompts = repetitive_prompts()[:3]
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 12}, "b": {"type": "integer"}},
              "required": ["a", "b"]}  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    spec, want, got = plain_and_replayed(model, tokenizer, prompts, params)
    assert got == want
    drafter = spec.llm_engine.scheduler.drafter
    assert 0 < drafter.num_accepted_tokens < drafter.num_draft_tokens, vars(drafter)
    assert_idle(spec)


def test_samples_of_one_request_are_each_proposed_for(tokenizer) -> None:
    """n and best_of: each sample (forked from the first one's prefill, its blocks shared copy-on-write) gets
    proposals of its own; greedy samples all equal HF's greedy, and a seeded request repeats itself."""
    model = tiny_model("llama")
    prompts = repetitive_prompts()[:2]
    llm = spec_llm(model, tokenizer, prompts)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=24, n=3),
                        use_tqdm=False)  # fmt: skip
    for prompt, out in zip(prompts, outs):
        assert [c.token_ids for c in out.outputs] == [hf_greedy(model, prompt, 24)] * 3
    assert llm.llm_engine.scheduler.drafter.num_accepted_tokens > 0
    seeded = SamplingParams(temperature=0.8, max_tokens=24, n=2, best_of=3, seed=9)
    first = [c.token_ids for c in llm.generate({"prompt_token_ids": prompts[0]}, seeded, use_tqdm=False)[0].outputs]
    again = [c.token_ids for c in llm.generate({"prompt_token_ids": prompts[0]}, seeded, use_tqdm=False)[0].outputs]
    assert first == again and len(first) == 2
    assert_idle(llm)


def test_hf_generate_with_prompt_lookup_on_a_patched_engine_that_speculates(tokenizer) -> None:
    """HF's own words, ``generate(prompt_lookup_num_tokens=...)``, on ``patch(model, speculative_config=...)``:
    the engine runs it, speculating by its own prompt lookup, and returns HF's result."""
    import warnings

    from paged_backend import patched

    model = tiny_model("llama")
    prompt = repetitive_prompts()[1]
    ids = torch.tensor([prompt])
    kwargs = dict(max_new_tokens=20, do_sample=False, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        want = model.generate(ids, prompt_lookup_num_tokens=4, **kwargs)
    with patched(model, tokenizer, block_size=4, num_kv_blocks=256, max_model_len=128, speculative_config=SPEC) as h:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback to HF's own generate warns
            got = model.generate(ids, prompt_lookup_num_tokens=4, **kwargs)
        assert h.llm.llm_engine.scheduler.drafter.num_draft_tokens > 0
    assert torch.equal(got, want)


def test_a_draft_model_proposes_and_greedy_output_stays_hf_s(tokenizer) -> None:
    """``method: draft_model``: a draft equal to the target has every proposal taken (the verifying step's
    cost alone, what the 8B figure needs); another model of the same vocabulary has some refused. Greedy output
    equals HF's either way, and each sequence's draft cache goes when it ends."""
    from tests.fixtures.tiny_models import build_tiny_model

    model = tiny_model("llama")
    prompts = repetitive_prompts()
    for draft, all_taken in ((model, True), (build_tiny_model("qwen2", vocab_size=512), False)):
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "disable_by_batch_size": None}
        llm = LLM(
            model, tokenizer=tokenizer, block_size=4, num_kv_blocks=256, max_model_len=128, speculative_config=spec
        )
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == hf_greedy(model, prompt, 24)[:24]
        drafter = llm.llm_engine.scheduler.drafter
        assert drafter.num_draft_tokens > 0
        if all_taken:  # and again after sleep() gave both caches back and wake_up() made them anew
            llm.sleep()
            llm.wake_up()
            again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
            assert drafter.num_accepted_tokens == drafter.num_draft_tokens, vars(drafter)
        else:
            assert drafter.num_accepted_tokens < drafter.num_draft_tokens
        assert drafter.proposer.proposals == {}
        assert_idle(llm)


@pytest.mark.parametrize(
    "case",
    [
        dict(num_kv_blocks=40, enable_prefix_caching=True, long_prefill_token_threshold=8),  # recompute, hits
        dict(num_kv_blocks=40, preemption_mode="swap", swap_space=0.01, max_num_batched_tokens=16),
        dict(num_scheduler_steps=4, async_scheduling=True),  # rounds while 4 or more run: no proposals then
    ],
    ids=["chunks-hits-recompute", "swap", "rounds"],
)
def test_a_draft_model_equal_to_the_target_has_every_guess_taken(tokenizer, case: dict) -> None:
    """The draft's paged KV follows the target's through chunked prefill, prefix hits, preemption (recomputed
    or swapped), multi-step rounds it did not guess in and async scheduling: a draft equal to the target then
    guesses exactly the target's greedy tokens, so every proposal is taken. A token the draft missed (a
    chunk, a round's token, a block moved without it) would make its guesses differ."""
    model = tiny_model("llama")
    shared = repetitive_prompts(1)[2]
    prompts = [shared + tail for tail in ([7], [8, 9], [10, 11, 12], [13])] + repetitive_prompts(2)
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 3, "disable_by_batch_size": 4}
    kwargs = {"block_size": 4, "max_model_len": 128, "num_kv_blocks": 256, **case}
    llm = LLM(model, tokenizer=tokenizer, speculative_config=spec, **kwargs)
    executor, batches = llm.llm_engine.executor, []
    execute = executor.execute_model_async
    executor.execute_model_async = lambda out: batches.append(out.batch) or execute(out)
    lengths = [8, 12, 16, 20, 28, 32, 36, 40]  # the batch shrinks below disable_by_batch_size as requests end
    first = llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    rest = [SamplingParams(temperature=0, max_tokens=n) for n in lengths[1:]]
    outs = first + llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], rest, use_tqdm=False)
    for prompt, n, out in zip(prompts, lengths, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, n)
    drafter, stats = llm.llm_engine.scheduler.drafter, llm.stats()
    assert drafter.num_draft_tokens > 20 and drafter.num_accepted_tokens == drafter.num_draft_tokens, vars(drafter)
    if "enable_prefix_caching" in case:
        assert stats["num_preemptions"] > 0 and stats["num_prompt_tokens_cached"] > 0, stats
    if "preemption_mode" in case:
        assert stats["num_swapped_out"] > 0, stats
    if "num_scheduler_steps" in case:
        assert any(b.num_steps is not None for b in batches)
    assert drafter.proposer.proposals == {}
    assert_idle(llm)


def test_a_draft_model_of_another_vocabulary_is_refused_by_name(tokenizer) -> None:
    from tests.fixtures.tiny_models import build_tiny_model

    spec = {"method": "draft_model", "model": build_tiny_model("llama", vocab_size=600)}
    with pytest.raises(ValueError, match="the draft model's vocabulary .600 tokens. must be the target's") as info:
        LLM(tiny_model("llama"), tokenizer=tokenizer, num_kv_blocks=64, max_model_len=64, speculative_config=spec)
    assert info.value.field == "speculative_config.model"
    with pytest.raises(ValueError, match="needed by method 'draft_model'"):
        EngineConfig.from_kwargs("m", speculative_config={"method": "draft_model"})


def test_taken_proposals_count_a_row_that_stops_on_one() -> None:
    from paged_backend.core.spec_decode import taken_proposals

    assert taken_proposals([5, 6], [5, 6, 7]) == 2  # stopped (EOS, a stop token) on its second proposal
    assert taken_proposals([5, 9], [5, 6]) == 1 and taken_proposals([5, 6, 8], [5, 6]) == 2
    assert taken_proposals([4], [5, 6]) == 0


def test_a_failing_proposer_costs_its_proposals_not_the_request(tokenizer, caplog) -> None:
    class Failing:
        def propose(self, token_ids: list[int], max_tokens: int | None = None, seq_id: int = 0) -> list[int]:
            raise RuntimeError("out of memory, say")

    model = tiny_model("llama")
    llm = spec_llm(model, tokenizer)
    llm.llm_engine.scheduler.drafter.proposer = Failing()
    prompt = repetitive_prompts()[0]
    (out,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(model, prompt, 8)
    assert "the proposer failed" in caplog.text
    assert_idle(llm)


def test_a_failing_draft_model_costs_its_guesses_not_the_step(tokenizer, caplog, monkeypatch) -> None:
    """The draft runs when a step's output is read: its failure leaves that step's samples without proposals,
    and the step and its requests go on."""
    from paged_backend.worker.draft_runner import DraftRunner

    model = tiny_model("llama")
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 3}
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=64, max_model_len=64, speculative_config=spec)
    monkeypatch.setattr(DraftRunner, "propose", lambda *_: (_ for _ in ()).throw(RuntimeError("out of memory, say")))
    prompt = repetitive_prompts()[0]
    (out,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(model, prompt, 8)
    assert "the draft model failed" in caplog.text
    assert llm.llm_engine.scheduler.drafter.num_draft_tokens == 0
    assert_idle(llm)


def test_a_draft_model_of_a_shorter_context_is_refused_by_name(tokenizer) -> None:
    from tests.fixtures.tiny_models import build_tiny_model

    draft = build_tiny_model("llama", vocab_size=512)
    draft.config.max_position_embeddings = 32
    spec = {"method": "draft_model", "model": draft}
    with pytest.raises(ValueError, match="the draft model takes 32 positions .* but max_model_len is 64") as info:
        LLM(tiny_model("llama"), tokenizer=tokenizer, num_kv_blocks=64, max_model_len=64, speculative_config=spec)
    assert info.value.field == "speculative_config.model"


def test_the_server_speculates_and_reports_it_in_metrics(tokenizer) -> None:
    pytest.importorskip("fastapi")
    import httpx

    from paged_backend.entrypoints.openai.cli_args import ServerArgs
    from tests.test_server import KEY, NAME, serving

    model = tiny_model("llama")
    prompts = repetitive_prompts()[:1]
    llm = spec_llm(model, tokenizer, prompts)
    with serving(llm, ServerArgs(model="tiny-path", served_model_name=NAME, api_key=KEY)) as url:
        headers = {"Authorization": f"Bearer {KEY}"}
        body = {"model": NAME, "prompt": prompts[0], "max_tokens": 20, "temperature": 0}
        reply = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert reply.status_code == 200, reply.text
        metrics = httpx.get(url + "/metrics", headers=headers, timeout=60).text
    taken = llm.llm_engine.scheduler.drafter.num_accepted_tokens
    assert (
        taken > 0
        and f'paged_backend:spec_decode_num_accepted_tokens_total{{model_name="{NAME}"}} {float(taken)}' in metrics
    )


def test_server_metrics_follow_each_replica_so_a_missed_scrape_counts_nothing_twice() -> None:
    """Data-parallel stats: a replica that misses a scrape and answers again adds only what it grew; one that
    restarted (its ``restarts`` changed) counts from zero, its run before forgotten; positions grow each on their
    own."""
    pytest.importorskip("prometheus_client")
    from paged_backend.entrypoints.openai.metrics import ServerMetrics

    def scrape(*replicas: tuple[int, int, int | None, list[int]]) -> dict:
        entries = []
        for index, restarts, drafts, per_pos in replicas:
            entry = {"replica": index, "restarts": restarts, "state": "running"}
            if drafts is not None:  # None: its stats call failed this time
                entry["stats"] = {"spec_decode_num_drafts": drafts, "spec_decode_num_accepted_tokens_per_pos": per_pos}
            entries.append(entry)
        return {"num_running": 0, "num_waiting": 0, "num_swapped": 0, "num_free_blocks": 1, "num_kv_blocks": 1,
                "prefix_cache_hit_rate": 0.0, "num_request_retries": 0, "replicas": entries}  # fmt: skip

    metrics = ServerMetrics("m")
    drafts = 'paged_backend:spec_decode_num_drafts_total{model_name="m"}'
    at_1 = 'paged_backend:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"}'
    for replicas, want, want_at_1 in [
        (((0, 0, 10, [6, 2]), (1, 0, 5, [3])), 15, 2),
        (((0, 0, 12, [7, 3]), (1, 0, None, [])), 17, 3),  # replica 1 missed the scrape
        (((0, 0, 12, [7, 3]), (1, 0, 8, [4, 1])), 20, 4),  # it answers again: only its growth
        (((0, 1, 2, [1, 1]), (1, 0, 8, [4, 1])), 22, 5),  # replica 0 restarted: from zero
    ]:
        text = metrics.render(scrape(*replicas)).decode()
        assert f"{drafts} {float(want)}" in text and f"{at_1} {float(want_at_1)}" in text, text
    assert sorted(metrics.spec_seen) == [(0, 1), (1, 0)]  # replica 0's run before its restart is forgotten
