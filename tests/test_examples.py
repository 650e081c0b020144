"""Every script in ``examples/`` runs unchanged on the embedded demo Llama (a smoke test: exit status 0), with the
demo checkpoint built once into a temporary cache folder."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what an example checks itself and logs
EXPECTED = {
    "tensor_parallel": "greedy output equals one device's: True",
    "data_parallel": "greedy output equals one engine's: True",
    "hf_generate_patch": "same tokens as HF's own generate: True",
    "memory_cap": "a prompt longer than max_model_len is refused",
    "structured_outputs": "every output follows its format: True",
    "tool_calling": "every surface made its call: True",
    "trl_grpo": "every rollout ran on the engine: True",
}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("paged-backend-cache")


def test_every_example_is_listed() -> None:
    assert {p.stem for p in EXAMPLES} >= {
        "offline_inference", "memory_cap", "tensor_parallel", "awq_quantize", "openai_server", "large_batches",
        "multi_lora", "hf_generate_patch", "langchain_chat", "llama_index_query", "structured_outputs",
        "tool_calling", "trl_grpo",
    }  # fmt: skip


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(script: Path, cache_dir: Path, tmp_path: Path) -> None:
    args: list[str] = []
    if script.stem in ("openai_server", "tool_calling"):
        args = ["--port", str(free_port())]
    elif script.stem == "awq_quantize":  # its default output, a folder it makes in /tmp, is left for the user
        args = ["--output", str(tmp_path / "awq")]
    env = dict(os.environ, PAGED_BACKEND_CACHE=str(cache_dir), TOKENIZERS_PARALLELISM="false")
    run = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert EXPECTED.get(script.stem, "") in run.stderr + run.stdout


def test_trl_grpo_with_parity_logs_a_ratio_of_exactly_one(cache_dir: Path) -> None:
    script = EXAMPLES[0].parent / "trl_grpo.py"
    env = dict(os.environ, PAGED_BACKEND_CACHE=str(cache_dir), TOKENIZERS_PARALLELISM="false")
    run = subprocess.run([sys.executable, str(script), "--parity"], env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "TRL's importance-sampling ratio, max over each step: [1.0, 1.0]" in run.stderr + run.stdout
    assert "TRL's importance-sampling ratio, min over each step: [1.0, 1.0]" in run.stderr + run.stdout
