"""``SamplingParams(structured_outputs=...)``: a grammar makes even a tiny random model's output valid.

Every output under a JSON schema validates with ``jsonschema`` (a corpus of 60 schemas: nested objects, arrays
with bounds, enums, ``anyOf``, patterns, required and optional fields, numbers with ranges), sampled with ``n``
and greedy; regex and choice outputs match; a structured request beside unconstrained ones leaves theirs equal
to HF ``generate``; preemption (swap and recompute), prefix-cache hits and multi-step rounds change nothing;
a bad schema, regex or grammar is a ValueError naming it before anything runs.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import warnings
from typing import Any

import jsonschema
import pytest
import torch

pytest.importorskip("xgrammar")

from paged_backend import LLM, GuidedDecodingParams, SamplingParams, StructuredOutputsParams  # noqa: E402
from tests.conftest import assert_idle, hf_greedy, ragged_prompts, tiny_model  # noqa: E402

PROMPTS = ["The paged cache", "hello", "JSON please:", "a b c d e f"]


def schema_corpus(count: int = 60, seed: int = 0) -> list[dict[str, Any]]:
    """Schemas drawn from the JSON Schema features structured output must follow, each output bounded (short
    strings, few items, integer ranges) so that a random model ends within the token limit."""
    rng = random.Random(seed)

    def leaf(depth: int) -> dict[str, Any]:
        kinds = ["int", "num", "bool", "enum", "str", "pattern", "null", "const", "anyof"]
        if depth < 2:
            kinds += ["object", "array"]
        kind = rng.choice(kinds)
        if kind == "int":
            low = rng.randint(-50, 50)
            return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
        if kind == "num":
            return {"type": "number", "minimum": -10, "maximum": 10}
        if kind == "bool":
            return {"type": "boolean"}
        if kind == "enum":
            return {"enum": rng.sample(["red", "green", "blue", "a b", 'q"t', "ünï"], rng.randint(1, 4))}
        if kind == "str":
            return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 6)}
        if kind == "pattern":
            return {"type": "string", "pattern": rng.choice(["^[a-z]{2,4}$", "^[0-9]{3}-[0-9]{2}$", "^(yes|no)$"])}
        if kind == "null":
            return {"type": "null"}
        if kind == "const":
            return {"const": rng.choice(["on", 7, True])}
        if kind == "anyof":
            return {"anyOf": [leaf(2), leaf(2)]}
        if kind == "array":
            low = rng.randint(0, 2)
            return {"type": "array", "items": leaf(depth + 1), "minItems": low, "maxItems": low + rng.randint(0, 2)}
        return obj(depth + 1)

    def obj(depth: int) -> dict[str, Any]:
        names = rng.sample(["id", "name", "tags", "size", "ok", "meta", "x", "kind"], rng.randint(1, 4))
        properties = {name: leaf(depth) for name in names}
        required = [name for name in names if rng.random() < 0.6]
        return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}

    return [obj(0) for _ in range(count)]


@pytest.fixture(scope="module")
def llm(tokenizer) -> LLM:
    return LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, max_model_len=512)


def structured(max_tokens: int = 300, **kwargs: Any) -> SamplingParams:
    fields = {k: kwargs.pop(k) for k in list(kwargs) if k in StructuredOutputsParams.__dataclass_fields__}
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**fields), **kwargs)


def test_every_output_follows_its_json_schema(llm: LLM) -> None:
    corpus = schema_corpus()
    params = [
        structured(json=schema, disable_any_whitespace=True, temperature=1.0, seed=i, n=2)
        for i, schema in enumerate(corpus)
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(corpus))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    checked = 0
    for schema, out in zip(corpus, outs):
        for completion in out.outputs:
            assert completion.finish_reason == "stop", (schema, completion.text)
            jsonschema.validate(json.loads(completion.text), schema)
            checked += 1
    assert checked == 2 * len(corpus)
    assert_idle(llm)


def test_greedy_schema_with_whitespace_allowed(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}
    (out,) = llm.generate("x", structured(json=json.dumps(schema), temperature=0), use_tqdm=False)
    jsonschema.validate(json.loads(out.outputs[0].text), schema)


CHOICES = ["alpha", "beta", 'with "quotes"', "ünï\ncode"]


def balanced(text: str) -> bool:
    return bool(re.fullmatch(r"(\(*)x(\)*)", text)) and text.count("(") == text.count(")")


@pytest.mark.parametrize(
    ("field", "value", "check"),
    [
        ("regex", r"[a-c]{3}-[0-9]{2}", lambda text: re.fullmatch(r"[a-c]{3}-[0-9]{2}", text)),
        ("choice", CHOICES, lambda text: text in CHOICES),
        ("grammar", 'root ::= "(" root ")" | "x"', balanced),
    ],
)
def test_regex_choice_grammar_and_json_object(llm: LLM, field: str, value: Any, check: Any) -> None:
    outs = llm.generate(PROMPTS, structured(**{field: value}, temperature=1.0, seed=5, n=4), use_tqdm=False)
    for out in outs:
        for completion in out.outputs:
            assert completion.finish_reason == "stop" and check(completion.text), completion.text


def test_json_object(llm: LLM) -> None:
    """Any JSON object: unbounded keys and strings, which a random model seldom closes, so the outputs that
    ended are objects and the others are cut-off objects."""
    params = structured(json_object=True, disable_any_whitespace=True, temperature=1.0, seed=5, n=4, max_tokens=60)
    completions = [c for out in llm.generate(PROMPTS, params, use_tqdm=False) for c in out.outputs]
    ended = [c for c in completions if c.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(c.text), dict) for c in ended)
    assert all(c.text.startswith("{") for c in completions)


def test_unconstrained_neighbours_stay_equal_to_hf(llm: LLM) -> None:
    prompts = ragged_prompts(4, seed=4)[:4]
    greedy = SamplingParams(temperature=0, max_tokens=10)
    requests = [{"prompt_token_ids": p} for p in prompts] + ["beside them"]
    params = [greedy] * len(prompts) + [structured(regex="[0-9]{4}", temperature=0)]
    outs = llm.generate(requests, params, use_tqdm=False)
    model = tiny_model("llama")
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 10)
    assert re.fullmatch("[0-9]{4}", outs[-1].outputs[0].text)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {"num_kv_blocks": 24, "preemption_mode": "swap", "swap_space": 0.01},
        {"num_kv_blocks": 24, "preemption_mode": "recompute"},
        {"num_scheduler_steps": 1},
        {"max_num_batched_tokens": 8, "max_num_seqs": 8},
    ],
    ids=["swap", "recompute", "single-steps", "chunked"],
)
def test_preemption_and_scheduling_change_nothing(tokenizer, engine_kwargs: dict) -> None:
    """Greedy structured outputs (and sampled ones, seeded) as an engine with room for all gives them."""
    schema = schema_corpus(6, seed=9)
    params = [structured(json=s, disable_any_whitespace=True, temperature=0) for s in schema]
    params += [structured(json=s, disable_any_whitespace=True, temperature=1.0, seed=2) for s in schema]
    prompts = [PROMPTS[i % 4] for i in range(len(params))]

    def run(**kwargs: Any) -> list[list[str]]:
        engine = LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, max_model_len=96, **kwargs)
        outs = engine.generate(prompts, params, use_tqdm=False)
        assert_idle(engine)
        if "num_kv_blocks" in kwargs:
            assert engine.stats()["num_preemptions"] > 0
        return [[c.text for c in out.outputs] for out in outs]

    assert run(**engine_kwargs) == run()


def test_a_prefix_cache_hit_keeps_the_grammar(llm: LLM) -> None:
    params = structured(choice=["one", "two", "three"], temperature=0)
    first = llm.generate("a shared prompt that fills blocks", params, use_tqdm=False)
    cached = llm.stats()["num_prompt_tokens_cached"]
    again = llm.generate("a shared prompt that fills blocks", params, use_tqdm=False)
    assert llm.stats()["num_prompt_tokens_cached"] > cached
    assert again[0].outputs[0].text == first[0].outputs[0].text in ("one", "two", "three")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"json": {"type": "bogus"}}, "structured_outputs.json"),
        ({"regex": "[0-9"}, "structured_outputs.regex"),
        ({"grammar": "root ::= "}, "structured_outputs.grammar"),
    ],
)
def test_a_bad_grammar_fails_before_anything_runs(llm: LLM, kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field) + " is not usable: ") as info:
        llm.generate("x", structured(**kwargs), use_tqdm=False)
    assert info.value.field == field  # type: ignore[attr-defined]
    assert_idle(llm)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "structured_outputs must set exactly one of json, regex, choice, grammar, json_object; got \\[\\]"),
        ({"regex": "a", "choice": ["b"]}, "got \\['regex', 'choice'\\]"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"json": 3}, "structured_outputs.json must be a dict or JSON text"),
        ({"choice": ["a", ""]}, "structured_outputs.choice must be a non-empty list of non-empty strings"),
        ({"json_object": "yes"}, "structured_outputs.json_object must be True or False"),
    ],
)
def test_params_are_checked(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_guided_decoding_is_the_deprecated_name(llm: LLM) -> None:
    with pytest.warns(DeprecationWarning, match="use structured_outputs"):
        params = SamplingParams(max_tokens=20, guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    assert params.structured_outputs == GuidedDecodingParams(choice=["yes", "no"]) and params.guided_decoding is None
    (out,) = llm.generate("x", params, use_tqdm=False)
    assert out.outputs[0].text in ("yes", "no")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError, match="give structured_outputs or guided_decoding, not both"):
            SamplingParams(
                structured_outputs=StructuredOutputsParams(regex="a"), guided_decoding=GuidedDecodingParams(regex="b")
            )


def test_structured_outputs_need_a_tokenizer() -> None:
    engine = LLM(tiny_model("llama"), max_model_len=64)
    with pytest.raises(ValueError, match="structured_outputs need a tokenizer"):
        engine.generate({"prompt_token_ids": [5, 6]}, structured(regex="a"), use_tqdm=False)


def test_corpus_covers_the_features() -> None:
    text = json.dumps(schema_corpus())
    for feature in ('"anyOf"', '"pattern"', '"enum"', '"minItems"', '"maximum"', '"required"', '"type": "object"'):
        assert feature in text, feature
    nested = sum('"properties"' in json.dumps(s["properties"]) for s in schema_corpus())
    assert nested >= 5 and len(list(itertools.islice(schema_corpus(), 60))) == 60


def test_greedy_structured_rows_run_in_masked_multi_step_rounds(tokenizer, monkeypatch) -> None:
    """Greedy structured requests run in multi-step rounds, each step masked through forks of the rows' grammars
    that the host advances one step behind the device: the tokens are those of single steps, every one allowed.
    The batch mixes grammars that end inside a round (choices), rows cut by max_tokens, and an unconstrained
    row."""
    from paged_backend.worker.structured_output import RoundGrammars

    steps_masked: list[int] = []
    apply = RoundGrammars.apply
    monkeypatch.setattr(
        RoundGrammars, "apply", lambda self, k, logits: (steps_masked.append(k), apply(self, k, logits))
    )
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 8, "maxItems": 8}
    params = [structured(json=schema, disable_any_whitespace=True, temperature=0)] * 3
    params += [
        structured(choice=["yes", "no", "maybe so"], temperature=0),
        structured(regex="[a-z]{40}", max_tokens=11, temperature=0),
    ]
    params += [SamplingParams(temperature=0, max_tokens=20)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]

    def run(num_scheduler_steps: int) -> list[list[int]]:
        engine = LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, num_scheduler_steps=num_scheduler_steps)
        outs = engine.generate(prompts, params, use_tqdm=False)
        assert_idle(engine)
        for out in outs[:3]:
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
        assert outs[3].outputs[0].text in ("yes", "no", "maybe so")
        assert re.fullmatch("[a-z]+", outs[4].outputs[0].text) and len(outs[4].outputs[0].token_ids) == 11
        return [list(out.outputs[0].token_ids) for out in outs]

    single = run(1)
    assert not steps_masked
    assert run(8) == single
    assert max(steps_masked) >= 4  # rounds ran, their later steps masked from tokens read back


def test_min_tokens_past_a_finished_grammar_ends_that_sample_alone(llm: LLM) -> None:
    """A grammar that is complete allows only its stop token, which ``min_tokens`` holds back: the sample ends
    with its complete output, and its unconstrained neighbour runs on untouched."""
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    stuck = structured(choice=["a"], temperature=0, max_tokens=8, min_tokens=5)
    neighbour, constrained = llm.generate(["hello there", "The paged cache"], [plain, stuck], use_tqdm=False)
    assert constrained.outputs[0].text == "a" and constrained.outputs[0].finish_reason == "stop"
    assert len(neighbour.outputs[0].token_ids) == 8
    assert_idle(llm)


def test_empty_values_are_named_and_an_empty_schema_is_any_json() -> None:
    assert StructuredOutputsParams(json={}).kind == "json"  # {} is JSON Schema's "anything"
    with pytest.raises(ValueError, match="structured_outputs.choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    assert StructuredOutputsParams(regex="a", json_object=False).kind == "regex"


def test_grammar_compiler_is_made_once_across_threads(tokenizer) -> None:
    """Callers' threads and the engine's may ask for the compiler at once: one is made."""
    import concurrent.futures

    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, max_model_len=64)
    processor = llm.llm_engine.input_processor
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        made = list(pool.map(lambda _: processor.grammar_compiler(), range(16)))
    assert all(compiler is made[0] for compiler in made)


def test_the_grammar_waits_for_the_end_of_thinking(tokenizer) -> None:
    """With a reasoning parser, a matcher starts once </think> has been generated (its tokens in a run): before,
    every token is allowed and none advances it; a prompt that holds the marker starts it at once."""
    from paged_backend.structured_output.grammar import GrammarCompiler
    from paged_backend.structured_output.reasoning_gate import END_OF_THINKING, ReasoningGate, contains

    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    grammar = compiler.compile(StructuredOutputsParams(regex="[0-9]{3}"))
    end = tuple(tokenizer.encode(END_OF_THINKING, add_special_tokens=False))
    letters = tokenizer.encode("abc", add_special_tokens=False)

    def allowed(gate: ReasoningGate) -> int:
        bitmask = torch.full((1, (len(tokenizer) + 31) // 32), -1, dtype=torch.int32)
        gate.fill_next_token_bitmask(bitmask, 0)
        return sum(bin(word & 0xFFFFFFFF).count("1") for word in bitmask[0].tolist())

    gate = ReasoningGate(compiler.matcher(grammar), end, ended=False)
    everything = allowed(gate)
    assert all(gate.accept_token(t) for t in [*letters, *end[:-1]]) and not gate.ended and not gate.is_terminated()
    assert allowed(gate) == everything  # still thinking
    assert gate.accept_token(end[-1]) and gate.ended
    assert allowed(gate) < everything and not gate.accept_token(letters[0])  # now the regex holds
    assert contains([5, *end, 7], end) and not contains(list(end[:-1]), end)
    with pytest.raises(ValueError, match="at least one token"):
        ReasoningGate(compiler.matcher(grammar), (), ended=False)


def test_thinking_is_free_and_a_closed_thinking_prompt_holds_the_grammar(tokenizer) -> None:
    """reasoning_parser="qwen3": greedy thinking under a grammar equals unconstrained greedy output (the random
    model never writes </think>); a prompt whose template closed the thinking gets the format from the start."""
    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, max_model_len=256, reasoning_parser="qwen3")
    end = tokenizer.encode("</think>", add_special_tokens=False)
    free, plain = llm.generate(
        ["The cache", "The cache"],
        [structured(max_tokens=24, regex="[0-9]{3}", temperature=0), SamplingParams(max_tokens=24, temperature=0)],
        use_tqdm=False,
    )
    assert free.outputs[0].token_ids == plain.outputs[0].token_ids and not re.fullmatch(
        "[0-9]{3}", free.outputs[0].text
    )
    closed = tokenizer.encode("The cache <think></think>", add_special_tokens=False)
    assert any(closed[i : i + len(end)] == end for i in range(len(closed)))
    (held,) = llm.generate({"prompt_token_ids": closed}, structured(regex="[0-9]{3}", temperature=0), use_tqdm=False)
    assert re.fullmatch("[0-9]{3}", held.outputs[0].text)
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        LLM(tiny_model("llama"), tokenizer=tokenizer, reasoning_parser="r1")


def test_special_tokens_never_fill_a_string(tokenizer) -> None:
    """xgrammar reads an added special token as its literal text ("<pad>"), which a JSON string would take; the
    output's text skips special tokens, so the string would come out shorter than the schema allows. Inside a
    string the grammar allows none of them (the stop token ends the output, as before)."""
    from paged_backend.structured_output.grammar import GrammarCompiler, hidden_special_ids

    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    hidden = hidden_special_ids(tokenizer) - {tokenizer.eos_token_id}
    assert hidden and hidden <= set(compiler.info.special_token_ids)
    matcher = compiler.matcher(compiler.compile(StructuredOutputsParams(json={"type": "string", "minLength": 3})))
    assert matcher.accept_token(tokenizer.convert_tokens_to_ids('"'))
    bitmask = torch.full((1, (len(tokenizer) + 31) // 32), -1, dtype=torch.int32)
    matcher.fill_next_token_bitmask(bitmask, 0)
    allowed = {t for t in range(len(tokenizer)) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1}
    assert tokenizer.convert_tokens_to_ids("a") in allowed and not allowed & hidden
