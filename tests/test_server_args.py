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
        "--api-key --chat-template --seed --max-waiting-requests --worker-use-ray"
    ).split():
        assert flag in text, flag


def test_model_as_positional_like_vllm_serve() -> None:
    expected = parse_args(["--model", "M", "--block-size", "8"])
    assert parse_args(["M", "--block-size", "8"]) == expected == parse_args(["--block-size", "8", "M"])
    assert parse_args(["M", "--model", "M"])[0] == expected[0]  # the same model twice is no conflict
