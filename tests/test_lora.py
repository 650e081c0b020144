"""Multi-LoRA: a batch mixing the base model and three PEFT adapters with two device LoRA indices gives, request by
request, HF ``generate`` on that adapter's PEFT-merged model; adapters rotate through the indices, leave and come
back to the CPU cache; bad adapters fail their own request only."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from paged_backend import LLM, LoRARequest, SamplingParams
from tests.conftest import assert_idle, capturing_backend, hf_greedy, ragged_prompts, tp2
from tests.fixtures.tiny_models import build_tiny_model

peft = pytest.importorskip("peft")

ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4, max_model_len=64)
ADAPTERS = {  # name: (rank, alpha, rsLoRA, target modules)
    "attn": (4, 8, False, ["q_proj", "v_proj"]),
    "mlp": (8, 16, False, ["gate_proj", "up_proj", "down_proj"]),
    "all": (2, 4, True, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}


def make_adapter(base, folder, rank: int, alpha: int, rslora: bool, targets: list[str], seed: int):
    """Save a PEFT adapter with random (non-zero) A and B; return the PEFT-merged model it stands for."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, init_lora_weights=False, lora_dropout=0.0
    )
    model = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():  # larger than PEFT's own random init, so each adapter changes greedy outputs
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory, tokenizer):
    base = build_tiny_model("llama", vocab_size=len(tokenizer))
    base_dir = tmp_path_factory.mktemp("base")
    base.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    adapters = {}
    for i, (name, spec) in enumerate(ADAPTERS.items()):
        folder = tmp_path_factory.mktemp(f"lora-{name}")
        merged = make_adapter(base, folder, *spec, seed=i)
        adapters[name] = (LoRARequest(name, i + 1, str(folder)), merged)
    return str(base_dir), base, adapters


NAMES = [None, "attn", "mlp", "all"]


def generate_mixed(llm: LLM, lora_setup, prompts: list[list[int]], max_tokens: int, references=None) -> dict:
    """Every prompt under the base model and under each adapter, in one batch (the same prompt under different
    adapters shares no cache); each output must equal HF generate on the base or that adapter's merged model
    (``references``: adapter name, None for the base, -> the model to compare with). Returns the token ids,
    grouped by adapter name."""
    _, base, adapters = lora_setup
    references = references or {None: base, **{n: merged for n, (_, merged) in adapters.items()}}
    batch = [(p, n) for n in NAMES for p in prompts]
    loras = [None if n is None else adapters[n][0] for _, n in batch]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in batch], params, lora_request=loras, use_tqdm=False)
    by_name: dict = {n: [] for n in NAMES}
    for (prompt, name), out in zip(batch, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(references[name], prompt, max_tokens), name
        by_name[name].append(tuple(out.outputs[0].token_ids))
    return by_name


def test_mixed_batch_with_rotating_lora_indices_equals_each_merged_model(lora_setup) -> None:
    llm = LLM(lora_setup[0], num_kv_blocks=64, **ENGINE)
    manager = llm.llm_engine.lora_manager
    distinct_per_step: list[int] = []
    set_step = manager.set_step

    def recording(step_adapters, num_tokens):
        distinct_per_step.append({a.name for a in step_adapters if a is not None})
        set_step(step_adapters, num_tokens)

    manager.set_step = recording
    outputs_by_adapter = generate_mixed(llm, lora_setup, ragged_prompts(4)[:3], 12)
    assert max(len(names) for names in distinct_per_step) == 2  # two LoRA indices, used together, never more
    first_both = next(i for i, names in enumerate(distinct_per_step) if names == {"attn", "mlp"})
    first_all = next(i for i, names in enumerate(distinct_per_step) if "all" in names)
    assert first_all > first_both  # the third adapter waited for a LoRA index, then took one of theirs
    assert len({tuple(v) for v in outputs_by_adapter.values()}) == 4  # each adapter changes the output
    assert_idle(llm)


@tp2
def test_tensor_parallel_adapters_are_cut_like_their_layers(lora_setup) -> None:
    """TP=2 (two processes, gloo): each rank holds its slice of every A or B, rowwise deltas are summed with the
    layer's output, and the worker places adapters exactly as rank 0 does, as two LoRA indices rotate through three
    adapters."""
    llm = LLM(lora_setup[0], tensor_parallel_size=2, num_kv_blocks=64, **ENGINE)
    try:
        generate_mixed(llm, lora_setup, ragged_prompts(4)[:2], 10)
        manager = llm.llm_engine.lora_manager
        assert manager.num_activations >= 3  # the third adapter took an index another had held
        shard = manager.shards["model.layers.0.self_attn.o_proj"]
        assert shard.style == "rowwise" and manager.lora_a["model.layers.0.self_attn.o_proj"].shape[2] == shard.stop
        assert_idle(llm)
    finally:
        llm.llm_engine.shutdown()


def test_lora_layers_compile_into_one_graph(lora_setup) -> None:
    """The LoRA hooks trace into the compiled decoder layer (the delta is one opaque op reading buffers that stay
    in place), with no graph break and no recompile as adapters and batch shapes change; outputs stay exact.
    Dynamo only (a counting backend), so it runs here; on a GPU the same graph goes to inductor, then into CUDA
    graphs."""
    llm = LLM(lora_setup[0], num_kv_blocks=64, **ENGINE)
    graphs: list = []
    runner = llm.llm_engine.executor.model_runner
    runner.compile(capturing_backend(graphs))
    assert runner.regions is not None and runner.regions.num_graphs == len(graphs) == 1
    generate_mixed(llm, lora_setup, ragged_prompts(4)[:2], 8)
    assert len(graphs) == 1, "a step recompiled the layer"
    assert_idle(llm)


def test_adapters_on_an_awq_model(lora_setup, tokenizer, tmp_path) -> None:
    """On an AWQ checkpoint each adapter adds its delta to the quantized layers' output: greedy output equals HF
    generate on the dequantized model with the adapter merged in."""
    from paged_backend.quantization.awq_quantize import write_checkpoint
    from tests.fixtures.awq import dequantized_copy
    from tests.test_awq import GROUP

    path, base, adapters = lora_setup
    folder = tmp_path / "awq"
    write_checkpoint(base, str(folder), GROUP, tokenizer)
    dequantized = dequantized_copy(base, folder)
    references = {None: dequantized}
    for name, (request, _) in adapters.items():
        merged = peft.PeftModel.from_pretrained(copy.deepcopy(dequantized), request.lora_path)
        references[name] = merged.merge_and_unload().eval()
    llm = LLM(str(folder), quantization="awq", dtype="float32", num_kv_blocks=64, **ENGINE)
    generate_mixed(llm, lora_setup, ragged_prompts(4)[:2], 8, references)
    assert_idle(llm)


def test_adapters_leave_the_cpu_cache_and_come_back(lora_setup) -> None:
    path, _, adapters = lora_setup
    llm = LLM(path, num_kv_blocks=64, max_cpu_loras=2, **ENGINE)
    prompt = {"prompt_token_ids": ragged_prompts(4)[0]}
    params = SamplingParams(temperature=0, max_tokens=6)
    first = {n: llm.generate(prompt, params, lora_request=adapters[n][0], use_tqdm=False) for n in adapters}
    assert llm.llm_engine.lora_manager.num_loads == 3 and len(llm.llm_engine.lora_manager.cpu_cache) == 2
    again = llm.generate(prompt, params, lora_request=adapters["attn"][0], use_tqdm=False)  # evicted: read again
    assert llm.llm_engine.lora_manager.num_loads == 4
    assert again[0].outputs[0].token_ids == first["attn"][0].outputs[0].token_ids


def _write_adapter(folder, config: dict, tensors: dict) -> str:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


def test_bad_adapters_fail_their_request_only(lora_setup, tmp_path) -> None:
    path, _, adapters = lora_setup
    llm = LLM(path, num_kv_blocks=64, **ENGINE)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    good_a, good_b = torch.randn(4, 64), torch.randn(64, 4)
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    cases = {
        "missing": (str(tmp_path / "nowhere"), "missing adapter_config.json"),
        "rank": (
            _write_adapter(
                tmp_path / "rank",
                {**config, "r": 16},
                {key.format("A"): torch.randn(16, 64), key.format("B"): torch.randn(64, 16)},
            ),
            "rank 16 is above max_lora_rank=8",
        ),
        "target": (
            _write_adapter(
                tmp_path / "target",
                config,
                {
                    key.format("A").replace("q_proj", "x_proj"): good_a,
                    key.format("B").replace("q_proj", "x_proj"): good_b,
                },
            ),
            r"targets model\.layers\.0\.self_attn\.x_proj, which the model has no LoRA-able layer",
        ),
        "shape": (
            _write_adapter(
                tmp_path / "shape", config, {key.format("A"): torch.randn(4, 32), key.format("B"): torch.randn(32, 4)}
            ),
            r"lora_A \(4, 32\) and lora_B \(32, 4\) do not fit .* trained for another base model",
        ),
    }
    prompt = {"prompt_token_ids": ragged_prompts(4)[0]}
    for i, (name, (folder, reason)) in enumerate(cases.items()):
        with pytest.raises(ValueError, match=f"LoRA adapter '{name}' .*{reason}"):
            llm.generate([prompt, prompt], lora_request=[None, LoRARequest(name, 10 + i, folder)], use_tqdm=False)
    assert_idle(llm)
    (out,) = llm.generate(prompt, SamplingParams(max_tokens=3), lora_request=adapters["mlp"][0], use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def test_lora_request_lists_must_align(lora_setup) -> None:
    path, _, adapters = lora_setup
    llm = LLM(path, num_kv_blocks=64, **ENGINE)
    with pytest.raises(
        ValueError, match=r"lora_request must be one LoRARequest \(None: the base model\) or a list of 2"
    ):
        llm.generate(["a", "b"], lora_request=[adapters["attn"][0]], use_tqdm=False)


def test_server_serves_each_adapter_as_a_model(lora_setup) -> None:
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from paged_backend.entrypoints.openai.cli_args import ServerArgs
    from tests.test_server import serving

    path, _, adapters = lora_setup
    folder = adapters["mlp"][0].lora_path
    llm = LLM(path, num_kv_blocks=64, **ENGINE)
    with serving(llm, ServerArgs(model=path, served_model_name="base", lora_modules={"mlp": folder})) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["base", "mlp"]
        params = SamplingParams(temperature=0, max_tokens=8)
        for model, lora in (("base", None), ("mlp", LoRARequest("mlp", 1, folder))):
            got = client.completions.create(model=model, prompt="The paged cache", max_tokens=8, temperature=0)
            (expected,) = llm.generate("The paged cache", params, lora_request=lora, use_tqdm=False)
            assert got.model == model and got.choices[0].text == expected.outputs[0].text


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens", [7, 70])
def test_triton_kernels_equal_their_twin(dtype: torch.dtype, num_tokens: int) -> None:
    """Tiled shrink + expand against the grouped torch twin: tokens of three LoRA indices and of none. With 70
    tokens (two blocks of 64) each block lacks an index the other uses, so the kernels' skipping of absent indices
    is exercised."""
    from paged_backend.kernels.lora import lora_delta_torch, lora_delta_triton

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # else Triton's interpreter
    torch.manual_seed(0)
    x = torch.randn(num_tokens, 72, dtype=dtype, device=device)
    a = torch.randn(3, 8, 72, dtype=dtype, device=device) * 0.1  # rank 8, zero-padded indices are fine too
    b = torch.randn(3, 80, 8, dtype=dtype, device=device) * 0.1
    pattern = [-1, 0, 1, 0, 2, -1, 1] if num_tokens == 7 else [-1, 0, 1, 0] * 16 + [2, -1, 2, 2, -1, 2]
    indices = torch.tensor(pattern, device=device)
    expected = lora_delta_torch(x.float(), a.float(), b.float(), indices)
    got = lora_delta_triton(x, a, b, indices)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)
    assert torch.equal(got[0], torch.zeros_like(got[0]))  # no adapter: no delta
    from paged_backend.kernels.lora import lora_delta_op

    torch.library.opcheck(lora_delta_op, (x, a, b, indices))  # the op compiled layers call: schema, fake, dispatch
    with pytest.raises(ValueError, match=f"token_lora_indices holds 6 entries for {num_tokens} tokens"):
        lora_delta_op(x, a, b, indices[:6])


def test_an_id_names_one_adapter_and_admitted_adapters_need_no_disk(lora_setup, tmp_path) -> None:
    import shutil

    path, _, adapters = lora_setup
    llm = LLM(path, num_kv_blocks=64, max_cpu_loras=2, **ENGINE)
    prompt = {"prompt_token_ids": ragged_prompts(4)[0]}
    attn = adapters["attn"][0]
    llm.generate(prompt, SamplingParams(max_tokens=2), lora_request=attn, use_tqdm=False)
    impostor = LoRARequest("other", attn.lora_int_id, adapters["mlp"][0].lora_path)
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter 'attn'.*each adapter needs its own id"):
        llm.generate(prompt, lora_request=impostor, use_tqdm=False)
    # Three adapters admitted with room for two in the CPU cache: the first is evicted before it runs, and its
    # folder is gone by then. The request holds its adapter, so nothing is read at step time.
    folder = tmp_path / "copy"
    shutil.copytree(adapters["mlp"][0].lora_path, folder)
    copy_request = LoRARequest("mlp-copy", 9, str(folder))
    engine = llm.llm_engine
    for i, lora in enumerate([copy_request, adapters["attn"][0], adapters["all"][0]]):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=4), lora_request=lora)
    assert 9 not in engine.lora_manager.cpu_cache
    shutil.rmtree(folder)
    while engine.has_unfinished_requests():
        engine.step()
    assert_idle(llm)


def test_shutdown_takes_the_hooks_off_the_users_model(tokenizer) -> None:
    model = build_tiny_model("llama", vocab_size=len(tokenizer))
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=64, **ENGINE)
    assert model.model.layers[0].self_attn.q_proj._forward_hooks
    buffers = {name for name, _ in model.named_buffers()}
    llm.llm_engine.shutdown()
    assert not model.model.layers[0].self_attn.q_proj._forward_hooks
    assert {name for name, _ in model.named_buffers()} < buffers  # the LoRA buffers left with the hooks
    assert not any("lora" in name for name, _ in model.named_buffers())
    plain = LLM(model, tokenizer=tokenizer, num_kv_blocks=64, block_size=4, max_model_len=64)
    prompt = ragged_prompts(4)[0]
    (out,) = plain.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert list(out.outputs[0].token_ids) == hf_greedy(model, prompt, 6)


def test_adapters_in_rounds_queued_behind_rounds(lora_setup) -> None:
    """Async scheduling with adapters: rounds queued behind rounds keep each row's adapter (every output equals
    HF on its merged model), and rounds were queued."""
    from tests.test_async_scheduling import count_continuations

    llm = LLM(lora_setup[0], num_kv_blocks=128, async_scheduling=True, **{**ENGINE, "max_loras": 4})
    continued = count_continuations(llm)
    generate_mixed(llm, lora_setup, ragged_prompts(4)[:2], 20)
    assert continued[0] > 0
    assert_idle(llm)
