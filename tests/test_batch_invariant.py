"""``batch_invariant=True``: a request's tokens and logprobs are the same alone and inside batches of other
requests, with its prompt chunked, served from the prefix cache or preempted — to the last bit."""

from __future__ import annotations

import random

import pytest
import torch

from paged_backend import LLM, SamplingParams
from tests.conftest import assert_idle, tiny_model
from tests.fixtures.tiny_models import build_tiny_model

RNG = random.Random(0)
TARGET = [RNG.randrange(1, 500) for _ in range(37)]
OTHERS = [[RNG.randrange(1, 500) for _ in range(RNG.randint(5, 60))] for _ in range(64)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True, logprobs=3)


def target_output(
    arch: str, others: list[list[int]], params: SamplingParams, target: list[int] = TARGET, **engine_kwargs: object
) -> list:
    """The target request's tokens and its logprob entries, run first beside ``others``."""
    llm = LLM(tiny_model(arch), batch_invariant=True, block_size=4, max_model_len=128, **engine_kwargs)
    prompts = [{"prompt_token_ids": target}] + [{"prompt_token_ids": p} for p in others]
    out = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    assert_idle(llm)
    return [list(out.token_ids), [{t: (e.logprob, e.rank) for t, e in entry.items()} for entry in out.logprobs]]


def test_alone_and_in_any_batch_alike() -> None:
    alone = target_output("llama", [], GREEDY)
    assert target_output("llama", OTHERS[:1], GREEDY) == alone
    assert target_output("llama", OTHERS[:7], GREEDY, num_scheduler_steps=1) == alone
    assert target_output("llama", OTHERS, GREEDY) == alone  # 64 others
    assert target_output("llama", OTHERS[:16], GREEDY, max_num_batched_tokens=16, max_num_seqs=8) == alone  # chunked
    assert target_output("llama", OTHERS[:8], GREEDY, num_kv_blocks=40, preemption_mode="recompute") == alone


@pytest.mark.parametrize("arch,params", [("gpt2", GREEDY), ("llama", SAMPLED)], ids=["gpt2", "seeded"])
def test_other_layers_and_seeded_sampling(arch: str, params: SamplingParams) -> None:
    """GPT-2's Conv1D layers (torch.addmm) and seeded sampling keep the guarantee."""
    alone = target_output(arch, [], params)
    assert target_output(arch, OTHERS[:12], params, max_num_batched_tokens=16, max_num_seqs=8) == alone


def test_prefix_cache_hits_change_nothing() -> None:
    llm = LLM(tiny_model("llama"), batch_invariant=True, block_size=4, max_model_len=128)
    prompts = [{"prompt_token_ids": TARGET}] + [{"prompt_token_ids": p} for p in OTHERS[:8]]
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    cached = llm.stats()["num_prompt_tokens_cached"]
    again = llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # its prompt's blocks come from the cache
    assert llm.stats()["num_prompt_tokens_cached"] > cached
    ours, theirs = first[0].outputs[0], again[0].outputs[0]
    assert ours.token_ids == theirs.token_ids
    assert [{t: e.logprob for t, e in d.items()} for d in ours.logprobs] == [
        {t: e.logprob for t, e in d.items()} for d in theirs.logprobs
    ]


def test_greedy_still_equals_hf() -> None:
    import torch

    model = tiny_model("llama")
    llm = LLM(model, batch_invariant=True, block_size=4, max_model_len=128)
    (out,) = llm.generate({"prompt_token_ids": TARGET}, GREEDY, use_tqdm=False)
    with torch.no_grad():
        hf = model.generate(torch.tensor([TARGET]), max_new_tokens=16, do_sample=False, eos_token_id=None)
    assert list(out.outputs[0].token_ids) == hf[0, len(TARGET) :].tolist()


def test_what_it_cannot_run_is_refused() -> None:
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="batch_invariant runs unquantized linear layers"):
        LLM(model, batch_invariant=True, quantization="awq")
    with pytest.raises(ValueError, match="batch_invariant needs enable_lora=False"):
        LLM(model, batch_invariant=True, enable_lora=True)
    # a token's experts' outputs are gathered and summed across the batch: refused (it was not invariant)
    with pytest.raises(ValueError, match="mixture-of-experts models .num_local_experts > 1."):
        LLM(tiny_model("mixtral"), batch_invariant=True)
    with pytest.raises(ValueError, match="calculate_kv_scales=False"):
        LLM(model, batch_invariant=True, kv_cache_dtype="fp8", calculate_kv_scales=True)


def test_what_it_cannot_make_invariant_is_refused() -> None:
    """Rotary frequencies set by the batch's longest position; on a GPU, a vocabulary whose fp32 rows are not
    16-byte aligned (checked without one: only the device's type is read)."""
    import torch
    from transformers import LlamaConfig

    from paged_backend.worker.batch_invariant import check_batch_invariant_supported

    model = torch.nn.Module()
    model.config = LlamaConfig(vocab_size=512, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type='dynamic'"):
        check_batch_invariant_supported(model, torch.device("cpu"))
    model.config = LlamaConfig(vocab_size=50257)
    check_batch_invariant_supported(model, torch.device("cpu"))
    with pytest.raises(ValueError, match="divisible by 4, got 50257"):
        check_batch_invariant_supported(model, torch.device("cuda"))


def test_a_greedy_rows_numbers_whatever_path_its_batch_takes() -> None:
    """A greedy request without logprobs takes the greedy fast path alone and the general one beside a seeded
    sampled request: its tokens and cumulative logprob are the same either way."""
    llm = LLM(tiny_model("llama"), batch_invariant=True, block_size=4, max_model_len=128)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": TARGET}, plain, use_tqdm=False)[0].outputs[0]
    llm.reset_prefix_cache()
    prompts = [{"prompt_token_ids": TARGET}, {"prompt_token_ids": OTHERS[0]}]
    mixed = llm.generate(prompts, [plain, SAMPLED], use_tqdm=False)[0].outputs[0]
    assert alone.token_ids == mixed.token_ids
    assert alone.cumulative_logprob == mixed.cumulative_logprob


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_trainer_logprobs_equal_the_sampled_ones(arch: str, dtype: torch.dtype) -> None:
    """RL parity: the sampled tokens' logprobs (``logprobs=0``) against the trainer's forward over the finished
    sequences — close on the default engine beside a plain HF forward, bit-equal with ``batch_invariant=True``
    and the model's forward under ``batch_invariant_forward`` (with autograd on: a trainer's forward), in the
    model's dtype (fp32, bf16)."""
    from paged_backend.worker.trainer_forward import batch_invariant_forward

    model = tiny_model(arch) if dtype == torch.float32 else build_tiny_model(arch, vocab_size=512).to(dtype)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, logprobs=0)
    prompts = [TARGET, OTHERS[0], OTHERS[1]]

    def trainer_logprobs(prompt: list[int], tokens: list[int], exact: bool) -> list[float]:
        ids = torch.tensor([prompt + tokens])
        with batch_invariant_forward(model) if exact else torch.enable_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        assert logits.requires_grad  # the trainer's own forward, not an inference-mode copy
        return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()

    for exact in (False, True):
        llm = LLM(model, batch_invariant=exact, block_size=4, max_model_len=128)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            tokens = list(out.outputs[0].token_ids)
            sampled = [entry[t].logprob for entry, t in zip(out.outputs[0].logprobs, tokens)]
            theirs = trainer_logprobs(prompt, tokens, exact)
            if exact:
                assert sampled == theirs
            else:
                assert max(abs(a - b) for a, b in zip(sampled, theirs)) < (1e-4 if dtype == torch.float32 else 0.1)


def test_blocks_of_rows_compute_what_the_ops_do() -> None:
    """The GPU's fixed blocks of rows (here 4, on the CPU): the same values as the ops themselves, any row count,
    and the norms' forms of a last-dimension reduction (anything else is left alone)."""
    import torch
    import torch.nn.functional as F

    from paged_backend.worker.batch_invariant import norm_by_blocks
    from paged_backend.worker.invariant_products import product_in_blocks, rows_in_blocks

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 11, 16, generator=gen)
    weight, bias = torch.randn(5, 16, generator=gen), torch.randn(5, generator=gen)
    out = rows_in_blocks(x, lambda rows: F.linear(rows, weight, bias), 4)
    assert out.shape == (2, 11, 5)
    torch.testing.assert_close(out, F.linear(x, weight, bias))
    strided = torch.randn(11, 32, generator=gen)[:, ::2]  # copied to a contiguous buffer first
    for rows, b in [(x, bias), (x, None), (x[:, :8], bias), (x[:1, :3], bias), (strided, None)]:  # 22, 16, 3 rows
        torch.testing.assert_close(product_in_blocks(rows, weight.t(), b, 4), F.linear(rows, weight, b))
    trained = weight.clone().requires_grad_()  # a trainer's forward keeps its gradient
    product_in_blocks(x, trained.t(), bias, 4).sum().backward()
    torch.testing.assert_close(trained.grad, x.reshape(-1, 16).sum(0).expand(5, 16))
    for func, args, kwargs in [
        (torch.Tensor.mean, (x, -1), {"keepdim": True}),
        (torch.Tensor.mean, (x, -1, True), {}),
        (torch.mean, (x,), {"dim": [2]}),
        (torch.mean, (x, 2), {"dtype": torch.float64}),
        (F.layer_norm, (x, (16,), weight[0], bias[0].expand(16), 1e-5), {}),
        (F.rms_norm, (x, [16]), {"eps": 1e-6}),
    ]:
        got = norm_by_blocks(func, args, kwargs, 4)
        assert got is not None
        torch.testing.assert_close(got, func(*args, **kwargs))
    for func, args in [
        (torch.mean, (x, 0)),
        (torch.Tensor.mean, (x,)),
        (torch.sum, (x, -1)),
        (F.rms_norm, (x, [11, 16])),
    ]:
        assert norm_by_blocks(func, args, {}, 4) is None


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="the GPU's kernels pick their order by shape")
def test_a_rows_products_and_norms_are_the_same_in_any_batch_on_a_gpu() -> None:
    """Rows in every position of a block (first, middle, last, past the first block) give the same bits alone and
    among 37, 256, 512, 600 and 2,100 rows (blocks of GPU_ROWS, full and padded), through the mode's linear layers
    (an 8B model's MLP and LM-head widths; with a bias, as Qwen's projections have), the RMSNorm's mean and a
    LayerNorm (bf16). Each row count is first run on other values: the compared call runs on the verdict
    ``ONE_PRODUCT`` kept from that first one."""
    import torch
    import torch.nn.functional as F

    from paged_backend.worker.batch_invariant import BatchInvariantMode

    gen = torch.Generator(device="cuda").manual_seed(0)

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen) * scale

    mlp, head, qkv, bias = draw(14336, 4096, scale=0.02), draw(128256, 4096, scale=0.02), draw(6144, 4096), draw(6144)
    norm_weight, norm_bias = draw(4096), draw(4096)
    rows, noise = draw(2100, 4096), draw(2100, 4096)
    ops = (
        lambda x: F.linear(x, mlp),
        lambda x: F.linear(x, head),
        lambda x: F.linear(x, qkv, bias),
        lambda x: x.float().pow(2).mean(-1, keepdim=True),
        lambda x: F.layer_norm(x, (4096,), norm_weight, norm_bias, 1e-5),
    )
    picks = [0, 100, 130, 255, 256, 300, 511, 599, 1500, 2099]
    with BatchInvariantMode():
        for op in ops:
            alone = {i: op(rows[i : i + 1]) for i in picks}
            for size in (37, 256, 512, 600, 2100):
                op(noise[:size])
                out = op(rows[:size])
                assert all(torch.equal(out[i : i + 1], alone[i]) for i in picks if i < size), (op, size)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's path; gpu_check.py --paths runs the GPU's")
def test_the_gpu_path_on_a_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's fixed-order path driven on the CPU: linear layers on blocks of 8 rows, the RMSNorms and the
    attention through their Triton kernels (the attention's invariant configuration; in the interpreter). Alone,
    beside others and chunked: the same tokens and logprobs — the engine hands every kind of step (a decode, a
    chunk, a mixed step) to the kernels in their invariant form. The target's context passes 64 keys, where the
    kernel's decode and prefill tiles would sum differently."""
    from paged_backend.kernels.paged_attention import paged_attention_triton
    from paged_backend.worker import attention, batch_invariant

    def invariant_kernel(query, k_cache, v_cache, tables, cu_seqlens_q, context_lens, scale, window, softcap, *scales):
        k_scale, v_scale = scales
        return paged_attention_triton(
            query, k_cache, v_cache, tables, cu_seqlens_q, context_lens, scale, window, softcap,
            k_scale=k_scale, v_scale=v_scale, batch_invariant=True,
        )  # fmt: skip

    monkeypatch.setattr(batch_invariant, "block_rows", lambda x: 8)
    monkeypatch.setattr(batch_invariant, "invariant_rms_norms", lambda model, _: batch_invariant.llama_rms_norms(model))
    monkeypatch.setattr(attention, "exact_attention", invariant_kernel)
    target = [random.Random(1).randrange(1, 500) for _ in range(90)]
    alone = target_output("llama", [], GREEDY, target)
    assert target_output("llama", OTHERS[:7], GREEDY, target) == alone
    assert target_output("llama", OTHERS[:12], GREEDY, target, max_num_batched_tokens=16, max_num_seqs=8) == alone


def test_the_llama_rms_norms_are_found_and_swapped_only_inside_the_mode() -> None:
    """HF Llama's RMSNorm and its copies (Qwen3's q/k norms too) are found by their code; GPT-2's LayerNorm, a norm
    whose forward differs (Gemma's) and one whose forward a subclass overrides are not. Inside the mode the found
    ones run the kernel; on leaving, their own forward is back."""
    import torch.nn as nn
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from paged_backend.kernels.rms_norm import rms_norm_torch
    from paged_backend.worker.batch_invariant import BatchInvariantMode, llama_rms_norms

    class Scaled(LlamaRMSNorm):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(hidden_states)

    layers = {"llama": 2 * 2 + 1, "qwen3": 4 * 2 + 1, "mistral": 2 * 2 + 1, "gpt2": 0, "gemma2": 0}
    for arch, count in layers.items():
        assert len(llama_rms_norms(build_tiny_model(arch, vocab_size=512))) == count, arch
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel: on the GPU, else in the interpreter
    model = nn.Sequential(LlamaRMSNorm(16, eps=1e-5), Scaled(16)).to(device)
    norms = llama_rms_norms(model)
    assert norms == [model[0]]
    x = torch.randn(3, 16, device=device) * 4
    with torch.no_grad(), BatchInvariantMode(norms):
        assert "forward" in model[0].__dict__
        torch.testing.assert_close(model[0](x), rms_norm_torch(x, model[0].weight, 1e-5))
    assert "forward" not in model[0].__dict__ and not any("forward" in m.__dict__ for m in model)
    with BatchInvariantMode(norms):  # nested: the inner entry leaves the outer one's kernel in place
        with BatchInvariantMode(norms):
            pass
        assert "forward" in model[0].__dict__
        x.requires_grad_()  # autograd on: the module's own forward, which records the ops
        model[0](x).sum().backward()
        assert x.grad is not None and bool(x.grad.abs().sum() > 0)
    patched = LlamaRMSNorm(16).to(device)
    patched.forward = lambda hidden_states: hidden_states  # an instance's own forward (a hook, a patch) is kept
    assert llama_rms_norms(patched) == []
    with BatchInvariantMode([patched]):
        assert patched(x) is x
    assert patched(x) is x


def test_blocks_of_rows_under_autocast_give_autocast_dtypes() -> None:
    """Under autocast the blocks' products run as autocast runs ``F.linear`` (``out=`` would skip it), with or
    without autograd."""
    import torch.nn.functional as F

    from paged_backend.worker.invariant_products import product_in_blocks

    x, weight = torch.randn(11, 16), torch.randn(5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.linear(x, weight)
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                got = product_in_blocks(x, weight.t(), None, 4)
            assert got.dtype == expected.dtype == torch.bfloat16
            torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("copied", [True, False], ids=["input_copied_whole", "tail_alone"])
@pytest.mark.parametrize("kernel", ["rows_alone", "rows_depend_on_the_row_count"])
def test_whole_blocks_run_as_one_product_only_where_it_gives_each_row_its_blocks_bits(
    monkeypatch: pytest.MonkeyPatch, kernel: str, copied: bool
) -> None:
    """The whole blocks of a product run as one product where a check on the key's first call found that to give
    each row the bits of its own block's product; else block by block. A small input is copied whole with its
    last block padded, which then joins the product; a large one (``COPY_BYTES`` 0 here) pads its last block
    alone, a product of its own. Either way every row has its block's bits, on the first call and on later
    ones. Two simulated kernels: one computing each row alone (one product is then right) and one that sums in
    another order above one block's row count, which shows only where a sum is not zero. The first call's weight
    is zeros (a freshly initialised layer), on which both orders agree: the check runs on random values, so it
    is not fooled."""
    from paged_backend.worker import invariant_products
    from paged_backend.worker.invariant_products import product_in_blocks

    verdicts: dict[tuple[object, ...], bool] = {}
    monkeypatch.setattr(invariant_products, "ONE_PRODUCT", verdicts)
    if not copied:
        monkeypatch.setattr(invariant_products, "COPY_BYTES", 0)
    real_mm, calls = torch.mm, []

    def product(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        calls.append(a.shape[0])
        out.copy_(torch.cat([real_mm(row[None], b) for row in a]))
        return out if kernel == "rows_alone" or a.shape[0] <= 4 else out.add_(1e-3 * (out != 0))

    def mm(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        return product(a, b, out)

    def addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        return product(a, b, out).add_(bias)

    gen = torch.Generator().manual_seed(0)
    trained, bias = torch.randn(5, 16, generator=gen), torch.randn(5, generator=gen)
    weight = torch.zeros(5, 16)
    merged = kernel == "rows_alone"
    for b in (None, bias):
        for trial in range(2):  # the first call checks (zero weights), the second uses the verdict (trained ones)
            weight.copy_(trained if trial else torch.zeros_like(trained))  # one tensor: one layout, one key
            x = torch.randn(18, 16, generator=gen)
            x[3, 5] = float("nan")  # a NaN row keeps its bits too
            expected = torch.cat([torch.mm(row[None], weight.t()) for row in x])
            expected = expected if b is None else expected + b
            calls.clear()
            with monkeypatch.context() as patched:
                patched.setattr(torch, "mm", mm)
                patched.setattr(torch, "addmm", addmm)
                got = product_in_blocks(x, weight.t(), b, 4)
            assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), (b is None, trial)
            whole = 20 if copied else 16  # the rows one product may cover: the padded tail too, or not
            check = [whole] + [4] * (whole // 4) if trial == 0 else []  # one product and its blocks, random values
            call = [whole] if merged else [4] * (whole // 4)
            assert calls == check + call + ([] if copied else [4])  # then the call itself (and its tail alone)
    assert list(verdicts.values()) == [merged] * 2  # with and without a bias: two kernels


def test_the_check_runs_on_random_tensors_of_the_same_layouts_and_reads_either_tf32_api() -> None:
    """The check's random stand-ins have the shape, strides, dtype and address alignment (modulo 256 bytes) of
    the tensors they stand in for, so cuBLAS picks the kernel it picks for those; the math mode in the key reads
    under PyTorch's new TF32 API, where the legacy getters raise."""
    import subprocess
    import sys

    from paged_backend.worker.invariant_products import _layout, _random_like

    base = torch.zeros(1024)
    for t in (torch.zeros(6, 5).t(), base[3:67].view(8, 8), base[1:33].view(4, 8)[:, ::2], torch.zeros(7)):
        stand_in = _random_like(t, torch.Generator().manual_seed(0))
        assert _layout(stand_in) == _layout(t) and bool(stand_in.abs().sum() > 0), t.stride()
    code = (
        "import torch; from paged_backend.worker.invariant_products import _math_mode; "
        "torch.backends.cuda.matmul.fp32_precision = 'tf32'; a = _math_mode(); "
        "torch.backends.cuda.matmul.fp32_precision = 'ieee'; assert a != _math_mode(), a"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_packed_siblings_run_as_one_product_each() -> None:
    """With q/k/v and gate/up packed (as the GPU's engine packs them), the mode computes each group once: the
    first projection's call makes the group's product, its siblings' calls on the same input take their slice
    (``invariant_siblings.py``). The result equals separate products; a sibling called on another input is
    computed alone; nothing waits after the mode is left."""
    import torch.nn.functional as F

    from paged_backend.worker.batch_invariant import BatchInvariantMode
    from paged_backend.worker.fuse_linears import pack
    from paged_backend.worker.invariant_siblings import SiblingProducts

    model = build_tiny_model("qwen2", vocab_size=512)  # q/k/v with biases
    layers = model.model.layers
    groups = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        for modules in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
            weights = [m.weight for m in modules]
            biases = [m.bias for m in modules] if modules[0].bias is not None else None
            for tensors in (weights, biases or []):
                if tensors:
                    pack(tensors)
            groups.append((weights, biases))
    assert groups[0][1] is not None  # the biases' group is exercised
    ids = torch.tensor([[5, 17, 42, 7, 99, 3, 250]])
    siblings = SiblingProducts(groups)
    with torch.no_grad():
        reference = model(ids).logits
        with BatchInvariantMode(siblings=siblings):
            fused = model(ids).logits
        assert siblings.hits == 3 * len(layers)  # k, v and up, from their group's product
        assert not siblings.pending
        torch.testing.assert_close(fused, reference, atol=1e-4, rtol=1e-4)  # (products of other shapes)
        attn = layers[0].self_attn
        x, other = torch.randn(3, attn.q_proj.in_features), torch.randn(3, attn.q_proj.in_features)
        with BatchInvariantMode(siblings=siblings):
            attn.q_proj(x)
            torch.testing.assert_close(attn.k_proj(other), F.linear(other, attn.k_proj.weight, attn.k_proj.bias))
        assert siblings.hits == 3 * len(layers)


def test_the_runner_packs_siblings_for_the_mode() -> None:
    """On a GPU the runner's set-up packs q/k/v and gate/up by a dynamo trace run outside the mode, then keeps the
    layers eager; driven by hand here, after a default engine packed the same weights: the groups are found, the
    steps use them, a request alone and beside others gets the same tokens and logprobs, and those are HF's."""
    from tests.conftest import capturing_backend, hf_greedy

    model = build_tiny_model("llama", vocab_size=512)
    first = LLM(model, block_size=4, max_model_len=128)  # a default engine packs (and fuses) the weights first
    first.llm_engine.executor.model_runner.compile(capturing_backend([]))
    first.llm_engine.shutdown()
    llm = LLM(model, batch_invariant=True, block_size=4, max_model_len=128)
    runner = llm.llm_engine.executor.model_runner
    runner.compile(capturing_backend([]))
    assert runner.regions is None and runner.siblings is not None
    assert len(runner.siblings) == 2 * model.config.num_hidden_layers
    runs = []
    for others in ([], OTHERS[:7]):
        prompts = [{"prompt_token_ids": p} for p in [TARGET, *others]]
        out = llm.generate(prompts, GREEDY, use_tqdm=False)[0].outputs[0]
        runs.append((list(out.token_ids), [{t: e.logprob for t, e in entry.items()} for entry in out.logprobs]))
    assert runner.siblings.hits > 0
    assert runs[0] == runs[1]
    assert runs[0][0] == hf_greedy(model, TARGET, GREEDY.max_tokens)
    k_proj = model.model.layers[0].self_attn.k_proj
    k_proj.weight.data = k_proj.weight.data.clone()  # out of the packed buffer: the group's product would miss it
    with pytest.raises(RuntimeError, match=r"parameter model\.layers\.0\.self_attn\.k_proj\.weight was replaced"):
        llm.generate([{"prompt_token_ids": TARGET}], GREEDY, use_tqdm=False)
