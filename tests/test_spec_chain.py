"""Verifying steps chained under async scheduling (core/spec_chain.py): the step after a verifying step is queued
before that step is read, on the guess that every proposal is taken; a row that took fewer is stale there and
skipped. Greedy output must stay HF's whichever rows turn out stale."""

from __future__ import annotations

import pytest
import torch

from paged_backend import LLM, SamplingParams
from paged_backend.core.spec_chain import lookup_after, stale_rows
from paged_backend.spec_decode.ngram_proposer import NgramProposer
from tests.conftest import assert_idle, hf_greedy, tiny_model
from tests.test_spec_decode import (
    SPEC,
    preemption_prefix_hits_and_chunks,
    repetitive_prompts,
    replayed_verify_graphs,
    spec_llm,
)


class PositionTruth:
    """A test double for prompt lookup that proposes by position alone: what follows position ``len(token_ids)``
    in the sequence's true continuation, whatever the ids before it, wrong at every position ``p % 11 == 5``. So
    a step whose proposals hold a wrong one takes fewer, while the lookup after it (made on the guess that it takes
    all) still proposes: its chained successor is stale."""

    def __init__(self, truths: list[list[int]], prompt_lens: list[int], k: int = 4) -> None:
        self.truths, self.prompt_lens, self.k = truths, prompt_lens, k

    def propose(self, token_ids: list[int], max_tokens: int | None = None, seq_id: int = 0) -> list[int]:
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        for full, n in zip(self.truths, self.prompt_lens):
            if full[:n] == token_ids[:n]:
                start = len(token_ids)
                return [t if p % 11 != 5 else (t + 1) % 500 + 3 for p, t in enumerate(full[start : start + k], start)]
        return []


def position_truth(model, prompts: list[list[int]]) -> PositionTruth:
    return PositionTruth([p + hf_greedy(model, p, 60) for p in prompts], [len(p) for p in prompts])


def traced(llm) -> tuple[list, list[int]]:
    """The batches the engine launches, and for each verifying step read, how many of its rows were stale."""
    engine = llm.llm_engine
    batches, stale = [], []
    execute, update = engine.executor.execute_model_async, engine.scheduler.update_from_output
    engine.executor.execute_model_async = lambda out: batches.append(out.batch) or execute(out)

    def counted(output, runner_output):
        if output.batch.first_from is not None:
            stale.append(len(stale_rows(output)))
        return update(output, runner_output)

    engine.scheduler.update_from_output = counted
    return batches, stale


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mistral"])
def test_chained_verifying_steps_give_hf_greedy(tokenizer, arch: str) -> None:
    """Proposals are HF's continuation, wrong at every position p % 11 == 5: some chained rows are stale, some
    not; both ways the output equals HF's, for requests of four lengths."""
    model = tiny_model(arch)
    prompts = repetitive_prompts()
    llm = spec_llm(model, tokenizer, async_scheduling=True)
    llm.llm_engine.scheduler.drafter.proposer = position_truth(model, prompts)
    batches, stale = traced(llm)
    lengths = (9, 17, 26, 40)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out, n in zip(prompts, outs, lengths):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, n), (arch, prompt)
    chained = [b for b in batches if b.first_from is not None]
    assert chained and all(b.draft_token_ids for b in chained)
    assert any(n == 0 for n in stale) and any(n > 0 for n in stale), stale  # kept and stale rows both read
    assert_idle(llm)


def test_a_lone_stream_chains_and_drops_a_stale_step_unread(tokenizer) -> None:
    """One sequence: a chained step whose only row is stale is dropped unread (the next step schedules anew);
    streamed outputs grow without gaps or repeats."""
    model = tiny_model("llama")
    prompt = repetitive_prompts()[2]
    llm = spec_llm(model, tokenizer, async_scheduling=True)
    llm.llm_engine.scheduler.drafter.proposer = position_truth(model, [prompt])
    batches, stale = traced(llm)
    engine, seen = llm.llm_engine, []
    engine.add_request("0", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=40))
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids = out.outputs[0].token_ids
            assert ids[: len(seen)] == seen
            seen = list(ids)
    assert seen == hf_greedy(model, prompt, 40)
    chained = [b for b in batches if b.first_from is not None]
    assert len(chained) > len(stale)  # some chained steps were dropped, never read
    assert_idle(llm)


def chain_decisions(llm, model, prompts: list[list[int]], monkeypatch) -> list[tuple[bool, bool, bool]]:
    """Each ``verify_continuation`` call's (every row proposed for in the step in flight took all in its last
    verifying step, every row did, chained) over greedy requests of ``prompts``, whose outputs must be HF's."""
    import paged_backend.core.scheduler as scheduler_module

    asked: list[tuple[bool, bool, bool]] = []
    continuation = scheduler_module.verify_continuation

    def recorded(scheduler, in_flight):
        proposed = in_flight.batch.draft_token_ids or []
        took_all = [seq.spec_took_all for seq in in_flight.seqs]
        out = continuation(scheduler, in_flight)
        asked.append((all(t for t, d in zip(took_all, proposed) if d), all(took_all), out is not None))
        return out

    monkeypatch.setattr(scheduler_module, "verify_continuation", recorded)
    params = SamplingParams(temperature=0, max_tokens=40)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 40)
    assert_idle(llm)
    return asked


def test_no_chain_after_a_row_took_fewer_than_all(tokenizer, monkeypatch) -> None:
    """The step after a verifying step is chained only while every row proposed for took all its proposals in
    its last verifying step read; a row that missed gets its next step planned once its tokens are known."""
    model = tiny_model("llama")
    prompts = repetitive_prompts()[:2]
    llm = spec_llm(model, tokenizer, async_scheduling=True)
    llm.llm_engine.scheduler.drafter.proposer = position_truth(model, prompts)
    asked = chain_decisions(llm, model, prompts, monkeypatch)
    assert not any(chained for took_all, _, chained in asked if not took_all), asked
    chained = {(took_all, chained) for took_all, _, chained in asked}
    assert (True, True) in chained and (False, False) in chained, asked  # both cases met


class MissOnceThenSilent:
    """A test double for prompt lookup: the first prompt's row is proposed a wrong token once, then nothing; the
    second's gets its true continuation every step."""

    def __init__(self, truths: list[list[int]], prompt_lens: list[int], k: int = 4) -> None:
        self.truths, self.prompt_lens, self.k, self.missed = truths, prompt_lens, k, False

    def propose(self, token_ids: list[int], max_tokens: int | None = None, seq_id: int = 0) -> list[int]:
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        (first, second), start = self.truths, len(token_ids)
        if token_ids[: self.prompt_lens[0]] == first[: self.prompt_lens[0]]:
            if self.missed:
                return []
            self.missed = True
            return [(first[start] + 1) % 500 + 3]
        return second[start : start + k]


def test_a_row_without_proposals_does_not_stop_the_chain(tokenizer, monkeypatch) -> None:
    """Only rows proposed for in the step in flight can be stale in its successor: a row that once took fewer
    and now gets no proposals does not keep the others from chaining."""
    model = tiny_model("llama")
    prompts = repetitive_prompts()[:2]
    llm = spec_llm(model, tokenizer, async_scheduling=True)
    truths = [p + hf_greedy(model, p, 60) for p in prompts]
    llm.llm_engine.scheduler.drafter.proposer = MissOnceThenSilent(truths, [len(p) for p in prompts])
    asked = chain_decisions(llm, model, prompts, monkeypatch)
    assert any(chained for _, every_row, chained in asked if not every_row), asked


def test_chained_steps_through_the_verify_graphs_give_hf_greedy(tokenizer) -> None:
    """The first token of each row goes into the graph's static inputs (every q_len-th token): graphs replaced by
    re-running the forward on the static buffers, so this runs on CPU."""

    model = tiny_model("llama")
    prompts = repetitive_prompts()
    llm = spec_llm(model, tokenizer, max_num_seqs=8, async_scheduling=True)
    llm.llm_engine.scheduler.drafter.proposer = position_truth(model, prompts)
    _, stale = traced(llm)
    fed: list[bool] = []
    replayed_verify_graphs(llm, lambda inputs, kw: fed.append(kw.get("first_ids") is not None))
    params = SamplingParams(temperature=0, max_tokens=30)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 30)
    assert sum(fed) > 2 and not all(fed), fed
    assert any(n == 0 for n in stale) and any(n > 0 for n in stale), stale
    assert_idle(llm)


def test_chaining_through_preemption_prefix_hits_and_chunked_prefill(tokenizer) -> None:
    """Greedy output with chaining on through preemption (few blocks), prefix hits and chunked prompts; the
    watermark test below checks the chain's own use of blocks."""
    launched: list = []
    preemption_prefix_hits_and_chunks(tokenizer, lambda llm: launched.extend([traced(llm)[0]]),
                                      async_scheduling=True)  # fmt: skip
    assert any(b.first_from is not None for b in launched[0])


def test_a_chain_leaves_the_watermark_free(tokenizer, monkeypatch) -> None:
    """A chained step's slots, like a normal step's proposals, never take the free blocks below the watermark
    (they would push a request out): under a tight cache the chain gives way, and the output stays HF's."""
    import paged_backend.core.spec_chain as spec_chain

    model = tiny_model("llama")
    prompts = repetitive_prompts()
    llm = spec_llm(model, tokenizer, num_kv_blocks=48, async_scheduling=True)
    llm.llm_engine.scheduler.drafter.proposer = position_truth(model, prompts)
    bm = llm.llm_engine.scheduler.block_manager
    bm.watermark_blocks = 6
    allocated, allocate = [], spec_chain._allocate

    def watched(*args):
        before = bm.num_free_blocks
        done = allocate(*args)
        allocated.append((done, before, bm.num_free_blocks))
        return done

    monkeypatch.setattr(spec_chain, "_allocate", watched)
    params = SamplingParams(temperature=0, max_tokens=40)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 40)
    assert any(done for done, _, _ in allocated) and not all(done for done, _, _ in allocated), allocated
    assert all(after >= 6 or after == before for done, before, after in allocated if done), allocated
    assert_idle(llm)


def test_no_chain_for_rows_the_device_cannot_choose_for(tokenizer) -> None:
    """Sampled rows, and greedy ones asking logprobs, take their tokens on the host: nothing is chained."""
    model = tiny_model("llama")
    prompts = repetitive_prompts()
    for params in (SamplingParams(temperature=0.8, seed=1, max_tokens=20),
                   SamplingParams(temperature=0, logprobs=1, max_tokens=20)):  # fmt: skip
        llm = spec_llm(model, tokenizer, prompts, async_scheduling=True)
        batches, _ = traced(llm)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert any(b.draft_token_ids for b in batches) and not any(b.first_from is not None for b in batches)
        assert_idle(llm)


def test_the_lookup_after_a_guess_continues_the_match() -> None:
    """The token after the proposals is guessed as the lookup's next, and the row's proposals follow it; a
    proposer other than prompt lookup is asked with the guesses in its list."""
    from types import SimpleNamespace

    from tests.test_spec_decode import TruthProposer

    seq = SimpleNamespace(token_ids=[5, 6, 7, 8, 9, 10, 11, 5, 6], seq_id=3)
    for proposer in (NgramProposer(1, 3, 4), TruthProposer([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5]])):
        assert lookup_after(proposer, seq, [7, 8], 3) == [10, 11, 5]  # 9 guessed after 7, 8
        assert lookup_after(proposer, seq, [7, 8], 0) == []
    assert lookup_after(NgramProposer(1, 3, 4), SimpleNamespace(token_ids=[1, 2], seq_id=4), [3], 4) == []


def test_a_lookup_ahead_equals_one_over_the_whole_list_and_keeps_only_taken_tokens() -> None:
    """``propose_ahead`` reads the sequence's kept array and the guesses after it: as a lookup over both, without
    the guesses joining the array (a later lookup over the taken tokens would otherwise read them)."""
    import random

    rng = random.Random(0)
    proposer, fresh = NgramProposer(1, 3, 5), NgramProposer(1, 3, 5)
    ids: list[int] = []
    for _ in range(200):
        ids.append(rng.randrange(6))
        ahead = [rng.randrange(6) for _ in range(rng.randrange(4))]
        assert proposer.propose_ahead(ids, ahead, 5, seq_id=1) == fresh.propose(ids + ahead, 5)
        assert proposer.arrays[1][1] == len(ids)
        assert proposer.propose(ids, 5, seq_id=1) == fresh.propose(ids, 5)


def test_random_arrivals_keep_hf_greedy_while_chaining(tokenizer) -> None:
    """Requests added between steps while the arrivals predicate (the engine loop's) answers at random: a chain is
    planned only when no arrival could take a place, and every output stays HF's."""
    import random

    model = tiny_model("llama")
    prompts = repetitive_prompts() + repetitive_prompts(3)
    llm = spec_llm(model, tokenizer, async_scheduling=True, max_num_seqs=4)
    llm.llm_engine.scheduler.drafter.proposer = position_truth(model, prompts)
    batches, _ = traced(llm)
    engine, rng = llm.llm_engine, random.Random(0)
    engine.arrivals = lambda: rng.random() < 0.5
    lengths = [rng.randrange(8, 40) for _ in prompts]
    finished: dict[str, list[int]] = {}
    added = 0
    while added < len(prompts) or engine.has_unfinished_requests():
        if added < len(prompts) and rng.random() < 0.3:
            params = SamplingParams(temperature=0, max_tokens=lengths[added])
            engine.add_request(str(added), {"prompt_token_ids": prompts[added]}, params)
            added += 1
        for out in engine.step(finished_only=True):
            finished[out.request_id] = list(out.outputs[0].token_ids)
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        assert finished[str(i)] == hf_greedy(model, prompt, n), i
    assert any(b.first_from is not None for b in batches)
    assert_idle(llm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs are captured on a GPU only")
def test_a_gpu_engine_chains_verifying_steps_in_captured_graphs_with_hf_greedy(tokenizer) -> None:
    """On a GPU (async scheduling on by default): chained steps replay the captured verify graphs with their first
    tokens gathered on the device, stale rows among them, and greedy output stays HF's."""
    import copy

    model = copy.deepcopy(tiny_model("llama")).cuda()  # the session's CPU model stays on the CPU
    prompts = repetitive_prompts()
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=256, max_model_len=128, speculative_config=SPEC)
    runner = llm.llm_engine.executor.model_runner
    assert llm.llm_engine.async_scheduling and runner.verify_graphs is not None and runner.verify_graphs.graphs
    llm.llm_engine.scheduler.drafter.proposer = position_truth(model, prompts)
    _, stale = traced(llm)
    fed: list[bool] = []
    replay = runner.verify_graphs.run
    runner.verify_graphs.run = lambda inputs, *a, **kw: (
        fed.append(kw.get("first_ids") is not None) or replay(inputs, *a, **kw)
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=30),
                        use_tqdm=False)  # fmt: skip
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 30)
    assert any(fed) and any(n == 0 for n in stale), (fed, stale)
    assert_idle(llm)
