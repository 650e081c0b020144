"""Every user-facing argument is validated with a message naming the field."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from paged_backend import LLM, LoRARequest, SamplingParams
from paged_backend.config import EngineConfig
from paged_backend.model_loader import looks_local
from tests.conftest import assert_idle, save_tiny_checkpoint, tiny_model


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.1}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63 - 1, "n": 2, "temperature": 1.0}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"skip_special_tokens": 1}, "skip_special_tokens"),
        ({"include_stop_str_in_output": None}, "include_stop_str_in_output"),
        ({"best_of": 2, "temperature": 0.0}, "best_of"),
    ],
)
def test_sampling_params_errors_name_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=rf"^{field}"):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_vllm_forms() -> None:
    params = SamplingParams(n=2, stop="###", top_k=0)
    assert params.best_of == 2 and params.stop == ["###"] and not params.uses_top_k
    assert SamplingParams(n=3, temperature=0).n == 3  # n > 1 greedy is allowed (identical samples)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size": 12}, "block_size"),
        ({"block_size": 0}, "block_size"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"swap_space": -1}, "swap_space"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"dtype": "int8"}, "dtype"),
        ({"quantization": "bitsandbytes"}, "quantization"),
        ({"device": "tpu"}, "device"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"num_kv_blocks": 0}, "num_kv_blocks"),
        ({"kv_cache_memory_gib": 0}, "kv_cache_memory_gib"),
        ({"enable_prefix_caching": "on"}, "enable_prefix_caching"),
        ({"max_loras": 0}, "max_loras"),
        ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras"),
        ({"seed": -5}, "seed"),
        ({"enforce_eager": 1}, "enforce_eager"),
        ({"load_format": "pt"}, "load_format"),
        ({"skip_tokenizer_init": 1}, "skip_tokenizer_init"),
    ],
)
def test_engine_config_errors_name_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=rf"^{field}"):
        EngineConfig.from_kwargs("m", **kwargs)


def test_unknown_kwarg_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="gpu_mem_util"):
        LLM(tiny_model("llama"), gpu_mem_util=0.5)


def test_request_errors_leave_the_engine_clean(tokenizer) -> None:
    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, num_kv_blocks=64, max_model_len=64)
    good = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([good, {"prompt_token_ids": list(range(3, 70))}], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([good, {"prompt_token_ids": [5, 100000]}], use_tqdm=False)
    with pytest.raises(ValueError, match="at least one token"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([good, good], [SamplingParams(), SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(TypeError, match=r"prompts\[1\] must be a str or a dict"):
        llm.generate([good, 12], use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(good, SamplingParams(stop_token_ids=[10**9]), use_tqdm=False)
    with pytest.raises(ValueError, match="lora_request needs LLM\\(..., enable_lora=True\\)"):
        llm.generate(good, lora_request=LoRARequest("a", 1, "/tmp/a"), use_tqdm=False)
    assert_idle(llm)
    assert llm.llm_engine.requests == {}
    (out,) = llm.generate(good, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def test_stop_strings_need_a_tokenizer() -> None:
    llm = LLM(tiny_model("llama"), block_size=4, num_kv_blocks=16, max_model_len=16)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(stop=["a"]), use_tqdm=False)
    # a prompt of exactly max_model_len tokens is accepted and ends after one token
    (out,) = llm.generate({"prompt_token_ids": list(range(3, 19))}, SamplingParams(max_tokens=5), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    assert_idle(llm)


def test_dummy_weights_need_a_path() -> None:
    with pytest.raises(ValueError, match="load_format='dummy' needs model as a path"):
        LLM(tiny_model("llama"), load_format="dummy")


def test_cache_too_small_for_max_model_len_fails_with_numbers() -> None:
    with pytest.raises(ValueError, match=r"4 blocks .* max_model_len=512 needs 32 blocks"):
        LLM(tiny_model("llama"), block_size=16, num_kv_blocks=4)


def test_unsupported_architecture_is_named() -> None:
    from transformers import BloomConfig, BloomForCausalLM

    model = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="BloomForCausalLM is not supported"):
        LLM(model)


def test_lora_request_import_paths() -> None:
    from paged_backend.lora.request import LoRARequest as FromVllmPath

    assert FromVllmPath is LoRARequest
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/tmp/a")


def test_import_is_light() -> None:
    code = "import sys, paged_backend; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("prompts", "error", "message"),
    [
        (None, TypeError, "prompts must be a str, a dict .* got NoneType"),
        (123, TypeError, "prompts must be .* got int"),
        (b"hello", TypeError, "prompts must be .* got bytes"),
        ([b"hello"], TypeError, r"prompts\[0\] must be .* got bytes"),
        ({"prompt": 5}, TypeError, "prompt must be a str .* got int"),
        ({"prompt_token_ids": "abc"}, TypeError, "prompt_token_ids must be a list of integers, got str"),
        ({"prompt_token_ids": [5, 6.0]}, TypeError, "prompt_token_ids must be a list of integers, got an element 6.0"),
        ({"prompt_token_ids": [True, 5]}, TypeError, "prompt_token_ids must be a list of integers"),
        ({"x": 1}, ValueError, "a prompt dict must have a 'prompt' or a 'prompt_token_ids' key"),
        ("caf\udce9", ValueError, "prompt is not valid Unicode: a lone surrogate '\\\\udce9' at character 3"),
    ],
)
def test_bad_prompts_are_named(tokenizer, prompts, error, message) -> None:
    llm = _llm(tokenizer)
    with pytest.raises(error, match=message):
        llm.generate(prompts, use_tqdm=False)
    assert_idle(llm)


def test_surrogates_in_chat_messages_are_named(tokenizer) -> None:
    with pytest.raises(ValueError, match="messages is not valid Unicode"):
        _llm(tokenizer).chat([{"role": "user", "content": "hi \ud800"}], use_tqdm=False)


def test_numpy_and_tensor_token_ids_are_accepted(tokenizer) -> None:
    import numpy as np

    llm = _llm(tokenizer)
    params = SamplingParams(temperature=0, max_tokens=4)
    ids = [5, 6, 7, 8]
    forms = [ids, np.array(ids), [np.int64(t) for t in ids], torch.tensor(ids), tuple(ids)]
    outs = llm.generate([{"prompt_token_ids": form} for form in forms], params, use_tqdm=False)
    assert all(out.prompt_token_ids == ids for out in outs)
    assert len({tuple(out.outputs[0].token_ids) for out in outs}) == 1
    with pytest.raises(TypeError, match="prompt_token_ids must be a list of integers, got ndarray"):
        llm.generate({"prompt_token_ids": np.array([ids])}, use_tqdm=False)


_SHARED: dict[str, LLM] = {}


def _llm(tokenizer) -> LLM:
    if "llm" not in _SHARED:
        _SHARED["llm"] = LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, num_kv_blocks=64, max_model_len=64)
    return _SHARED["llm"]


def test_a_missing_local_path_is_named_before_any_hub_lookup(tmp_path) -> None:
    for missing in (str(tmp_path / "nope"), "./no/such/model", "~/no-such-model-here", "a/b/c"):
        assert looks_local(missing)
        with pytest.raises(FileNotFoundError, match="no such file or folder"):
            LLM(missing)
    for hub_id in ("gpt2", "meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-0.5B"):
        assert not looks_local(hub_id)


def _no_weight_loading(monkeypatch) -> None:
    import paged_backend.engine.llm_engine as llm_engine

    def no_loading(*args, **kwargs):
        raise AssertionError("the weights were loaded before config.json was checked")

    monkeypatch.setattr(llm_engine, "make_executor", no_loading)


def test_max_model_len_is_checked_before_the_weights_load(tmp_path, monkeypatch) -> None:
    save_tiny_checkpoint(tmp_path)
    _no_weight_loading(monkeypatch)
    with pytest.raises(ValueError, match="max_model_len must be <= the model's maximum length"):
        LLM(str(tmp_path), max_model_len=10**6)


def test_an_unsupported_architecture_is_named_before_the_weights_load(tmp_path, monkeypatch) -> None:
    from transformers import BloomConfig, BloomForCausalLM

    BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2)).save_pretrained(tmp_path)
    _no_weight_loading(monkeypatch)
    with pytest.raises(ValueError, match="BloomForCausalLM is not supported"):
        LLM(str(tmp_path), skip_tokenizer_init=True)
