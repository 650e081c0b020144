"""One frozen, validated configuration tree, built once from ``LLM(...)`` keyword arguments.

Every field is checked here so that bad input fails early with a message naming the field and the allowed
range; the rest of the engine trusts these values. Fields that depend on the loaded model (``max_model_len``,
``max_num_batched_tokens`` defaults) are resolved later with :func:`dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from paged_backend.field_checks import FieldError, check_bool, check_choice, check_float, check_int
from paged_backend.paths import is_gguf_path
from paged_backend.reasoning import REASONING_PARSERS

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")

DTYPES = ("auto", "float32", "float16", "bfloat16", "float", "half")
QUANTIZATIONS = (None, "awq", "gptq", "compressed-tensors", "fp8")
LOAD_FORMATS = ("auto", "dummy")
PREEMPTION_MODES = (None, "recompute", "swap")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names; auto: the model's dtype
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass(frozen=True)
class ModelConfig:
    """What to load and how. ``model`` is a path or hub id; a loaded model object travels separately."""

    model: str
    tokenizer: str | None = None
    trust_remote_code: bool = False
    dtype: str = "auto"
    # "awq" / "gptq" / "compressed-tensors" / "fp8": the checkpoint's own (found in its config when None); "fp8" on an
    # unquantized checkpoint: quantized at load
    quantization: str | None = None
    max_model_len: int | None = None
    seed: int = 0
    load_format: str = "auto"  # "dummy": the config's architecture with random weights (benchmarks), as in vLLM
    skip_tokenizer_init: bool = False  # no tokenizer: token-id prompts only, outputs without text
    # deepseek_r1 or qwen3 (vLLM's): a structured output's grammar starts after the model's </think>
    reasoning_parser: str | None = None
    # vLLM's: reported logprobs come from the model's own logits ("raw_logprobs"), or from the distribution a
    # token was drawn from, after penalties, temperature and top-k / top-p / min-p ("processed_logprobs": what an
    # RL trainer's importance ratio wants)
    logprobs_mode: str = "raw_logprobs"
    # vLLM's: prompts may be embeddings ({"prompt_embeds": [L, hidden] tensor}) instead of token ids
    enable_prompt_embeds: bool = False
    # a request's tokens and logprobs independent of its batch, chunking, prefix hits and preemption
    # (worker/batch_invariant.py: fixed blocks of rows on a GPU, a row at a time on a CPU)
    batch_invariant: bool = False
    # transformers' name: the GGUF file inside the folder or hub repo ``model`` (``model="x.gguf"`` names a local
    # file directly); config, tokenizer and weights come from it, dequantized at load (model_loader/gguf.py)
    gguf_file: str | None = None

    def __post_init__(self) -> None:
        check_bool("trust_remote_code", self.trust_remote_code)
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("quantization", self.quantization, QUANTIZATIONS)
        check_choice("load_format", self.load_format, LOAD_FORMATS)
        check_bool("skip_tokenizer_init", self.skip_tokenizer_init)
        check_choice("reasoning_parser", self.reasoning_parser, (None, *REASONING_PARSERS))
        check_choice("logprobs_mode", self.logprobs_mode, LOGPROBS_MODES)
        check_bool("enable_prompt_embeds", self.enable_prompt_embeds)
        check_bool("batch_invariant", self.batch_invariant)
        if self.batch_invariant and self.quantization is not None:
            raise FieldError("batch_invariant", "batch_invariant runs unquantized linear layers: quantization=None")
        check_int("max_model_len", self.max_model_len, 1, allow_none=True)
        check_int("seed", self.seed, 0, 2**63 - 1)
        if self.gguf_file is not None:
            if not isinstance(self.gguf_file, str) or not is_gguf_path(self.gguf_file):
                raise FieldError("gguf_file", f"gguf_file must be a file name ending in .gguf, got {self.gguf_file!r}")
            if is_gguf_path(self.model):
                raise FieldError(
                    "gguf_file",
                    f"gguf_file names the file inside the folder model; model is already a GGUF file ({self.model!r})",
                )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry and sizing."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    swap_space: float = 4
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    kv_cache_memory_gib: float = 1.0
    # "fp8" / "fp8_e4m3": keys and values stored as float8_e4m3fn, a scale per KV head (1.0, or from the first
    # step with calculate_kv_scales); the cache holds twice the tokens of a bf16 one, attention reads them back in
    # the model's dtype. "auto": the model's dtype.
    kv_cache_dtype: str = "auto"
    # fp8 only: set each layer's scales from the first step's keys and values (vLLM's calculate_kv_scales)
    calculate_kv_scales: bool = False

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size, 1, 256)
        if self.block_size & (self.block_size - 1):
            raise FieldError("block_size", f"block_size must be a power of two in [1, 256], got {self.block_size!r}")
        check_float("gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_open=True)
        check_float("swap_space", self.swap_space, 0.0, 1024.0)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_int("num_kv_blocks", self.num_kv_blocks, 1, allow_none=True)
        check_float("kv_cache_memory_gib", self.kv_cache_memory_gib, 0.0, 4096.0, low_open=True)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        check_bool("calculate_kv_scales", self.calculate_kv_scales)
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise FieldError("calculate_kv_scales", "calculate_kv_scales needs kv_cache_dtype='fp8' (scales are fp8's)")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step budgets of the continuous-batching scheduler."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    # Decode steps run back to back on the device per scheduling round (vLLM's multi-step scheduling), for
    # batches where every sequence decodes greedily without penalties or logprobs.
    num_scheduler_steps: int = 8
    # What preemption does with a request's KV: "swap" copies its blocks to swap_space (pinned CPU memory) and
    # back; "recompute" drops them and prefills again. None: swap on a GPU when swap_space > 0 and the KV cache
    # is smaller than max_num_seqs sequences of max_model_len (one that size never preempts), else recompute.
    preemption_mode: str | None = None
    # vLLM's: above 0, a request's prompt goes in chunks of at most this many tokens a step, so that a long prompt
    # arriving beside running decodes lengthens each of their steps by at most this much (inter-token latency)
    long_prefill_token_threshold: int = 0
    # vLLM's: the next step is queued on the device before the host has made this one's outputs (the next
    # multi-step round before this one's tokens are read), so the host's bookkeeping runs while the device
    # computes (a row that stopped meanwhile is computed for nothing). None: on for a single GPU, off elsewhere
    # (a CPU computes the queued step before it can read this one).
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs, 1)
        if self.async_scheduling is not None:
            check_bool("async_scheduling", self.async_scheduling)
        check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, allow_none=True)
        check_int("num_scheduler_steps", self.num_scheduler_steps, 1, 64)
        check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"  # "mp": local worker processes; "ray": actors on a Ray cluster
    disable_custom_all_reduce: bool = False  # True: NCCL for every all-reduce (see distributed/all_reduce.py)

    def __post_init__(self) -> None:
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        check_choice("distributed_executor_backend", self.distributed_executor_backend, ("mp", "ray"))
        check_bool("disable_custom_all_reduce", self.disable_custom_all_reduce)


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = False
    max_loras: int = 4  # distinct adapters in one step (device slots)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept in CPU memory (LRU); None: all that were used

    def __post_init__(self) -> None:
        check_bool("enable_lora", self.enable_lora)
        check_int("max_loras", self.max_loras, 1)
        check_int("max_lora_rank", self.max_lora_rank, 1)
        check_int("max_cpu_loras", self.max_cpu_loras, self.max_loras, allow_none=True)


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "auto"
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        ok = isinstance(self.device, str) and (
            self.device in ("auto", "cpu", "cuda") or (self.device.startswith("cuda:") and self.device[5:].isdigit())
        )
        if not ok:
            raise FieldError("device", f"device must be one of ['auto', 'cpu', 'cuda', 'cuda:N'], got {self.device!r}")
        check_bool("enforce_eager", self.enforce_eager)


SPECULATIVE_METHODS = ("ngram", "draft_model")
DEFAULT_PROMPT_LOOKUP = (2, 4)  # (prompt_lookup_min, prompt_lookup_max) when neither is given


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config``: each step proposes up to ``num_speculative_tokens`` tokens per decoding
    sequence, which one forward verifies. ``ngram`` (prompt lookup) proposes the tokens that followed the last
    earlier occurrence of the sequence's last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens (repeated as a
    period where they run out before ``num_speculative_tokens``); as in vLLM,
    one of the two given stands for both, and with neither given the n-grams are 2 to 4 tokens long (vLLM: 5 to
    5), which on the real model pays best where a verifying step costs two to three decoded tokens
    (docs/benchmarks.md, "Prompt lookup's shortest n-gram"). Proposals
    stop where they do not pay: for the whole step from ``disable_by_batch_size`` running sequences, and for a
    sample whose proposals are seldom taken (core/spec_decode.py); steps where no sample is proposed for run as
    usual (multi-step rounds, async scheduling)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # vLLM's: no proposals in a step where this many sequences run or more (a large batch's step is bound by
    # compute, and every rejected proposal costs it); None: never switched off by the batch
    disable_by_batch_size: int | None = 32
    # draft_model: a checkpoint path or a loaded HF causal LM sharing the target's tokenizer
    model: Any = None

    def __post_init__(self) -> None:
        check_choice("speculative_config.method", self.method, SPECULATIVE_METHODS)
        check_int("speculative_config.disable_by_batch_size", self.disable_by_batch_size, 1, allow_none=True)
        if (self.method == "draft_model") != (self.model is not None):
            raise FieldError(
                "speculative_config.model",
                "speculative_config.model (a checkpoint path or a loaded model) is needed by method 'draft_model' "
                f"and by no other method; got method {self.method!r} with model {type(self.model).__name__}",
            )
        check_int("speculative_config.num_speculative_tokens", self.num_speculative_tokens, 1, 32)
        check_int("speculative_config.prompt_lookup_min", self.prompt_lookup_min, 1, 64, allow_none=True)
        check_int("speculative_config.prompt_lookup_max", self.prompt_lookup_max, 1, 64, allow_none=True)
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low, high = DEFAULT_PROMPT_LOOKUP
        low, high = low or high, high or low  # one given stands for both
        assert low is not None and high is not None
        check_int("speculative_config.prompt_lookup_max", high, low, 64)
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    def ngram_sizes(self) -> tuple[int, int]:
        """(prompt_lookup_min, prompt_lookup_max), both set once the config is made."""
        assert self.prompt_lookup_min is not None and self.prompt_lookup_max is not None
        return self.prompt_lookup_min, self.prompt_lookup_max

    @classmethod
    def of(cls, value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        """From ``LLM(speculative_config=...)``: a dict of vLLM's keys (an unknown key is an error naming it)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise FieldError("speculative_config", f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise FieldError(
                "speculative_config", f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}"
            )
        return cls(**value)


def getattr_any(config: EngineConfig, name: str) -> object:
    """A field's value by name, from whichever section holds it."""
    for section in _SECTIONS:
        value = getattr(config, section)
        if hasattr(value, name):
            return getattr(value, name)
    raise AttributeError(name)


_SECTIONS: dict[str, type] = {
    "model_config": ModelConfig,
    "cache_config": CacheConfig,
    "scheduler_config": SchedulerConfig,
    "parallel_config": ParallelConfig,
    "lora_config": LoRAConfig,
    "device_config": DeviceConfig,
}


@dataclass(frozen=True)
class EngineConfig:
    """The whole engine's configuration, passed down as one object."""

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            self._check_speculation()
        if self.scheduler_config.preemption_mode == "swap" and self.cache_config.swap_space == 0:
            raise FieldError(
                "preemption_mode", "preemption_mode='swap' needs swap_space > 0 (GiB of CPU memory for swapped blocks)"
            )
        if self.model_config.batch_invariant and (
            self.lora_config.enable_lora or self.parallel_config.tensor_parallel_size > 1
        ):
            raise FieldError(
                "batch_invariant", "batch_invariant needs enable_lora=False and tensor_parallel_size=1 (for now)"
            )
        if self.model_config.batch_invariant and self.cache_config.calculate_kv_scales:
            raise FieldError(
                "batch_invariant",
                "batch_invariant needs calculate_kv_scales=False (the scales would come from the first step's batch)",
            )
        if self.scheduler_config.async_scheduling and self.parallel_config.tensor_parallel_size > 1:
            raise FieldError("async_scheduling", "async_scheduling needs tensor_parallel_size=1 (for now)")
        if self.model_config.enable_prompt_embeds and self.parallel_config.tensor_parallel_size > 1:
            raise FieldError(
                "enable_prompt_embeds", "enable_prompt_embeds needs tensor_parallel_size=1 (embeddings stay on rank 0)"
            )

    def _check_speculation(self) -> None:
        """What speculative decoding does not run beside yet, refused by name."""
        others = {
            "tensor_parallel_size": self.parallel_config.tensor_parallel_size > 1,
            "batch_invariant": self.model_config.batch_invariant,
        }
        clash = [name for name, on in others.items() if on]
        if clash:
            raise FieldError(
                "speculative_config",
                "speculative_config needs tensor_parallel_size=1 and batch_invariant=False (for now); got "
                + ", ".join(f"{n}={getattr_any(self, n)!r}" for n in clash),
            )

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Split flat ``LLM(...)`` kwargs into sections; an unknown name is a TypeError naming it."""
        speculative = SpeculativeConfig.of(kwargs.pop("speculative_config", None))
        owners = {f.name: section for section, kind in _SECTIONS.items() for f in dataclasses.fields(kind)}
        unknown = sorted(set(kwargs) - set(owners))
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {unknown}; accepted: {sorted(set(owners) - {'model'})}")
        grouped: dict[str, dict[str, Any]] = {section: {} for section in _SECTIONS}
        for name, value in kwargs.items():
            grouped[owners[name]][name] = value
        return cls(
            **{
                section: _SECTIONS[section](**values)
                for section, values in grouped.items()
                if section != "model_config"
            },
            model_config=ModelConfig(model=model, **grouped["model_config"]),
            speculative_config=speculative,
        )

    @property
    def block_size(self) -> int:
        return self.cache_config.block_size

    @property
    def max_model_len(self) -> int:
        """Resolved context limit; only valid after :meth:`resolve`."""
        assert self.model_config.max_model_len is not None, "EngineConfig.resolve() has not run"
        return self.model_config.max_model_len

    @property
    def max_num_batched_tokens(self) -> int:
        assert self.scheduler_config.max_num_batched_tokens is not None, "EngineConfig.resolve() has not run"
        return self.scheduler_config.max_num_batched_tokens

    @property
    def max_tokens_per_forward(self) -> int:
        """The most tokens one forward carries: a step's token budget (its default before ``resolve``) or a padded
        decode batch. Buffers every forward reads (LoRA's token slots, the all-reduce's) are sized by it."""
        budget = self.scheduler_config.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        return max(budget, self.scheduler_config.max_num_seqs)

    def resolve(self, model_max_len: int | None) -> EngineConfig:
        """Fill model-dependent defaults: ``max_model_len`` from the model, the token budget from vLLM's default."""
        max_model_len = self.model_config.max_model_len
        if max_model_len is None:
            if model_max_len is None:
                raise FieldError(
                    "max_model_len", "max_model_len must be given: the model config states no maximum length"
                )
            max_model_len = model_max_len
        elif model_max_len is not None and max_model_len > model_max_len:
            raise FieldError(
                "max_model_len",
                f"max_model_len must be <= the model's maximum length {model_max_len}, got {max_model_len}",
            )
        budget = self.scheduler_config.max_num_batched_tokens
        if budget is None:
            budget = DEFAULT_MAX_NUM_BATCHED_TOKENS
        return dataclasses.replace(
            self,
            model_config=dataclasses.replace(self.model_config, max_model_len=max_model_len),
            scheduler_config=dataclasses.replace(self.scheduler_config, max_num_batched_tokens=budget),
        )
