"""One device's share of the engine: the model, its LoRA indices, the KV cache and the model runner.

The engine reaches the device side only through ``Executor``: a single-device ``Worker`` is one, and so is the
tensor-parallel ``TPExecutor`` (``distributed/tp_executor.py``), whose every rank holds a ``Worker``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Protocol

import torch
from transformers import PreTrainedModel

from paged_backend.config import EngineConfig, FieldError
from paged_backend.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from paged_backend.lora.manager import LoRAManager, max_lora_tokens
from paged_backend.model_loader.tp_plan import head_layout
from paged_backend.quantization.compressed_tensors import KV_CACHE_SCALES_ATTR
from paged_backend.worker.async_output import AsyncModelRunnerOutput
from paged_backend.worker.cache_engine import CacheEngine, KVCacheSpec
from paged_backend.worker.draft_runner import DraftRunner, ProposingOutput
from paged_backend.worker.model_runner import ModelRunner
from paged_backend.worker.profiler import gpu_blocks_that_fit

logger = logging.getLogger(__name__)

# torch's own type for device errors, where this torch has one (2.8 and later)
_DEVICE_ERRORS: tuple[type[Exception], ...] = tuple(
    e for e in [getattr(torch, "AcceleratorError", None)] if isinstance(e, type) and issubclass(e, Exception)
)


class Executor(Protocol):
    """What the engine asks of the device side: LoRA indices, the KV cache's size and allocation, steps, the end."""

    model: PreTrainedModel  # rank 0's
    device: torch.device
    lora_manager: LoRAManager | None  # rank 0's: it reads a request's adapter when the request is added

    def init_lora(self, config: EngineConfig) -> None: ...

    def kv_cache_spec(self, config: EngineConfig) -> KVCacheSpec: ...

    def profile_num_gpu_blocks(self, config: EngineConfig, block_bytes: int) -> int: ...

    def initialize_cache(self, config: EngineConfig, num_gpu_blocks: int, num_cpu_blocks: int) -> None: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        """``execute_model``, except that a multi-step round is only queued (async scheduling)."""
        ...

    def is_recoverable(self, error: Exception) -> bool:
        """Whether the engine can go on after ``execute_model`` raised ``error`` (failing only that step's
        requests), or the device side is in an unknown state and the engine must stop."""
        ...

    def shutdown(self) -> None: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...


class Worker:
    def __init__(
        self,
        model: PreTrainedModel,
        device: torch.device,
        world_size: int = 1,
        draft_model: PreTrainedModel | None = None,  # speculative decoding's, on ``device``
    ) -> None:
        self.model = model
        self.device = device
        self.world_size = world_size
        self.draft_model = draft_model
        self.lora_manager: LoRAManager | None = None
        self._model_runner: ModelRunner | None = None
        self.draft_runner: DraftRunner | None = None
        self.agree: Callable[[int], int] | None = None  # tensor parallelism: a value's minimum over the ranks

    @property
    def model_runner(self) -> ModelRunner:
        if self._model_runner is None:
            raise RuntimeError("the KV cache is not initialized yet: call initialize_cache first")
        return self._model_runner

    def init_lora(self, config: EngineConfig) -> None:
        """LoRA indices (device copies of up to max_loras adapters), made before the KV cache is sized so that their
        memory counts."""
        if config.lora_config.enable_lora and self.lora_manager is None:
            tokens = max_lora_tokens(config)
            self.lora_manager = LoRAManager(self.model, config.lora_config, self.device, self.model.dtype, tokens)

    def kv_cache_spec(self, config: EngineConfig) -> KVCacheSpec:
        """This device's KV geometry: under tensor parallelism, its share of the KV heads."""
        spec = KVCacheSpec.from_config(self.model.config, self.model.dtype, config.cache_config.kv_cache_dtype)
        if spec.scaled and self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise FieldError(
                "kv_cache_dtype",
                "kv_cache_dtype='fp8' needs a GPU with fp8 (compute capability 8.9 or later: Ada, Hopper); "
                f"{torch.cuda.get_device_name(self.device)} has {torch.cuda.get_device_capability(self.device)}",
            )
        if self.draft_model is not None:  # its cache in the draft's own dtype, block for block beside this one
            draft = KVCacheSpec.from_config(self.draft_model.config, self.draft_model.dtype)
            spec = dataclasses.replace(spec, draft=draft)
        if self.world_size == 1:
            return spec
        local = head_layout(self.model.config.get_text_config(), self.world_size).local_kv_heads
        return dataclasses.replace(spec, num_kv_heads=local)

    def profile_num_gpu_blocks(self, config: EngineConfig, block_bytes: int) -> int:
        """KV blocks that fit beside the weights and the activation peak (with every token's LoRA delta)."""
        lora = self.lora_manager
        if lora is not None:
            lora.profile_step()
        try:
            return gpu_blocks_that_fit(self.model, config, self.device, block_bytes)
        finally:
            if lora is not None:
                lora.clear_step()

    def initialize_cache(self, config: EngineConfig, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        spec = self.kv_cache_spec(config)
        cache_engine = CacheEngine(spec, num_gpu_blocks, config.block_size, self.device, num_cpu_blocks)
        try:
            self._make_runners(config, spec, cache_engine, num_gpu_blocks, num_cpu_blocks)
        except BaseException:
            cache_engine.swap_space.join()  # its thread must not pin on past a start that failed
            raise

    def _make_runners(
        self,
        config: EngineConfig,
        spec: KVCacheSpec,
        cache_engine: CacheEngine,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
    ) -> None:
        """The draft's runner (speculative decoding with a draft model) and the model runner over the cache."""
        self._use_checkpoint_kv_scales(config, cache_engine)
        draft = config.speculative_config
        if self.draft_model is not None and spec.draft is not None and draft is not None:
            check_draft_positions(self.draft_model, config.max_model_len)
            self.draft_runner = DraftRunner(
                self.draft_model,
                spec.draft,
                num_gpu_blocks,
                config.block_size,
                self.device,
                num_cpu_blocks,
                draft.num_speculative_tokens,
                proposal_rows(config),
                config.max_model_len,
                round_steps=config.scheduler_config.num_scheduler_steps,
                use_graphs=self.device.type == "cuda" and not config.device_config.enforce_eager,
            )
        self._model_runner = ModelRunner(
            self.model,
            cache_engine,
            self.device,
            enforce_eager=config.device_config.enforce_eager,
            batch_invariant=config.model_config.batch_invariant,
            max_num_seqs=config.scheduler_config.max_num_seqs,
            max_model_len=config.max_model_len,
            num_scheduler_steps=config.scheduler_config.num_scheduler_steps,
            lora_manager=self.lora_manager,
            seed=config.model_config.seed,
            calculate_kv_scales=config.cache_config.calculate_kv_scales,
            logprobs_mode=config.model_config.logprobs_mode,
            verify_shape=verify_shape(config),
            lookup_ngrams=lookup_ngrams(config),
            max_num_batched_tokens=config.max_num_batched_tokens,
            agree=self.agree,
        )
        if self.draft_runner is not None:  # after the target's set-up, which may pack weights the draft shares
            self.draft_runner.capture_graphs()

    def _use_checkpoint_kv_scales(self, config: EngineConfig, cache_engine: CacheEngine) -> None:
        """A checkpoint's own fp8 KV-cache scales (compressed-tensors' ``kv_cache_scheme``) start an fp8 cache;
        with another cache dtype they are not used, and the log says so."""
        scales: dict[int, tuple[float, float]] | None = getattr(self.model, KV_CACHE_SCALES_ATTR, None)
        if not scales:
            return
        if cache_engine.kv_scales is None:
            logger.info("the checkpoint has fp8 KV-cache scales: they apply with kv_cache_dtype='fp8'")
            return
        if config.cache_config.calculate_kv_scales:
            raise FieldError(
                "calculate_kv_scales",
                "the checkpoint has its own KV-cache scales: calculate_kv_scales=True would replace them (choose one)",
            )
        for layer, (k_scale, v_scale) in enumerate(cache_engine.kv_scales):
            if layer not in scales:
                raise ValueError(f"the checkpoint's KV-cache scales lack layer {layer}")
            k_scale.fill_(scales[layer][0])
            v_scale.fill_(scales[layer][1])

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output).get_output()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        if self.draft_runner is None:
            return self.model_runner.execute_model_async(scheduler_output)
        self.draft_runner.move_blocks(scheduler_output.batch)
        step = self.model_runner.execute_model_async(scheduler_output)
        return ProposingOutput(step, self.draft_runner, scheduler_output)

    def sleep(self) -> None:
        if self.draft_runner is not None:  # first: the target's sleep gives the freed memory back to the device
            self.draft_runner.sleep()
        self.model_runner.sleep()

    def wake_up(self) -> None:
        if self.draft_runner is not None:
            self.draft_runner.wake_up()
        self.model_runner.wake_up()

    def is_recoverable(self, error: Exception) -> bool:
        """Any error but the device's own: after an illegal address or a device-side assert the CUDA context is
        lost for good, while an out-of-memory error or a bad value leaves the next step to run normally."""
        if isinstance(error, _DEVICE_ERRORS):
            return False
        text = str(error)
        return not ("CUDA error" in text or "device-side assert" in text)

    def shutdown(self) -> None:
        """Take LoRA's hooks off the model: it may be the user's and outlive the engine."""
        if self.lora_manager is not None:
            self.lora_manager.close()


def verify_shape(config: EngineConfig) -> tuple[int, int] | None:
    """Speculative decoding's graphs: rows of its proposals plus one token, as many as a step with proposals has
    and its token budget holds at k proposals a row (each bucket keeps every token's logits: rows past the budget
    would hold memory for steps that never come; a step of many short rows replays a prompt-step graph)."""
    spec = config.speculative_config
    if spec is None or config.lora_config.enable_lora:  # LoRA's per-token adapter indices are not padded alike
        return None
    q_len = spec.num_speculative_tokens + 1
    return q_len, max(1, min(proposal_rows(config), config.max_num_batched_tokens // q_len))


def lookup_ngrams(config: EngineConfig) -> tuple[int, int] | None:
    """Prompt lookup's n-gram sizes where its rounds run on the device (one worker: core/lookup_round.py), for
    their CUDA graphs."""
    spec = config.speculative_config
    if spec is None or spec.method != "ngram" or config.parallel_config.tensor_parallel_size > 1:
        return None
    return spec.ngram_sizes()


def check_draft_positions(draft: PreTrainedModel, max_model_len: int) -> None:
    """The draft reads every position the target does: its own limit must reach ``max_model_len``."""
    limit = getattr(draft.config.get_text_config(), "max_position_embeddings", None)
    if isinstance(limit, int) and limit < max_model_len:
        raise FieldError(
            "speculative_config.model",
            f"the draft model takes {limit} positions (max_position_embeddings) but max_model_len is "
            f"{max_model_len}: lower max_model_len to {limit} or use a draft of a longer context",
        )


def proposal_rows(config: EngineConfig) -> int:
    """The most rows a step with proposals has: a larger batch gets none."""
    rows = config.scheduler_config.max_num_seqs
    spec = config.speculative_config
    if spec is not None and spec.disable_by_batch_size is not None:
        rows = min(rows, spec.disable_by_batch_size - 1)
    return max(1, rows)
