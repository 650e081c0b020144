"""EleutherAI's lm-evaluation-harness scores a model the same through our server and through our engine in its own
process as through its own HF backend.

lm-eval runs itself (its CLI, in a child process, offline) on three local tasks — multiple choice, rolling
loglikelihood over documents longer than one window, and greedy generation — with ``--model hf`` on the tiny fp32
Llama, with ``--model local-completions`` against ``paged-backend``'s server on the same checkpoint, and with
``--model paged-backend`` (``python -m paged_backend.integrations.lm_eval``). Every per-sample loglikelihood agrees
to 1e-4, every ``is_greedy`` flag and every generation is identical.

``add_bos_token=True`` for local-completions: lm-eval's HF backend encodes with the tokenizer's own default
(which adds BOS here), its API backend without special tokens unless told.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

pytest.importorskip("lm_eval")
pytest.importorskip("fastapi")

from tests.conftest import save_tiny_checkpoint  # noqa: E402
from tests.fixtures.server_process import ROOT, ServerProcess  # noqa: E402

TASKS = ("tiny_mc", "tiny_rolling", "tiny_gen")
MAX_LENGTH = 64  # the HF backend's window: the rolling task's documents take several
# The same rolling windows from lm-eval's API backend: it keeps one token of max_length for generation and makes
# windows of what is left minus one (its HF backend: windows of max_length)
API_MAX_LENGTH = MAX_LENGTH + 2
QUESTIONS = [
    {
        "question": f"Question {i}: what does the paged cache {verb}?",
        "choices": ["fixed-size blocks of keys", "a page", "runs fast", "numbers 1 2 3"],
        "answer": i % 4,
    }
    for i, verb in enumerate(["store", "hold", "free", "share", "copy", "swap"])
]
DOCUMENTS = [
    "Continuous batching lets new requests join a running batch at every decoding step. " * (i + 1)
    + f"Document {i} ends here."
    for i in range(3)
]
TASK_YAML = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
{body}
"""
TASK_BODIES = {
    "tiny_mc": (
        "questions.jsonl",
        "multiple_choice",
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ntarget_delimiter: ""\n'
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n",
    ),
    "tiny_rolling": (
        "documents.jsonl",
        "loglikelihood_rolling",
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n',
    ),
    "tiny_gen": (
        "questions.jsonl",
        "generate_until",
        'doc_to_text: "{{question}}"\ndoc_to_target: "{{choices[0]}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 16\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n",
    ),
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """The checkpoint, the tasks' data and YAML files, and lm-eval's caches, all in one temporary folder."""
    root = tmp_path_factory.mktemp("lm_eval")
    save_tiny_checkpoint(root / "model")
    tasks = root / "tasks"
    tasks.mkdir()
    questions = [{**q, "choices": [greedy_token_text(root / "model", q["question"]), *q["choices"]]} for q in QUESTIONS]
    (tasks / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    (tasks / "documents.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCUMENTS))
    for name, (data, output_type, body) in TASK_BODIES.items():
        text = TASK_YAML.format(name=name, data=tasks / data, output_type=output_type, body=body)
        (tasks / f"{name}.yaml").write_text(text)
    return root


def greedy_token_text(model_dir: Path, question: str) -> str:
    """The model's own greedy next token after ``question``, as text that encodes back to that one token (else " none"):
    a choice lm-eval must report as greedy, which it can only do when the chosen token is in ``top_logprobs``."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    context = tokenizer.encode(question)
    with torch.no_grad():
        token = int(model(torch.tensor([context])).logits[0, -1].argmax())
    text = tokenizer.decode([token])
    return text if tokenizer.encode(question + text)[len(context) :] == [token] else " none"


def run_lm_eval(
    workspace: Path,
    label: str,
    model: str,
    model_args: str,
    batch_size: int,
    cli: str = "lm_eval",
    tasks: tuple[str, ...] = TASKS,
) -> dict[str, Any]:
    """lm-eval's own CLI (``cli``: the module run with ``-m``) on ``tasks`` (YAML files in ``workspace/tasks``);
    returns each task's logged samples by ``doc_id``."""
    out = workspace / f"out_{label}"
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_DATASETS_CACHE=str(workspace / "datasets_cache"),
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    command = [sys.executable, "-m", cli, "run", "--model", model, "--model_args", model_args]
    command += ["--tasks", ",".join(tasks), "--include_path", str(workspace / "tasks"), "--batch_size", str(batch_size)]
    command += ["--output_path", str(out), "--log_samples", "--device", "cpu"]
    done = subprocess.run(command, env=env, cwd=workspace, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"lm-eval {label} exited {done.returncode}:\n{done.stderr[-4000:]}"
    samples: dict[str, Any] = {}
    for task in tasks:
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        samples[task] = {row["doc_id"]: row for row in rows}
    return samples


def responses(task: str, sample: dict[str, Any]) -> list[tuple[float, str] | str]:
    """A sample's responses, as lm-eval logs them (as strings): (loglikelihood, is_greedy) per choice for multiple
    choice, (loglikelihood, "") for a rolling document, the text for a generation."""
    resps = sample["resps"]
    if task == "tiny_mc":
        return [(float(ll), greedy) for ((ll, greedy),) in resps]
    if task == "tiny_rolling":
        return [(float(ll), "") for (ll,) in resps]
    return [text for (text,) in resps]


@pytest.fixture(scope="module")
def hf_samples(workspace: Path) -> dict[str, Any]:
    hf_args = f"pretrained={workspace / 'model'},dtype=float32,max_length={MAX_LENGTH}"
    return run_lm_eval(workspace, "hf", "hf", hf_args, batch_size=1)


def assert_same_as_hf(hf: dict[str, Any], ours: dict[str, Any]) -> None:
    """Every sample's requests identical, loglikelihoods within 1e-4, greedy flags and generations identical."""
    counts = {"loglikelihoods": 0, "generations": 0, "greedy": 0}
    for task in TASKS:
        assert hf[task].keys() == ours[task].keys() and len(hf[task]) > 0, task
        for doc_id, sample in hf[task].items():
            assert sample["arguments"] == ours[task][doc_id]["arguments"], (task, doc_id)
            want, got = responses(task, sample), responses(task, ours[task][doc_id])
            assert len(want) == len(got), (task, doc_id, want, got)
            for a, b in zip(want, got):
                if isinstance(a, tuple) and isinstance(b, tuple):
                    assert a[0] < 0.0 and abs(a[0] - b[0]) <= 1e-4 and a[1] == b[1], (task, doc_id, a, b)
                    counts["loglikelihoods"] += 1
                    counts["greedy"] += a[1] == "True"
                else:
                    assert a == b, (task, doc_id, a, b)
                    counts["generations"] += 1
    # 6 questions x 5 choices, 3 documents, 6 generations: nothing was skipped on either side
    assert counts["loglikelihoods"] == 6 * 5 + 3 and counts["generations"] == 6, counts
    assert counts["greedy"] >= 1, counts  # the greedy choices were seen as greedy


def test_through_our_server(workspace: Path, hf_samples: dict[str, Any]) -> None:
    """``--model local-completions`` against ``paged-backend``'s OpenAI server."""
    model = workspace / "model"
    server = ServerProcess(model, "--served-model-name", "tiny", "--num-kv-blocks", "512")
    try:
        api_args = (
            f"model=tiny,base_url={server.base}/v1/completions,tokenizer={model},tokenizer_backend=huggingface,"
            f"add_bos_token=True,max_length={API_MAX_LENGTH},num_concurrent=1,max_retries=1"
        )
        ours = run_lm_eval(workspace, "server", "local-completions", api_args, batch_size=4)
    finally:
        server.close()
    assert_same_as_hf(hf_samples, ours)


def test_in_process(workspace: Path, hf_samples: dict[str, Any]) -> None:
    """``--model paged-backend`` (``paged_backend.integrations.lm_eval``): the engine in lm-eval's own process."""
    args = f"pretrained={workspace / 'model'},dtype=float32,max_length={MAX_LENGTH},num_kv_blocks=512"
    ours = run_lm_eval(
        workspace, "in_process", "paged-backend", args, batch_size=1, cli="paged_backend.integrations.lm_eval"
    )
    assert_same_as_hf(hf_samples, ours)


def test_in_process_model_refuses_what_it_cannot_honour(tokenizer) -> None:
    from lm_eval.api.instance import Instance

    from paged_backend import LLM
    from paged_backend.integrations.lm_eval import PagedBackendLM
    from tests.conftest import tiny_model

    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, max_model_len=64)
    with pytest.raises(ValueError, match=r"max_length must be in \[1, 63\]"):
        PagedBackendLM(llm=llm, max_length=64)
    with pytest.raises(ValueError, match="give llm"):
        PagedBackendLM()
    with pytest.raises(ValueError, match=r"with llm=, give no pretrained= and no engine arguments \(got \['dtype'\]\)"):
        PagedBackendLM(llm=llm, dtype="float32")
    lm = PagedBackendLM(llm=llm, max_gen_toks=4)

    def request(**gen_kwargs: Any) -> Instance:
        return Instance("generate_until", doc={}, arguments=("a b", {"until": ["\n"], **gen_kwargs}), idx=0)

    with pytest.raises(ValueError, match=r"generation_kwargs \['num_beams'\] are not supported"):
        lm.generate_until([request(num_beams=4)])
    with pytest.raises(ValueError, match=r"max_gen_toks must be in \[1, max_length=63\)"):
        lm.generate_until([request(max_gen_toks=63)])
    (text,) = lm.generate_until([request(num_beams=1, do_sample=False)])
    assert isinstance(text, str)


@contextlib.contextmanager
def tempfile_checkpoint() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as folder:
        save_tiny_checkpoint(Path(folder))
        yield Path(folder)


def test_an_unavailable_device_falls_back_as_lm_evals_hf_backend_does(tokenizer, caplog) -> None:
    """lm-eval passes ``device="cuda:0"`` by default; its ``hf`` backend runs on the CPU where there is no such
    GPU, and so does this model, with a warning (an available device or another kind is passed through)."""
    from paged_backend.integrations.lm_eval import available_device

    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU: never there
    assert available_device(missing) == "auto" and "is not available" in caplog.text
    assert available_device("cpu") == "cpu" and available_device("cuda:x") == "cuda:x"  # the config refuses it
    if torch.cuda.is_available():
        assert available_device("cuda:0") == "cuda:0"
    else:
        assert available_device("cuda") == "auto"
    with tempfile_checkpoint() as path:
        from paged_backend.integrations.lm_eval import PagedBackendLM

        lm = PagedBackendLM(pretrained=str(path), device=missing, dtype="float32", num_kv_blocks=64, max_model_len=64)
        assert lm.llm.llm_engine.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
        lm.llm.shutdown()
