"""The trainer's side of ``batch_invariant`` on the GPU's path: full sequences through the engine's fixed-order
attention kernel give each query the bits of its own decode step; the engine's packed siblings are found; and a
tiny model's sampled logprobs equal its trainer's forward bit for bit with that path driven on the CPU (the
kernels in Triton's interpreter)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from paged_backend import LLM, SamplingParams
from paged_backend.kernels.paged_attention import paged_attention_triton
from paged_backend.worker import attention, batch_invariant, trainer_forward
from paged_backend.worker.fuse_linears import pack
from paged_backend.worker.invariant_siblings import packed_siblings
from tests.fixtures.tiny_models import build_tiny_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.bfloat16, torch.float16] if DEVICE.type == "cuda" else [torch.float32, torch.float16]


def decode_alone(query, key, value, p, scale, window, softcap):
    """Packed query ``p`` (of the sequence starting at 0 in these [1, H, T, D] tensors) as the engine decodes it:
    alone in its step, over a cache holding exactly the keys before it, in blocks scattered over a larger cache."""
    block, num_kv_heads, dim = 16, key.shape[1], key.shape[-1]
    blocks = -(-(p + 1) // block)
    order = torch.randperm(blocks + 3, generator=torch.Generator().manual_seed(p))[:blocks]
    caches = []
    for x in (key, value):
        cache = torch.zeros(blocks + 3, block, num_kv_heads, dim, dtype=x.dtype, device=x.device)
        flat = torch.zeros(blocks * block, num_kv_heads, dim, dtype=x.dtype, device=x.device)
        flat[: p + 1] = x[0, :, : p + 1].transpose(0, 1)
        cache[order.to(x.device)] = flat.view(blocks, block, num_kv_heads, dim)
        caches.append(cache)
    ints = dict(dtype=torch.int32, device=query.device)
    out = paged_attention_triton(
        query[0, :, p][None], *caches, order[None].to(**ints), torch.tensor([0, 1], **ints),
        torch.tensor([p + 1], **ints), scale, window, softcap, batch_invariant=True,
    )  # fmt: skip
    return out[0]


def packed(lengths, heads=4, kv_heads=2, dim=16, dtype=torch.float32, seed=0):
    """Random [1, H, T, D] queries, keys and values of sequences of ``lengths`` packed back to back, and their
    bounds [B + 1]."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    qkv = [torch.randn(1, h, total, dim, generator=gen).to(DEVICE, dtype) for h in (heads, kv_heads, kv_heads)]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], device=DEVICE)
    return (*qkv, cu)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window, softcap", [(None, None), (7, None), (None, 20.0)], ids=["plain", "window", "cap"])
@pytest.mark.usefixtures("row_independent_dot")
def test_packed_sequences_give_each_query_its_decode_steps_bits(dtype, window, softcap) -> None:
    lengths = [37, 5, 23]  # the second ends inside a block, the third starts there
    query, key, value, cu = packed(lengths, dtype=dtype)
    scale = query.shape[-1] ** -0.5
    full = trainer_forward._causal_attention_gpu(query, key, value, cu, scale, window, softcap)  # [1, T, H, D]
    for s, (lo, hi) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        q, k, v = (x[:, :, lo:hi] for x in (query, key, value))  # the sequence alone
        for p in range(hi - lo):
            assert torch.equal(full[0, lo + p], decode_alone(q, k, v, p, scale, window, softcap)), (s, p)
    eager = trainer_forward._causal_attention_eager(query, key, value, cu, scale, window, softcap)
    torch.testing.assert_close(full.float(), eager.float(), atol=2e-2 if dtype != torch.float32 else 1e-5, rtol=0)


def test_the_kernels_attention_has_the_eager_attentions_gradient() -> None:
    query, key, value, cu = packed([13, 8])
    inputs = [x.requires_grad_() for x in (query, key, value)]
    out = trainer_forward._InvariantAttention.apply(*inputs, cu, 0.25, 5, None)
    assert torch.equal(out, trainer_forward._causal_attention_gpu(*inputs, cu, 0.25, 5, None))
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got = torch.autograd.grad((out * weights).sum(), inputs)
    eager = trainer_forward._causal_attention_eager(*inputs, cu, 0.25, 5, None)
    want = torch.autograd.grad((eager * weights).sum(), inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_the_engines_packed_siblings_are_found_by_their_buffers() -> None:
    model = build_tiny_model("qwen2", vocab_size=512)  # q/k/v with biases
    assert len(packed_siblings(model)) == 0  # nothing packed: each projection alone
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        pack([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        pack([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
        pack([mlp.gate_proj.weight, mlp.up_proj.weight])
    siblings = packed_siblings(model)
    attn = model.model.layers[0].self_attn
    assert len(siblings) == 2 * model.config.num_hidden_layers
    weights, biases = siblings.first[id(attn.q_proj.weight)]
    assert weights == [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    assert biases == [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.usefixtures("row_independent_dot")
def test_sampled_logprobs_equal_the_trainers_on_the_gpus_path(monkeypatch: pytest.MonkeyPatch, dtype) -> None:
    """The engine (``batch_invariant=True``) and the trainer (``batch_invariant_forward``, no grad: the "old"
    logprobs of an RL step) both on the GPU's path: linear layers by blocks of rows, the RMSNorm kernel, the
    fixed-order attention kernel (the trainer's over whole sequences). Every sampled token's logprob is the
    trainer's, bit for bit. On a CPU the path is driven by hand (blocks of 8 rows, the kernels in Triton's
    interpreter)."""
    if DEVICE.type == "cpu":

        def invariant_kernel(query, k_cache, v_cache, tables, cu_seqlens_q, context_lens, scale, window, softcap, *kv):
            return paged_attention_triton(
                query, k_cache, v_cache, tables, cu_seqlens_q, context_lens, scale, window, softcap,
                k_scale=kv[0], v_scale=kv[1], batch_invariant=True,
            )  # fmt: skip

        def norms(model, device):
            return batch_invariant.llama_rms_norms(model)

        monkeypatch.setattr(batch_invariant, "block_rows", lambda x: 8)
        monkeypatch.setattr(batch_invariant, "invariant_rms_norms", norms)
        monkeypatch.setattr(trainer_forward, "invariant_rms_norms", norms)
        monkeypatch.setattr(attention, "exact_attention", invariant_kernel)
        monkeypatch.setattr(trainer_forward, "uses_kernel", lambda query: True)
    model = build_tiny_model("llama", vocab_size=512).to(DEVICE, dtype)
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 500) for _ in range(n)] for n in (30, 9, 21)]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, logprobs=0)
    llm = LLM(model, batch_invariant=True, block_size=4, max_model_len=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        tokens = list(out.outputs[0].token_ids)
        sampled = [entry[t].logprob for entry, t in zip(out.outputs[0].logprobs, tokens)]
        with trainer_forward.batch_invariant_forward(model), torch.no_grad():
            logits = model(torch.tensor([prompt + tokens], device=DEVICE)).logits[0, len(prompt) - 1 : -1].float()
        want = logits.log_softmax(-1).gather(1, torch.tensor(tokens, device=DEVICE)[:, None])[:, 0].tolist()
        assert sampled == want
    # all of them packed into one forward: the same bits again
    sequences = [torch.tensor(p + list(o.outputs[0].token_ids), device=DEVICE) for p, o in zip(prompts, outs)]
    with trainer_forward.batch_invariant_forward(model), torch.no_grad():
        logits = model(**trainer_forward.pack_sequences(sequences)).logits[0].float().log_softmax(-1)
    start = 0
    for prompt, out, sequence in zip(prompts, outs, sequences):
        tokens = list(out.outputs[0].token_ids)
        rows = logits[start + len(prompt) - 1 : start + len(sequence) - 1]
        got = rows.gather(1, torch.tensor(tokens, device=DEVICE)[:, None])[:, 0].tolist()
        assert got == [entry[t].logprob for entry, t in zip(out.outputs[0].logprobs, tokens)]
        start += len(sequence)


def test_packed_sequences_get_the_bits_each_has_alone_on_the_cpus_exact_path() -> None:
    """A CPU's path (a row and a query at a time) packs too: each sequence's logits equal its own forward's."""
    model = build_tiny_model("qwen2", vocab_size=512)  # q/k/v biases
    gen = torch.Generator().manual_seed(4)
    sequences = [torch.randint(1, 500, (n,), generator=gen) for n in (11, 4, 17)]
    with trainer_forward.batch_invariant_forward(model), torch.no_grad():
        alone = [model(s[None]).logits[0] for s in sequences]
        together = model(**trainer_forward.pack_sequences(sequences)).logits[0]
    assert torch.equal(torch.cat(alone), together)
    with pytest.raises(ValueError, match="one row: got a batch of 2"):
        with trainer_forward.batch_invariant_forward(model), torch.no_grad():
            model(torch.stack([sequences[0], sequences[0]]), cu_seq_lens_q=torch.tensor([0, 11]))


def test_a_packed_row_is_bounded_by_its_position_ids_alone_and_bad_bounds_are_refused() -> None:
    """HF's padding-free packing may pass only ``position_ids`` restarting at 0: the bounds come from them. Bounds
    that do not cover the row, and positions that restart elsewhere than 0, are errors."""
    model = build_tiny_model("llama", vocab_size=512)
    gen = torch.Generator().manual_seed(5)
    sequences = [torch.randint(1, 500, (n,), generator=gen) for n in (6, 9, 3)]
    packed = trainer_forward.pack_sequences(sequences)
    with trainer_forward.batch_invariant_forward(model), torch.no_grad():
        alone = torch.cat([model(s[None]).logits[0] for s in sequences])
        by_positions = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]).logits[0]
        assert torch.equal(by_positions, alone)
        with pytest.raises(ValueError, match="cu_seq_lens_q ends at 17: the row has 18 tokens"):
            model(**{**packed, "cu_seq_lens_q": torch.tensor([0, 6, 17])})
        with pytest.raises(ValueError, match="must restart at 0"):
            model(input_ids=packed["input_ids"], position_ids=packed["position_ids"] + 1)
    with pytest.raises(ValueError, match="at least one sequence"):
        trainer_forward.pack_sequences([])


def test_a_forwards_cache_layout_is_made_once_and_again_for_the_next_forward() -> None:
    """Every layer asks for the layout with the forward's one bounds tensor: the second ask gets the first's. The
    next forward starts afresh (``_new_forward``): a trainer that reuses its bounds buffer writes the next batch's
    bounds into it, and under ``torch.inference_mode`` no version counter tells."""
    from paged_backend.worker.trainer_forward import _cache_layout, _new_forward

    with torch.inference_mode():
        cu = torch.tensor([0, 5, 12])
        first = _cache_layout(cu, 12)
        assert _cache_layout(cu, 12) is first
        _new_forward()
        cu.copy_(torch.tensor([0, 9, 12]))
        second = _cache_layout(cu, 12)
    assert second is not first and second.lens.tolist() == [9, 3]
    assert _cache_layout(cu.clone(), 12) is not second  # another tensor with the same values: made again


def test_a_positions_buffer_written_in_place_between_forwards_bounds_the_next_forward() -> None:
    """A trainer's reused ``position_ids`` buffer (HF's packing without ``cu_seq_lens_q``: the sequences' bounds
    are where positions restart), made under inference mode (no version counter) and written in place between
    two no-grad forwards inside one ``batch_invariant_forward``: the second forward reads the new bounds (each
    forward's logits equal a forward given fresh tensors). The same with a buffer that keeps a version counter."""
    model = build_tiny_model("llama", vocab_size=512).to(DEVICE)
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0)).to(DEVICE)

    def positions(*lengths: int) -> torch.Tensor:
        return torch.cat([torch.arange(n, device=DEVICE) for n in lengths])[None]

    def fresh(*lengths: int) -> torch.Tensor:
        with torch.inference_mode(), trainer_forward.batch_invariant_forward(model):
            return model(input_ids=ids, position_ids=positions(*lengths)).logits

    for grad_mode in (torch.inference_mode, torch.no_grad):
        with grad_mode(), trainer_forward.batch_invariant_forward(model):
            buffer = positions(5, 7)
            first = model(input_ids=ids, position_ids=buffer).logits
            buffer.copy_(positions(9, 3))
            second = model(input_ids=ids, position_ids=buffer).logits
        assert torch.equal(first, fresh(5, 7)) and torch.equal(second, fresh(9, 3))
        assert not torch.equal(first, second)
