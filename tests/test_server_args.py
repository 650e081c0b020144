"""The server's command line takes vLLM's flags and hands the engine's straight to ``LLM(...)``."""

from __future__ import annotations

import pytest

from paged_backend.config import EngineConfig
from paged_backend.entrypoints.openai.cli_args import API_KEY_ENV, make_parser, parse_args


def test_vllm_serving_command_maps_onto_engine_arguments() -> None:
    server, engine = parse_args(["--model", "M", "--block-size", "16", "--swap-space", "4", "--max-num-seqs", "256"])
    assert engine == {"block_size": 16, "swap_space": 4.0, "max_num_seqs": 256}
    assert (server.model, server.host, server.port, server.model_name, server.api_key) == (
        "M",
        "127.0.0.1",
        8000,
        "M",
        None,
    )


def test_every_engine_flag_is_an_engine_argument() -> None:
    argv = ["--model", "M", "--max-num-batched-tokens", "512", "--max-model-len", "256", "--dtype", "float32"]
    argv += ["--gpu-memory-utilization", "0.5", "--seed", "3", "--num-scheduler-steps", "4", "--device", "cpu"]
    argv += ["--preemption-mode", "recompute", "--no-enable-prefix-caching", "--enforce-eager", "--max-loras", "2"]
    argv += ["--max-lora-rank", "8", "--tensor-parallel-size", "1", "--load-format", "dummy"]
    _, engine = parse_args(argv)
    assert engine["enable_prefix_caching"] is False and engine["enforce_eager"] is True
    assert engine["load_format"] == "dummy"
    config = EngineConfig.from_kwargs("M", **engine)  # no TypeError: every key is an engine argument
    assert config.scheduler_config.max_num_seqs == 256 and config.cache_config.enable_prefix_caching is False


def test_server_flags(monkeypatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    server, engine = parse_args(
        [
            "--model",
            "M",
            "--served-model-name",
            "tiny",
            "--enable-lora",
            "--lora-modules",
            "a=/x",
            "b=/y",
            "--host",
            "0.0.0.0",
        ]
    )
    assert server.model_name == "tiny" and server.lora_modules == {"a": "/x", "b": "/y"}
    assert server.api_key == "from-env" and server.host == "0.0.0.0" and engine == {"enable_lora": True}
    assert parse_args(["--model", "M", "--api-key", "k"])[0].api_key == "k"
    engine = parse_args(["--model", "M", "--tensor-parallel-size", "2", "--worker-use-ray"])[1]
    assert engine == {"tensor_parallel_size": 2, "distributed_executor_backend": "ray"}


@pytest.mark.parametrize(
    "argv",
    [
        ["--lora-modules", "nopath"],
        ["--lora-modules", "a=/x"],
        ["--max-waiting-requests", "0"],
        ["--port", "x"],
        ["--max-request-body-mb", "0"],
        ["--max-request-body-mb", "nan"],
        ["--shutdown-timeout", "-1"],
        ["--shutdown-timeout", "inf"],
        [],
    ],
)
def test_bad_flags_exit_with_a_message(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--model", "M", *argv] if argv else argv)
    assert exit_info.value.code == 2 and capsys.readouterr().err


def test_help_documents_vllm_flags() -> None:
    text = make_parser().format_help()
    for flag in (
        "--host --port --block-size --swap-space --max-num-seqs --max-num-batched-tokens --max-model-len "
        "--gpu-memory-utilization --tensor-parallel-size --dtype --quantization --enable-prefix-caching "
        "--no-enable-prefix-caching --enable-lora --lora-modules --max-loras --max-lora-rank --served-model-name "
        "--api-key --chat-template --seed --max-waiting-requests --worker-use-ray --kv-cache-memory-gib "
        "--num-kv-blocks --max-request-body-mb --shutdown-timeout --kv-cache-dtype --calculate-kv-scales "
        "--reasoning-parser --enable-auto-tool-choice --tool-call-parser --logprobs-mode --long-prefill-token-threshold"
    ).split():
        assert flag in text, flag


def test_tool_call_flags() -> None:
    server, _ = parse_args(["M", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert server.enable_auto_tool_choice and server.tool_call_parser == "hermes"
    assert parse_args(["M", "--tool-call-parser", "mistral"])[0].enable_auto_tool_choice is False


def test_reasoning_parser_reaches_server_and_engine() -> None:
    """The server splits the thinking off; the engine starts requested formats after it."""
    server, engine = parse_args(["M", "--reasoning-parser", "qwen3"])
    assert server.reasoning_parser == engine["reasoning_parser"] == "qwen3"
    assert "reasoning_parser" not in parse_args(["M"])[1]


def test_auto_tool_choice_needs_a_parser(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(["M", "--enable-auto-tool-choice"])
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err


def test_model_as_positional_like_vllm_serve() -> None:
    expected = parse_args(["--model", "M", "--block-size", "8"])
    assert parse_args(["M", "--block-size", "8"]) == expected == parse_args(["--block-size", "8", "M"])
    assert parse_args(["M", "--model", "M"])[0] == expected[0]  # the same model twice is no conflict


def test_kv_cache_size_flags_are_engine_arguments() -> None:
    _, engine = parse_args(["M", "--kv-cache-memory-gib", "0.5", "--num-kv-blocks", "300", "--kv-cache-dtype", "fp8"])
    assert engine == {"kv_cache_memory_gib": 0.5, "num_kv_blocks": 300, "kv_cache_dtype": "fp8"}
    config = EngineConfig.from_kwargs("M", **engine)
    assert config.cache_config.kv_cache_memory_gib == 0.5 and config.cache_config.num_kv_blocks == 300
    assert config.cache_config.kv_cache_dtype == "fp8"
    assert parse_args(["M", "--kv-cache-dtype", "fp8", "--calculate-kv-scales"])[1]["calculate_kv_scales"] is True


def test_runtime_flags_and_their_defaults() -> None:
    server, engine = parse_args(["M"])
    assert (server.max_request_body_mb, server.shutdown_timeout, engine) == (32.0, 0.0, {})
    server, _ = parse_args(["M", "--max-request-body-mb", "1.5", "--shutdown-timeout", "20"])
    assert (server.max_request_body_mb, server.shutdown_timeout) == (1.5, 20.0)


@pytest.mark.parametrize("key", ["", "  "])
def test_an_empty_api_key_is_refused_not_an_open_server(key: str, monkeypatch, capsys) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["M", "--api-key", key])
    assert exit_info.value.code == 2 and "--api-key is empty" in capsys.readouterr().err
    monkeypatch.setenv(API_KEY_ENV, key)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["M"])
    assert exit_info.value.code == 2 and f"${API_KEY_ENV} is set but empty" in capsys.readouterr().err
    assert parse_args(["M", "--api-key", "k"])[0].api_key == "k"  # the flag wins over the environment


def test_an_engine_serving_on_cpu_leaves_a_core_to_the_http_side() -> None:
    from paged_backend.entrypoints.openai.launch import engine_cpu_threads

    assert engine_cpu_threads("cpu", {}, 16) == 15
    assert engine_cpu_threads("cpu", {}, 1) == 1
    assert engine_cpu_threads("cpu", {"OMP_NUM_THREADS": "4"}, 16) is None  # the user's choice stands
    assert engine_cpu_threads("cuda", {}, 16) is None


def test_speculative_config_flag_is_json_checked_before_the_model_loads(capsys) -> None:
    from paged_backend.entrypoints.openai.cli_args import parse_args

    _, engine = parse_args(["--model", "m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
                           "serve")  # fmt: skip
    assert engine["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    for bad, said in (('{"method": "eagle"}', "speculative_config.method must be one of ['ngram', 'draft_model']"),
                      ("[1]", "invalid json_dict value")):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(["--model", "m", "--speculative-config", bad], "serve")
        assert said in capsys.readouterr().err


def test_the_server_steps_384_tokens_in_rounds_of_2_unless_told(monkeypatch) -> None:
    """The server's own token budget (a step is a gap in every stream) and decode steps a round (an arrival
    waits for the round in flight); a flag still sets each."""
    from paged_backend.entrypoints.openai.launch import SERVER_MAX_NUM_BATCHED_TOKENS, SERVER_NUM_SCHEDULER_STEPS, load

    built: list[dict] = []
    monkeypatch.setattr("paged_backend.entrypoints.llm.LLM", lambda model, **kwargs: built.append(kwargs))
    load(*parse_args(["--model", "M", "--seed", "1"]))
    load(*parse_args(["--model", "M", "--max-num-batched-tokens", "2048"]))
    load(*parse_args(["--model", "M", "--max-num-seqs", "1024"]))  # each running sequence can still decode
    load(*parse_args(["--model", "M", "--num-scheduler-steps", "8"]))
    steps = {"num_scheduler_steps": SERVER_NUM_SCHEDULER_STEPS}
    assert built == [
        {"max_num_batched_tokens": SERVER_MAX_NUM_BATCHED_TOKENS, **steps, "seed": 1},
        {"max_num_batched_tokens": 2048, **steps},
        {"max_num_batched_tokens": 1024, **steps, "max_num_seqs": 1024},
        {"max_num_batched_tokens": SERVER_MAX_NUM_BATCHED_TOKENS, "num_scheduler_steps": 8},
    ]
    assert (SERVER_MAX_NUM_BATCHED_TOKENS, SERVER_NUM_SCHEDULER_STEPS) == (384, 2)
