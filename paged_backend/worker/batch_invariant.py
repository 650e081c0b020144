"""``batch_invariant=True``: a request's tokens and logprobs do not depend on the other requests in its steps,
on how its prompt was chunked, on prefix-cache hits or on preemption.

A token's result changes with its batch only where a reduction's order does. A matrix product picks its kernel,
and so the order it sums in, by its number of rows; a row-wise reduction (a norm's mean) on a GPU splits a row
over more threads when rows are few; the attention's reference twin pads each group's contexts to the longest.
So every reduction is given a shape that its own token decides:

- On a GPU, every linear layer gives each row the bits of a product of exactly ``GPU_ROWS`` rows (the last block
  padded with zeros): one kernel for every batch, and inside it a row's sums do not depend on its neighbours'.
  Whole blocks run as one product where that was checked to give the same bits (``invariant_products.py``).
  HF Llama's RMSNorm (and its copies) runs ``kernels/rms_norm.py``, any other norm's ``mean(-1)``
  ``kernels/row_mean.py``: one program a row, an order set by the row's length. ``layer_norm`` and
  ``rms_norm`` run on blocks of rows too. Packed sibling projections (q/k/v, gate/up) run as one product a group
  (``invariant_siblings.py``). The attention runs the Triton kernel's fixed-order configuration
  (``batch_invariant=True`` in ``kernels/paged_attention.py``). Decode steps still replay CUDA graphs (captured
  in this mode); the layers are not compiled (inductor's fused reductions choose their own splits).
- On a CPU each row of a linear layer is computed alone (``F.linear``, the ``torch.addmm`` of GPT-2's Conv1D,
  ``torch.matmul`` by a 2-D weight) and each query attends over exactly the keys it sees, one at a time: the
  exact path, not a fast one. A CPU's row-wise reductions already run one row per thread.

Elementwise work needs nothing. The sampler (``worker/sampler.py``) gives every row its logprobs by the same
operations whichever path its batch takes, sorts stably and takes top-p's running sums by blocks of rows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers import PretrainedConfig

from paged_backend.kernels import triton
from paged_backend.kernels.attention_twin import gather_slots
from paged_backend.kernels.rms_norm import rms_norm_triton
from paged_backend.kernels.row_mean import row_mean_triton
from paged_backend.worker.invariant_modules import hooks_made, outside_the_mode, run_outside_the_mode, same_code
from paged_backend.worker.invariant_products import needs_grad, product_in_blocks, rows_in_blocks
from paged_backend.worker.invariant_siblings import SiblingProducts

GPU_ROWS = 256  # a decode step's rows at the default max_num_seqs fit one block; prefill fills blocks whole


ROW_MEAN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the row-mean kernel reads


def block_rows(x: torch.Tensor) -> int:
    """Rows per block for ``x``'s device: ``GPU_ROWS`` on a GPU, one (each row alone) on a CPU."""
    return GPU_ROWS if x.is_cuda else 1


def _last_dim(x: torch.Tensor, dim: object) -> bool:
    """Whether ``dim`` (an int or a one-element list or tuple) names the last dimension of ``x``."""
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    return hasattr(dim, "__index__") and x.dim() > 0 and int(dim) in (-1, x.dim() - 1)


def norm_by_blocks(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], block: int
) -> torch.Tensor | None:
    """A norm's reduction over the last dimension, by blocks of ``block`` rows: ``x.mean(-1)`` (the RMSNorm of
    Llama and most others), ``F.layer_norm`` and ``F.rms_norm`` over one dimension. ``None``: not one of those."""
    x = args[0]
    if func in (torch.mean, torch.Tensor.mean):
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if not _last_dim(x, dim) or len(args) > 3:
            return None
        keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
        if "out" in kwargs:
            return None
        rest = {k: v for k, v in kwargs.items() if k not in ("dim", "keepdim")}
        if x.is_cuda and triton is not None and not rest and x.dtype in ROW_MEAN_DTYPES and not needs_grad(x):
            out = row_mean_triton(x)  # (no gradient: a trainer's forward takes the blocks below)
        else:
            out = rows_in_blocks(x, lambda rows: func(rows, -1, keepdim=True, **rest), block)
        return out if keepdim else out.squeeze(-1)
    if func in (F.layer_norm, F.rms_norm):
        shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape")
        if shape is None or len(shape) != 1:
            return None
        return rows_in_blocks(x, lambda rows: func(rows, *args[1:], **kwargs), block)
    return None


MOE_CONFIG_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")  # their frequencies follow the batch's longest position


def check_batch_invariant_supported(model: torch.nn.Module, device: torch.device) -> None:
    """What the mode cannot make invariant fails here: quantized linear layers (their kernels are not row-wise),
    mixture-of-experts models (the experts' outputs are gathered and summed across the batch's tokens), rotary
    scalings chosen by the batch's longest position; on a GPU, a vocabulary not a multiple of 4 (the softmax's
    vector loads shift with each fp32 row's address, so a row sums in an order set by its index) and no Triton
    (the fixed-order attention is a Triton kernel)."""
    from paged_backend.config import FieldError
    from paged_backend.quantization.awq import AWQLinear
    from paged_backend.quantization.fp8 import FP8Linear
    from paged_backend.quantization.fp8_block import FP8BlockLinear

    if any(isinstance(m, (AWQLinear, FP8Linear, FP8BlockLinear)) for m in model.modules()):
        raise FieldError("batch_invariant", "batch_invariant runs unquantized linear layers: this model's are not")
    config = getattr(model, "config", None)
    text = config.get_text_config() if isinstance(config, PretrainedConfig) else None
    experts = [f for f in MOE_CONFIG_FIELDS if (getattr(text, f, None) or 0) > 1]
    if experts:
        raise FieldError(
            "batch_invariant", f"batch_invariant does not run mixture-of-experts models ({experts[0]} > 1) yet"
        )
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if kind in DYNAMIC_ROPE_TYPES:
        raise FieldError("batch_invariant", f"batch_invariant does not run rope_type={kind!r} (set by the batch)")
    vocab = getattr(text, "vocab_size", 0) or 0
    if device.type == "cuda" and vocab % 4:
        raise FieldError(
            "batch_invariant", f"batch_invariant on a GPU needs a vocabulary size divisible by 4, got {vocab}"
        )
    if device.type == "cuda" and triton is None:
        raise FieldError("batch_invariant", "batch_invariant on a GPU needs triton (its attention kernel)")


def llama_rms_norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's RMSNorm modules whose ``forward`` is HF Llama's, code for code (Mistral's, Qwen2's, Qwen3's and
    the other copies are), with a weight over the last dimension: those ``kernels/rms_norm.py`` computes."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return [
        m
        for m in model.modules()
        if same_code(type(m).forward, LlamaRMSNorm.forward)
        and _norm_parts(m) is not None
        and "forward" not in m.__dict__  # a forward set on the instance (a hook, a patch) is not HF's
    ]


def invariant_rms_norms(model: torch.nn.Module, device: torch.device) -> list[torch.nn.Module]:
    """The norms ``batch_invariant`` runs as one kernel each: ``llama_rms_norms`` on a GPU, none on a CPU (its
    exact path computes a row's norm alone already)."""
    return llama_rms_norms(model) if device.type == "cuda" else []


def _norm_parts(module: torch.nn.Module) -> tuple[torch.Tensor, float] | None:
    """An RMSNorm module's weight (1-D) and epsilon, or ``None`` where it lacks either."""
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 1 and isinstance(eps, float):
        return weight, eps
    return None


def fused_rms_norm(module: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """A ``llama_rms_norms`` module's forward as one kernel (its weight read at each call: live weights); its own
    forward where autograd must see the ops."""
    parts = _norm_parts(module)
    if parts is None:
        raise TypeError(f"{type(module).__name__} lost its RMSNorm weight or epsilon")
    if needs_grad(hidden_states, parts[0]):
        return type(module).forward(module, hidden_states)
    with outside_the_mode():
        return rms_norm_triton(hidden_states, *parts)


# The functions the mode computes its own way (norm_by_blocks' and the products below).
INTERCEPTED = frozenset(
    (torch.mean, torch.Tensor.mean, F.layer_norm, F.rms_norm, F.linear, torch.addmm)
    + (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)
)


class BatchInvariantMode(TorchFunctionMode):
    """Inside: linear layers (and on a GPU the norms) computed by fixed blocks of rows (see the module's
    docstring); ``rms_norms`` (``llama_rms_norms``' modules, on a GPU) run ``kernels/rms_norm.py`` instead of
    their own forward; ``siblings``' packed groups run as one product each; ``outside`` (from
    ``invariant_modules.modules_outside_the_mode``: modules, and the linear layers inside them) run with the
    mode off, those linear layers computing as the mode computes ``F.linear``. Swapped forwards are put back on
    leaving."""

    def __init__(
        self,
        rms_norms: list[torch.nn.Module] | None = None,
        siblings: SiblingProducts | None = None,
        outside: tuple[list[torch.nn.Module], list[torch.nn.Linear]] = ([], []),
    ) -> None:
        super().__init__()
        self.rms_norms = rms_norms or []
        self.siblings = siblings
        self.outside = outside
        self.swapped: list[torch.nn.Module] = []  # the modules this entry swapped, to put back on leaving

    def __enter__(self) -> BatchInvariantMode:
        modules, linears = self.outside
        forwards: list[tuple[torch.nn.Module, Callable[..., Any]]] = [
            *((m, functools.partial(fused_rms_norm, m)) for m in self.rms_norms),
            *((m, functools.partial(self.linear_forward, m)) for m in linears),
            *((m, functools.partial(run_outside_the_mode, m, hooks_made())) for m in modules),
        ]
        # A module whose instance already has a forward (an enclosing mode's, or anyone's) keeps it.
        self.swapped = []
        for module, forward in forwards:
            if "forward" not in module.__dict__:
                module.__dict__["forward"] = forward
                self.swapped.append(module)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for module in self.swapped:
            module.__dict__.pop("forward", None)
        self.swapped = []
        if self.siblings is not None:
            self.siblings.clear()
        super().__exit__(*exc)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` as the mode computes it (``x`` not empty)."""
        block = block_rows(x)
        product = functools.partial(product_in_blocks, block=block)
        fused = None if self.siblings is None else self.siblings.product(x, weight, bias, product)
        if fused is not None:
            return fused
        if block > 1:
            return product(x, weight.t(), bias)
        return rows_in_blocks(x, lambda row: F.linear(row, weight, bias), 1)

    def linear_forward(self, module: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        """An ``nn.Linear``'s forward (its argument's name too) inside a module that runs outside the mode; where
        that module's call ran inside it after all (``run_outside_the_mode``), ``F.linear`` through the mode."""
        weight, bias = module.weight, module.bias
        if torch._C._is_torch_function_enabled() or not input.numel():
            return F.linear(input, weight, bias)
        return self.linear(input, weight, bias)

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func not in INTERCEPTED:  # every other op of the forward passes through here: return at once
            return func(*args, **kwargs)
        if args and isinstance(args[0], torch.Tensor) and args[0].numel() and block_rows(args[0]) > 1:
            normed = norm_by_blocks(func, args, kwargs, block_rows(args[0]))
            if normed is not None:
                return normed
        if func is F.linear and len(args) >= 2 and args[0].numel():
            return self.linear(args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias"))
        if func is torch.addmm and not kwargs and len(args) == 3 and args[1].numel():
            bias, x, weight = args
            if block_rows(x) > 1:
                return product_in_blocks(x, weight, bias, block_rows(x))
            return rows_in_blocks(x, lambda row: torch.addmm(bias, row, weight), 1)
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__) and not kwargs and len(args) == 2:
            x, weight = args
            if isinstance(weight, torch.Tensor) and weight.dim() == 2 and x.dim() >= 2 and x.numel():
                if block_rows(x) > 1:
                    return product_in_blocks(x, weight, None, block_rows(x))
                return rows_in_blocks(x, lambda row: torch.matmul(row, weight), 1)
        return func(*args, **kwargs)


def exact_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks]
    cu_seqlens_q: torch.Tensor,  # [B + 1]
    context_lens: torch.Tensor,  # [B]
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,  # [Hkv], fp8 caches only
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, H, D]
    """Paged attention, one query at a time over exactly the keys it sees (its window's), in fp32: each
    reduction's length is the token's own context, whatever else the step holds. A window or softcap of 0 is
    none, as in the Triton kernel."""
    sliding_window, softcap = sliding_window or None, softcap or None
    out = torch.empty_like(query)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    per_kv = query.shape[1] // num_kv_heads
    starts, contexts = cu_seqlens_q.tolist(), context_lens.tolist()
    for row, context in enumerate(contexts):
        num_new = starts[row + 1] - starts[row]
        if num_new == 0:
            continue
        positions = torch.arange(context, device=query.device)
        slots = block_tables[row, positions // block_size].long() * block_size + positions % block_size
        keys = gather_slots(k_cache, slots).float()  # [C, Hkv, D]
        values = gather_slots(v_cache, slots).float()
        if k_scale is not None and v_scale is not None:
            keys, values = keys * k_scale[:, None], values * v_scale[:, None]
        keys = keys.repeat_interleave(per_kv, dim=1).contiguous()  # [C, H, D]
        values = values.repeat_interleave(per_kv, dim=1).contiguous()
        for j in range(num_new):
            position = context - num_new + j
            first = 0 if sliding_window is None else max(0, position - sliding_window + 1)
            query_row = query[starts[row] + j].float()
            attended = attend_one(query_row, keys[first : position + 1], values[first : position + 1], scale, softcap)
            out[starts[row] + j] = attended.to(out.dtype)
    return out


def attend_one(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    """One query [H, D] over exactly the keys and values [C, H, D] it sees, in fp32: [H, D]."""
    scores = torch.einsum("hd,chd->hc", query, keys) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.einsum("hc,chd->hd", torch.softmax(scores, dim=-1), values)
