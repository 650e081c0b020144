"""LLMEngine: the synchronous step loop (schedule -> forward -> sample -> detokenize -> outputs).

Servers drive it through ``add_request`` / ``step`` / ``abort_request``; ``LLM.generate`` loops ``step`` until
every request is done. Each ``step`` returns cumulative outputs of the requests that advanced, so a caller can
stream the text.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from paged_backend.attention import check_model_supported
from paged_backend.config import EngineConfig
from paged_backend.core.block_manager import BlockManager
from paged_backend.core.scheduler import Scheduler, SchedulerOutput
from paged_backend.distributed.tp_runner import TPGroup, TPModelRunner, local_kv_spec
from paged_backend.engine.detokenizer import (
    detokenize_incrementally,
    find_stop_string,
    init_offsets,
    visible_text,
)
from paged_backend.engine.sequence import Request, Sequence, SequenceStatus
from paged_backend.lora.manager import LoRAManager, lora_slot_tokens
from paged_backend.lora.request import LoRARequest
from paged_backend.model_loader import load_model, load_tokenizer, model_max_length
from paged_backend.model_loader.sharded import check_tp_support
from paged_backend.outputs import CompletionOutput, Logprob, RequestOutput
from paged_backend.sampler import Sampler, SampleResult, to_host
from paged_backend.sampling_params import SamplingParams
from paged_backend.worker.cache_engine import CacheEngine, KVCacheSpec
from paged_backend.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

PromptType = str | Mapping[str, Any]


class LLMEngine:
    def __init__(self, config: EngineConfig, model: str | PreTrainedModel, tokenizer: Any = None) -> None:
        world_size = config.parallel_config.tensor_parallel_size
        if world_size > 1 and not isinstance(model, str):
            raise ValueError(
                "tensor_parallel_size > 1 loads the model in every worker process: pass model as a path or hub id"
            )
        self.tp_group: TPGroup | None = None
        if world_size > 1:
            check_tp_support(config, model)  # before any process starts
            self.tp_group = TPGroup.start(config, model)
            self.model, self.device = self.tp_group.load(config, model), self.tp_group.device
        else:
            self.model, self.device = load_model(config, model)
        check_model_supported(self.model)
        self.tokenizer = load_tokenizer(config, model, tokenizer)
        self.config = config.resolve(model_max_length(self.model))
        self.max_model_len = self.config.max_model_len
        self._log_inactive_options()

        self.lora_manager: LoRAManager | None = None
        if self.config.lora_config.enable_lora:
            # Before the KV cache is sized, so its slots count.
            self.lora_manager = LoRAManager(
                self.model, self.config.lora_config, self.device, self.model.dtype, lora_slot_tokens(self.config)
            )
            weakref.finalize(self, self.lora_manager.close)

        block_size = self.config.block_size
        spec = (
            local_kv_spec(self.model, world_size)
            if world_size > 1
            else KVCacheSpec.from_config(self.model.config, self.model.dtype)
        )
        num_blocks = self._num_kv_blocks(spec)
        per_seq = math.ceil(self.config.max_model_len / block_size)
        if num_blocks < per_seq:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks ({num_blocks * block_size} tokens) but one sequence of "
                f"max_model_len={self.config.max_model_len} needs {per_seq} blocks: lower max_model_len or give the "
                "cache more memory (num_kv_blocks, kv_cache_memory_gib or gpu_memory_utilization)"
            )
        num_cpu_blocks = self._num_swap_blocks(spec)
        if self.tp_group is not None:
            self.tp_group.send("init_cache", self.config, num_blocks, num_cpu_blocks)
        self.cache_engine = CacheEngine(spec, num_blocks, block_size, self.device, num_cpu_blocks)
        self.block_manager = BlockManager(
            num_blocks,
            block_size,
            enable_prefix_caching=self.config.cache_config.enable_prefix_caching,
            num_cpu_blocks=num_cpu_blocks,
        )
        self.scheduler = Scheduler(self.config, self.block_manager)
        self.runner = ModelRunner(
            self.model,
            self.cache_engine,
            self.device,
            enforce_eager=self.config.device_config.enforce_eager,
            max_num_seqs=self.config.scheduler_config.max_num_seqs,
            max_model_len=self.config.max_model_len,
            num_scheduler_steps=self.config.scheduler_config.num_scheduler_steps,
        )
        if self.tp_group is not None:
            self.runner = TPModelRunner(self.runner, self.tp_group, self.lora_manager)
        self.sampler = Sampler(self.device, self.config.model_config.seed)
        self.eos_token_ids = self._eos_token_ids()
        self.vocab_size = self.model.config.get_text_config().vocab_size
        self.requests: dict[str, Request] = {}
        self._seq_counter = itertools.count()
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB) on %s",
            num_blocks,
            block_size,
            num_blocks * spec.bytes_per_block(block_size) / 2**30,
            self.device,
        )

    def shutdown(self) -> None:
        """Stop tensor-parallel workers now (they also stop when the engine is garbage-collected or at exit) and
        take LoRA's hooks off the model (also done when the engine is collected)."""
        if self.tp_group is not None:
            self.tp_group.close()
        if self.lora_manager is not None:
            self.lora_manager.close()

    # ------------------------------------------------------------------ set-up
    def _log_inactive_options(self) -> None:
        if self.device.type != "cuda":
            swap = "" if self.config.scheduler_config.preemption_mode == "swap" else "swap_space, "
            logger.info(
                "running on %s: gpu_memory_utilization, %storch.compile and CUDA graphs have no effect here",
                self.device,
                swap,
            )

    def _num_swap_blocks(self, spec: KVCacheSpec) -> int:
        """CPU blocks of swap space, or 0 when preemption recomputes. By default a GPU swaps (swap_space > 0);
        on a CPU device swapping would copy from CPU memory to CPU memory, so it is used only when asked for."""
        mode = self.config.scheduler_config.preemption_mode
        if mode is None:
            mode = "swap" if self.device.type == "cuda" and self.config.cache_config.swap_space > 0 else "recompute"
        if mode == "recompute":
            return 0
        block_bytes = spec.bytes_per_block(self.config.block_size)
        num_cpu_blocks = int(self.config.cache_config.swap_space * 2**30) // block_bytes
        logger.info("swap space: %d CPU blocks (%.2f GiB)", num_cpu_blocks, num_cpu_blocks * block_bytes / 2**30)
        return num_cpu_blocks

    def _num_kv_blocks(self, spec: KVCacheSpec) -> int:
        cache = self.config.cache_config
        block_bytes = spec.bytes_per_block(cache.block_size)
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        if self.device.type == "cuda":
            return self._profile_gpu_blocks(block_bytes)
        by_memory = int(cache.kv_cache_memory_gib * 2**30) // block_bytes
        # Never more than max_num_seqs full-length sequences could use.
        cap = self.config.scheduler_config.max_num_seqs * math.ceil(self.config.max_model_len / cache.block_size)
        return max(1, min(by_memory, cap))

    def _profile_gpu_blocks(self, block_bytes: int) -> int:
        """Blocks that fit in ``gpu_memory_utilization`` of the GPU (of every rank's GPU under tensor parallelism:
        the workers profile in step with rank 0, their forwards' all-reduces need it)."""
        from paged_backend.worker.profiler import gpu_blocks_that_fit

        if self.tp_group is not None:
            self.tp_group.send("profile_num_blocks", self.config, block_bytes)
        if self.lora_manager is not None:  # the activation peak with every token's LoRA delta computed
            self.lora_manager.profile_step()
        try:
            num_blocks = gpu_blocks_that_fit(self.model, self.config, self.device, block_bytes)
        finally:
            if self.lora_manager is not None:
                self.lora_manager.clear_step()
        if self.tp_group is not None:
            num_blocks = self.tp_group.min_over_ranks(num_blocks)
        if num_blocks < 1:
            utilization = self.config.cache_config.gpu_memory_utilization
            raise ValueError(
                f"no GPU memory left for the KV cache: gpu_memory_utilization={utilization} is below what weights "
                "and the activation peak take (see the log for the figures)"
            )
        return num_blocks

    def _eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        generation_config = getattr(self.model, "generation_config", None)
        for source in (
            getattr(generation_config, "eos_token_id", None),
            getattr(self.tokenizer, "eos_token_id", None),
        ):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(int(t) for t in source)
        return frozenset(ids)

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """A prompt is a string or ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}``."""
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids
                ):
                    raise ValueError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict must have a 'prompt' or a 'prompt_token_ids' key")
        if not isinstance(prompt, str):
            raise ValueError(
                f"prompt must be a str or a dict with 'prompt' or 'prompt_token_ids', got {type(prompt).__name__}"
            )
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer: pass tokenizer=... or use prompt_token_ids")
        return prompt, list(self.tokenizer(prompt).input_ids)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        lora_request: Any = None,
        keep_logits: bool = False,
    ) -> None:
        """Validate and queue a request; nothing is queued when validation fails. ``keep_logits`` keeps each
        generated token's raw logits row in the outputs (for HF's ``output_logits``; it disables multi-step
        decoding for the request's batches)."""
        if lora_request is not None:
            if self.lora_manager is None:
                raise ValueError("lora_request needs LLM(..., enable_lora=True)")
            if not isinstance(lora_request, LoRARequest):
                raise ValueError(f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}")
            lora_adapter = self.lora_manager.get(lora_request)  # read and checked now: fails this request only
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("prompt must contain at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        if len(ids) > self.config.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len={self.config.max_model_len}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer=... or use stop_token_ids")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        max_num_seqs = self.config.scheduler_config.max_num_seqs
        if params.best_of > max_num_seqs:
            raise ValueError(
                f"best_of must be <= max_num_seqs={max_num_seqs} (its samples run together), got {params.best_of}"
            )
        request = Request(request_id, text, ids, params, lora_request, arrival_time=time.monotonic())
        if lora_request is not None:
            request.lora_adapter = lora_adapter
        for index in range(params.best_of):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed + index)
            seq_id = next(self._seq_counter)
            seq = Sequence(seq_id, index, request, list(ids), len(ids), arrival=seq_id, generator=generator)
            seq.logprobs = [] if params.logprobs is not None else None
            seq.logits = [] if keep_logits else None
            init_offsets(seq)
            request.seqs.append(seq)
        self.requests[request_id] = request
        # One prefill for all samples: the others fork its blocks when it samples its first token.
        self.scheduler.add_seq(request.seqs[0])
        request.unforked = request.seqs[1:]
        self.num_prompt_tokens += len(ids)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Drop requests (unknown ids are ignored, as in vLLM) and free their blocks."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            request = self.requests.pop(rid, None)
            for seq in request.seqs if request else []:
                if not seq.status.finished:
                    self.scheduler.finish_seq(seq, SequenceStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ the step
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one batch; return the (cumulative) outputs of every request that advanced, or with
        ``finished_only`` just of those that finished (building a snapshot of every running request each step
        costs more than the step's bookkeeping when nobody streams)."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.scheduler.has_unfinished_seqs():
                raise RuntimeError("scheduler made no progress although requests are waiting")
            return []
        num_steps = self._multi_step_plan(sched)
        if num_steps is not None:
            advanced = self._run_decode_steps(sched, num_steps)
        else:
            advanced = self._run_step(sched)
        outputs = []
        for request in advanced.values():
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            finished = request.finished
            if finished:
                self.requests.pop(request.request_id, None)
            if finished or (request.params.best_of == request.params.n and not finished_only):
                outputs.append(self._make_output(request))
        return outputs

    @contextlib.contextmanager
    def _lora_step(self, sched: SchedulerOutput, tokens_per_seq: Any) -> Iterator[None]:
        """This step's adapters in their slots and each token's slot set, for the forward(s) inside only."""
        if self.lora_manager is None:
            yield
            return
        self.lora_manager.set_step([seq.request.lora_adapter for seq in sched.seqs], tokens_per_seq)
        try:
            yield
        finally:
            self.lora_manager.clear_step()

    def _run_step(self, sched: SchedulerOutput) -> dict[str, Request]:
        """One forward, then the sampler; returns the requests that got a token."""
        with self._lora_step(sched, sched.num_new_tokens):
            logits, sample_seqs = self.runner.execute(sched, self.block_manager)
        self.scheduler.on_step_done(sched)
        if not sample_seqs:
            return {}
        forked = [(row, child) for row, seq in enumerate(sample_seqs) for child in self._fork_samples(seq)]
        if forked:  # the other samples draw their first token from their parent's logits row
            logits = torch.cat([logits, logits[[row for row, _ in forked]]])  # [N + F, V]
            sample_seqs = sample_seqs + [child for _, child in forked]
        for row, seq in enumerate(sample_seqs):
            if seq.logits is not None:
                seq.logits.append(logits[row].float().cpu())
        stop_ids = [
            self._min_tokens_stop_ids(s) if s.num_output_tokens < s.params.min_tokens else frozenset()
            for s in sample_seqs
        ]
        results = self.sampler(logits, sample_seqs, stop_ids)
        advanced: dict[str, Request] = {}
        for seq, result in zip(sample_seqs, results):
            self._append_token(seq, result)
            advanced[seq.request.request_id] = seq.request
        return advanced

    def _fork_samples(self, seq: Sequence) -> list[Sequence]:
        """When a request's first sample has prefilled the prompt, its other samples take its blocks by
        reference (copy-on-write from their first token on) and start running."""
        request = seq.request
        if not request.unforked or seq is not request.seqs[0]:
            return []
        children, request.unforked = request.unforked, []
        for child in children:
            self.block_manager.fork(seq.seq_id, child.seq_id)
            child.num_computed_tokens = seq.num_computed_tokens
            child.num_cached_prompt_tokens = 0  # the prompt was counted once, with the first sample
            self.scheduler.add_running(child)
        return children

    def _multi_step_plan(self, sched: SchedulerOutput) -> np.ndarray | None:
        """How many decode steps each sequence takes in one device-side run, or None for a normal step.

        Only for batches where every sequence decodes one token greedily without penalties, logprobs or a
        min_tokens barrier: their tokens can be fed to the next step on the device and checked afterwards.
        A sequence takes no more steps than max_tokens and max_model_len leave it, and gets its blocks now."""
        k = self.config.scheduler_config.num_scheduler_steps
        if (
            k == 1
            or sched.block_copies
            or sched.blocks_to_swap_out
            or sched.blocks_to_swap_in
            or any(n != 1 for n in sched.num_new_tokens)
        ):
            return None
        for seq in sched.seqs:
            p = seq.params
            if (
                seq.num_uncomputed_tokens != 1
                or seq.num_output_tokens == 0  # a first token goes out at once (time to first token)
                or not p.greedy
                or p.has_penalties
                or p.logprobs is not None
                or seq.logits is not None
                or seq.num_output_tokens < p.min_tokens
            ):
                return None
        steps = np.empty(len(sched.seqs), dtype=np.int64)
        copies_for_round: list[tuple[int, int]] = []
        for i, seq in enumerate(sched.seqs):
            left = self.max_model_len - len(seq.token_ids)
            if seq.params.max_tokens is not None:
                left = min(left, seq.params.max_tokens - seq.num_output_tokens)
            steps[i] = n = max(1, min(k, left))
            if n > 1:
                copies = self.block_manager.allocate_slots(
                    seq.seq_id, seq.num_computed_tokens, seq.num_computed_tokens + n
                )
                if copies is None:  # no free blocks for all n: as many steps as its blocks already hold
                    capacity = len(self.block_manager.get_block_table(seq.seq_id)) * self.config.block_size
                    steps[i] = max(1, min(n, capacity - seq.num_computed_tokens))
                else:
                    copies_for_round += copies
        if copies_for_round:  # copy-on-write of shared blocks before any write; one call (a message under TP)
            self.runner.copy_blocks(copies_for_round)
        # A round runs steps.max() forwards for the whole batch: not worth it when most rows would idle.
        return steps if steps.max() > 1 and 2 * steps.sum() >= steps.max() * len(steps) else None

    def _run_decode_steps(self, sched: SchedulerOutput, num_steps: np.ndarray) -> dict[str, Request]:
        """``num_steps.max()`` greedy decode steps back to back on the device, one host read at the end; then
        each sequence's tokens are appended in order until it finishes (the rest were computed for nothing)."""
        with torch.inference_mode(), self._lora_step(sched, [1] * len(sched.seqs)):
            inputs = self.runner.prepare_inputs(sched, self.block_manager)  # inference tensors, as in every step
            sampled = self.runner.run_decode_round(inputs, num_steps, self.config.block_size)
            tokens, logprobs = to_host(*sampled)  # [K][B] each
        advanced: dict[str, Request] = {}
        for i, seq in enumerate(sched.seqs):
            for k in range(int(num_steps[i])):
                if seq.status.finished:
                    break
                seq.num_computed_tokens += 1  # the step's input token is now in the cache
                self._append_token(seq, SampleResult(tokens[k][i], logprobs[k][i]))
            advanced[seq.request.request_id] = seq.request
        # Finished sequences offered their blocks to the prefix cache in finish_seq.
        self.scheduler.cache_full_blocks([seq for seq in sched.seqs if not seq.status.finished])
        return advanced

    def _min_tokens_stop_ids(self, seq: Sequence) -> frozenset[int]:
        params = seq.params
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        return eos | frozenset(params.stop_token_ids)

    def _append_token(self, seq: Sequence, result: SampleResult) -> None:
        params = seq.params
        token = result.token_id
        seq.token_ids.append(token)
        seq.cumulative_logprob += result.logprob
        self.num_generated_tokens += 1
        if seq.logprobs is not None and result.top_logprobs is not None:
            seq.logprobs.append(
                {tid: Logprob(lp, rank, self._decode_one(tid)) for tid, lp, rank in result.top_logprobs}
            )

        num_output = len(seq.token_ids) - seq.num_prompt_tokens
        may_stop = num_output >= params.min_tokens
        status: SequenceStatus | None = None
        if may_stop and params.stop_token_ids and token in params.stop_token_ids:
            status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
        elif may_stop and not params.ignore_eos and token in self.eos_token_ids:
            status = SequenceStatus.FINISHED_STOPPED
        if self.tokenizer is not None and (status is None or params.include_stop_str_in_output):
            delta = detokenize_incrementally(self.tokenizer, seq)
            seq.output_text += delta
            if status is None and params.stop and delta and may_stop:
                hit = find_stop_string(seq.output_text, len(delta), params.stop)
                if hit is not None:
                    start, stop = hit
                    end = start + len(stop) if params.include_stop_str_in_output else start
                    seq.output_text = seq.output_text[:end]
                    status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
        if status is None and (
            (params.max_tokens is not None and num_output >= params.max_tokens)
            or len(seq.token_ids) >= self.max_model_len
        ):
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            self.scheduler.finish_seq(seq, status)

    def _decode_one(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _make_output(self, request: Request) -> RequestOutput:
        params = request.params
        seqs = request.seqs
        if params.best_of > params.n:  # only reported once finished: keep the n best, best first
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
        outputs = [
            CompletionOutput(
                index=i,
                text=visible_text(seq),
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=float(seq.cumulative_logprob),
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                logits=list(seq.logits) if seq.logits is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for i, seq in enumerate(seqs)
        ]
        metrics = {"arrival_time": request.arrival_time}
        if request.first_token_time is not None:
            metrics["first_token_time"] = request.first_token_time
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            outputs=outputs,
            finished=request.finished,
            lora_request=request.lora_request,
            metrics=metrics,
        )

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        bm = self.block_manager
        in_cache = {seq.seq_id: seq.num_computed_tokens for seq in self.scheduler.running}
        return {
            "num_kv_blocks": bm.num_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "block_size": bm.block_size,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_swapped_out": self.scheduler.num_swapped_out,
            "num_swapped": len(self.scheduler.swapped),
            "num_free_cpu_blocks": len(bm.cpu_free_block_ids),
            "num_cpu_blocks": bm.num_cpu_blocks,
            "num_chunked_prefill_steps": self.scheduler.num_chunked_prefill_steps,
            "num_cached_blocks": bm.num_cached_blocks,
            "prefix_cache_hit_rate": self.scheduler.prefix_cache_hit_rate,
            "kv_waste_fraction": bm.kv_waste_fraction(in_cache),
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
        }
