"""Prompt lookup's rounds on the device (core/lookup_round.py, worker/lookup_round.py): the device's lookup makes
the host's proposals, and greedy output through rounds equals HF ``generate`` token for token, with proposals
taken and refused inside a round, rounds queued behind rounds, and rows that end inside one."""

from __future__ import annotations

import random

import pytest
import torch

from paged_backend import LLM, SamplingParams
from paged_backend.core import lookup_round as planning
from paged_backend.spec_decode.device_lookup import device_lookup
from paged_backend.spec_decode.ngram_proposer import NgramProposer
from paged_backend.worker.lookup_step import LookupInputs
from tests.conftest import assert_idle, hf_greedy
from tests.fixtures.tiny_models import build_tiny_model

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}


def test_the_device_lookup_proposes_what_prompt_lookup_does() -> None:
    """Random rows of few distinct ids (many matches, of every length, some filling the history), every n-gram range
    and k (some past the rows' lengths); through a step's inputs, each row's length limit cuts its proposals as the
    host's room does."""
    rng = random.Random(0)
    for _ in range(600):
        min_n = rng.choice([1, 2, 3])
        max_n, k = rng.choice([min_n, min_n + 1, 4]), rng.choice([1, 3, 8, 33])
        rows = [[rng.randint(0, rng.choice([2, 3, 6])) for _ in range(rng.randint(1, 40))] for _ in range(3)]
        history = torch.full((3, 40), -7, dtype=torch.long)  # what lies past a row's length must not count
        for b, row in enumerate(rows):
            history[b, : len(row)] = torch.tensor(row)
        lens = torch.tensor([len(r) for r in rows])
        proposals, count = device_lookup(history, lens, min_n, max_n, k)
        host = NgramProposer(min_n, max_n, k)
        for b, row in enumerate(rows):
            assert proposals[b, : count[b]].tolist() == host.propose(row), (min_n, max_n, k, row)
        max_lens = lens + torch.tensor([rng.randint(0, 12) for _ in rows])
        step = LookupInputs(history, lens, max_lens, torch.zeros(3, 8, dtype=torch.int32), (min_n, max_n), k, 16)
        for b, row in enumerate(rows):
            room = int(max_lens[b]) - len(row) - 1
            want = host.propose(row, room) if room > 0 else []
            assert step.proposals[b, : step.proposed[b]].tolist() == want, (min_n, max_n, k, row, room)


def copying_model():
    """A tiny Llama whose greedy choice after token t is a fixed token f(t), by a wide margin: the embedding is
    normal(0, 1), the layers' output projections nearly zero (the residual stream stays t's embedding) and the
    untied head the embedding's rows in a fixed random order. A prompt holding a piece of t, f(t), f(f(t)), ...
    is then continued as it goes on: prompt lookup's proposals are taken, up to where the prompt's piece ends."""
    model = build_tiny_model("llama", vocab_size=512)
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(1e-4)
            layer.mlp.down_proj.weight.mul_(1e-4)
        order = torch.randperm(embedding.shape[0], generator=torch.Generator().manual_seed(1))
        model.lm_head.weight = torch.nn.Parameter(embedding[order].clone())
    return model


def orbit_prompts(model, seed: int = 0) -> list[list[int]]:
    """Prompts of random ids, each holding a piece of the model's own greedy continuation of one of its ids, once
    with a wrong id inside (a round's proposals are taken, then refused where the piece goes wrong)."""
    rng = random.Random(seed)
    prompts = []
    for length in (6, 10, 14):
        start = rng.randrange(3, 500)
        piece = [start, *hf_greedy(model, [start], length)]
        piece[length // 2] = (piece[length // 2] + 7) % 500 + 3
        noise = [rng.randrange(3, 500) for _ in range(5)]
        prompts.append(noise + piece + noise[:2] + [start])
    return prompts


def traced(llm) -> list:
    """The batches the engine launches."""
    engine, batches = llm.llm_engine, []
    execute = engine.executor.execute_model_async
    engine.executor.execute_model_async = lambda out: batches.append(out.batch) or execute(out)
    return batches


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_lookup_rounds_give_hf_greedy(tokenizer, async_scheduling: bool) -> None:
    model = copying_model()
    prompts = orbit_prompts(model)
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=256, max_model_len=160,
              speculative_config=SPEC, async_scheduling=async_scheduling)  # fmt: skip
    batches = traced(llm)
    lengths = (11, 30, 45)
    for prompt, n in zip(prompts, lengths):  # one stream at a time, as a chat is
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)
        assert out[0].outputs[0].token_ids == hf_greedy(model, prompt, n), prompt
    rounds = [b for b in batches if b.lookup_round is not None]
    assert rounds, "no lookup round ran"
    if async_scheduling:
        assert any(b.lookup_round.history is None for b in rounds)  # a round queued behind another
    drafter = llm.llm_engine.scheduler.drafter
    assert 0 < drafter.num_accepted_tokens < drafter.num_draft_tokens, vars(drafter)
    assert_idle(llm)


def test_a_batch_of_rounds_with_stops_max_tokens_and_the_length_limit(tokenizer) -> None:
    """Three streams in one batch, each ending inside a round in its own way: a stop token among taken proposals,
    ``max_tokens``, and ``max_model_len`` (rounds stop planning where a round could pass it)."""
    model = copying_model()
    prompts = orbit_prompts(model, seed=1)
    plain = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=256, max_model_len=64)
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=256, max_model_len=64, speculative_config=SPEC)
    batches = traced(llm)
    stop = hf_greedy(model, prompts[0], 20)[9]
    params = [
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop]),
        SamplingParams(temperature=0, max_tokens=17),
        SamplingParams(temperature=0, max_tokens=200),  # ends at max_model_len
    ]
    want = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for w, g in zip(want, got):
        assert (g.outputs[0].token_ids, g.outputs[0].finish_reason) == (w.outputs[0].token_ids,
                                                                         w.outputs[0].finish_reason)  # fmt: skip
    assert [o.outputs[0].finish_reason for o in got] == ["stop", "length", "length"]
    assert any(b.lookup_round is not None and b.num_seqs == 3 for b in batches)
    assert_idle(llm)


def test_rounds_end_where_their_yield_drops(tokenizer, monkeypatch) -> None:
    """A round started from a host step is read before another is queued; one read that yielded less than
    LOOKUP_ROUND_MIN_YIELD tokens a step queues no round behind the next. With the bar at 4.9 (k = 4: every step
    taking all its proposals, which the prompt's pieces, one token wrong, never allow for a whole round) no round
    is queued behind another, and the output is the same."""
    model = copying_model()
    prompt = orbit_prompts(model)[2]
    want = hf_greedy(model, prompt, 45)
    for bar, longest in ((planning.LOOKUP_ROUND_MIN_YIELD, 2), (4.9, 0)):
        monkeypatch.setattr(planning, "LOOKUP_ROUND_MIN_YIELD", bar)
        llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=256, max_model_len=160,
                  speculative_config=SPEC, async_scheduling=True)  # fmt: skip
        batches = traced(llm)
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=45), use_tqdm=False)
        assert out[0].outputs[0].token_ids == want
        # each batch as launched: a step of the host's (.), a round started from one (F), one queued behind (C)
        kinds = "".join("." if b.lookup_round is None else "C" if b.lookup_round.history is None else "F"
                        for b in batches)  # fmt: skip
        assert ".FC" not in kinds and max(len(run) for run in kinds.replace("F", ".").split(".")) == longest, kinds
        assert_idle(llm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs are captured on a GPU only")
@pytest.mark.parametrize("whole_step", [True, False], ids=["lookup_graphs", "verify_graphs_only"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_gpu_engine_runs_rounds_in_the_verifying_graphs_with_hf_greedy(
    tokenizer, dtype: str, whole_step: bool
) -> None:
    """Compiled layers and captured graphs: one stream (a padded graph bucket) and a batch of three, each step
    replayed whole (worker/lookup_graphs.py) or its forward alone (the lookup and acceptance launched eagerly)."""
    model = copying_model().to("cuda", getattr(torch, dtype))
    prompts = orbit_prompts(model)
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=256, max_model_len=160, speculative_config=SPEC)
    runner = llm.llm_engine.executor.model_runner
    assert runner.verify_graphs is not None and runner.verify_graphs.graphs and runner.lookup_graphs is not None
    replays = []
    if whole_step:
        step = runner.lookup_graphs.step
        runner.lookup_graphs.step = lambda size, rows: replays.append(rows) or step(size, rows)
    else:
        runner.lookup_graphs = None
        replay = runner.verify_graphs.run_rows
        runner.verify_graphs.run_rows = lambda *args: replays.append(args[3].shape[0]) or replay(*args)
    params = SamplingParams(temperature=0, max_tokens=40)
    outs = [llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)[0]]
    outs += llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip([prompts[0], *prompts], outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 40), prompt
    assert 1 in replays and 3 in replays, replays
    assert_idle(llm)


def test_the_captured_step_halves_equal_the_eager_step() -> None:
    """worker/lookup_graphs.py's two halves around the verifying forward, run here uncaptured on a CPU (``before``,
    the forward over the static buffers, ``after``), against the eager step over the same rows: three rows in a
    bucket of four (one padding row, which writes no slot and keeps its count), three steps in a row, the rows'
    token ids and counts carried in the static buffers from step to step. Then a fresh round of shorter rows over
    the same buffers: only each row's tokens are copied in, and the first round's tokens past them, left in
    place, must change no match (a lookup's candidate ends stop before a row's last token; proposal slots past a
    row's length are never counted, whatever they hold, and these rows' lookups do not reach them)."""
    from paged_backend.core.scheduler_output import LookupRound
    from paged_backend.worker.cuda_graphs import CUDAGraphRunner
    from paged_backend.worker.lookup_graphs import LookupGraphs
    from paged_backend.worker.lookup_round import verify_step

    model = copying_model()
    prompts = orbit_prompts(model)
    llm = LLM(model, skip_tokenizer_init=True, block_size=4, num_kv_blocks=256, max_model_len=160)
    runner = llm.llm_engine.executor.model_runner
    k, ngrams, width = SPEC["num_speculative_tokens"], (2, 3), runner._graph_shape[1]
    verify = CUDAGraphRunner(runner._model_forward, 4, width, torch.device("cpu"), q_len=k + 1)
    graphs = LookupGraphs(verify, ngrams, runner.block_size, runner.sampler.greedy)
    tables = torch.arange(3 * width, dtype=torch.int32).view(3, width)  # every row its own blocks
    for rows in (prompts, [ids[3:] for ids in orbit_prompts(model, seed=1)]):  # the second's rows shorter
        plan = LookupRound(num_steps=3, num_speculative_tokens=k, ngram_sizes=ngrams, max_lens=[160, 160, 40],
                           capacity=160, history=rows)  # fmt: skip
        size = graphs.start(plan.history, plan.max_lens, tables)
        assert size == 4
        captured = []
        with torch.inference_mode():
            for _ in range(plan.num_steps):
                graphs.found[size] = graphs._before(size)
                verify.outputs[size] = verify._run(size)
                graphs.records[size] = graphs._after(size)
                captured.append(graphs.records[size][:3].clone())
            assert verify.static_ints[2, 3 * (k + 1) : 4 * (k + 1)].eq(-1).all() and graphs.lens[3] == 1
            history = torch.zeros(3, 160, dtype=torch.long)
            for row, ids in enumerate(rows):
                history[row, : len(ids)] = torch.tensor(ids)
            lens = torch.tensor([len(ids) for ids in rows])
            max_lens = torch.tensor(plan.max_lens)
            eager = [verify_step(runner, plan, history, lens, tables, max_lens) for _ in range(plan.num_steps)]
        for got, want in zip(captured, eager):
            assert torch.equal(got[:, : k + 1], want[:, : k + 1]) and torch.equal(got[:, -2:], want[:, -2:])
            torch.testing.assert_close(got[:, k + 1 : -2], want[:, k + 1 : -2])
        assert sum(step[:, -1].sum() for step in eager) > 0  # proposals were taken: the halves were tested on them
        assert torch.equal(graphs.lens[:3], lens)
        for row, n in enumerate(lens.tolist()):
            assert torch.equal(graphs.history[row, :n], history[row, :n])


def test_a_round_is_no_longer_than_max_tokens_likely_leaves() -> None:
    """At the yield that keeps rounds going (2 tokens a step): 7 tokens left make a round of 4 steps at most, 5 of
    3, none once the steps in flight likely take them; without ``max_tokens`` a whole round."""
    from types import SimpleNamespace

    def seq(max_tokens, done):
        return SimpleNamespace(params=SimpleNamespace(max_tokens=max_tokens), num_output_tokens=done)

    steps = planning.LOOKUP_ROUND_STEPS
    assert planning.LOOKUP_ROUND_MIN_YIELD == 2.0 and steps == 4
    assert planning._round_steps([seq(40, 33)], 0) == 4
    assert planning._round_steps([seq(40, 35)], 0) == 3
    assert planning._round_steps([seq(40, 35), seq(40, 39)], 0) == 3  # the longest row decides
    assert planning._round_steps([seq(40, 20)], 4) == 4 and planning._round_steps([seq(40, 32)], 4) == 0
    assert planning._round_steps([seq(None, 500), seq(40, 39)], 4) == steps
