"""Tensor-parallel sharding checked in one process: N sharded copies of a tiny model run in N threads whose
rowwise layers sum their partial outputs through a barrier, and every rank's logits equal the full model's."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from paged_backend.model_loader.tp_plan import head_layout, shard_model, tp_plan
from paged_backend.quantization.fp8 import FP8Linear, quantize_fp8
from tests.fixtures.tiny_models import build_tiny_model


class ThreadAllReduce:
    """Sum over ``world`` threads, in place: what NCCL or gloo do across processes."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world, timeout=30)
        self.parts: list[torch.Tensor | None] = [None] * world

    def for_rank(self, rank: int):
        def all_reduce(out: torch.Tensor) -> None:
            self.parts[rank] = out
            self.barrier.wait()
            total = torch.stack(self.parts).sum(0)  # every rank reads the others' partial sums before any write
            self.barrier.wait()
            out.copy_(total)

        return all_reduce


def tp_logits(model, world: int, ids: torch.Tensor) -> list[torch.Tensor]:
    reducer = ThreadAllReduce(world)
    ranks = []
    for rank in range(world):
        shard = copy.deepcopy(model)
        shard_model(shard, rank, world, reducer.for_rank(rank))
        ranks.append(shard)
    results: list[torch.Tensor | None] = [None] * world

    def run(rank: int) -> None:
        with torch.no_grad():
            results[rank] = ranks[rank](ids).logits

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def assert_ranks_reproduce(model, world: int, ids: torch.Tensor) -> None:
    """Every one of ``world`` ranks (threads summing their rowwise partial outputs) gives the full model's logits."""
    with torch.no_grad():
        full = model(ids).logits
    for rank, logits in enumerate(tp_logits(model, world, ids)):
        assert logits is not None, f"rank {rank} did not finish"
        torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("arch", "world"),
    [("llama", 2), ("llama", 4), ("qwen2", 2), ("qwen3", 2), ("mistral", 2)],  # llama/4, qwen3/2: KV replicated
)
def test_sharded_ranks_reproduce_the_full_model(arch: str, world: int) -> None:
    model = build_tiny_model(arch, vocab_size=512)
    model.config._attn_implementation = "eager"
    assert_ranks_reproduce(model, world, torch.randint(3, 512, (2, 11), generator=torch.Generator().manual_seed(0)))


def test_fp8_layers_are_cut_with_their_scales() -> None:
    """quantization='fp8' layers (weights per output channel) cut rows with their scales, columns without: the
    ranks give the full fp8 model's logits. Activations stay unquantized here: per token over a rank's slice of
    the inputs, a rowwise layer's activation scales would differ from the full layer's."""
    model = build_tiny_model("llama", vocab_size=512)
    model.config._attn_implementation = "eager"
    assert quantize_fp8(model) == 7 * model.config.num_hidden_layers
    for module in model.modules():
        if isinstance(module, FP8Linear):
            module.dynamic_activations = False
    assert "model.layers.0.mlp.down_proj" in tp_plan(model)
    assert_ranks_reproduce(model, 2, torch.randint(3, 512, (2, 11), generator=torch.Generator().manual_seed(1)))


def test_a_gptq_layer_in_activation_order_is_not_cut_along_its_inputs() -> None:
    """A desc_act layer reads its inputs in its own order: a rank's contiguous slice of the inputs is not its slice
    of the layer's rows, so the row-wise cut is refused by name (column-wise cuts of q/k/v/gate/up come first)."""
    from pathlib import Path

    from paged_backend.config import EngineConfig
    from paged_backend.model_loader.gptq import load_gptq_model
    from paged_backend.model_loader.hf import load_hf_config

    folder = str(Path(__file__).parent / "data" / "quantized" / "gptq_asym_group32_desc_act")
    config = EngineConfig.from_kwargs(folder)
    model = load_gptq_model(load_hf_config(config, folder), folder, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="o_proj: a GPTQ layer in activation order .desc_act."):
        shard_model(model, 0, 2, None)


def test_plan_covers_the_projections_and_bad_sizes_are_named() -> None:
    model = build_tiny_model("llama", vocab_size=512)
    plan = tp_plan(model)
    assert plan["model.layers.0.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.1.mlp.down_proj"] == "rowwise"
    assert "lm_head" not in plan and len(plan) == 2 * 7
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        head_layout(model.config, 3)
    with pytest.raises(NotImplementedError, match="GPT2LMHeadModel has no base_model_tp_plan"):
        tp_plan(build_tiny_model("gpt2", vocab_size=512))
    with pytest.raises(NotImplementedError, match=r"Phi3ForCausalLM's base_model_tp_plan shards .* as 'rowwise_split"):
        tp_plan(build_tiny_model("phi3", vocab_size=512))  # fused qkv / gate_up with gathered outputs
    layout = head_layout(build_tiny_model("qwen3", vocab_size=512).config, 2)
    assert [list(layout.kv_heads_of(r)) for r in range(2)] == [[0], [0]]  # one KV head, replicated


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # split KV heads; q/k/v biases; a replicated KV head
def test_a_rank_reads_only_its_slices_of_a_checkpoint(arch: str, tmp_path, monkeypatch) -> None:
    """A local safetensors checkpoint is read slice by slice (never loaded whole): each rank's tensors equal
    those of the full model cut by shard_model, rowwise biases on rank 0 only."""
    from paged_backend.config import EngineConfig
    from paged_backend.model_loader import sharded

    model = build_tiny_model(arch)
    model.save_pretrained(tmp_path)
    config = EngineConfig.from_kwargs(model=str(tmp_path), tensor_parallel_size=2, dtype="float32")

    def no_whole_load(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded whole")

    monkeypatch.setattr(sharded, "load_model", no_whole_load)
    for rank in range(2):
        shard = sharded.load_shard(config, str(tmp_path), rank, torch.device("cpu"), all_reduce=None)
        expected = copy.deepcopy(model)
        shard_model(expected, rank, 2, None)
        got = dict(shard.named_parameters())
        assert got.keys() == dict(expected.named_parameters()).keys()
        for name, param in expected.named_parameters():
            assert torch.equal(got[name], param), name
