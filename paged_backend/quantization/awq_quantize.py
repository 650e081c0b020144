"""Making AWQ checkpoints: activation-aware scaling, a clipping search, then 4-bit round-to-nearest.

For each decoder layer (inputs recorded from the model as scaled and clipped so far, still in float), each group
of linears that share an input gets per-input-channel scales ``s = mean|x| ** a``, with ``a`` chosen on a grid to
minimise the group's output error once its weights are quantized: salient channels (large activations) are scaled
up before rounding, and the inverse scale is folded into what produces the input (the norm, or the previous
linear), so the model's function is unchanged before quantization. Then each linear's per-group weight range is
shrunk where that lowers its output error (skipped for q/k, whose errors the softmax amplifies), and the weights
are rounded.

Supported: decoder layers in the Llama layout (Llama, Mistral, Qwen2/3): ``input_layernorm``,
``self_attn.{q,k,v,o}_proj``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``, with norms that multiply
by their weight (Gemma's ``1 + weight`` would not fold).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Sequence
from typing import TypeVar

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from paged_backend.model_structure import find_decoder_layers, module_tensor
from paged_backend.quantization.awq import AWQConfig, convertible_linears
from paged_backend.quantization.rtn import pack_linear, quantize_rtn

logger = logging.getLogger(__name__)

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
N_GRID = 20
MAX_SHRINK = 0.5
CLIP_TOKENS = 512  # inputs sampled for the clipping search


def fake_quantize(weight: torch.Tensor, group_size: int) -> torch.Tensor:  # [N, K] -> [N, K]
    """Round-to-nearest with a zero point per group, dequantized again (in fp32)."""
    q, z, s = quantize_rtn(weight, group_size)  # [K, N], [K/G, N], [K/G, N]
    groups = z.shape[0]
    w = (q.view(groups, group_size, -1) - z[:, None]).float() * s.float()[:, None]
    return w.reshape(q.shape).t()


_Child = TypeVar("_Child", bound=nn.Module)


def _child(module: nn.Module, name: str, kind: type[_Child]) -> _Child:
    """``module.<name>`` as a ``kind``; missing or of another kind, an AttributeError naming it (``exc.name``)."""
    child = getattr(module, name)
    if not isinstance(child, kind):
        raise AttributeError(f"{type(module).__name__}.{name} is not a {kind.__name__}", name=name, obj=module)
    return child


def _layer_groups(layer: nn.Module) -> list[tuple[nn.Module, list[str]]]:
    """(what produces the input, the linears reading it) for one Llama-layout decoder layer."""
    try:
        attn, mlp = _child(layer, "self_attn", nn.Module), _child(layer, "mlp", nn.Module)
        groups = [
            (_child(layer, "input_layernorm", nn.Module), ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
            (_child(layer, "post_attention_layernorm", nn.Module), ["mlp.gate_proj", "mlp.up_proj"]),
            (_child(mlp, "up_proj", nn.Module), ["mlp.down_proj"]),
        ]
        v_proj, o_proj = _child(attn, "v_proj", nn.Linear), _child(attn, "o_proj", nn.Linear)
        if v_proj.out_features == o_proj.in_features:  # without grouped KV heads v feeds o directly
            groups.insert(1, (v_proj, ["self_attn.o_proj"]))
    except AttributeError as exc:
        raise NotImplementedError(
            f"AWQ quantization needs Llama-layout decoder layers (input_layernorm, self_attn.q/k/v/o_proj, "
            f"post_attention_layernorm, mlp.gate/up/down_proj); {type(layer).__name__} lacks {exc.name}"
        ) from exc
    return groups


@torch.no_grad()
def _record_inputs(
    model: PreTrainedModel, layer: nn.Module, names: list[str], batches: list[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Each named linear's inputs ``[n, K]`` over the calibration batches (the model as it is now)."""
    inputs: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    hooks = [
        layer.get_submodule(name).register_forward_hook(
            lambda _m, args, _out, name=name: inputs[name].append(args[0].reshape(-1, args[0].shape[-1]).float())
        )
        for name in names
    ]
    try:
        for ids in batches:
            model(input_ids=ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return {name: torch.cat(chunks) for name, chunks in inputs.items()}


@torch.no_grad()
def search_scales(x: torch.Tensor, weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """The per-input-channel scales ``[K]`` minimising the group's output error after quantization."""
    x_mean = x.abs().mean(0)  # [K]
    reference = [x @ w.float().t() for w in weights]
    best, best_scales = float("inf"), torch.ones_like(x_mean)
    for ratio in (i / N_GRID for i in range(N_GRID)):  # ratio 0 is plain round-to-nearest
        scales = x_mean.pow(ratio).clamp(min=1e-4)
        scales = scales / (scales.max() * scales.min()).sqrt()
        loss = sum(
            (x @ (fake_quantize(w.float() * scales, group_size) / scales).t() - ref).pow(2).mean().item()
            for w, ref in zip(weights, reference)
        )
        if loss < best:
            best, best_scales = loss, scales
    return best_scales


@torch.no_grad()
def search_clip(x: torch.Tensor, weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-(output, group) maximum magnitudes ``[N, K/G, 1]`` that minimise the group-wise output error."""
    if x.shape[0] > CLIP_TOKENS:
        x = x[torch.linspace(0, x.shape[0] - 1, CLIP_TOKENS).long()]
    w = weight.float().view(weight.shape[0], -1, group_size)  # [N, K/G, G]
    xg = x.view(x.shape[0], -1, group_size)  # [n, K/G, G]
    best_max = w.abs().amax(-1, keepdim=True)  # [N, K/G, 1]
    for rows in torch.split(torch.arange(w.shape[0]), 256):  # bounded memory: [n, rows, K/G]
        wr = w[rows]
        reference = torch.einsum("ngc,ogc->nog", xg, wr)
        org_max = wr.abs().amax(-1, keepdim=True)
        best_err = torch.full_like(org_max, float("inf"))
        for i in range(int(MAX_SHRINK * N_GRID)):
            max_val = org_max * (1 - i / N_GRID)
            clipped = wr.clamp(-max_val, max_val)
            quantized = fake_quantize(clipped.reshape(len(rows), -1), group_size).view_as(wr)
            err = (torch.einsum("ngc,ogc->nog", xg, quantized) - reference).pow(2).mean(0)[..., None]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max[rows] = torch.where(better, max_val, best_max[rows])
    return best_max


def _fold_inverse(prev: nn.Module, scales: torch.Tensor) -> None:
    """Divide what produces the input by ``scales`` (a norm's weight and bias, or a linear's output rows)."""
    weight = module_tensor(prev, "weight")
    if isinstance(prev, nn.Linear):
        weight.div_(scales.to(weight.dtype)[:, None])
    else:
        weight.div_(scales.to(weight.dtype))
    bias = getattr(prev, "bias", None)
    if isinstance(bias, torch.Tensor):  # a parameter, or None
        bias.div_(scales.to(bias.dtype))


@torch.no_grad()
def apply_awq(
    model: PreTrainedModel, batches: list[torch.Tensor], group_size: int, clip: bool = True, scale: bool = True
) -> None:
    """Scale and clip every decoder layer's linears in place (float weights: quantization comes after)."""
    model_type = model.config.get_text_config().model_type
    if model_type not in SUPPORTED:
        raise NotImplementedError(f"AWQ quantization supports {list(SUPPORTED)}, not model_type={model_type!r}")
    layers = find_decoder_layers(model)
    if layers is None:
        raise NotImplementedError(f"AWQ quantization found no decoder layers in {type(model).__name__}")
    for layer in tqdm(layers, desc="AWQ", unit="layer"):
        groups = _layer_groups(layer)
        names = [name for _, linears in groups for name in linears]
        if scale:
            for prev, linears in groups:
                x = _record_inputs(model, layer, linears[:1], batches)[linears[0]]
                weights = [module_tensor(layer.get_submodule(name), "weight") for name in linears]
                scales = search_scales(x, weights, group_size)
                _fold_inverse(prev, scales)
                for weight in weights:
                    weight.mul_(scales.to(weight.dtype))
        if clip:
            inputs = _record_inputs(model, layer, names, batches)
            for name in names:
                if name.endswith(("q_proj", "k_proj")):
                    continue
                weight = module_tensor(layer.get_submodule(name), "weight")
                max_val = search_clip(inputs[name], weight, group_size)
                w = weight.view(weight.shape[0], -1, group_size)
                w.copy_(w.float().clamp(-max_val, max_val).to(w.dtype))


def calibration_batches(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], seq_len: int, device: torch.device
) -> list[torch.Tensor]:
    """The texts' tokens, concatenated and cut into ``[1, seq_len]`` rows."""
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text)["input_ids"]
    if len(ids) < 2:
        raise ValueError("calib_texts must hold some text: they tokenize to fewer than 2 tokens")
    rows = [ids[i : i + seq_len] for i in range(0, len(ids), seq_len)]
    return [torch.tensor([row], device=device) for row in rows]


def write_checkpoint(
    model: PreTrainedModel,
    output_dir: str,
    group_size: int,
    tokenizer: PreTrainedTokenizerBase | None = None,
    modules_to_not_convert: Sequence[str] = (),
) -> None:
    """Quantize the convertible linears to 4 bits (round to nearest) and save the AWQ checkpoint: safetensors with
    ``qweight``/``qzeros``/``scales`` and config.json's ``quantization_config`` as AutoAWQ writes it."""
    from safetensors.torch import save_file

    awq = AWQConfig(group_size, tuple(modules_to_not_convert))
    linears = convertible_linears(model, awq)
    tensors: dict[str, torch.Tensor] = {}
    for name, linear in tqdm(linears.items(), desc="packing", unit="linear"):
        qweight, qzeros, scales = pack_linear(linear.weight, group_size)
        tensors[f"{name}.qweight"] = qweight.cpu()
        tensors[f"{name}.qzeros"] = qzeros.cpu()
        tensors[f"{name}.scales"] = scales.cpu()
        if linear.bias is not None:
            tensors[f"{name}.bias"] = linear.bias.detach().half().cpu()
    quantized = {f"{name}.{attr}" for name in linears for attr in ("weight", "bias")}
    storages: set[int] = set()
    for key, tensor in model.state_dict().items():
        if key in quantized or tensor.untyped_storage().data_ptr() in storages:
            continue  # a tied LM head is stored once, as transformers does
        storages.add(tensor.untyped_storage().data_ptr())
        tensors[key] = (tensor.half() if tensor.is_floating_point() else tensor).contiguous().cpu()
    os.makedirs(output_dir, exist_ok=True)
    save_file(tensors, os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    config.quantization_config = awq.to_hf()
    config.dtype = torch.float16
    config.save_pretrained(output_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(output_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(output_dir)
    logger.info("AWQ checkpoint: %d linears at 4 bits, group size %d, in %s", len(linears), group_size, output_dir)


def quantize(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    output_dir: str,
    calib_texts: Sequence[str],
    w_bit: int = 4,
    group_size: int = 128,
    zero_point: bool = True,
    seq_len: int = 512,
    modules_to_not_convert: Sequence[str] = (),
) -> None:
    """AWQ-quantize a copy of ``model`` (the caller's stays as it was) and write the checkpoint to ``output_dir``,
    loadable by ``LLM(output_dir)`` and by transformers where gptqmodel is installed."""
    if w_bit != 4:
        raise ValueError(f"w_bit must be 4, got {w_bit}")
    if not zero_point:
        raise ValueError("zero_point must be True: symmetric AWQ is not supported")
    AWQConfig.from_hf({"quant_method": "awq", "bits": w_bit, "group_size": group_size})  # validates group_size
    work = copy.deepcopy(model).eval()
    device = next(work.parameters()).device
    batches = calibration_batches(tokenizer, calib_texts, seq_len, device)
    apply_awq(work, batches, group_size)
    write_checkpoint(work, output_dir, group_size, tokenizer, modules_to_not_convert)
