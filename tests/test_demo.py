"""``paged-backend demo``: the checkpoint is built once, both sides decode the same tokens, and the KV figures
follow from the prompts' lengths."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from paged_backend.entrypoints.cli import main
from paged_backend.entrypoints.demo import demo_prompts, run_demo


def test_demo_compares_hf_and_the_engine_on_one_batch(tmp_path) -> None:
    result = run_demo(num_prompts=5, max_tokens=6, batch_size=2, cache_dir=tmp_path, block_size=4)
    hf, paged = result["hf"], result["paged"]
    assert result["identical"] == 5 and hf.outputs == paged.outputs
    assert hf.output_tokens == paged.output_tokens == 30 and paged.preemptions == 0
    # HF holds each batch of 2 at its longest prompt plus the new tokens (the last one is never cached)
    lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(result["model"])(demo_prompts(5))["input_ids"]]
    batches = [lengths[i : i + 2] for i in range(0, 5, 2)]
    peak = max(batches, key=lambda b: len(b) * (max(b) + 5))
    assert hf.kv_slots == len(peak) * (max(peak) + 5)
    assert hf.kv_waste == pytest.approx(1 - (sum(peak) + 5 * len(peak)) / hf.kv_slots)
    # the engine's blocks hold at most all five sequences in whole blocks of 4
    assert 0 < paged.kv_slots <= sum(-(-(n + 5) // 4) * 4 for n in lengths) and 0 <= paged.kv_waste < 1


def test_demo_builds_its_checkpoint_once(tmp_path) -> None:
    args = ["demo", "--cache-dir", str(tmp_path), "--num-prompts", "2", "--max-tokens", "2", "--block-size", "4"]
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
