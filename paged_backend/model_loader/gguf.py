"""GGUF files (llama.cpp's one-file checkpoints) as models: read by transformers' own GGUF support (the ``gguf``
package), every weight dequantized once at load to the dtype the engine runs in.

vLLM's spellings both work: ``model="path/model.gguf"`` (the file; its folder is the checkpoint folder) and
``model=folder_or_hub_id, gguf_file="model.gguf"`` (transformers' own). Config, tokenizer (chat template included)
and weights all come from the file; ``tokenizer=`` still overrides the tokenizer. The engine then runs a plain
model: GGUF's int4/int8 blocks are not kept packed (no GGUF kernels), so a model needs the memory of its
dequantized weights (2 bytes a parameter in bf16). Newer transformers can keep GGUF weights packed
(``GgufConfig(dequantize=False)`` with the ``kernels`` package); the engine asks for ``dequantize=True``, so the
model's linears stay ``nn.Linear`` on every transformers 5.x.

What cannot be read fails with the reason: the ``gguf`` package missing (the ``[gguf]`` extra), an architecture
transformers does not map, or a tensor type the ``gguf`` package cannot dequantize, each named with what is read.
"""

from __future__ import annotations

import copy
import errno
import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from paged_backend.paths import is_gguf_path


@dataclass(frozen=True)
class GGUFSource:
    """Where transformers reads a GGUF checkpoint: ``from_pretrained(folder, gguf_file=file)``. ``folder`` is a
    local folder or a hub id, ``file`` the name inside it."""

    folder: str
    file: str

    @property
    def path(self) -> str:
        return os.path.join(self.folder, self.file)


def gguf_source(model: str, gguf_file: str | None) -> GGUFSource | None:
    """The GGUF file ``model`` (with ``gguf_file``) names, or None for any other checkpoint. A ``.gguf`` path must
    be a file that exists (named at once, before any hub lookup)."""
    if gguf_file is not None:
        return GGUFSource(os.path.expanduser(model), gguf_file)
    if not is_gguf_path(model):
        return None
    path = os.path.expanduser(model)
    if not os.path.isfile(path):
        raise FileNotFoundError(errno.ENOENT, "no such GGUF file", model)
    return GGUFSource(os.path.dirname(os.path.abspath(path)), os.path.basename(path))


def require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("reading a GGUF file needs the gguf package: pip install 'paged-backend[gguf]'")


def readable_tensor_types() -> list[str]:
    """The GGUF tensor types the installed ``gguf`` package dequantizes (what transformers reads through it)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    readable = []
    for qtype in GGMLQuantizationType:
        try:
            dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
        except NotImplementedError:
            continue
        readable.append(qtype.name)
    return readable


def readable_architectures() -> list[str]:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))


def unreadable(source: GGUFSource, exc: Exception) -> ValueError:
    """transformers' refusal of a GGUF file, with the file's name and what transformers reads instead."""
    import transformers

    if isinstance(exc, NotImplementedError):  # the gguf package's: "Dequantization for Q8_1 is not ..."
        allowed = f"; the gguf package dequantizes the tensor types {readable_tensor_types()}"
    elif "architecture" in str(exc):  # transformers': "GGUF model with architecture rwkv6 is not supported yet."
        allowed = f"; transformers {transformers.__version__} reads the GGUF architectures {readable_architectures()}"
    else:
        allowed = ""
    return ValueError(f"{source.path} cannot be read: {str(exc).rstrip('.')}{allowed}")


@functools.lru_cache(maxsize=4)
def _gguf_config(folder: str, file: str, trust_remote_code: bool) -> PretrainedConfig:
    source = GGUFSource(folder, file)
    try:
        return AutoConfig.from_pretrained(folder, gguf_file=file, trust_remote_code=trust_remote_code)
    except (ValueError, NotImplementedError) as exc:
        raise unreadable(source, exc) from exc


def gguf_config(source: GGUFSource, trust_remote_code: bool) -> PretrainedConfig:
    """The file's config (parsed once a file: the metadata of a large vocabulary takes seconds to read)."""
    require_gguf()
    return copy.deepcopy(_gguf_config(source.folder, source.file, trust_remote_code))


def model_kwargs(source: GGUFSource) -> dict[str, Any]:
    """``from_pretrained`` arguments that load the file dequantized: ``GgufConfig(dequantize=True)`` where
    transformers has it (it may otherwise keep the blocks packed), nothing more where it always dequantizes."""
    kwargs: dict[str, Any] = {"gguf_file": source.file}
    try:
        from transformers import GgufConfig  # type: ignore[attr-defined,unused-ignore]
    except ImportError:
        return kwargs
    kwargs["quantization_config"] = GgufConfig(dequantize=True)
    return kwargs


def as_plain_model(model: PreTrainedModel) -> PreTrainedModel:
    """A model loaded from GGUF, dequantized, told so: no quantizer or ``quantization_config`` left to make
    transformers treat it as packed (``save_pretrained`` refuses a model that has them)."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.__dict__["hf_quantizer"] = None  # a plain attribute (nn.Module's __setattr__ is typed for tensors)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    return model


def save_as_checkpoint(source: GGUFSource, output_dir: str, dtype: torch.dtype) -> None:
    """Write the GGUF file as an ordinary transformers checkpoint folder (safetensors in ``dtype``, config, the
    file's tokenizer and chat template): later loads read plain tensors instead of parsing and dequantizing the
    file again."""
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    require_gguf()
    with tqdm(total=3, desc=f"converting {source.file}", unit="step") as bar:
        bar.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(source.folder, gguf_file=source.file)
        bar.update(1)
        bar.set_postfix_str(f"weights, dequantized to {dtype}")
        try:
            model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=dtype, **model_kwargs(source))
        except (ValueError, NotImplementedError) as exc:
            raise unreadable(source, exc) from exc
        bar.update(1)
        bar.set_postfix_str("writing")
        as_plain_model(model).save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
        bar.update(1)
