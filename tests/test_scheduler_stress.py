"""Random request mixes under heavy memory pressure: greedy output unchanged, no block leaked."""

from __future__ import annotations

import random

from paged_backend import LLM, SamplingParams
from tests.conftest import assert_idle, tiny_model


def test_random_mixes_under_pressure_match_an_unpressured_engine(tokenizer) -> None:
    model = tiny_model("llama")
    roomy = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=512, max_model_len=48)
    tight = LLM(
        model, tokenizer=tokenizer, block_size=4, num_kv_blocks=12, max_model_len=48,
        max_num_batched_tokens=5, max_num_seqs=3,
    )  # fmt: skip
    rng = random.Random(0)
    for _ in range(3):
        prompts, params = [], []
        for _ in range(7):
            length = rng.choice([1, 3, 4, 5, 20, 46, 48])
            prompts.append({"prompt_token_ids": [rng.randrange(3, 512) for _ in range(length)]})
            max_tokens = rng.choice([None, 1, 5, 30])
            if rng.random() < 0.5:
                params.append(SamplingParams(temperature=0, max_tokens=max_tokens, n=rng.choice([1, 2])))
            else:
                params.append(
                    SamplingParams(temperature=0.8, n=2, best_of=rng.choice([2, 3]), seed=7, max_tokens=max_tokens)
                )
        expected = roomy.generate(prompts, params, use_tqdm=False)
        got = tight.generate(prompts, params, use_tqdm=False)
        for want, have, p in zip(expected, got, params):
            assert len(have.outputs) == p.n
            if p.greedy:
                assert [o.token_ids for o in have.outputs] == [o.token_ids for o in want.outputs]
        assert_idle(tight)
    assert tight.stats()["num_preemptions"] > 0


def test_abort_under_preemption_frees_everything(tokenizer) -> None:
    llm = LLM(
        tiny_model("llama"), tokenizer=tokenizer, block_size=4, num_kv_blocks=12, max_model_len=48,
        max_num_batched_tokens=5, max_num_seqs=3,
    )  # fmt: skip
    engine = llm.llm_engine
    for i in range(6):
        prompt = {"prompt_token_ids": [5 + i] * (3, 30, 40)[i % 3]}
        engine.add_request(f"r{i}", prompt, SamplingParams(n=2, temperature=1.0, max_tokens=None))
    for step in range(40):
        engine.step()
        if step == 10:
            engine.abort_request(["r1", "r4"])
    engine.abort_request([f"r{i}" for i in range(6)])
    assert not engine.has_unfinished_requests()
    assert_idle(llm)
