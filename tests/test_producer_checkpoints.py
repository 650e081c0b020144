"""Quantized checkpoints made by the real producers (``tests/data/quantized``; its ``make_fixtures.py`` and
``make_autoawq_fixtures.py`` made them, ``versions.json`` says with what): llm-compressor's compressed-tensors
int4 per group (symmetric, and with zero points) and per channel, and FP8 with dynamic per-token activations;
AutoAWQ's GEMM checkpoint. The engine's greedy output equals HF ``generate`` on the producer's own dequantized
weights (saved beside each checkpoint), with the activations rounded through fp8 per token for FP8; also vLLM's
online ``quantization="fp8"``, and schemes we do not run failing at load with their name. The engines run on the
CPU, HF's oracle's device, also on a GPU machine; there the fp8 products are checked against their twin."""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, LlamaForCausalLM

from paged_backend import LLM, SamplingParams
from paged_backend.kernels.awq_format import dequantize
from paged_backend.quantization.awq import AWQLinear
from paged_backend.quantization.fp8 import FP8Linear
from tests.conftest import hf_greedy, ragged_prompts
from tests.fixtures.tiny_models import build_tiny_model

FIXTURES = Path(__file__).parent / "data" / "quantized"
# compressed-tensors' int4 needs its package (the [quant] extra, also in [test]); elsewhere those cases skip
NEEDS_PACKAGE = pytest.mark.skipif(
    importlib.util.find_spec("compressed_tensors") is None, reason="compressed-tensors is not installed"
)
INT4 = [
    pytest.param(n, marks=NEEDS_PACKAGE)
    for n in ("w4a16_group128", "w4a16_asym_group32", "w4a16_channel", "w4a16_asym_gptq")
]
INT4 += ["autoawq_group128", "gptq_sym_group128_desc_act", "gptq_asym_group32_desc_act", "gptq_asym_group64"]
FP8_MAX = 448.0


def fake_quantize_per_token(x: torch.Tensor) -> torch.Tensor:
    """What FP8_DYNAMIC does to a linear's input: each token scaled so its largest magnitude is fp8's largest,
    rounded to float8_e4m3fn, scaled back (written here from the scheme's definition, not from the library)."""
    scale = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


def fake_quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What FP8 (static) does to a linear's input: scaled by the checkpoint's one ``input_scale``, rounded to
    float8_e4m3fn (saturating), scaled back."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


def gptq_dequantize(stored: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """A GPTQ linear's weight [out, in] in float32, written from AutoGPTQ's layout (not from our loader): ``qweight``
    packs eight inputs along its rows, ``qzeros`` eight outputs along its columns, each word minus 0x11111111;
    ``g_idx`` gives each input's group."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    qweight, qzeros = stored[f"{module}.qweight"].long(), stored[f"{module}.qzeros"].long()
    q = ((qweight[:, None, :] >> shifts[None, :, None]) & 15).reshape(-1, qweight.shape[1])  # [in, out]
    qzeros = (qzeros + 0x11111111) & 0xFFFFFFFF  # v1 stored each word minus 0x11111111 (GPTQModel's v1 -> v2)
    z = ((qzeros[:, :, None] >> shifts) & 15).reshape(qzeros.shape[0], -1)  # [groups, out]
    g_idx = stored[f"{module}.g_idx"].long()
    return ((q - z[g_idx]).float() * stored[f"{module}.scales"].float()[g_idx]).T


def reference_model(folder: Path, fp8_inputs: bool) -> LlamaForCausalLM:
    """A plain fp32 HF model: the checkpoint's unquantized tensors and the producer's dequantized linears; with
    ``fp8_inputs``, each quantized linear's input rounded through fp8 as its scheme says (per token, or with the
    checkpoint's static ``input_scale``). GPTQModel dequantizes in fp16 only: a GPTQ checkpoint's linears are
    dequantized exactly from its layout (``gptq_dequantize``), checked first to round to GPTQModel's weights."""
    config = AutoConfig.from_pretrained(folder)
    del config.quantization_config
    model = LlamaForCausalLM(config).eval()
    reference = load_file(folder / "reference.safetensors")
    quantized = {key.rsplit(".", 1)[0] for key in reference}
    stored = load_file(folder / "model.safetensors")
    if folder.name.startswith("gptq"):
        exact = {f"{name}.weight": gptq_dequantize(stored, name) for name in quantized}
        for key, weight in exact.items():
            torch.testing.assert_close(weight.half().float(), reference[key], rtol=0, atol=0)
        reference = exact
    state = {
        k: v
        for k, v in stored.items()
        if k.rsplit(".", 1)[0] not in quantized and not k.endswith(("k_scale", "v_scale"))  # KV cache's, not HF's
    }
    model.load_state_dict(state | reference, strict=True)
    if fp8_inputs:
        for name in quantized:
            static = stored.get(f"{name}.input_scale")
            quantize = fake_quantize_per_token if static is None else partial(fake_quantize_static, scale=static)
            model.get_submodule(name).register_forward_pre_hook(lambda _, args, q=quantize: (q(args[0]),))
    return model


def greedy_outputs(llm: LLM, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.mark.parametrize("name", INT4)
def test_int4_repacked_for_our_kernels_dequantizes_to_the_producers_weights(name: str, tokenizer) -> None:
    llm = LLM(str(FIXTURES / name), tokenizer=tokenizer, num_kv_blocks=64, device="cpu")
    reference = load_file(FIXTURES / name / "reference.safetensors")
    layers = {n: m for n, m in llm.llm_engine.model.named_modules() if isinstance(m, AWQLinear)}
    assert set(layers) == {key.rsplit(".", 1)[0] for key in reference}  # lm_head (ignored) stays a Linear
    for module_name, layer in layers.items():
        ours = dequantize(layer.qweight, layer.qzeros, layer.scales, torch.float32)  # exact: (q - z) * s
        if layer.input_order is not None:  # GPTQ's activation order: row i of ours is the input's input_order[i]
            ours = torch.empty_like(ours).index_copy_(0, layer.input_order, ours)
        ours = ours.T
        if name.startswith(("autoawq", "gptq")):  # AutoAWQ and GPTQModel multiply in fp16: its rounding of the same
            ours = ours.half().float()
        assert (layer.input_order is not None) == ("desc_act" in name)
        torch.testing.assert_close(ours, reference[f"{module_name}.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("name", [*INT4, "fp8_dynamic", "fp8_static_kv"])
def test_greedy_equals_hf_on_the_producers_dequantized_model(name: str, tokenizer) -> None:
    """In float32 as the reference runs (GPTQModel saves its checkpoints' other tensors in bfloat16)."""
    folder = FIXTURES / name
    llm = LLM(str(folder), tokenizer=tokenizer, dtype="float32", block_size=4, num_kv_blocks=128, device="cpu")
    kind = FP8Linear if name.startswith("fp8") else AWQLinear
    assert any(isinstance(m, kind) for m in llm.llm_engine.model.modules())
    reference = reference_model(folder, fp8_inputs=name.startswith("fp8"))
    prompts = ragged_prompts(4, seed=21)
    for prompt, ours in zip(prompts, greedy_outputs(llm, prompts)):
        assert ours == hf_greedy(reference, prompt, 12)


@pytest.mark.parametrize("name", ["fp8_dynamic_kv", "fp8_static_kv"])
def test_a_checkpoints_fp8_kv_cache_scales_start_an_fp8_cache(name: str, tokenizer) -> None:
    """llm-compressor's ``kv_cache_scheme`` (one static scale per layer for keys, one for values), beside fp8
    linears with dynamic or static activations: with ``kv_cache_dtype="fp8"`` the cache holds k / k_scale, and
    greedy output equals HF attending to keys and values through that fp8 round trip; with the default cache
    dtype the scales are not used."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from tests.fixtures.fp8_kv import round_trip

    folder = FIXTURES / name
    stored = load_file(folder / "model.safetensors")
    config = AutoConfig.from_pretrained(folder)
    heads = config.num_key_value_heads
    scales = {
        i: tuple(stored[f"model.layers.{i}.self_attn.{kind}_scale"].float().expand(heads) for kind in ("k", "v"))
        for i in range(config.num_hidden_layers)
    }

    def attention(module, query, key, value, attention_mask, **kwargs):
        k_scale, v_scale = scales[module.layer_idx]
        key, value = round_trip(key, k_scale), round_trip(value, v_scale)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("fp8_kv_checkpoint_scales", attention)
    AttentionMaskInterface.register("fp8_kv_checkpoint_scales", sdpa_mask)
    reference = reference_model(folder, fp8_inputs=True)
    reference.set_attn_implementation("fp8_kv_checkpoint_scales")
    llm = LLM(str(folder), tokenizer=tokenizer, kv_cache_dtype="fp8", block_size=4, num_kv_blocks=128, device="cpu")
    engine_scales = llm.llm_engine.executor.model_runner.cache_engine.kv_scales
    assert [(k.tolist(), v.tolist()) for k, v in engine_scales] == [
        (k.tolist(), v.tolist()) for k, v in scales.values()
    ]
    prompts = ragged_prompts(4, seed=23)
    for prompt, ours in zip(prompts, greedy_outputs(llm, prompts)):
        assert ours == hf_greedy(reference, prompt, 12)
    plain = LLM(str(folder), tokenizer=tokenizer, block_size=4, num_kv_blocks=128, device="cpu")
    assert plain.llm_engine.executor.model_runner.cache_engine.kv_scales is None
    with pytest.raises(ValueError, match="the checkpoint has its own KV-cache scales"):
        LLM(
            str(folder),
            tokenizer=tokenizer,
            kv_cache_dtype="fp8",
            calculate_kv_scales=True,
            num_kv_blocks=64,
            device="cpu",
        )


@pytest.mark.parametrize("name", ["fp8_dynamic", "fp8_static_kv"])
def test_fp8_weights_and_scales_are_the_checkpoints(name: str, tokenizer) -> None:
    """Weights and their scales as stored; activations per token (FP8_DYNAMIC), or with the stored static input
    scale (FP8)."""
    folder = FIXTURES / name
    llm = LLM(str(folder), tokenizer=tokenizer, num_kv_blocks=64, device="cpu")
    stored = load_file(folder / "model.safetensors")
    reference = load_file(folder / "reference.safetensors")
    for module_name, layer in llm.llm_engine.model.named_modules():
        if isinstance(layer, FP8Linear):
            static = stored.get(f"{module_name}.input_scale")
            assert layer.dynamic_activations == (static is None)
            if static is not None:
                assert torch.equal(layer.input_scale, static.float().reshape(1))
            assert torch.equal(layer.weight.view(torch.uint8), stored[f"{module_name}.weight"].view(torch.uint8))
            dequantized = layer.weight.float() * layer.weight_scale[:, None]
            torch.testing.assert_close(dequantized, reference[f"{module_name}.weight"], rtol=0, atol=0)


def test_online_fp8_quantizes_an_unquantized_checkpoint(tokenizer, tmp_path) -> None:
    """``quantization="fp8"``: each linear's weight per output channel through fp8, activations per token."""
    model = build_tiny_model("llama", vocab_size=len(tokenizer))
    model.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), tokenizer=tokenizer, quantization="fp8", block_size=4, num_kv_blocks=128, device="cpu")
    assert sum(isinstance(m, FP8Linear) for m in llm.llm_engine.model.modules()) == 7 * model.config.num_hidden_layers
    reference = copy.deepcopy(model)
    for name, module in reference.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            with torch.no_grad():  # per output channel: each row through fp8 like a token
                module.weight.copy_(fake_quantize_per_token(module.weight))
            module.register_forward_pre_hook(lambda _, args: (fake_quantize_per_token(args[0]),))
    prompts = ragged_prompts(4, seed=22)
    for prompt, ours in zip(prompts, greedy_outputs(llm, prompts)):
        assert ours == hf_greedy(reference, prompt, 12)


def _with_config(tmp_path: Path, change) -> Path:
    folder = tmp_path / "changed"
    shutil.copytree(FIXTURES / "w4a16_group128", folder)
    config = json.loads((folder / "config.json").read_text())
    change(config["quantization_config"])
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda qc: qc["config_groups"]["group_0"]["weights"].update(num_bits=8), "8-bit int"),
        (lambda qc: qc["config_groups"]["group_0"]["weights"].update(actorder="group"), "actorder none or 'static'"),
        (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "head"}), "kv_cache_scheme"),
        (lambda qc: qc["config_groups"].update(group_1=qc["config_groups"]["group_0"]), "exactly one scheme"),
        (lambda qc: qc.update(quant_method="marlin"), "quant_method='marlin'"),
        (lambda qc: qc["config_groups"]["group_0"].update(format="marlin-24"), "format 'marlin-24'"),
    ],
)
def test_schemes_we_do_not_run_fail_at_load_naming_them(change, message: str, tokenizer, tmp_path) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(_with_config(tmp_path, change)), tokenizer=tokenizer, num_kv_blocks=64, device="cpu")


def test_gptq_zero_points_of_zero_borrow_from_the_next_one() -> None:
    """v1 checkpoints store each packed word of zero points minus 0x11111111 (an int32 subtraction: a zero point of
    0 borrows from the nibble above it); every zero point, 0 and 15 included, comes back."""
    from paged_backend.kernels.awq_format import unpack
    from paged_backend.quantization.gptq import GPTQConfig

    zeros = torch.tensor([[0, 5, 3, 0, 9, 15, 0, 1], [15, 0, 0, 0, 8, 2, 0, 7]])  # [groups, out]
    word = sum(zeros[:, i].long() << (4 * i) for i in range(8))
    stored = ((word - 0x11111111) & 0xFFFFFFFF).to(torch.int64)
    stored = torch.where(stored >= 2**31, stored - 2**32, stored).to(torch.int32)[:, None]  # [groups, out / 8]
    qweight = torch.zeros(16 // 8, 8, dtype=torch.int32)  # 16 inputs, 8 outputs
    g_idx = torch.arange(16, dtype=torch.int32) // 8
    buffers = GPTQConfig(8, sym=False, desc_act=False).awq_buffers(qweight, stored, torch.ones(2, 8), g_idx)
    assert torch.equal(unpack(buffers["qzeros"]), zeros.int())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda qc: qc.update(bits=8), "bits=8"),
        (lambda qc: qc.update(checkpoint_format="gptq_v2"), "checkpoint_format='gptq_v2'"),
        (lambda qc: qc.update(group_size=16), "group_size=16"),
        (lambda qc: qc.update(lm_head=True), "lm_head=True"),
        (lambda qc: qc.update(desc_act=False), "g_idx reorders the input rows but quantization_config.desc_act"),
    ],
)
def test_gptq_settings_we_do_not_run_fail_at_load_naming_them(change, message: str, tokenizer, tmp_path) -> None:
    folder = tmp_path / "changed"
    shutil.copytree(FIXTURES / "gptq_asym_group32_desc_act", folder)
    config = json.loads((folder / "config.json").read_text())
    change(config["quantization_config"])
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), tokenizer=tokenizer, num_kv_blocks=64, device="cpu")


def test_gptq_zero_biases_of_linears_without_one_are_dropped(tokenizer, tmp_path) -> None:
    """AutoGPTQ writes a zero bias for every quantized linear: dropped where the model has none (a nonzero one
    fails naming it)."""
    from safetensors.torch import save_file

    folder = tmp_path / "biased"
    shutil.copytree(FIXTURES / "gptq_asym_group64", folder)
    stored = load_file(folder / "model.safetensors")
    key = "model.layers.0.self_attn.o_proj.bias"
    for value in (0.0, 0.5):
        save_file(stored | {key: torch.full((128,), value)}, str(folder / "model.safetensors"))
        if value:
            with pytest.raises(ValueError, match=f"{key} is not zero but the model's"):
                LLM(str(folder), tokenizer=tokenizer, num_kv_blocks=64, device="cpu")
        else:
            llm = LLM(str(folder), tokenizer=tokenizer, num_kv_blocks=64, device="cpu")
            assert llm.llm_engine.model.get_submodule(key.rsplit(".", 1)[0]).bias is None


def test_int4_without_the_package_names_the_extra(tokenizer, monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "compressed_tensors" else real(name, *a)
    )
    with pytest.raises(ImportError, match=r"paged-backend\[quant\]"):
        LLM(str(FIXTURES / "w4a16_group128"), tokenizer=tokenizer, num_kv_blocks=64, device="cpu")


def test_quantization_argument_must_match_the_checkpoint(tokenizer) -> None:
    with pytest.raises(ValueError, match="quantization='awq' does not match"):
        LLM(str(FIXTURES / "w4a16_group128"), tokenizer=tokenizer, quantization="awq", num_kv_blocks=64, device="cpu")
    with pytest.raises(ValueError, match="quantization='compressed-tensors' does not match .* quant_method='gptq'"):
        LLM(str(FIXTURES / "gptq_asym_group64"), tokenizer=tokenizer, quantization="compressed-tensors", device="cpu")
    for name, method in (("gptq_asym_group64", "gptq"), ("fp8_static_kv", "compressed-tensors")):  # named: the same
        named = LLM(str(FIXTURES / name), tokenizer=tokenizer, quantization=method, num_kv_blocks=64, device="cpu")
        plain = LLM(str(FIXTURES / name), tokenizer=tokenizer, num_kv_blocks=64, device="cpu")
        prompts = ragged_prompts(2, seed=5)
        assert greedy_outputs(named, prompts) == greedy_outputs(plain, prompts)


def fast_accumulation_atol(rows: int, twin: torch.Tensor) -> float:
    """The absolute tolerance of an fp8 product of ``rows`` rows against its float32 twin: 0.02 where the split-K
    kernel adds in float32 (up to ``KERNEL_MAX_ROWS``), a tenth of the outputs' spread above, where
    ``torch._scaled_mm``'s fast accumulation keeps fewer bits (single outputs near 0 fell outside 0.02 at down's K
    on an H100)."""
    from paged_backend.quantization.fp8 import KERNEL_MAX_ROWS

    return 2e-2 if rows <= KERNEL_MAX_ROWS else max(2e-2, 0.1 * twin.std().item())


@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)), reason="needs fp8 matrix units"
)
def test_fp8_gemm_on_the_gpu_equals_its_torch_twin() -> None:
    """The fp8 products (the split-K kernel up to ``KERNEL_MAX_ROWS`` rows, torch._scaled_mm above) with per-token
    (or one static) and per-channel scales against the float32 twin, bf16 activations."""
    from paged_backend.kernels.fp8_quant import quantize_per_row_triton
    from paged_backend.quantization.fp8 import fp8_linear, fp8_linear_torch, fp8_scaled_mm, quantize_per_row

    torch.manual_seed(0)
    for m, k, n in [(1, 4096, 1024), (7, 256, 512), (256, 4096, 14336), (256, 14336, 4096)]:  # the last: down's K
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        weight, scale = quantize_per_row(torch.randn(n, k, device="cuda") * 0.02)
        ours = fp8_scaled_mm(*quantize_per_row_triton(x), weight, scale[:, 0], x.dtype).float()
        twin = fp8_linear_torch(x, weight, scale[:, 0], True).float()
        assert (ours - twin).norm() < 1e-2 * twin.norm()  # a wrong scale or row is off by far more
        torch.testing.assert_close(ours, twin, rtol=2e-2, atol=fast_accumulation_atol(m, twin))
        static = x.abs().amax().float().reshape(1) / 300  # a static input scale: some values saturate
        ours = fp8_linear(x, weight, scale[:, 0], False, static).float()  # at every row count: quantized
        twin = fp8_linear_torch(x, weight, scale[:, 0], False, static).float()
        assert (ours - twin).norm() < 1e-2 * twin.norm()
        torch.testing.assert_close(ours, twin, rtol=2e-2, atol=fast_accumulation_atol(m, twin))
    layer = FP8Linear.from_linear(torch.nn.Linear(64, 32))  # quantized on the CPU (as TP ranks do), then moved
    x = torch.randn(8, 64, dtype=torch.bfloat16)  # more rows than the fp8 GEMV takes
    on_gpu = layer.cuda()(x.cuda()).cpu().float()  # the split-K kernel (which product runs where: the test below)
    torch.testing.assert_close(on_gpu, layer.cpu()(x).float(), rtol=2e-2, atol=2e-2)
    from paged_backend.kernels.fp8_gemv import fp8_gemv_torch

    layer = layer.cuda()  # one row: the fp8 GEMV, x unquantized (nearer that twin than the quantized one)
    lone = layer(x[:1].cuda()).float()
    unquantized = fp8_gemv_torch(x[:1].cuda(), layer.weight, layer.weight_scale).float() + layer.bias.float()
    quantized = fp8_linear_torch(x[:1].cuda(), layer.weight, layer.weight_scale, True).float() + layer.bias.float()
    torch.testing.assert_close(lone, unquantized, rtol=2e-2, atol=2e-2)
    assert (lone - unquantized).abs().max() < (lone - quantized).abs().max()


@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)), reason="needs fp8 matrix units"
)
@pytest.mark.parametrize(
    ("m", "dtype", "runs"),
    [
        (2, torch.bfloat16, "kernel"),
        (64, torch.float16, "kernel"),  # the kernel writes either 16-bit dtype
        (65, torch.bfloat16, "_scaled_mm"),
        (65, torch.float16, "twin"),  # torch._scaled_mm's row-wise scales write bfloat16 only
    ],
)
def test_fp8_product_runs_the_kernel_up_to_its_rows(m: int, dtype: torch.dtype, runs: str, monkeypatch) -> None:
    """Up to ``KERNEL_MAX_ROWS`` rows the split-K kernel (its scale blocks 1 x K) multiplies per-token and
    per-channel scales, above them torch._scaled_mm: each equals the float32 twin within bf16 rounding."""
    from paged_backend.kernels.fp8_quant import quantize_per_row_triton
    from paged_backend.quantization import fp8

    calls: list[str] = []
    kernel, scaled_mm = fp8.fp8_block_mm_triton, torch._scaled_mm
    monkeypatch.setattr(fp8, "fp8_block_mm_triton", lambda *a: calls.append("kernel") or kernel(*a))
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **kw: calls.append("_scaled_mm") or scaled_mm(*a, **kw))
    torch.manual_seed(m)
    x = torch.randn(m, 4096, device="cuda", dtype=dtype)
    weight, scale = fp8.quantize_per_row(torch.randn(1024, 4096, device="cuda") * 0.02)
    out = fp8.fp8_scaled_mm(*quantize_per_row_triton(x), weight, scale[:, 0], dtype)
    assert calls == ([] if runs == "twin" else [runs]) and out.dtype == dtype
    twin = fp8.fp8_linear_torch(x, weight, scale[:, 0], True)
    torch.testing.assert_close(out.float(), twin.float(), rtol=2e-2, atol=2e-2)


def test_our_awq_writer_matches_autoawqs_format(tokenizer, tmp_path) -> None:
    """What ``awq_quantize.quantize`` writes for the fixture's architecture has AutoAWQ's tensor names, packed
    dtypes and shapes, and its ``quantization_config`` (transformers reads AWQ checkpoints by these)."""
    from safetensors import safe_open

    from paged_backend.demo_checkpoint import CORPUS
    from paged_backend.quantization.awq_quantize import quantize

    theirs = FIXTURES / "autoawq_group128"
    config = json.loads((theirs / "config.json").read_text())
    shape = {k: config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")}
    model = build_tiny_model("llama", vocab_size=config["vocab_size"], **shape)
    quantize(model, tokenizer, str(tmp_path), calib_texts=CORPUS, group_size=128, seq_len=64)
    ours_config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert ours_config == config["quantization_config"]
    with safe_open(theirs / "model.safetensors", "pt") as a, safe_open(tmp_path / "model.safetensors", "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for key in a.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
            if key.rsplit(".", 1)[1] in ("qweight", "qzeros", "scales"):
                ta, tb = a.get_tensor(key), b.get_tensor(key)
                assert (ta.dtype, ta.shape) == (tb.dtype, tb.shape), key
