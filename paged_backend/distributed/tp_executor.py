"""Tensor parallelism: rank 0 (the engine's process) schedules and samples, every rank runs its shard.

Each rank loads only its slices (``model_loader``'s sharded loading); rowwise layers all-reduce their outputs, so
every rank ends a forward with the full logits. ``TPExecutor`` is the engine's executor: each call is sent to
the workers (``tp_group.py``) before rank 0's own ``Worker`` runs it, and the collectives inside the forward keep
the ranks in step. A step goes out as one message, ``SchedulerOutput.to_wire()``: the batch without its Python
objects; a multi-step round is derived from it on every rank alike. The workers also profile memory, compile and
capture CUDA graphs in step with rank 0, since each of those runs forwards. Rank 0 alone samples: every rank
holds the same logits, so a round's on-device argmax agrees.
"""

from __future__ import annotations

import functools
import logging
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from transformers import PreTrainedModel

from paged_backend.config import EngineConfig
from paged_backend.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from paged_backend.distributed.all_reduce import TPAllReduce
from paged_backend.distributed.tp_group import Messages, TPGroup, init_groups, min_over_ranks, tp_device
from paged_backend.lora.manager import LoRAManager
from paged_backend.model_loader.sharded import check_tp_support, load_shard
from paged_backend.worker.async_output import AsyncModelRunnerOutput, ReadyOutput
from paged_backend.worker.cache_engine import KVCacheSpec
from paged_backend.worker.compile import start_compile_workers
from paged_backend.worker.worker import Worker

logger = logging.getLogger(__name__)

# Bytes of the largest hidden states one forward all-reduces through symmetric memory; larger ones use NCCL.
_MAX_CUSTOM_ALL_REDUCE_BYTES = 128 * 2**20


def load_rank(
    config: EngineConfig, model_path: str, rank: int, device: torch.device
) -> tuple[PreTrainedModel, TPAllReduce]:
    """Rank ``rank``'s shard and its all-reduce, set up (collective: every rank calls this at the same point)."""
    all_reduce = TPAllReduce(use_custom=not config.parallel_config.disable_custom_all_reduce)
    model = load_shard(config, model_path, rank, device, all_reduce)
    hidden = model.config.get_text_config().hidden_size
    max_numel = min(config.max_tokens_per_forward * hidden, _MAX_CUSTOM_ALL_REDUCE_BYTES // model.dtype.itemsize)
    all_reduce.setup(device, model.dtype, max_numel)
    return model, all_reduce


class _RankWorker:
    """A worker rank's side of each message rank 0 sends: its ``Worker``, plus the collectives rank 0 joins."""

    def __init__(self, worker: Worker, control: ProcessGroup | None) -> None:
        self.worker, self.control = worker, control

    def init_lora(self, config: EngineConfig) -> None:
        self.worker.init_lora(config)

    def profile_num_gpu_blocks(self, config: EngineConfig, block_bytes: int) -> None:
        min_over_ranks(self.worker.profile_num_gpu_blocks(config, block_bytes), self.control)

    def initialize_cache(self, config: EngineConfig, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.worker.initialize_cache(config, num_gpu_blocks, num_cpu_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self.worker.execute_model(scheduler_output)


def _worker_main(
    rank: int, world_size: int, init_method: str, config: EngineConfig, model_path: str, pipe: Connection | None = None
) -> None:
    """A worker process: join the groups, load its shard, then run what rank 0 sends (through ``pipe``, or
    broadcast over the control group) until told to stop."""
    device = tp_device(config, rank)
    start_compile_workers(config, device)
    control = init_groups(init_method, rank, world_size, device)
    messages = Messages(control, None if pipe is None else [pipe])
    all_reduce: TPAllReduce | None = None
    failed = False
    try:
        model, all_reduce = load_rank(config, model_path, rank, device)
        worker = _RankWorker(Worker(model, device, world_size), control)
        worker.worker.agree = functools.partial(min_over_ranks, control=control)  # ranks keep the same graphs
        while True:
            method, args = messages.receive()
            if method == "shutdown":
                break
            with torch.inference_mode():
                getattr(worker, method)(*args)
    except BaseException:
        # Said here: after a failure the group's orderly teardown can wait forever on rank 0, which is blocked in
        # a collective this rank never joins; aborting it instead ends this process, which rank 0's watcher sees.
        logger.exception("tensor-parallel worker %d failed", rank)
        failed = True
        raise
    finally:
        if all_reduce is not None and not failed:
            all_reduce.close()
        if failed:
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()


class TPExecutor:
    """The engine's executor over a tensor-parallel group (see the module docstring)."""

    def __init__(self, group: TPGroup, driver_worker: Worker, all_reduce: TPAllReduce) -> None:
        self.group = group
        self.all_reduce = all_reduce  # rank 0's: which implementation runs, for logs and benchmarks
        self.driver_worker = driver_worker
        self.model = driver_worker.model
        self.device = driver_worker.device
        self.lora_manager: LoRAManager | None = None

    @classmethod
    def start(cls, config: EngineConfig, model_path: str) -> TPExecutor:
        """Start the workers; each loads its shard while rank 0 loads its own."""
        check_tp_support(config, model_path)  # before any process starts
        group = TPGroup.start(config, model_path, _worker_main)
        start_compile_workers(config, group.device)
        model, all_reduce = load_rank(config, model_path, 0, group.device)
        group.all_reduces.append(all_reduce)
        driver = Worker(model, group.device, group.world_size)
        driver.agree = group.min_over_ranks  # the ranks keep the same graphs (ModelRunner.capture_graphs)
        return cls(group, driver, all_reduce)

    def init_lora(self, config: EngineConfig) -> None:
        self.group.send("init_lora", config)
        self.driver_worker.init_lora(config)
        self.lora_manager = self.driver_worker.lora_manager

    def kv_cache_spec(self, config: EngineConfig) -> KVCacheSpec:
        return self.driver_worker.kv_cache_spec(config)

    def profile_num_gpu_blocks(self, config: EngineConfig, block_bytes: int) -> int:
        """The blocks that fit on every rank's GPU (the workers profile in step: their forwards all-reduce)."""
        self.group.send("profile_num_gpu_blocks", config, block_bytes)
        return self.group.min_over_ranks(self.driver_worker.profile_num_gpu_blocks(config, block_bytes))

    def initialize_cache(self, config: EngineConfig, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.group.send("initialize_cache", config, num_gpu_blocks, num_cpu_blocks)
        self.driver_worker.initialize_cache(config, num_gpu_blocks, num_cpu_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.group.send("execute_model", scheduler_output.to_wire())
        try:
            return self.driver_worker.execute_model(scheduler_output)
        except RuntimeError as failure:  # a collective failed: a dead worker is named, not the transport's error
            self.group.raise_if_a_worker_died(failure)
            raise

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Every step at once: a round queued behind another would need every rank's tokens (not supported)."""
        return ReadyOutput(self.execute_model(scheduler_output))

    def sleep(self) -> None:
        self.group.send("sleep")
        self.driver_worker.sleep()

    def wake_up(self) -> None:
        self.group.send("wake_up")  # the ranks capture their graphs together: the captures all-reduce
        self.driver_worker.wake_up()

    def is_recoverable(self, error: Exception) -> bool:
        """Never: the other ranks may be waiting in a collective that rank 0 left, or be past a step it failed."""
        return False

    def shutdown(self) -> None:
        """Stop the workers now (they also stop when the group is collected or at exit)."""
        self.group.close()
        self.driver_worker.shutdown()
