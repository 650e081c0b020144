"""LLM / LLMEngine behaviour: stops, min_tokens, EOS, seeds, n / best_of, streaming text, chat, paths."""

from __future__ import annotations

import random

import pytest
import torch

from paged_backend import LLM, LLMEngine, SamplingParams
from tests.conftest import EOS, assert_idle, hf_greedy, tiny_model
from tests.fixtures.tiny_models import build_tiny_model

PROMPT = [1, 40, 41, 42, 43, 44]


@pytest.fixture(scope="module")
def llm(tokenizer) -> LLM:
    return LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, num_kv_blocks=256, max_model_len=128)


def _greedy(llm: LLM, max_tokens: int = 24, **kwargs):
    (out,) = llm.generate(
        {"prompt_token_ids": PROMPT},
        SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs),
        use_tqdm=False,
    )
    return out.outputs[0]


def test_text_prompts_are_tokenized_and_returned_in_order(llm, tokenizer) -> None:
    prompts = ["Hello world!", "The paged KV cache stores keys", "A"]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m) for m in (7, 3, 5)], use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [o.prompt_token_ids for o in outs] == [tokenizer(p).input_ids for p in prompts]
    assert [len(o.outputs[0].token_ids) for o in outs] == [7, 3, 5]
    for o in outs:
        assert o.finished and o.outputs[0].finish_reason == "length"
        assert isinstance(o.outputs[0].cumulative_logprob, float) and o.outputs[0].logprobs is None
        assert (
            o.outputs[0].text
            == tokenizer.decode(o.prompt_token_ids + o.outputs[0].token_ids, skip_special_tokens=True)[
                len(tokenizer.decode(o.prompt_token_ids, skip_special_tokens=True)) :
            ]
        )
    assert_idle(llm)


def test_stop_token_ids(llm) -> None:
    base = _greedy(llm)
    stop = base.token_ids[4]
    first = base.token_ids.index(stop)
    out = _greedy(llm, stop_token_ids=[stop])
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_min_tokens_defers_stop_tokens(llm) -> None:
    base = _greedy(llm)
    stop = base.token_ids[0]
    out = _greedy(llm, stop_token_ids=[stop], min_tokens=5, max_tokens=12)
    assert len(out.token_ids) >= 5
    assert stop not in out.token_ids[:4]
    assert out.finish_reason == "length" or out.token_ids[-1] == stop


def test_stop_strings_cut_text(llm) -> None:
    base = _greedy(llm)
    text = base.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.index(stop)
    out = _greedy(llm, stop=[stop])
    assert out.text == text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    kept = _greedy(llm, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == text[: cut + len(stop)]


def test_eos_from_generation_config_and_ignore_eos(tokenizer) -> None:
    model = build_tiny_model("llama", vocab_size=len(tokenizer))
    base = hf_greedy(model, PROMPT, 12)
    eos = base[3]
    model.generation_config.eos_token_id = [EOS, eos]
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=64, max_model_len=64)
    out = _greedy(llm, max_tokens=12)
    assert out.token_ids == base[: base.index(eos) + 1] and out.finish_reason == "stop"
    assert out.stop_reason is None
    out = _greedy(llm, max_tokens=12, ignore_eos=True)
    assert out.token_ids == base and out.finish_reason == "length"


def test_max_model_len_ends_with_length(tokenizer) -> None:
    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, num_kv_blocks=16, max_model_len=10)
    out = _greedy(llm, max_tokens=50)
    assert len(PROMPT) + len(out.token_ids) == 10 and out.finish_reason == "length"


def test_logprobs_are_top_k_dicts_of_the_model_distribution(llm) -> None:
    out = _greedy(llm, max_tokens=4, logprobs=3)
    model = tiny_model("llama")
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + out.token_ids])).logits[0].log_softmax(-1)
    total = 0.0
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        expected = logits[len(PROMPT) - 1 + step]
        assert len(entry) in (3, 4) and entry[token].rank == 1
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(expected[tid].item(), abs=1e-4)
        total += expected[token].item()
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_tiny_temperature_is_greedy_and_greedy_ignores_filters(llm) -> None:
    base = _greedy(llm, max_tokens=8, logprobs=1)
    (tiny,) = llm.generate(
        {"prompt_token_ids": PROMPT}, SamplingParams(temperature=1e-39, max_tokens=8, seed=1), use_tqdm=False
    )
    assert tiny.outputs[0].token_ids == base.token_ids
    filtered = _greedy(llm, max_tokens=8, logprobs=1, top_k=1, top_p=0.1, min_p=0.9)
    assert filtered.token_ids == base.token_ids
    assert filtered.cumulative_logprob == pytest.approx(base.cumulative_logprob) and base.cumulative_logprob < 0


def test_seeded_sampling_is_reproducible_across_batches(llm) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    (alone,) = llm.generate({"prompt_token_ids": PROMPT}, seeded, use_tqdm=False)
    others = SamplingParams(temperature=1.0, max_tokens=20)
    batch = [{"prompt_token_ids": [1, 7, 8, 9] * k} for k in range(1, 4)]
    mixed = llm.generate(batch + [{"prompt_token_ids": PROMPT}], [others] * 3 + [seeded], use_tqdm=False)
    assert mixed[-1].outputs[0].token_ids == alone.outputs[0].token_ids
    unseeded = [llm.generate({"prompt_token_ids": PROMPT}, others, use_tqdm=False)[0] for _ in range(2)]
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_n_and_best_of(llm) -> None:
    (out,) = llm.generate(
        {"prompt_token_ids": PROMPT},
        SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=0),
        use_tqdm=False,
    )
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    (best,) = llm.generate(
        {"prompt_token_ids": PROMPT},
        SamplingParams(n=2, best_of=5, temperature=1.0, max_tokens=8, seed=0),
        use_tqdm=False,
    )
    scores = [c.cumulative_logprob for c in best.outputs]
    assert len(scores) == 2 and scores[0] >= scores[1]
    (greedy,) = llm.generate(
        {"prompt_token_ids": PROMPT}, SamplingParams(n=2, temperature=0, max_tokens=6), use_tqdm=False
    )
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    assert_idle(llm)


def test_samples_share_one_prefill(tokenizer) -> None:
    """n=4: the prompt's blocks are allocated once and forked; each sample then equals a lone request seeded
    like it (sample i draws from seed + i), so forking changes nothing but the memory."""
    # async scheduling off: the step queued behind this one would hold blocks of its own when they are counted
    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, num_kv_blocks=64, max_model_len=128,
              async_scheduling=False)  # fmt: skip
    engine: LLMEngine = llm.llm_engine
    prompt = list(range(10, 10 + 13))  # 3 full blocks and a partial one
    engine.add_request("n4", {"prompt_token_ids": prompt}, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8))
    engine.step()  # prefill once, then every sample draws its first token
    stats = llm.stats()
    assert stats["num_running"] == 4
    assert stats["num_kv_blocks"] - stats["num_free_blocks"] == 4  # ceil(13 / 4): shared, not 4 x 4
    while engine.has_unfinished_requests():
        outputs = engine.step()
    (out,) = outputs
    assert_idle(llm)
    for i, sample in enumerate(out.outputs):
        (alone,) = llm.generate(
            {"prompt_token_ids": prompt}, SamplingParams(temperature=1.0, seed=7 + i, max_tokens=8), use_tqdm=False
        )
        assert sample.token_ids == alone.outputs[0].token_ids
    with pytest.raises(ValueError, match="best_of must be <= max_num_seqs"):
        engine.add_request("big", {"prompt_token_ids": prompt}, SamplingParams(n=300, temperature=1.0))


def test_streamed_pieces_concatenate_to_the_final_text(llm, tokenizer) -> None:
    engine: LLMEngine = llm.llm_engine
    base = _greedy(llm, max_tokens=30)
    stop = base.text[10:13]
    engine.add_request("s1", {"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=30, stop=[stop]))
    engine.add_request("s2", "Unicode text: caf", SamplingParams(temperature=0.9, max_tokens=30, seed=3))
    seen = {"s1": "", "s2": ""}
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            assert text.startswith(seen[out.request_id]), "streamed text was taken back"
            seen[out.request_id] = text
            if out.finished:
                final[out.request_id] = text
    assert final["s1"] == base.text[: base.text.index(stop)]
    assert seen == final
    assert_idle(llm)


def test_abort_frees_blocks(llm) -> None:
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": PROMPT * 3}, SamplingParams(max_tokens=50))
    engine.add_request("b", {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert llm.stats()["num_free_blocks"] < llm.stats()["num_kv_blocks"]
    assert 0.0 <= llm.stats()["kv_waste_fraction"] < 1.0
    engine.abort_request(["a", "b", "unknown"])
    assert not engine.has_unfinished_requests()
    assert_idle(llm)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("c", {"prompt_token_ids": PROMPT})
        engine.add_request("c", {"prompt_token_ids": PROMPT})
    engine.abort_request("c")


def test_chat_applies_the_template(llm, tokenizer) -> None:
    conversation = [{"role": "user", "content": "Hello world!"}]
    outs = llm.chat([conversation, conversation], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    expected = tokenizer(
        tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    ).input_ids
    assert outs[0].prompt_token_ids == expected and expected.count(tokenizer.bos_token_id) == 1
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    (single,) = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert single.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_chat_continues_a_message_and_passes_tools_and_template_kwargs(llm, tokenizer) -> None:
    """vLLM's chat() arguments: continue_final_message, tools and chat_template_kwargs reach the template."""
    template = (
        "{% if tools %}[{{ tools | length }} tools]{% endif %}{{ flavour | default('') }}"
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if not loop.last %}</s>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}</s><|assistant|>{% endif %}"
    )
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    params = SamplingParams(temperature=0, max_tokens=2)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    (out,) = llm.chat(
        conversation, params, use_tqdm=False, chat_template=template, add_generation_prompt=False,
        continue_final_message=True, tools=[tool], chat_template_kwargs={"flavour": "~"},
    )  # fmt: skip
    assert out.prompt == "[1 tools]~<|user|>Hi</s><|assistant|>Hel"  # the last message left open
    with pytest.raises(ValueError, match="cannot both be True"):
        llm.chat(conversation, params, continue_final_message=True)
    with pytest.raises(ValueError, match="chat_template_kwargs may not set"):
        llm.chat(conversation, params, chat_template_kwargs={"tools": []})


def test_model_from_a_path_matches_hf(tmp_path, tokenizer) -> None:
    model = tiny_model("qwen3")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), block_size=8, num_kv_blocks=80, device="cpu")
    assert llm.llm_engine.model.dtype == torch.float32 and llm.get_tokenizer() is not None
    out = _greedy(llm, max_tokens=10)
    assert out.token_ids == hf_greedy(model, PROMPT, 10)


def test_users_model_keeps_its_attention(llm) -> None:
    model = tiny_model("llama")
    _greedy(llm, max_tokens=2)
    assert model.config._attn_implementation != "paged_backend"


def test_the_engine_loop_waits_for_a_direct_generate_and_then_runs_generate(tokenizer) -> None:
    """One thread steps the engine at a time: starting the loop waits for a generate that steps it directly,
    and later generate calls go through the loop with the same results."""
    import threading

    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, num_kv_blocks=256, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(["a b", "c d"], params, use_tqdm=False)]
    engine, started, inside, most = llm.llm_engine, threading.Event(), [0], [0]
    step = engine.step

    def watched_step(*args, **kwargs):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        started.set()
        try:
            return step(*args, **kwargs)
        finally:
            inside[0] -= 1

    engine.step = watched_step
    direct: list = []
    worker = threading.Thread(target=lambda: direct.extend(llm.generate(["a b", "c d"], params, use_tqdm=False)))
    worker.start()
    assert started.wait(30)
    loop = llm.engine_loop  # waits for the direct run to end
    worker.join(timeout=30)
    assert [o.outputs[0].token_ids for o in direct] == expected
    through_loop = llm.generate(["a b", "c d"], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in through_loop] == expected and most[0] == 1
    assert llm.engine_loop is loop
    with pytest.raises(RuntimeError, match="already running"):
        llm.start_engine_loop(max_waiting_requests=4)
    loop.shutdown()


def test_the_final_text_is_the_decode_of_the_tokens(tokenizer) -> None:
    """Random tokens often end inside a UTF-8 character: held back while streaming, it shows at the end as
    decode gives it ("\\ufffd"), so the text equals HF's decode of the same tokens (as evaluation harnesses
    compare generations)."""
    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, num_kv_blocks=256, max_model_len=64)
    prompts = [{"prompt_token_ids": [5 + (i * 13) % 400, 7, 9]} for i in range(64)]
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=3, max_tokens=7), use_tqdm=False)
    texts = [(o.outputs[0].text, tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True)) for o in outs]
    assert all(text == decoded for text, decoded in texts)
    assert any(text.endswith("\ufffd") for text, _ in texts)  # the case this is about did occur


def test_decode_text_is_the_tokenizer_s_decode(tokenizer) -> None:
    """The detokenizer calls a transformers tokenizer's ``_decode`` (skipping ``decode``'s conversion of its
    argument): the text must be ``decode``'s, special tokens and ``skip_special_tokens`` included; a tokenizer
    without ``_decode`` is called through ``decode``."""
    from paged_backend.engine.detokenizer import decode_text

    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 12))]
        for skip in (False, True):
            assert decode_text(tokenizer, ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip), ids

    class OnlyDecode:
        def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
            return f"{token_ids}{skip_special_tokens}"

    assert decode_text(OnlyDecode(), [1, 2], True) == "[1, 2]True"
