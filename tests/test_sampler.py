"""Sampler: exact filtered distributions, empirical frequencies, penalties, min_tokens, logprobs."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from paged_backend.core.sequence import Request, Sequence
from paged_backend.sampling_params import SamplingParams
from paged_backend.worker.sampler import Sampler, apply_penalties, sampling_logprobs

PROBS = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]


def _logits() -> torch.Tensor:
    return torch.tensor([PROBS]).log()  # [1, 6]


def _dist(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0) -> list[float]:
    lp = sampling_logprobs(
        _logits(),
        torch.tensor([temperature]),
        torch.tensor([top_k]),
        torch.tensor([top_p]),
        torch.tensor([min_p]),
    )
    return lp.exp()[0].tolist()


def _normalized(weights: list[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, PROBS),
        ({"temperature": 0.5}, _normalized([p**2 for p in PROBS])),
        ({"temperature": 2.0}, _normalized([p**0.5 for p in PROBS])),
        ({"top_k": 3}, _normalized(PROBS[:3] + [0, 0, 0])),
        ({"top_k": 1}, [1, 0, 0, 0, 0, 0]),
        # keep the smallest set whose mass reaches top_p: 0.4 + 0.25 + 0.15 = 0.8 >= 0.7
        ({"top_p": 0.7}, _normalized(PROBS[:3] + [0, 0, 0])),
        ({"top_p": 0.4}, [1, 0, 0, 0, 0, 0]),
        # min_p 0.3 * 0.4 = 0.12: tokens with p < 0.12 are dropped
        ({"min_p": 0.3}, _normalized(PROBS[:3] + [0, 0, 0])),
        # top-p applies to the top-k renormalized distribution (vLLM): 0.4/0.9 + 0.25/0.9 >= 0.7 after dropping
        # the tail whose renormalized mass (0.1 + 0.15) / 0.9 <= 0.3
        ({"top_k": 4, "top_p": 0.7}, _normalized([0.4, 0.25, 0, 0, 0, 0])),
        ({"top_k": 2, "temperature": 0.5}, _normalized([0.16, 0.0625, 0, 0, 0, 0])),
    ],
)
def test_filtered_distribution_is_exact(kwargs, expected) -> None:
    assert _dist(**kwargs) == pytest.approx(expected, abs=1e-6)


def _seqs(params: list[SamplingParams], prompt=(5, 6), outputs=(), eos=frozenset()) -> list[Sequence]:
    seqs = []
    for i, p in enumerate(params):
        request = Request(str(i), None, list(prompt), p, eos_token_ids=eos)
        seq = Sequence(i, 0, request, list(prompt) + list(outputs), len(prompt), arrival=i)
        if p.seed is not None:
            seq.generator = torch.Generator().manual_seed(p.seed)
        seqs.append(seq)
    return seqs


def test_sampled_frequencies_follow_the_distribution() -> None:
    n = 20000
    params = SamplingParams(temperature=0.5, top_k=4)
    expected = _normalized([p**2 for p in PROBS[:4]] + [0, 0])
    sampler = Sampler(torch.device("cpu"), seed=0)
    results = sampler(_logits().expand(n, -1).clone(), _seqs([params] * n))
    counts = [0] * 6
    for r in results:
        counts[r.token_id] += 1
    for token, p in enumerate(expected):
        sigma = math.sqrt(n * p * (1 - p)) + 1e-9
        assert abs(counts[token] - n * p) <= 5 * sigma, (token, counts, expected)
        if p == 0:
            assert counts[token] == 0
    # the reported logprob is that of the distribution sampled from
    for r in results[:50]:
        assert r.logprob == pytest.approx(math.log(expected[r.token_id]), abs=1e-5)


def test_greedy_picks_argmax_and_reports_logprobs() -> None:
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    (result,) = sampler(logits, _seqs([SamplingParams(temperature=0, logprobs=2)]))
    log_probs = logits.log_softmax(-1)[0]
    assert result.token_id == 1
    assert result.logprob == pytest.approx(log_probs[1].item())
    assert result.top_logprobs == [
        (1, pytest.approx(log_probs[1].item()), 1),
        (1, pytest.approx(log_probs[1].item()), 1),
        (3, pytest.approx(log_probs[3].item()), 2),
    ]


def test_penalties_match_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    # prompt has token 0; output has token 1 twice and token 3 once
    out = apply_penalties(
        logits.clone(),
        [[0]],
        [[1, 1, 3]],
        presence=torch.tensor([0.5]),
        frequency=torch.tensor([0.25]),
        repetition=torch.tensor([2.0]),
    )
    expected = [
        2.0 / 2,  # prompt token: repetition only
        -1.0 * 2 - 0.25 * 2 - 0.5,  # negative logit multiplied, then frequency x2 and presence
        0.5,  # unseen
        3.0 / 2 - 0.25 - 0.5,
        -2.0,
    ]
    assert out[0].tolist() == pytest.approx(expected)


def test_min_tokens_masks_stop_tokens() -> None:
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    params = SamplingParams(temperature=0, min_tokens=2)
    (early,) = sampler(logits.clone(), _seqs([params], eos=frozenset({1})))
    (late,) = sampler(logits.clone(), _seqs([params], outputs=(2, 2), eos=frozenset({1})))
    assert early.token_id == 2 and late.token_id == 1


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    logits = torch.randn(1, 50)
    seeded = SamplingParams(temperature=1.0, seed=7)
    alone = Sampler(torch.device("cpu"), seed=0)(logits.clone(), _seqs([seeded]))
    other = SamplingParams(temperature=1.0)
    mixed = Sampler(torch.device("cpu"), seed=1)(torch.cat([torch.randn(2, 50), logits]), _seqs([other, other, seeded]))
    assert mixed[2].token_id == alone[0].token_id


def test_greedy_fast_path_matches_the_general_path() -> None:
    """An all-greedy batch skips the sort; its tokens and logprobs equal those of the general path (which a
    logprobs request forces)."""
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(3))
    sampler = Sampler(torch.device("cpu"), seed=0)
    fast = sampler(logits.clone(), _seqs([SamplingParams(temperature=0)] * 7))
    general = sampler(logits.clone(), _seqs([SamplingParams(temperature=0, logprobs=0)] * 7))
    assert [r.token_id for r in fast] == logits.argmax(-1).tolist() == [r.token_id for r in general]
    for a, b in zip(fast, general):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-6)
        assert a.top_logprobs is None


def test_logits_processors_run_on_their_row_only(tokenizer) -> None:
    """vLLM v0's per-request ``logits_processors``: with two parameters a processor gets the output so far, with
    three the prompt first; each changes its own request's row at every step (so a greedy batch beside it keeps
    its tokens), and the request takes single steps rather than multi-step rounds."""
    from paged_backend import LLM
    from tests.conftest import tiny_model

    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, max_model_len=64)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11]}]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    free = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
    seen: list[tuple[list[int], list[int]]] = []

    def ban_first(output: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[free[0][0]] = float("-inf")  # the token greedy decoding chose first
        return logits

    def record(prompt: list[int], output: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen.append((list(prompt), list(output)))
        return logits

    banned = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logits_processors=[ban_first, record])
    outs = llm.generate(prompts, [banned, greedy], use_tqdm=False)
    tokens = list(outs[0].outputs[0].token_ids)
    assert free[0][0] not in tokens and tokens != free[0]
    assert list(outs[1].outputs[0].token_ids) == free[1]
    assert [prompt for prompt, _ in seen] == [[5, 6, 7, 8]] * 8
    assert [output for _, output in seen] == [tokens[:i] for i in range(8)]  # one call a step
    with pytest.raises(ValueError, match="logits_processors must be a list of callables"):
        SamplingParams(logits_processors=[1])


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU"))]
)
def test_logit_bias_forces_or_bars_a_token_on_its_row_only(tokenizer, monkeypatch, device: str) -> None:
    """OpenAI's ``logit_bias``: +100 on a token makes greedy decoding choose it at every step, -100 on the token
    greedy decoding chose bars it; an unbiased greedy request beside them keeps its tokens. Alone, a biased
    greedy request runs multi-step rounds, whose every step adds the bias too (on a GPU: inside CUDA graphs)."""
    from paged_backend import LLM
    from tests.conftest import assert_idle, tiny_model

    llm = LLM(copy.deepcopy(tiny_model("llama")).to(device), tokenizer=tokenizer, max_model_len=64)  # shared: copied
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10]}]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    free = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
    forced_token = next(t for t in range(3, 512) if t not in free[0])
    forced = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={forced_token: 100})
    barred = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={free[1][0]: -100.0})
    outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, [forced, barred, greedy], use_tqdm=False)]
    assert outs[0] == [forced_token] * 6
    assert free[1][0] not in outs[1] and outs[1] != free[1]
    assert outs[2] == free[2]
    runner = llm.llm_engine.executor.model_runner
    biased_rounds: list[bool] = []
    run_decode_steps = runner.run_decode_steps

    def spy(steps, grammars=None, first_input_ids=None, bias=None):
        biased_rounds.append(bias is not None)
        return run_decode_steps(steps, grammars, first_input_ids, bias)

    monkeypatch.setattr(runner, "run_decode_steps", spy)
    alone = llm.generate([prompts[0]], forced, use_tqdm=False)[0]  # a lone greedy request runs rounds
    assert list(alone.outputs[0].token_ids) == [forced_token] * 6 and biased_rounds and all(biased_rounds)
    assert_idle(llm)
    with pytest.raises(ValueError, match=r"logit_bias\[5\] must be a number in \[-100, 100\], got 100.5"):
        SamplingParams(logit_bias={5: 100.5})
    with pytest.raises(ValueError, match="logit_bias's keys must be token ids"):
        SamplingParams(logit_bias={"5": 1.0})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"logit_bias's token ids must be in \[0, 512\), got \[512\]"):
        llm.generate([prompts[0]], SamplingParams(logit_bias={512: 1.0}), use_tqdm=False)
