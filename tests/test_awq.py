"""AWQ int4: the packed format against a reference written from its description, the linear against its
dequantized twin, the Triton kernel against the torch twin (interpreter on CPU), the quantizer against
round-to-nearest, and the engine on AWQ checkpoints against HF ``generate`` on the dequantized fp32 model."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from paged_backend import LLM, SamplingParams
from paged_backend.demo_checkpoint import CORPUS
from paged_backend.kernels.arrival import arrival_counters
from paged_backend.kernels.awq_format import AWQ_ORDER, dequantize, pack, unpack
from paged_backend.kernels.awq_gemm import Launch, awq_gemm_torch, awq_gemm_triton
from paged_backend.quantization.awq import AWQLinear
from paged_backend.quantization.awq_quantize import apply_awq, calibration_batches, quantize, write_checkpoint
from paged_backend.quantization.rtn import pack_linear
from tests.conftest import capturing_backend, hf_greedy, ragged_prompts, tp2
from tests.fixtures.awq import dequantized_copy
from tests.fixtures.tiny_models import build_tiny_model

GROUP = 32
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the kernel: on the GPU, else interpreted


def reference_unpack(packed: torch.Tensor) -> torch.Tensor:
    """Straight from the format: nibble i (bits 4i..4i+3) of int32 column c is output column 8c + AWQ_ORDER[i]."""
    rows, cols = packed.shape
    out = torch.zeros(rows, cols * 8, dtype=torch.int32)
    for r in range(rows):
        for c in range(cols):
            word = int(packed[r, c]) & 0xFFFFFFFF
            for i in range(8):
                out[r, 8 * c + AWQ_ORDER[i]] = (word >> (4 * i)) & 0xF
    return out


def test_pack_unpack_round_trip_against_the_format() -> None:
    torch.manual_seed(0)
    values = torch.randint(0, 16, (6, 32), dtype=torch.int32)
    packed = pack(values)
    assert packed.dtype == torch.int32 and packed.shape == (6, 4)
    assert torch.equal(reference_unpack(packed), values)
    assert torch.equal(unpack(packed), values)
    row = torch.arange(8, dtype=torch.int32)[None]  # column j holds value j
    word = sum(AWQ_ORDER[i] << (4 * i) for i in range(8))
    assert int(pack(row)[0, 0]) & 0xFFFFFFFF == word


def test_awq_linear_equals_the_dequantized_linear() -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 128), torch.randn(48)
    qweight, qzeros, scales = pack_linear(weight, GROUP)
    dense = dequantize(qweight, qzeros, scales, torch.float32).t()  # [N, K]
    assert (dense - weight).abs().max() <= scales.float().max() / 2 + 1e-3  # rounding error at most half a step
    layer = AWQLinear(128, 48, GROUP, bias=True)
    layer.qweight.copy_(qweight)
    layer.qzeros.copy_(qzeros)
    layer.scales.copy_(scales)
    layer.bias.data.copy_(bias)
    x = torch.randn(3, 5, 128)
    torch.testing.assert_close(layer(x), nn.functional.linear(x, dense, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("m", "k"), [(1, 256), (3, 224), (7, 224), (40, 256)])  # 224: split-K's last part is short
def test_triton_kernel_equals_its_twin(dtype: torch.dtype, m: int, k: int) -> None:
    torch.manual_seed(m)
    n = 80
    qweight, qzeros, scales = pack_linear(torch.randn(n, k, device=DEVICE) * 0.1, GROUP)
    x = torch.randn(m, k, dtype=dtype, device=DEVICE)
    expected = awq_gemm_torch(x.float(), qweight, qzeros, scales)
    # the heuristic's shape, then split-K over 4 parts: the tl.dot kernel (also with tall, narrow tiles, 8 warps and
    # one stage, as launches for many rows may take), and for a few rows the GEMV kernel with one row a program
    # (BLOCK_M 1) and with four (the last program's rows partly masked when m is 3 or 7)
    gemv = ((1, 64, 32, 4), (4, 64, 8, 4)) if m < 16 else ()
    for launch in (None, (16, 32, 32, 4), Launch(64, 32, 32, 2, num_warps=8, num_stages=1), *gemv):
        got = awq_gemm_triton(x, qweight, qzeros, scales, launch)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)
    assert not arrival_counters(DEVICE).any()  # the programs that added the split-K parts reset the counters


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("k", "n"), [(256, 80), (384, 136)])  # a partial block of columns, three groups
def test_triton_dequantize_equals_its_twin(dtype: torch.dtype, k: int, n: int) -> None:
    """Prefill's path (dequantize once, then cuBLAS): the one-pass kernel gives the twin's weight exactly."""
    from paged_backend.kernels.awq_gemm import awq_dequantize_triton

    torch.manual_seed(k + n)
    qweight, qzeros, scales = pack_linear(torch.randn(n, k, device=DEVICE) * 0.1, GROUP)
    got = awq_dequantize_triton(qweight, qzeros, scales, dtype)
    assert got.dtype == dtype and got.shape == (k, n)
    torch.testing.assert_close(got, dequantize(qweight, qzeros, scales, dtype), rtol=0, atol=0)


def test_kernels_read_column_slices_of_packed_siblings() -> None:
    """Fused siblings (worker/fuse_linears.py) leave each layer's tensors as column slices of one buffer: every
    path reads them through the row stride, and the buffer whole is the fused layer."""
    from paged_backend.kernels.awq_gemm import awq_dequantize_triton

    torch.manual_seed(1)
    parts = [pack_linear(torch.randn(n, 256, device=DEVICE) * 0.1, GROUP) for n in (64, 16, 24)]
    whole = [torch.cat(tensors, dim=1) for tensors in zip(*parts)]  # qweight, qzeros, scales side by side
    x = torch.randn(3, 256, device=DEVICE)
    start_packs = start_cols = 0
    for qweight, qzeros, scales in parts:
        packs, cols = qweight.shape[1], scales.shape[1]
        views = (
            whole[0][:, start_packs : start_packs + packs],
            whole[1][:, start_packs : start_packs + packs],
            whole[2][:, start_cols : start_cols + cols],
        )
        assert not views[0].is_contiguous()
        expected = awq_gemm_torch(x, qweight, qzeros, scales)
        for launch in ((1, 64, 32, 2), (4, 64, 8, 2), (16, 32, 32, 2)):  # GEMV, one row / 4 rows a program; tl.dot
            torch.testing.assert_close(awq_gemm_triton(x, *views, launch), expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(awq_gemm_torch(x, *views), expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(
            awq_dequantize_triton(*views, torch.float32), dequantize(qweight, qzeros, scales, torch.float32)
        )
        start_packs, start_cols = start_packs + packs, start_cols + cols
    torch.testing.assert_close(
        awq_gemm_triton(x, *whole), torch.cat([awq_gemm_torch(x, *t) for t in parts], dim=1), rtol=1e-4, atol=1e-4
    )


# ---------------------------------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def awq_checkpoints(tmp_path_factory, tokenizer):
    """Tiny Llama and Qwen2 (biases) written as round-to-nearest AWQ checkpoints."""
    out = {}
    for arch in ("llama", "qwen2"):
        model = build_tiny_model(arch, vocab_size=len(tokenizer))
        folder = tmp_path_factory.mktemp(f"awq-{arch}")
        write_checkpoint(model, str(folder), GROUP, tokenizer)
        out[arch] = (str(folder), dequantized_copy(model, folder))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_on_an_awq_checkpoint_equals_hf_on_the_dequantized_model(awq_checkpoints, arch: str) -> None:
    folder, reference = awq_checkpoints[arch]
    prompts = ragged_prompts(4)
    params = SamplingParams(temperature=0, max_tokens=16)
    llm = LLM(folder, dtype="float32", block_size=4, num_kv_blocks=14, max_num_batched_tokens=24, max_model_len=48)
    linears = [m for m in llm.llm_engine.model.modules() if isinstance(m, AWQLinear)]
    assert len(linears) == 14  # 2 layers x (q, k, v, o, gate, up, down); the LM head stays dense
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(reference, p, 16) for p in prompts]
    assert llm.stats()["num_preemptions"] > 0  # the small cache preempted, the outputs still agree
    explicit = LLM(folder, quantization="awq", dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=64)
    again = explicit.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    assert list(again[0].outputs[0].token_ids) == list(outs[0].outputs[0].token_ids)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_compiled_awq_layers_fuse_their_siblings(awq_checkpoints, arch: str) -> None:
    """The engine's compiled decoder layer makes one AWQ call for q/k/v (Qwen2: with biases) and one for gate/up
    (dynamo-only backend, so it runs on CPU; inductor on the GPU compiles the same graph), and still equals HF
    generate on the dequantized model."""
    folder, reference = awq_checkpoints[arch]
    llm = LLM(folder, dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=24, max_model_len=48)
    runner = llm.llm_engine.executor.model_runner
    graphs: list = []
    capture = capturing_backend(graphs)

    runner.compile(capture)
    assert runner.regions is not None and runner.regions.num_fused_groups == 2 * len(graphs)
    calls = [n for n in graphs[0].graph.nodes if str(n.target) == "paged_backend.awq_gemm.default"]
    assert len(calls) == 4  # q/k/v, o, gate/up, down
    prompts = ragged_prompts(4)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(reference, p, 8) for p in prompts]


def _edit_checkpoint(folder, tmp_path, edit_tensors=None, edit_config=None):
    import shutil

    from safetensors.torch import load_file, save_file

    target = tmp_path / "edited"
    shutil.copytree(folder, target)
    if edit_tensors:
        tensors = load_file(target / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    if edit_config:
        config = json.loads((target / "config.json").read_text())
        edit_config(config["quantization_config"])
        (target / "config.json").write_text(json.dumps(config))
    return str(target)


@pytest.mark.parametrize(
    ("tensors", "config", "match"),
    [
        (lambda t: t.pop("model.layers.0.mlp.up_proj.qzeros"), None, r"missing tensor.*up_proj\.qzeros"),
        (
            lambda t: t.update({"model.layers.1.self_attn.o_proj.qweight": torch.zeros(64, 4, dtype=torch.int32)}),
            None,
            r"o_proj\.qweight has shape \(64, 4\), expected \(64, 8\)",
        ),
        (None, lambda qc: qc.update(bits=8), r"quantization_config\.bits must be 4"),
        (None, lambda qc: qc.update(group_size=48), r"quantization_config\.group_size must be one of"),
        (None, lambda qc: qc.update(version="gemv"), r"quantization_config\.version must be 'gemm'"),
    ],
)
def test_bad_checkpoints_fail_at_load_naming_the_tensor(awq_checkpoints, tmp_path, tensors, config, match) -> None:
    folder = _edit_checkpoint(awq_checkpoints["llama"][0], tmp_path, tensors, config)
    with pytest.raises(ValueError, match=match):
        LLM(folder, dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=64)


def test_group_size_must_divide_in_features(awq_checkpoints, tmp_path) -> None:
    folder = _edit_checkpoint(awq_checkpoints["llama"][0], tmp_path, None, lambda qc: qc.update(group_size=128))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj: group_size=128 must divide"):
        LLM(folder, dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=64)


def test_awq_needs_an_awq_checkpoint(tmp_path, tokenizer) -> None:
    build_tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="quantization=.awq. does not match.*no quantization_config"):
        LLM(str(tmp_path), quantization="awq", num_kv_blocks=64, block_size=4, max_model_len=64)


# ---------------------------------------------------------------------------------------------------- quantizer
def outlier_model(tokenizer) -> nn.Module:
    """A tiny Llama whose norms boost a few hidden channels, as trained LLMs' activations do: the salient
    channels AWQ is built to protect."""
    model = build_tiny_model("llama", vocab_size=len(tokenizer), seed=1)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[[3, 17, 40, 58]] = 12.0
    return model


@torch.no_grad()
def logits_error(model: nn.Module, candidate: nn.Module, batches: list[torch.Tensor]) -> float:
    return sum((candidate(ids).logits - model(ids).logits).pow(2).mean().item() for ids in batches) / len(batches)


def test_awq_beats_round_to_nearest_on_held_out_text(tokenizer, tmp_path) -> None:
    model = outlier_model(tokenizer)
    calib, held_out = CORPUS[: len(CORPUS) // 2], CORPUS[len(CORPUS) // 2 :]
    quantize(model, tokenizer, str(tmp_path / "awq"), calib_texts=calib, group_size=GROUP, seq_len=64)
    write_checkpoint(model, str(tmp_path / "rtn"), GROUP, tokenizer)  # plain round to nearest
    batches = calibration_batches(tokenizer, held_out, 64, torch.device("cpu"))
    awq_error = logits_error(model, dequantized_copy(model, tmp_path / "awq"), batches)
    rtn_error = logits_error(model, dequantized_copy(model, tmp_path / "rtn"), batches)
    assert awq_error < 0.8 * rtn_error, (awq_error, rtn_error)
    # Scaling alone keeps the float model's function: the inverse scales fold into the norms and linears.
    scaled = copy.deepcopy(model)
    apply_awq(scaled, calibration_batches(tokenizer, calib, 64, torch.device("cpu")), GROUP, clip=False)
    assert logits_error(model, scaled, batches) < 1e-8
    config = json.loads((tmp_path / "awq" / "config.json").read_text())["quantization_config"]
    assert config == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": GROUP,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    llm = LLM(str(tmp_path / "awq"), dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=64)
    reference = dequantized_copy(model, tmp_path / "awq")
    prompt = ragged_prompts(4)[1]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == hf_greedy(reference, prompt, 8)


@tp2
def test_tp2_on_an_awq_checkpoint_equals_hf_on_the_dequantized_model(awq_checkpoints) -> None:
    """Under tensor parallelism the packed tensors are cut like the layer: outputs in whole packs of eight, inputs
    in whole groups."""
    folder, reference = awq_checkpoints["llama"]
    prompts = ragged_prompts(4)[:4]
    llm = LLM(folder, tensor_parallel_size=2, dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=64)
    try:
        (down,) = [m for n, m in llm.llm_engine.model.named_modules() if n == "model.layers.0.mlp.down_proj"]
        assert isinstance(down, AWQLinear) and down.qweight.shape == (64, 8) and down.scales.shape == (2, 64)
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
        )
        assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(reference, p, 8) for p in prompts]
    finally:
        llm.llm_engine.shutdown()


def test_tp_refuses_awq_groups_split_across_ranks() -> None:
    from paged_backend.model_loader.tp_plan import head_layout, shard_linear

    layer = AWQLinear(64, 16, GROUP, bias=False)
    with pytest.raises(ValueError, match=r"o_proj: each rank's 16 inputs must be whole AWQ groups of 32"):
        shard_linear("model.layers.0.self_attn.o_proj", layer, "rowwise", head_layout(_TinyConfig(), 4), 0, None)


class _TinyConfig:
    num_attention_heads = 4
    num_key_value_heads = 4
    hidden_size = 64
    intermediate_size = 128
