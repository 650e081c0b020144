"""LLMEngine: the synchronous step, as vLLM v1 draws it.

``step`` is ``scheduler.schedule()`` → ``executor.execute_model(scheduler_output)`` →
``scheduler.update_from_output(scheduler_output, runner_output)`` → the output processor (text, stop strings,
``RequestOutput``). Servers drive it through ``add_request`` / ``step`` / ``abort_request``; ``LLM.generate``
loops ``step`` until every request is done. Each ``step`` returns cumulative outputs of the requests that
advanced, so a caller can stream the text.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

from transformers import PreTrainedModel

from paged_backend.config import EngineConfig
from paged_backend.core.scheduler_output import SchedulerOutput
from paged_backend.core.sequence import SequenceStatus
from paged_backend.core.spec_chain import has_live_rows
from paged_backend.engine.async_steps import Arrivals, InFlight, queue_following, queue_next
from paged_backend.engine.engine_setup import (
    async_scheduling,
    eos_token_ids,
    input_embedding,
    make_executor,
    make_scheduler,
)
from paged_backend.engine.engine_stats import engine_stats
from paged_backend.engine.input_processor import InputProcessor, PromptType
from paged_backend.engine.output_processor import OutputProcessor
from paged_backend.engine.round_reader import Reading, read_round_step, round_to_read, unfinished
from paged_backend.engine.step_failures import StepError, step_failed, step_owners
from paged_backend.engine.weight_updates import WeightUpdates
from paged_backend.lora.request import LoRARequest
from paged_backend.model_loader import causal_lm_class, load_hf_config, load_tokenizer, model_max_length
from paged_backend.outputs import RequestOutput
from paged_backend.sampling_params import SamplingParams
from paged_backend.worker.async_output import AsyncModelRunnerOutput, ReadyOutput
from paged_backend.worker.attention import check_model_supported
from paged_backend.worker.kv_sizing import num_cpu_blocks, num_gpu_blocks

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "PromptType", "StepError"]


class LLMEngine:
    def __init__(self, config: EngineConfig, model: str | PreTrainedModel, tokenizer: Any = None) -> None:
        # What config.json and the tokenizer can refute fails before any weights load (minutes for a large model).
        if isinstance(model, str):
            hf_config = load_hf_config(config, model)
            model_class = causal_lm_class(hf_config)
            if model_class is not None:
                check_model_supported(model_class, hf_config)
            config.resolve(model_max_length(hf_config))
        self.tokenizer = load_tokenizer(config, model, tokenizer)
        self.executor = make_executor(config, model)
        # Stops tensor-parallel workers and takes LoRA's hooks off the model (which may outlive the engine).
        self._finalizer = weakref.finalize(self, self.executor.shutdown)
        self.model, self.device = self.executor.model, self.executor.device
        check_model_supported(self.model, self.model.config)
        self.config = config.resolve(model_max_length(self.model))
        self.max_model_len = self.config.max_model_len
        if self.device.type != "cuda":
            swap = "" if self.config.scheduler_config.preemption_mode == "swap" else "swap_space, "
            logger.info("running on %s: gpu_memory_utilization, %storch.compile and CUDA graphs have no effect here",
                        self.device, swap)  # fmt: skip
        self.executor.init_lora(self.config)
        self.lora_manager = self.executor.lora_manager
        spec = self.executor.kv_cache_spec(self.config)
        profile = functools.partial(self.executor.profile_num_gpu_blocks, self.config)
        num_blocks = num_gpu_blocks(self.config, spec, self.device, profile)
        num_swap_blocks = num_cpu_blocks(self.config, spec, self.device, num_blocks)
        self.executor.initialize_cache(self.config, num_blocks, num_swap_blocks)
        self.scheduler = make_scheduler(self.config, num_blocks, num_swap_blocks)
        self.asleep = False  # sleep(): no KV cache until wake_up()
        self.async_scheduling = async_scheduling(self.config, self.device)
        # Cached prefixes hold KV of the weights they were computed with, and a queued round was computed with the
        # weights of its time (see engine/weight_updates.py).
        watch = self.config.cache_config.enable_prefix_caching or self.async_scheduling
        self.weight_updates = WeightUpdates(self.model) if watch else None
        # async scheduling: a step queued on the device, its tokens not read yet (the next step reads them)
        self._in_flight: InFlight | None = None
        self._reading: Reading | None = None  # a round handed out a step at a time (``round_reader``)
        # set by whoever adds requests while the engine steps (``EngineLoop``): whether some wait to be added. Async
        # scheduling then queues nothing ahead of them that they could join (``queue_next``, ``queue_following``).
        self.arrivals: Arrivals | None = None
        self.vocab_size = self.model.config.get_text_config().vocab_size
        self.input_processor = InputProcessor(
            self.config,
            self.tokenizer,
            self.vocab_size,
            eos_token_ids(self.model, self.tokenizer),
            self.device,
            self.lora_manager,
            hf_tokenizer=self.tokenizer,
            embedding=input_embedding(self.config, self.model),
            kv_shape=(spec.num_layers, spec.num_kv_heads, spec.head_dim),
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.requests = self.output_processor.requests  # unfinished requests by id
        self.num_prompt_tokens = 0
        gib = num_blocks * spec.bytes_per_block(self.config.block_size) / 2**30
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB) on %s", num_blocks, self.config.block_size, gib,
                    self.device)  # fmt: skip

    def shutdown(self) -> None:
        """Stop tensor-parallel workers now and take LoRA's hooks off the model (both also happen when the
        engine is garbage-collected)."""
        self._finalizer()

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """A prompt is a string or ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}``."""
        return self.input_processor.tokenize(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
        keep_logits: bool = False,
    ) -> None:
        """Validate and queue a request; nothing is queued when validation fails. ``keep_logits`` keeps each
        generated token's raw logits row in the outputs (for HF's ``output_logits``; its batches then run one
        step at a time)."""
        if self.asleep:
            raise RuntimeError("the engine is asleep (sleep()): call wake_up() before adding requests")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        request = self.input_processor.process(request_id, prompt, params, lora_request, keep_logits)
        self.output_processor.add_request(request)
        self.scheduler.add_request(request)
        self.num_prompt_tokens += len(request.prompt_token_ids)

    def abort_request(self, request_id: str | list[str], cache_blocks: bool = True) -> None:
        """Drop requests (unknown ids are ignored, as in vLLM) and free their blocks (``cache_blocks``: see
        ``Scheduler.finish_seq``)."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            request = self.requests.pop(rid, None)
            for seq in request.seqs if request else []:
                if not seq.status.finished:
                    self.scheduler.finish_seq(seq, SequenceStatus.FINISHED_ABORTED, cache_blocks=cache_blocks)

    @property
    def num_generated_tokens(self) -> int:
        return self.output_processor.num_generated_tokens

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ the step
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one step; return the (cumulative) outputs of every request that advanced, or with
        ``finished_only`` just of those that finished (a snapshot of every running request each step costs more
        than the step's bookkeeping when nobody streams). With async scheduling the next step is queued on the
        device before this one's outputs are made: a multi-step round's successor before its tokens are read
        (``_queue_next``), any other step once they are counted (``_queue_following``); the step after reads it."""
        if self.weight_updates is not None and self.weight_updates.changed():
            self.scheduler.reset_prefix_cache()
            self._in_flight = self._reading = None  # queued with the old weights: its tokens are computed again
        self._reading = unfinished(self._reading)
        if self._reading is not None:  # a round read a step at a time (``round_reader``)
            return read_round_step(self, step_owners(self, self._reading.scheduler_output), finished_only)
        in_flight, self._in_flight = self._live_in_flight(), None
        if in_flight is None:
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.is_empty:
                if self.scheduler.has_unfinished_seqs():
                    raise RuntimeError("scheduler made no progress although requests are waiting")
                return []
        else:
            scheduler_output = in_flight[0]
        owners = step_owners(self, scheduler_output)
        try:
            pending = self._execute(scheduler_output) if in_flight is None else in_flight[1]
            self._reading = round_to_read(self, scheduler_output, pending, finished_only)
            if self._reading is None and self.async_scheduling:
                self._in_flight = self._queue_next((scheduler_output, pending))
            runner_output = pending.get_output() if self._reading is None else None
        except Exception as error:  # no token of the step was taken: its requests are redone, or fail
            self._in_flight = None
            failed = step_failed(self, owners, error, retry=True)
            if failed:
                raise StepError(failed, error) from error
            return []
        if runner_output is None:  # its failures are its own (``read_round_step``)
            return read_round_step(self, owners, finished_only)
        try:
            updates = self.scheduler.update_from_output(scheduler_output, runner_output)
            self._in_flight = self._live_in_flight()  # a chained step whose rows all turned out stale: dropped
            if self.async_scheduling and self._in_flight is None:
                self._in_flight = self._queue_following()
            for hit in self.output_processor.process_tokens(updates):
                self.scheduler.finish_seq(hit.seq, SequenceStatus.FINISHED_STOPPED, hit.stop, hit.num_tokens)
            self._in_flight = self._live_in_flight()
            return self.output_processor.make_outputs(updates, finished_only)
        except Exception as error:
            self._in_flight = None
            raise StepError(step_failed(self, owners, error, retry=False), error) from error

    def _queue_next(self, in_flight: InFlight, read: int = 0) -> InFlight | None:
        return queue_next(self.scheduler, self.executor, in_flight, self.arrivals, read)

    def _queue_following(self) -> InFlight | None:
        return queue_following(self.scheduler, self.executor, self.arrivals)

    def _live_in_flight(self) -> InFlight | None:
        """The queued step, unless no row of it is left to read (``spec_chain.has_live_rows``): then its work is
        dropped unread."""
        return self._in_flight if self._in_flight is not None and has_live_rows(self._in_flight[0]) else None

    def _execute(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        if self.async_scheduling:
            return self.executor.execute_model_async(scheduler_output)
        return ReadyOutput(self.executor.execute_model(scheduler_output))

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode, level 1: the KV cache, its cached prefixes and the CUDA graphs are freed; the
        weights are the user's model's and stay. Only an idle engine sleeps; until ``wake_up`` it takes no
        requests."""
        if level != 1:
            raise ValueError(
                f"sleep level must be 1, got {level!r}: level 2 would also move weights off the device, and the "
                "weights here are the user's model's (move the model yourself)"
            )
        if self.scheduler.has_unfinished_seqs():
            raise RuntimeError("the engine has requests in flight: let them finish or abort them before sleep()")
        if not self.asleep:
            self.scheduler.reset_prefix_cache()  # the KV they point to is about to go
            self._in_flight = self._reading = None  # a queued round of rows that all ended: dropped unread
            self.executor.sleep()
            self.asleep = True

    def wake_up(self) -> None:
        """The KV cache allocated again (and the CUDA graphs captured again); requests are taken again."""
        if self.asleep:
            self.executor.wake_up()
            self.asleep = False

    def stats(self) -> dict[str, Any]:
        return engine_stats(self)
