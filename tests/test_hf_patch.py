"""``patch(model)``: HF's ``model.generate`` on the paged engine gives what the unpatched method gives."""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
from transformers import TextStreamer, pipeline

from paged_backend import patch, patched, unpatch
from paged_backend.integrations.hf_assisted import ADAPTIVE_ASSISTANT_K
from tests.conftest import tiny_model
from tests.fixtures.tiny_models import build_tiny_model

ENGINE = dict(block_size=4, num_kv_blocks=512, max_model_len=128)
PAD = 0


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28], [40]]


def unpatched(model, *args, **kwargs):
    assert "generate" not in model.__dict__
    with torch.no_grad():
        return model.generate(*args, **kwargs)


def engine_only(model, patch_tokenizer, *args, **kwargs):
    """The patched call, failing on any warning (a fallback warns)."""
    with patched(model, patch_tokenizer, **ENGINE) as handle, warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model.generate(*args, **kwargs)
        assert handle.llm is not None and handle.engine.model is model  # it ran, on the model's own weights
    return out


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gpt2"])
def test_greedy_left_padded_batch_equals_hf(tokenizer, arch: str) -> None:
    model = tiny_model(arch)
    ids, mask = left_padded(PROMPTS)
    expected = unpatched(model, ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(engine_only(model, tokenizer, ids, attention_mask=mask, max_new_tokens=12), expected)


def test_right_padding_goes_to_hf(tokenizer) -> None:
    """HF generates after a right-padded prompt's padding (its first token comes from a pad position): the
    engine cannot lay a row out that way, so the call runs on HF's generate, after a warning naming it."""
    model = tiny_model("llama")
    width = max(map(len, PROMPTS))
    ids = torch.tensor([p + [PAD] * (width - len(p)) for p in PROMPTS])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in PROMPTS])
    expected = unpatched(model, ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    with patched(model, tokenizer, **ENGINE), pytest.warns(UserWarning, match="pads a row on the right"):
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False), expected)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_holes_in_the_mask_run_on_the_engine(tokenizer, arch: str) -> None:
    """An attention mask with holes (0s between 1s, as HF's own tests draw them; the last token real): HF's tokens
    are those of each row's real tokens alone, so the engine runs the call — greedy tokens, scores under an n-gram
    ban (HF's processor reads the masked ids too) and the cache equal HF's. Where HF reads the masked slots (a
    repetition penalty, a sliding window) the call goes to HF."""
    from paged_backend.integrations.hf_outputs import _CACHE_FIELD

    model = tiny_model(arch)
    ids, mask = left_padded(PROMPTS)
    mask = mask.clone()
    mask[0, 5:7] = 0  # holes inside the first and third rows' prompts
    mask[2, 1:8:3] = 0
    assert bool(mask[:, -1].all())
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=PAD)
    expected = unpatched(model, ids, **kwargs)
    assert torch.equal(engine_only(model, tokenizer, ids, **kwargs), expected)
    scored = dict(kwargs, no_repeat_ngram_size=2, return_dict_in_generate=True, output_scores=True)
    expected = unpatched(model, ids, **scored)
    out = engine_only(model, tokenizer, ids, **scored)
    assert torch.equal(out.sequences, expected.sequences)
    for ours, theirs in zip(out.scores, expected.scores, strict=True):
        assert torch.equal(ours.isinf(), theirs.isinf())
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    real = torch.cat([mask, torch.ones(len(PROMPTS), 9, dtype=mask.dtype)], 1).bool()
    for mine, hf in zip(getattr(out, _CACHE_FIELD).layers, getattr(expected, _CACHE_FIELD).layers):
        torch.testing.assert_close(mine.keys.transpose(1, 2)[real], hf.keys.transpose(1, 2)[real], atol=1e-4, rtol=1e-4)
    with patched(model, tokenizer, **ENGINE), pytest.warns(UserWarning, match="holes .* repetition_penalty"):
        model.generate(ids, repetition_penalty=1.3, **kwargs)
    with patched(tiny_model("mistral"), tokenizer, **ENGINE) as handle, pytest.warns(UserWarning, match="sliding"):
        handle.model.generate(ids, **kwargs)


def test_eos_lists_min_new_tokens_and_max_length(tokenizer) -> None:
    """Extra EOS ids taken from HF's own continuation stop rows early (padded after); min_new_tokens holds them
    back; max_length counts the padded prompt."""
    model = tiny_model("llama")
    ids, mask = left_padded(PROMPTS)
    free = unpatched(model, ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    width = ids.shape[1]
    eos = [2, int(free[0, width + 2]), int(free[2, width + 5])]
    for kwargs in (
        dict(eos_token_id=eos, max_new_tokens=12),
        dict(eos_token_id=eos, max_new_tokens=12, min_new_tokens=6),
        dict(eos_token_id=eos, max_length=width + 7, min_length=width + 4),
    ):
        expected = unpatched(model, ids, attention_mask=mask, do_sample=False, **kwargs)
        assert torch.equal(engine_only(model, tokenizer, ids, attention_mask=mask, **kwargs), expected), kwargs


def test_stop_strings(tokenizer) -> None:
    model = tiny_model("llama")
    ids = torch.tensor([PROMPTS[0]])
    free = unpatched(model, ids, max_new_tokens=12, do_sample=False)
    stop = tokenizer.decode(free[0, len(PROMPTS[0]) + 4 :][:1]).strip() or tokenizer.decode(free[0, -1:])
    kwargs = dict(max_new_tokens=12, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    expected = unpatched(model, ids, **kwargs)
    assert expected.shape[1] < free.shape[1]  # the stop string cut HF's run short
    assert torch.equal(engine_only(model, tokenizer, ids, **kwargs), expected)


def test_default_length_is_twenty_new_tokens(tokenizer) -> None:
    """With no length given HF generates 20 new tokens whatever the prompt's length (not 20 in all)."""
    model = tiny_model("llama")
    for prompt in (PROMPTS[1], list(range(30, 55))):
        ids = torch.tensor([prompt])
        expected = unpatched(model, ids, do_sample=False, eos_token_id=None)
        assert expected.shape[1] == len(prompt) + 20
        assert torch.equal(engine_only(model, tokenizer, ids, do_sample=False, eos_token_id=None), expected)


def test_scores_of_a_padded_batch(tokenizer) -> None:
    """HF's repetition penalty skips each row's left padding; the reported scores do the same."""
    model = tiny_model("llama")
    ids, mask = left_padded(PROMPTS[:3])
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, repetition_penalty=1.5, eos_token_id=None)
    kwargs.update(return_dict_in_generate=True, output_scores=True)
    expected = unpatched(model, ids, **kwargs)
    result = engine_only(model, tokenizer, ids, **kwargs)
    assert torch.equal(result.sequences, expected.sequences)
    for ours, theirs in zip(result.scores, expected.scores):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_sampling_shape_and_seeds(tokenizer) -> None:
    model = tiny_model("llama")
    ids, mask = left_padded(PROMPTS[:2])
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(
            engine_only(
                model, tokenizer, ids, attention_mask=mask, do_sample=True, num_return_sequences=3, max_new_tokens=8
            )
        )
    assert runs[0].shape == (6, ids.shape[1] + 8)
    assert torch.equal(runs[0], runs[1])  # torch.manual_seed reproduces the samples
    assert torch.equal(runs[0][:3, : ids.shape[1]], ids[[0, 0, 0]])  # each row's samples follow its prompt
    assert len({tuple(r.tolist()) for r in runs[0][:3]}) > 1
    with pytest.raises(ValueError, match="num_return_sequences"):  # HF's own validation
        with patched(model, tokenizer, **ENGINE):
            model.generate(ids, attention_mask=mask, do_sample=False, num_return_sequences=2)


class Collect(TextStreamer):
    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, skip_prompt=True)
        self.text = ""

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.text += text


def test_streamer_and_return_dict(tokenizer) -> None:
    model = tiny_model("llama")
    ids = torch.tensor([PROMPTS[2]])
    streamer = Collect(tokenizer)
    out = engine_only(model, tokenizer, ids, max_new_tokens=16, do_sample=False, streamer=streamer)
    assert streamer.text == tokenizer.decode(out[0, ids.shape[1] :])
    result = engine_only(model, tokenizer, ids, max_new_tokens=16, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(result.sequences, out)


def test_scores_and_logits_match_hf(tokenizer) -> None:
    """``output_logits`` are the model's raw rows, ``output_scores`` those after HF's own processors (here the
    repetition penalty and min_new_tokens' EOS mask): both as HF reports them, step by step."""
    model = tiny_model("llama")
    ids = torch.tensor([PROMPTS[0]])
    kwargs = dict(
        max_new_tokens=8,
        do_sample=False,
        min_new_tokens=3,
        repetition_penalty=1.3,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
    )
    expected = unpatched(model, ids, **kwargs)
    result = engine_only(model, tokenizer, ids, **kwargs)
    assert torch.equal(result.sequences, expected.sequences)
    assert len(result.logits) == len(expected.logits) == len(result.scores) == len(expected.scores)
    for ours, theirs in zip(result.logits + result.scores, expected.logits + expected.scores):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert torch.isinf(result.scores[0][0, 2]) and not torch.isinf(result.scores[4][0, 2])  # EOS held back


def test_unsupported_calls_fall_back_to_hf(tokenizer) -> None:
    """Beam search and a logits processor the engine lacks run on HF's generate after one warning, with HF's
    exact result; fallback="error" raises instead."""
    model = tiny_model("llama")
    ids, mask = left_padded(PROMPTS[:2])
    beam = dict(attention_mask=mask, max_new_tokens=6, num_beams=3)
    typical = dict(attention_mask=mask, max_new_tokens=12, do_sample=True, typical_p=0.5)
    expected_beam = unpatched(model, ids, **beam)
    torch.manual_seed(3)
    expected_typical = unpatched(model, ids, **typical)
    with patched(model, tokenizer, **ENGINE):
        with pytest.warns(UserWarning, match="num_beams=3") as record:
            assert torch.equal(model.generate(ids, **beam), expected_beam)
        assert len(record) == 1
        torch.manual_seed(3)
        with pytest.warns(UserWarning, match="typical_p=0.5"):
            assert torch.equal(model.generate(ids, **typical), expected_typical)
    with patched(model, tokenizer, fallback="error", **ENGINE), pytest.raises(NotImplementedError, match="num_beams"):
        model.generate(ids, **beam)


@pytest.mark.parametrize("engine_first", [False, True])
def test_a_model_assisting_itself(tokenizer, engine_first: bool) -> None:
    """A model that is its own assistant in a call that goes to HF (assisted decoding of a sliding-window model):
    HF's generate calls the patched generate of the same model from inside, on the same thread — before the
    engine exists and after. HF's result, and no deadlock (a thread with a deadline, so a regression fails instead
    of hanging). A model of its own: run on the session's shared one, such a test left later regional-compile
    tests without a graph (cause not traced)."""
    model = build_tiny_model("mistral", vocab_size=512)
    ids = torch.tensor([PROMPTS[0]])
    kwargs = dict(max_new_tokens=6, do_sample=False, assistant_model=model, return_dict_in_generate=True)
    expected = unpatched(model, ids, **kwargs).sequences
    result: dict[str, torch.Tensor] = {}
    patch(model, tokenizer, **ENGINE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if engine_first:
            model.generate(ids, max_new_tokens=2, do_sample=False)
        thread = threading.Thread(target=lambda: result.setdefault("out", model.generate(ids, **kwargs)), daemon=True)
        thread.start()
        thread.join(timeout=120)
    assert not thread.is_alive(), "generate(assistant_model=model) did not return"  # (unpatch would wait too)
    unpatch(model)
    assert torch.equal(result["out"].sequences, expected)


def test_assisted_decoding_runs_on_the_engine(tokenizer) -> None:
    """Assisted decoding finds the model's own tokens: with an assistant model (another model, same vocabulary) or
    prompt lookup, a one-row call runs on the engine with HF's greedy result, scores, attentions and hidden states
    (HF splits its verification forwards into steps of greedy's shapes); a batch, which HF's assisted decoding
    refuses, goes to HF, which raises."""
    # models of their own: eager attention (it returns weights); with the shared qwen2 as HF's assistant here,
    # later regional-compile tests of it made more graphs (cause not traced)
    model, assistant = build_tiny_model("llama", vocab_size=512), build_tiny_model("qwen2", vocab_size=512)
    model.config._attn_implementation = "eager"
    ids = torch.tensor([PROMPTS[2]])
    plain = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_scores=True)
    plain |= dict(output_attentions=True, output_hidden_states=True)
    expected = unpatched(model, ids, **plain)
    for assisted in (dict(assistant_model=assistant), dict(prompt_lookup_num_tokens=2)):
        hf = unpatched(model, ids, **plain, **assisted)
        out = engine_only(model, tokenizer, ids, **plain, **assisted)
        assert torch.equal(out.sequences, hf.sequences) and torch.equal(out.sequences, expected.sequences)
        for ours, theirs in zip(out.scores, hf.scores, strict=True):
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
        for name in ("attentions", "hidden_states"):
            for mine, hfs in zip(getattr(out, name), getattr(hf, name), strict=True):
                for a, b in zip(mine, hfs, strict=True):
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    two, mask = left_padded(PROMPTS[:2])
    with patched(model, tokenizer, **ENGINE), pytest.warns(UserWarning, match="assisted decoding with a batch"):
        with pytest.raises(ValueError, match="batch_size = 1"):
            model.generate(two, attention_mask=mask, max_new_tokens=4, assistant_model=assistant)


def test_an_assisted_first_call_builds_the_engine_with_those_proposals(tokenizer) -> None:
    """HF's prompt lookup or assistant model, in the call that builds the engine, become its speculative_config
    (vLLM's names, HF's settings; prompt lookup first, as HF picks): the engine proposes as asked, and greedy output
    stays HF's. A later call on that engine, or a patch that named its own speculative_config, keeps the engine's;
    after close() the next first call decides again."""
    model, assistant = build_tiny_model("llama", vocab_size=512), build_tiny_model("qwen2", vocab_size=512)
    named = build_tiny_model("qwen2", vocab_size=512)
    named.generation_config.num_assistant_tokens = 3  # a constant schedule (HF's default): its number is the k
    ids = torch.tensor([PROMPTS[2]])
    want = unpatched(model, ids, max_new_tokens=12, do_sample=False)
    cases = [(dict(prompt_lookup_num_tokens=3), {}, ("ngram", 3, (1, 2))),
             (dict(prompt_lookup_num_tokens=5, max_matching_ngram_size=4), {}, ("ngram", 5, (1, 4))),
             (dict(assistant_model=assistant), {}, ("draft_model", ADAPTIVE_ASSISTANT_K, None)),
             (dict(assistant_model=named), {}, ("draft_model", 3, None)),
             (dict(assistant_model=assistant, prompt_lookup_num_tokens=2), {}, ("ngram", 2, (1, 2))),
             (dict(prompt_lookup_num_tokens=3), {"speculative_config": {"num_speculative_tokens": 7}},
              ("ngram", 7, None))]  # fmt: skip
    for assisted, patch_args, (method, k, sizes) in cases:
        with patched(model, tokenizer, **ENGINE, **patch_args) as handle:
            assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, **assisted), want), assisted
            spec = handle.engine.config.speculative_config
            assert (spec.method, spec.num_speculative_tokens) == (method, k), (assisted, spec)
            assert sizes is None or spec.ngram_sizes() == sizes
            if method == "draft_model":
                assert spec.model is assisted["assistant_model"] and handle.engine.scheduler.drafter.num_drafts > 0
            assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False), want)  # later: the same engine
            handle.close()
            model.generate(ids, max_new_tokens=4, do_sample=False)
            assert handle.engine.config.speculative_config is None or patch_args  # the next first call's choice
    # a plain first call; one asking more proposals than the engine verifies; one an engine refuses beside
    # batch_invariant: the same tokens without proposals, said once
    for first, patch_args in [(dict(), {}), (dict(prompt_lookup_num_tokens=50), {}),
                              (dict(prompt_lookup_num_tokens=3), {"batch_invariant": True})]:  # fmt: skip
        with patched(model, tokenizer, **ENGINE, **patch_args) as handle:
            assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, **first), want)
            later = model.generate(ids, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3)
            assert torch.equal(later, want) and handle.engine.config.speculative_config is None
            assert handle.told_speculation


def test_pipeline_on_a_patched_model(tokenizer) -> None:
    model = tiny_model("llama")
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
    kwargs = dict(max_new_tokens=10, do_sample=False)
    expected = generator("hello world", **kwargs)
    with patched(model, tokenizer, **ENGINE) as handle:
        assert generator("hello world", **kwargs) == expected
        assert handle.llm is not None


def test_threads_share_one_engine(tokenizer) -> None:
    """8 threads call generate at once: each gets its own HF-equal result, and the engine batched them."""
    model = tiny_model("llama")
    prompts = [[10 + i, 20 + i, 30 + i] + [40 + j for j in range(i)] for i in range(8)]
    expected = [unpatched(model, torch.tensor([p]), max_new_tokens=10, do_sample=False) for p in prompts]
    handle = patch(model, tokenizer, **ENGINE)
    engine = handle.engine
    batch_sizes: list[int] = []
    schedule = engine.scheduler.schedule

    def counting_schedule():
        out = schedule()
        batch_sizes.append(len(out.seqs))
        return out

    engine.scheduler.schedule = counting_schedule
    start = threading.Barrier(8)
    results: dict[int, torch.Tensor] = {}

    def call(i: int) -> None:
        start.wait()
        results[i] = model.generate(torch.tensor([prompts[i]]), max_new_tokens=10, do_sample=False)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    unpatch(model)
    for i in range(8):
        assert torch.equal(results[i], expected[i])
    assert max(batch_sizes) > 1


def test_patch_is_idempotent_and_unpatch_restores() -> None:
    model = tiny_model("llama")
    assert "generate" not in model.__dict__
    first = patch(model, **ENGINE)
    assert patch(model) is first and first.llm is None  # the engine is built on the first call
    unpatch(model)
    assert "generate" not in model.__dict__  # the class's own method again
    unpatch(model)  # harmless
    with pytest.raises(ValueError, match="fallback"):
        patch(model, fallback="ignore")
    assert "generate" not in model.__dict__


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_return_dict_carries_hf_cache(tokenizer, arch: str) -> None:
    """With ``return_dict_in_generate`` (and ``use_cache``, HF's default) HF returns its cache: the patched call
    returns the same class and length, with HF's keys and values at every unpadded position; one row ends early
    (EOS) and is continued with padding, as HF does."""
    from paged_backend.integrations.hf_outputs import _CACHE_FIELD

    model = tiny_model(arch)
    ids, mask = left_padded(PROMPTS)
    greedy = unpatched(model, ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    eos = int(greedy[1, ids.shape[1] + 2])  # the second row's third new token ends it
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    expected = unpatched(model, ids, eos_token_id=eos, pad_token_id=PAD, **kwargs)
    out = engine_only(model, tokenizer, ids, eos_token_id=eos, pad_token_id=PAD, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    ours, theirs = getattr(out, _CACHE_FIELD), getattr(expected, _CACHE_FIELD)
    assert type(ours) is type(theirs) and ours.get_seq_length() == theirs.get_seq_length()
    full = torch.cat([mask, torch.ones(len(PROMPTS), out.sequences.shape[1] - ids.shape[1], dtype=mask.dtype)], 1)
    real = full[:, :-1].bool()
    for mine, hf in zip(ours.layers, theirs.layers):
        for a, b in ((mine.keys, hf.keys), (mine.values, hf.values)):
            assert a.shape == b.shape
            torch.testing.assert_close(a.transpose(1, 2)[real], b.transpose(1, 2)[real], atol=1e-4, rtol=1e-4)
    plain = engine_only(model, tokenizer, ids, use_cache=False, **kwargs)
    assert getattr(plain, _CACHE_FIELD) is None


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_attentions_and_hidden_states_are_hfs(tokenizer, arch: str, use_cache: bool) -> None:
    """``output_attentions`` / ``output_hidden_states`` run on the engine: each step's tensors, recomputed by
    forwards of HF's steps' shapes, are HF's — at every position, the left padding and a row that ended early (EOS)
    and was fed padding included; with and without a cache (whose steps differ in shape)."""
    model = build_tiny_model(arch, vocab_size=512)  # its own: the attention setting below must not leak
    model.config._attn_implementation = "eager"  # attention weights come from eager attention
    ids, mask = left_padded(PROMPTS)
    greedy = unpatched(model, ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    eos = int(greedy[1, ids.shape[1] + 1])  # the second row's second new token ends it
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    kwargs |= dict(output_attentions=True, output_hidden_states=True, use_cache=use_cache, eos_token_id=eos)
    expected = unpatched(model, ids, pad_token_id=PAD, **kwargs)
    out = engine_only(model, tokenizer, ids, pad_token_id=PAD, **kwargs)
    assert torch.equal(out.sequences, expected.sequences) and bool((out.sequences[1, -3:] == PAD).all())
    for name in ("attentions", "hidden_states"):
        ours, theirs = getattr(out, name), getattr(expected, name)
        assert len(ours) == len(theirs) == 5
        for mine, hf in zip(ours, theirs):
            assert len(mine) == len(hf)
            for a, b in zip(mine, hf):
                assert a.shape == b.shape
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_attentions_with_a_passed_in_or_static_cache(tokenizer, arch: str) -> None:
    """Attentions and hidden states of a call that continues from a passed-in cache (step 0's queries are the
    tokens the cache does not hold) and, for Llama, of a static-cache call (weights over all its slots): HF's."""
    from paged_backend.integrations.hf_outputs import _CACHE_FIELD

    model = build_tiny_model(arch, vocab_size=512)  # its own: eager attention, which returns weights
    model.config._attn_implementation = "eager"
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, pad_token_id=PAD)
    first = unpatched(model, ids, attention_mask=mask, **kwargs)
    full = torch.cat([mask, torch.ones(len(PROMPTS), 4, dtype=mask.dtype)], 1)
    details = dict(kwargs, output_attentions=True, output_hidden_states=True)
    calls = [
        (first.sequences, dict(details, attention_mask=full, past_key_values=getattr(first, _CACHE_FIELD))),
    ]
    if arch == "llama":
        calls.append((ids, dict(details, attention_mask=mask, cache_implementation="static")))
    for inputs, call in calls:

        def fresh(call: dict = call) -> dict:  # each run extends its own copy of a passed-in cache
            return {k: copy.deepcopy(v) if k == "past_key_values" else v for k, v in call.items()}

        expected = unpatched(model, inputs, **fresh())
        out = engine_only(model, tokenizer, inputs, **fresh())
        assert torch.equal(out.sequences, expected.sequences)
        for name in ("attentions", "hidden_states"):
            for mine, hf in zip(getattr(out, name), getattr(expected, name), strict=True):
                for a, b in zip(mine, hf, strict=True):
                    assert a.shape == b.shape
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_hf_argument_edge_cases_as_hf(tokenizer) -> None:
    """Accept what HF accepts (a negative EOS id, which never matches, with HF's warning; top_p=0, which keeps
    the most likely token; top_p above 1, which filters nothing), raise what HF raises (do_sample with
    temperature 0: HF's message; 1-D input_ids: HF's own error, through its generate)."""
    model = tiny_model("llama")
    ids, mask = left_padded(PROMPTS)
    for kwargs in (dict(eos_token_id=-1, do_sample=False), dict(do_sample=True, top_p=0.0)):
        expected = unpatched(model, ids, attention_mask=mask, max_new_tokens=8, **kwargs)
        assert torch.equal(
            engine_only(model, tokenizer, ids, attention_mask=mask, max_new_tokens=8, **kwargs), expected
        )
    wide = engine_only(model, tokenizer, ids, attention_mask=mask, max_new_tokens=4, do_sample=True, top_p=1.5)
    assert wide.shape == (len(PROMPTS), ids.shape[1] + 4)
    dynamic = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, cache_implementation="dynamic")
    assert torch.equal(engine_only(model, tokenizer, ids, **dynamic), unpatched(model, ids, **dynamic))
    every = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, logits_to_keep=0)  # all positions' logits
    assert torch.equal(engine_only(model, tokenizer, ids, **every), unpatched(model, ids, **every))
    # no input ids: HF starts from its BOS token (and raises without one, through its own generate)
    assert torch.equal(engine_only(model, tokenizer, max_new_tokens=6), unpatched(model, max_new_tokens=6))
    no_bos = build_tiny_model("llama", vocab_size=512)
    no_bos.config.bos_token_id = no_bos.generation_config.bos_token_id = None
    with patched(no_bos, tokenizer, **ENGINE), pytest.warns(UserWarning, match="no input ids"):
        with pytest.raises(ValueError, match="bos_token_id"):
            no_bos.generate(max_new_tokens=6)
    with patched(model, tokenizer, **ENGINE):
        with pytest.raises(ValueError, match=r"`temperature` \(=0.0\) has to be a strictly positive float"):
            model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=True, temperature=0.0)
        with pytest.warns(UserWarning, match="2-D tensor"), pytest.raises(IndexError):
            model.generate(torch.tensor(PROMPTS[0]), max_new_tokens=4)


def test_static_cache_is_hfs(tokenizer) -> None:
    """``cache_implementation="static"`` runs on the engine and returns HF's ``StaticCache``: its size (the call's
    length, or ``max_cache_len`` when larger) and HF's keys and values at every unpadded position. With a passed-in
    cache HF refuses the pair: the call goes to HF, which raises."""
    from transformers import StaticCache

    from paged_backend.integrations.hf_outputs import _CACHE_FIELD

    model = tiny_model("llama")
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    kwargs |= dict(cache_implementation="static", pad_token_id=PAD)
    for extra in ({}, {"max_cache_len": 40}):
        expected = unpatched(model, ids, **kwargs, **extra)
        out = engine_only(model, tokenizer, ids, **kwargs, **extra)
        assert torch.equal(out.sequences, expected.sequences)
        ours, theirs = getattr(out, _CACHE_FIELD), getattr(expected, _CACHE_FIELD)
        assert isinstance(ours, StaticCache) and type(ours) is type(theirs)
        real = torch.cat([mask, torch.ones(len(PROMPTS), 5, dtype=mask.dtype)], 1).bool()  # the last token: no keys
        for mine, hf in zip(ours.layers, theirs.layers):
            for a, b in ((mine.keys, hf.keys), (mine.values, hf.values)):
                assert a.shape == b.shape == (len(PROMPTS), 2, extra.get("max_cache_len", ids.shape[1] + 5), 16)
                width = real.shape[1]
                torch.testing.assert_close(a.transpose(1, 2)[:, :width][real], b.transpose(1, 2)[:, :width][real])
    passed = getattr(
        unpatched(model, ids, **{k: v for k, v in kwargs.items() if k != "cache_implementation"}), _CACHE_FIELD
    )
    with patched(model, tokenizer, **ENGINE), pytest.warns(UserWarning, match="passed-in cache"):
        with pytest.raises(ValueError, match="cache_implementation"):
            model.generate(ids, past_key_values=passed, **kwargs)


def test_hf_processors_run_on_the_engine(tokenizer) -> None:
    """No-repeat n-grams, bad words (one token and several), sequence bias, suppressed tokens (always and at the
    first step), a forced EOS and renormalized scores run on the engine through HF's own processors, row by row:
    greedy tokens and scores equal HF's. Each setting is taken from the unconstrained output, so that it acts."""
    model = tiny_model("llama")
    ids, mask = left_padded(PROMPTS)
    width = ids.shape[1]
    base = dict(attention_mask=mask, max_new_tokens=10, do_sample=False)
    free = unpatched(model, ids, **base)[:, width:].tolist()
    settings = [
        dict(no_repeat_ngram_size=2),
        dict(bad_words_ids=[[free[0][2]], free[1][:2]]),
        dict(sequence_bias={(free[2][0],): -5.0, tuple(free[3][:2]): -10.0}),
        dict(suppress_tokens=[free[0][0], free[1][1]], begin_suppress_tokens=[free[2][0]]),
        dict(forced_eos_token_id=free[3][0]),
    ]
    for setting in settings:
        expected = unpatched(model, ids, **base, **setting)
        assert torch.equal(engine_only(model, tokenizer, ids, **base, **setting), expected), setting
        assert not torch.equal(expected[:, width:], torch.tensor(free)), setting  # it acted
    scored = dict(base, return_dict_in_generate=True, output_scores=True, renormalize_logits=True, **settings[1])
    expected = unpatched(model, ids, **scored)
    out = engine_only(model, tokenizer, ids, **scored)
    assert torch.equal(out.sequences, expected.sequences)
    for ours, theirs in zip(out.scores, expected.scores):
        finite = torch.isfinite(theirs)
        assert torch.equal(finite, torch.isfinite(ours))
        torch.testing.assert_close(ours[finite], theirs[finite], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("with_ids", [False, True])
def test_inputs_embeds_run_on_the_engine(tokenizer, with_ids: bool) -> None:
    """``inputs_embeds`` (left-padded, a little off the vocabulary's embeddings) run on the engine as prompt
    embeddings: HF's sequences (the new tokens alone, or after the input ids when those are given too), its
    cache, and its scores — with HF's lengths, which with embeddings alone count from the empty input ids
    (``min_length`` and ``max_length`` less the prompt's width)."""
    from paged_backend.integrations.hf_outputs import _CACHE_FIELD

    model = tiny_model("llama")
    ids, mask = left_padded(PROMPTS)
    noise = torch.randn(*ids.shape, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    embeds = model.get_input_embeddings().weight.detach()[ids] + 0.05 * noise
    kwargs = dict(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=8, do_sample=False)
    if with_ids:
        kwargs["input_ids"] = ids
    expected = unpatched(model, **kwargs, return_dict_in_generate=True)
    out = engine_only(model, tokenizer, **kwargs, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected.sequences)
    assert out.sequences.shape[1] == (ids.shape[1] if with_ids else 0) + 8
    ours, theirs = getattr(out, _CACHE_FIELD), getattr(expected, _CACHE_FIELD)
    real = torch.cat([mask, torch.ones(len(PROMPTS), 8, dtype=mask.dtype)], 1)[:, :-1].bool()
    for mine, hf in zip(ours.layers, theirs.layers):
        torch.testing.assert_close(mine.keys.transpose(1, 2)[real], hf.keys.transpose(1, 2)[real], atol=1e-4, rtol=1e-4)
    eos = [int(t) for t in expected.sequences[:2, -5]]  # tokens that would end rows early, barred until min_length
    del kwargs["max_new_tokens"]
    lengths = dict(max_length=ids.shape[1] + 7, min_length=ids.shape[1] + 5, eos_token_id=eos, pad_token_id=PAD)
    scored = dict(return_dict_in_generate=True, output_scores=True, **lengths)
    expected = unpatched(model, **kwargs, **scored)
    out = engine_only(model, tokenizer, **kwargs, **scored)
    assert torch.equal(out.sequences, expected.sequences)
    for ours, theirs in zip(out.scores, expected.scores, strict=True):
        assert torch.equal(ours.isinf(), theirs.isinf())  # the same tokens barred at the same steps
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_scores_of_rows_that_end_early_are_hf(tokenizer) -> None:
    """HF keeps computing a finished row (fed padding) and reports those scores; when a row ends before the
    others, the call runs on HF's generate, with the torch RNG as the call found it (so a seeded sampled call
    gives HF's own sample)."""
    model = tiny_model("llama")
    ids, mask = left_padded(PROMPTS)
    greedy = unpatched(model, ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    eos = int(greedy[1, ids.shape[1] + 1])  # the second row's second new token ends it
    for sampled in (False, True):
        kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=sampled, eos_token_id=eos, pad_token_id=PAD)
        kwargs.update(return_dict_in_generate=True, output_scores=True)
        torch.manual_seed(5)
        expected = unpatched(model, ids, **kwargs)
        with patched(model, tokenizer, **ENGINE), pytest.warns(UserWarning, match="a row ended before the others"):
            torch.manual_seed(5)
            out = model.generate(ids, **kwargs)
        assert torch.equal(out.sequences, expected.sequences)
        for ours, theirs in zip(out.scores, expected.scores):
            assert torch.equal(ours, theirs)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_continue_from_a_passed_in_cache(tokenizer, arch: str) -> None:
    """HF's "continue from past_key_values": a left-padded batch generates with ``return_dict_in_generate``, then
    generates again from its sequences with the returned cache. The engine imports the cache's keys and values
    into its blocks (it does not recompute them: a cache whose values were scaled gives HF's output for that
    cache, not the model's own) and extends the cache in place as HF does."""

    from paged_backend.integrations.hf_outputs import _CACHE_FIELD

    model = tiny_model(arch)
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=PAD, eos_token_id=-1)
    first = unpatched(model, ids, attention_mask=mask, return_dict_in_generate=True, **kwargs)
    sequences = first.sequences
    full = torch.cat([mask, torch.ones(len(PROMPTS), sequences.shape[1] - ids.shape[1], dtype=mask.dtype)], 1)
    for scale in (1.0, 3.0):  # 3.0: a cache that is not what the model computes
        cache = copy.deepcopy(getattr(first, _CACHE_FIELD))
        for layer in cache.layers:
            layer.values.mul_(scale)
        theirs_cache, ours_cache = copy.deepcopy(cache), copy.deepcopy(cache)
        expected = unpatched(model, sequences, attention_mask=full, past_key_values=theirs_cache, **kwargs)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "`past_key_values` is deprecated")
            out = engine_only(model, tokenizer, sequences, attention_mask=full, past_key_values=ours_cache, **kwargs)
        assert torch.equal(out, expected)
        assert ours_cache.get_seq_length() == theirs_cache.get_seq_length() == out.shape[1] - 1  # extended in place
        real = torch.cat([full, torch.ones(len(PROMPTS), 5, dtype=mask.dtype)], 1)[:, :-1].bool()
        for mine, hf in zip(ours_cache.layers, theirs_cache.layers):
            torch.testing.assert_close(
                mine.keys.transpose(1, 2)[real], hf.keys.transpose(1, 2)[real], atol=1e-4, rtol=1e-4
            )
    unscaled = unpatched(model, sequences, attention_mask=full, **kwargs)
    assert not torch.equal(expected, unscaled)  # the scaled cache changed HF's output: the import is tested
