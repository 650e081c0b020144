"""Block-wise FP8 (``quant_method: "fp8"`` with ``weight_block_size``: DeepSeek-V3's and Qwen3-FP8's format) on a
checkpoint transformers' own quantizer made (``tests/data/quantized/make_fp8_block_fixtures.py``): the engine's
greedy output equals HF ``generate`` on the weights transformers dequantizes from it, with each linear's input
rounded through fp8 per token and block of inputs as the format runs; tensor-parallel ranks cut on whole blocks;
settings we do not run fail naming them. The product's kernel against its twin: ``test_fp8_block_mm.py``."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from paged_backend import LLM
from paged_backend.config import EngineConfig
from paged_backend.kernels.fp8_block_mm import (
    expand_scales,
    quantize_per_block,
)
from paged_backend.kernels.fp8_quant import FP8
from paged_backend.model_loader.fp8_block import load_fp8_block_model
from paged_backend.model_loader.hf import load_hf_config
from paged_backend.quantization.fp8_block import (
    FP8BlockConfig,
    FP8BlockLinear,
    fp8_block_linear,
    fp8_block_linear_op,
    quantized_fp8_block_linear,
)
from tests.conftest import hf_greedy, ragged_prompts
from tests.test_producer_checkpoints import greedy_outputs, reference_model
from tests.test_tp_plan import assert_ranks_reproduce

FOLDER = Path(__file__).parent / "data" / "quantized" / "fp8_block_32x64"
BLOCK_N, BLOCK_K = 32, 64  # the fixture's weight_block_size
FP8_MAX = 448.0
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def fake_quantize_per_group(x: torch.Tensor, group: int) -> torch.Tensor:
    """What the format does to a linear's input: each token's inputs in groups of ``group``, each group scaled so
    its largest magnitude is fp8's largest, rounded to float8_e4m3fn, scaled back (written from the format's
    definition, not from the library)."""
    groups = x.unflatten(-1, (-1, group))
    scale = (groups.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    return ((groups / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale).flatten(-2)


def reference() -> nn.Module:
    model = reference_model(FOLDER, fp8_inputs=False)
    for name in {key.rsplit(".", 1)[0] for key in load_file(FOLDER / "reference.safetensors")}:
        hook = lambda _, args: (fake_quantize_per_group(args[0], BLOCK_K),)  # noqa: E731
        model.get_submodule(name).register_forward_pre_hook(hook)
    return model


@pytest.mark.parametrize("quantization", [None, "fp8"])  # named or read from the checkpoint: the same
def test_greedy_equals_hf_on_transformers_dequantized_model(quantization: str | None, tokenizer) -> None:
    llm = LLM(
        str(FOLDER),
        tokenizer=tokenizer,
        quantization=quantization,
        dtype="float32",
        block_size=4,
        num_kv_blocks=128,
        device="cpu",
    )
    layers = [m for m in llm.llm_engine.model.modules() if isinstance(m, FP8BlockLinear)]
    assert len(layers) == 7 * 2 and not isinstance(llm.llm_engine.model.lm_head, FP8BlockLinear)
    model = reference()
    prompts = ragged_prompts(4, seed=31)
    for prompt, ours in zip(prompts, greedy_outputs(llm, prompts)):
        assert ours == hf_greedy(model, prompt, 12)


def test_weights_and_block_scales_are_the_checkpoints(tokenizer) -> None:
    """As stored, and dequantized block by block to exactly what transformers dequantizes."""
    llm = LLM(str(FOLDER), tokenizer=tokenizer, num_kv_blocks=64, device="cpu")
    stored = load_file(FOLDER / "model.safetensors")
    dequantized = load_file(FOLDER / "reference.safetensors")
    layers = {n: m for n, m in llm.llm_engine.model.named_modules() if isinstance(m, FP8BlockLinear)}
    assert set(layers) == {key.rsplit(".", 1)[0] for key in dequantized}
    for name, layer in layers.items():
        assert torch.equal(layer.weight.view(torch.uint8), stored[f"{name}.weight"].view(torch.uint8))
        assert torch.equal(layer.weight_scale_inv, stored[f"{name}.weight_scale_inv"])
        n, k = layer.weight.shape
        ours = layer.weight.float() * expand_scales(layer.weight_scale_inv, n, k, BLOCK_N, BLOCK_K)
        torch.testing.assert_close(ours, dequantized[f"{name}.weight"], rtol=0, atol=0)


def _changed(tmp_path: Path, change) -> str:
    folder = tmp_path / "changed"
    shutil.copytree(FOLDER, folder)
    config = json.loads((folder / "config.json").read_text())
    change(config["quantization_config"])
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda qc: qc.update(activation_scheme="static"), "activation_scheme='static'"),
        (lambda qc: qc.update(activation_scheme="Static"), "activation_scheme='Static'"),
        (lambda qc: qc.update(scale_fmt="ue8m0"), "scale_fmt='ue8m0'"),
        (lambda qc: qc.update(fmt="e5m2"), "fmt='e5m2'"),
        (lambda qc: qc.pop("weight_block_size"), "weight_block_size=None .*per-tensor"),
        (lambda qc: qc.update(weight_block_size=[32, 48]), "block_k 48 must be a multiple of 32"),
        (lambda qc: qc.update(weight_block_size=[32, 128]), "weight_scale_inv has shape"),  # unlike the tensors
    ],
)
def test_settings_we_do_not_run_fail_at_load_naming_them(change, message: str, tokenizer, tmp_path) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(_changed(tmp_path, change), tokenizer=tokenizer, num_kv_blocks=64, device="cpu")


def test_scales_of_a_module_that_is_no_linear_fail_naming_it(tokenizer, tmp_path) -> None:
    """A mixture-of-experts checkpoint's experts (fused into one module in transformers) or any tensor naming no
    linear layer of the model: refused with the tensor's name, not an AttributeError."""
    from safetensors.torch import save_file

    folder = tmp_path / "experts"
    shutil.copytree(FOLDER, folder)
    stored = load_file(folder / "model.safetensors")
    key = "model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv"
    save_file(stored | {key: torch.ones(8, 2)}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{key} names no module of LlamaForCausalLM.*mixture-of-experts"):
        LLM(str(folder), tokenizer=tokenizer, num_kv_blocks=64, device="cpu")


def test_the_quantization_named_must_be_the_checkpoints(tokenizer) -> None:
    with pytest.raises(ValueError, match="quantization='awq' does not match .* quant_method='fp8'"):
        LLM(str(FOLDER), tokenizer=tokenizer, quantization="awq", num_kv_blocks=64, device="cpu")
    with pytest.raises(ValueError, match="load_format='dummy' does not make fp8 weights"):
        LLM(str(FOLDER), tokenizer=tokenizer, load_format="dummy", num_kv_blocks=64, device="cpu")


@pytest.mark.parametrize("name", ["fp8_block_32x64", "fp8_dynamic"])  # block-wise; per channel (FP8Linear)
def test_adapters_add_their_delta_to_fp8_layers(name: str, tokenizer, tmp_path) -> None:
    """A LoRA adapter on FP8 layers adds B·A of the layer's unquantized input to its output: greedy output equals
    HF generate on the dequantized model (inputs through fp8 as the format runs) with the PEFT adapter beside it,
    unmerged (merged, its delta would go through fp8 too); the adapter changes the output."""
    peft = pytest.importorskip("peft")
    from paged_backend import LoRARequest, SamplingParams

    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False, lora_dropout=0.0
    )
    folder = FOLDER.parent / name
    base = reference() if folder == FOLDER else reference_model(folder, fp8_inputs=True)
    adapted = peft.get_peft_model(base, config)
    with torch.no_grad():  # larger than PEFT's own random init, so the adapter changes greedy outputs
        for parameter_name, param in adapted.named_parameters():
            if "lora_" in parameter_name:
                param.normal_(0.0, 0.3)
    adapted.save_pretrained(tmp_path / "adapter")
    llm = LLM(str(folder), tokenizer=tokenizer, dtype="float32", enable_lora=True, max_lora_rank=8, block_size=4,
              num_kv_blocks=128, device="cpu")  # fmt: skip
    prompts = ragged_prompts(3, seed=41)
    request = LoRARequest("fp8", 1, str(tmp_path / "adapter"))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=10),
                           lora_request=[request] * len(prompts), use_tqdm=False)  # fmt: skip
    ours = [list(o.outputs[0].token_ids) for o in outputs]
    assert ours == [hf_greedy(adapted.eval(), p, 10) for p in prompts]
    assert ours != greedy_outputs(llm, prompts, 10)


def _model() -> nn.Module:
    config = EngineConfig.from_kwargs(str(FOLDER))
    model = load_fp8_block_model(load_hf_config(config, str(FOLDER)), str(FOLDER), torch.float32, torch.device("cpu"))
    model.config._attn_implementation = "eager"
    return model


def test_tensor_parallel_ranks_cut_whole_blocks_with_their_scales() -> None:
    """Two ranks: colwise layers keep whole blocks of outputs, rowwise ones whole blocks of inputs (so each rank's
    activation groups are the full layer's), and every rank's logits equal the full model's. Four ranks would cut
    o_proj's 128 inputs into 32, half a block: refused by name."""
    from paged_backend.model_loader.tp_plan import shard_model

    assert_ranks_reproduce(_model(), 2, torch.randint(3, 512, (2, 9), generator=torch.Generator().manual_seed(2)))
    with pytest.raises(ValueError, match=r"o_proj: block-wise FP8 has one scale per 64 inputs; this rank's 0:32"):
        shard_model(_model(), 0, 4, None)


def test_a_rank_loads_the_checkpoint_cut_on_blocks_and_dummy_weights_are_refused() -> None:
    """What a tensor-parallel worker loads: the checkpoint read whole on the CPU and cut (as ``shard_model`` cuts
    the loaded model); ``load_format="dummy"`` makes no fp8 weights, for one rank as for one process."""
    from paged_backend.model_loader.sharded import load_shard
    from paged_backend.model_loader.tp_plan import shard_model

    config = EngineConfig.from_kwargs(model=str(FOLDER), tensor_parallel_size=2, dtype="float32")
    shard = load_shard(config, str(FOLDER), 1, torch.device("cpu"), all_reduce=None)
    expected = _model()
    shard_model(expected, 1, 2, None)
    got = dict(shard.named_buffers()) | dict(shard.named_parameters())
    for name, tensor in (dict(expected.named_buffers()) | dict(expected.named_parameters())).items():
        assert torch.equal(got[name].view(torch.uint8) if got[name].dtype == FP8 else got[name],
                           tensor.view(torch.uint8) if tensor.dtype == FP8 else tensor), name  # fmt: skip
    assert shard.model.layers[0].self_attn.o_proj.weight_scale_inv.shape == (4, 1)  # 64 of 128 inputs: one block
    dummy = EngineConfig.from_kwargs(model=str(FOLDER), tensor_parallel_size=2, load_format="dummy")
    with pytest.raises(ValueError, match="load_format='dummy' does not make fp8 weights"):
        load_shard(dummy, str(FOLDER), 0, torch.device("cpu"), all_reduce=None)
    asked = EngineConfig.from_kwargs(model=str(FOLDER), tensor_parallel_size=2, quantization="awq")
    with pytest.raises(ValueError, match="quantization='awq' does not match"):  # as one process refuses it
        load_shard(asked, str(FOLDER), 0, torch.device("cpu"), all_reduce=None)


def block_quantized(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random [n, k] weight in fp8 with a scale per BLOCK_N × BLOCK_K block (ragged at the edges)."""
    return quantize_per_block(torch.randn(n, k, generator=gen) * 0.1, BLOCK_N, BLOCK_K)


def test_config_reads_transformers_own_settings() -> None:
    from transformers import FineGrainedFP8Config

    config = FP8BlockConfig.from_hf(FineGrainedFP8Config(weight_block_size=[128, 128]))
    assert (config.block_n, config.block_k) == (128, 128)


def _compiled(layers: nn.ModuleList, run) -> tuple[object, list[torch.fx.GraphModule], int]:
    """``run()`` under the regional compile with the sibling packing first, as the engine compiles (a backend that
    keeps the rewritten graphs and runs them as they are): its output, the graphs, the fused groups."""
    from paged_backend.worker.compile import RegionalCompile
    from paged_backend.worker.fuse_linears import PackingBackend

    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        packer = PackingBackend(list(layers))
        with RegionalCompile(layers, packer):
            run()
        packer.finish()
        regions = RegionalCompile(layers, backend)
        with regions:
            out = run()
    return out, graphs, regions.num_fused_groups


def test_a_compiled_layer_fuses_siblings_and_quantizes_in_the_graph() -> None:
    """Compiled, q/k/v and gate/up (whole blocks of outputs each) run as one product each, their weights and scales
    packed back to back; each product's input quantized by torch ops before one opaque ``fp8_block_mm`` (so inductor
    can fuse the quantization into what produced the input); the output is the eager layer's."""
    model = _model()
    layers = model.model.layers
    x = torch.randn(1, 5, 128)
    embeddings = model.model.rotary_emb(x, torch.arange(5)[None])
    with torch.no_grad():
        expected = layers[0](x, position_embeddings=embeddings, attention_mask=None)
    got, graphs, fused = _compiled(layers, lambda: layers[0](x, position_embeddings=embeddings, attention_mask=None))
    assert fused == 2
    products = [n for gm in graphs for n in gm.graph.nodes if n.target is quantized_fp8_block_linear]
    assert len(products) == 4  # q/k/v, o, gate/up, down
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_compiled_quantization_pads_rows_to_fours_without_a_graph_per_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled product, by the engine's route (dynamo's graph of ``fp8_block_linear_op`` rewritten by
    ``quantize_fp8_activations``, then inductor), pads its rows to a multiple of 4 (cuBLAS's) before quantizing
    and slices them off: one graph serves every row count of two or more (no guard on the count's remainder, no
    recompile in the middle of serving), the product receives whole groups of 4 rows, and each count's rows are
    the eager layer's. A graph of one row (dynamo's own) reaches the product unpadded."""
    import torch._dynamo
    from torch._inductor.compile_fx import compile_fx

    from paged_backend.quantization import fp8_block
    from paged_backend.worker.fp8_activations import quantize_fp8_activations

    product_rows: list[int] = []
    twin = fp8_block.fp8_block_mm_torch
    monkeypatch.setattr(fp8_block, "fp8_block_mm_torch", lambda q, *a: product_rows.append(q.shape[0]) or twin(q, *a))

    def rewriting_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., object]:
        assert quantize_fp8_activations(gm) == 1  # as the engine's backend does (worker/compile.py)
        return compile_fx(gm, example_inputs)

    gen = torch.Generator().manual_seed(0)
    weight, scale = block_quantized(96, 256, gen)
    compiled = torch.compile(
        lambda x: fp8_block_linear_op(x, weight, scale, BLOCK_N, BLOCK_K),  # positional, as FP8BlockLinear calls it
        dynamic=True,
        fullgraph=True,
        backend=rewriting_backend,
    )
    torch._dynamo.reset()
    for i, m in enumerate([2, 3, 5, 8, 65, 130]):
        x = torch.randn(m, 256, generator=gen)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled(x)
        assert got.shape == (m, 96) and product_rows[-1] == m + (-m % 4)
        torch.testing.assert_close(got, fp8_block_linear(x, weight, scale, BLOCK_N, BLOCK_K), rtol=1e-6, atol=1e-6)
    x = torch.randn(1, 256, generator=gen)
    torch.testing.assert_close(compiled(x), fp8_block_linear(x, weight, scale, BLOCK_N, BLOCK_K))
    assert product_rows[-2:] == [1, 1]  # compiled, then eager


class Siblings(nn.Module):
    """q/k/v as block-wise FP8 layers of 64, ``kv`` and ``kv`` outputs (blocks of 32 outputs) on one input."""

    def __init__(self, kv: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(kv)
        layers = []
        for n in (64, kv, kv):
            layer = FP8BlockLinear(128, n, False, FP8BlockConfig(BLOCK_N, BLOCK_K), "cpu")
            layer.weight, layer.weight_scale_inv = block_quantized(n, 128, gen)
            layers.append(layer)
        self.q, self.k, self.v = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.k(x) * 2, self.v(x).relu()], dim=-1)


@pytest.mark.parametrize(("kv", "fused"), [(32, 1), (48, 0)])
def test_siblings_fuse_only_where_each_ends_on_a_block(kv: int, fused: int) -> None:
    """k's 48 outputs end mid-block: packed behind them, v's scales would not line up with its rows, so the three
    stay separate calls (and still equal the eager layers)."""
    layers = nn.ModuleList([Siblings(kv) for _ in range(2)])
    x = torch.randn(3, 128)
    with torch.no_grad():
        expected = layers[0](x)
    got, _, groups = _compiled(layers, lambda: layers[0](x))
    assert groups == fused
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
