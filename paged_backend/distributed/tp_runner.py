"""Tensor parallelism over ``torch.distributed``: rank 0 (the engine's process) schedules, every rank runs its
shard of the model.

``TPGroup.start`` spawns ``tensor_parallel_size - 1`` worker processes on free local ports and joins them in one
process group (gloo on CPU). Each rank loads the model from its path and cuts it down with ``shard_model``, whose
rowwise layers all-reduce their outputs, so every rank ends a forward with the full logits. ``TPModelRunner``
stands in for rank 0's ``ModelRunner``: each cache move and forward is broadcast to the workers (plain tensors
and lists, no sequences) before it runs here, and the collectives inside the forward keep the ranks in step.
Rank 0 alone samples: every rank holds the same logits, so multi-step decoding's on-device argmax agrees.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.process
import socket
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from paged_backend.distributed.tp_plan import head_layout, shard_model
from paged_backend.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)

_TIMEOUT = timedelta(seconds=300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _all_reduce(tensor: torch.Tensor) -> None:
    dist.all_reduce(tensor)


def _receive() -> tuple[str, tuple[Any, ...]]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def local_kv_spec(model: Any, world_size: int) -> Any:
    """The KV cache shape of one rank: its share of the KV heads (one when they are replicated)."""
    from paged_backend.worker.cache_engine import KVCacheSpec

    spec = KVCacheSpec.from_config(model.config, model.dtype)
    return dataclasses.replace(
        spec, num_kv_heads=head_layout(model.config.get_text_config(), world_size).local_kv_heads
    )


def _worker_main(rank: int, world_size: int, init_method: str, config: Any, model_path: str) -> None:
    """A worker process: join the group, load and shard the model, build its cache and runner from rank 0's
    sizes, then run what rank 0 broadcasts until told to stop."""
    from paged_backend.model_loader import load_model
    from paged_backend.worker.cache_engine import CacheEngine
    from paged_backend.worker.model_runner import ModelRunner

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=_TIMEOUT)
    try:
        model, device = load_model(config, model_path)
        shard_model(model, rank, world_size, _all_reduce)
        method, (num_blocks, num_cpu_blocks) = _receive()
        assert method == "sizes", method
        spec = local_kv_spec(model, world_size)
        cache_engine = CacheEngine(spec, num_blocks, config.block_size, device, num_cpu_blocks)
        runner = ModelRunner(
            model,
            cache_engine,
            device,
            enforce_eager=config.device_config.enforce_eager,
            max_num_seqs=config.scheduler_config.max_num_seqs,
            max_model_len=config.max_model_len,
            num_scheduler_steps=config.scheduler_config.num_scheduler_steps,
        )
        while True:
            method, args = _receive()
            if method == "shutdown":
                break
            with torch.inference_mode():
                getattr(runner, method)(*args)
    finally:
        dist.destroy_process_group()


class TPGroup:
    """Rank 0's side of the group: the worker processes and the broadcast of each call to them."""

    def __init__(self, world_size: int, processes: list[multiprocessing.process.BaseProcess]) -> None:
        self.world_size = world_size
        self.processes = processes
        # Workers never outlive the engine or the interpreter: stopped on close, collection or exit.
        self._finalizer = weakref.finalize(self, _shutdown, processes)

    @classmethod
    def start(cls, config: Any, model_path: str) -> TPGroup:
        """Start the workers (local processes, or Ray tasks for ``distributed_executor_backend="ray"``) and join
        the group (gloo on CPU; CUDA tensor parallelism is not available yet)."""
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group is already initialized in this process")
        world_size = config.parallel_config.tensor_parallel_size
        if config.parallel_config.distributed_executor_backend == "ray":
            host, workers = _start_ray_workers(config, model_path, world_size)
        else:
            host = "127.0.0.1"
            workers = []
        init_method = f"tcp://{host}:{_free_port()}"
        if not workers:
            context = mp.get_context("spawn")
            workers = [
                context.Process(
                    target=_worker_main,
                    args=(rank, world_size, init_method, config, model_path),
                    name=f"paged-backend-tp-{rank}",
                    daemon=True,
                )
                for rank in range(1, world_size)
            ]
            for process in workers:
                process.start()
        else:
            for worker in workers:
                worker.start(init_method)
        dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=world_size, timeout=_TIMEOUT)
        backend = config.parallel_config.distributed_executor_backend
        logger.info("tensor parallelism: %d ranks (gloo), workers started by %s", world_size, backend)
        return cls(world_size, workers)

    def shard(self, model: Any) -> None:
        shard_model(model, 0, self.world_size, _all_reduce)

    def send(self, method: str, *args: Any) -> None:
        _check_alive(self.processes)
        dist.broadcast_object_list([(method, args)], src=0)

    def close(self) -> None:
        self._finalizer()


def _check_alive(processes: list[multiprocessing.process.BaseProcess]) -> None:
    for process in processes:
        if not process.is_alive():
            raise RuntimeError(f"tensor-parallel worker {process.name} died (exit code {process.exitcode})")


def _shutdown(processes: list[multiprocessing.process.BaseProcess]) -> None:
    """Tell the workers to stop, wait for them (killing any that hang or are half dead), leave the group."""
    try:
        _check_alive(processes)
        dist.broadcast_object_list([("shutdown", ())], src=0)
    except Exception:  # noqa: BLE001 - a dead worker: the rest are killed below
        logger.debug("could not tell the workers to stop", exc_info=True)
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
    if dist.is_initialized():
        dist.destroy_process_group()


class RayWorker:
    """One rank as a Ray task on the cluster, with the process-like handle the group uses (is_alive, join, kill)."""

    def __init__(self, rank: int, world_size: int, config: Any, model_path: str) -> None:
        self.rank, self.world_size, self.config, self.model_path = rank, world_size, config, model_path
        self.name = f"paged-backend-tp-{rank}"
        self.ref: Any = None

    def start(self, init_method: str) -> None:
        import ray

        task = ray.remote(num_cpus=0)(_worker_main).options(name=self.name)
        self.ref = task.remote(self.rank, self.world_size, init_method, self.config, self.model_path)

    @property
    def exitcode(self) -> str:
        return "ended" if not self.is_alive() else "running"

    def is_alive(self) -> bool:
        import ray

        return not ray.wait([self.ref], timeout=0)[0]

    def join(self, timeout: float | None = None) -> None:
        import ray

        ray.wait([self.ref], timeout=timeout)

    def kill(self) -> None:
        import ray

        ray.cancel(self.ref, force=True)


def _start_ray_workers(config: Any, model_path: str, world_size: int) -> tuple[str, list[RayWorker]]:
    """Ray tasks for ranks 1..N-1 on the running cluster (``ray start --head`` on one node, ``ray start --address``
    on the others; or a local instance started here); rank 0's address is this node's IP."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError("distributed_executor_backend='ray' needs Ray: pip install ray") from exc
    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True, include_dashboard=False)
    host = ray.util.get_node_ip_address()
    return host, [RayWorker(rank, world_size, config, model_path) for rank in range(1, world_size)]


class TPModelRunner:
    """``ModelRunner``'s interface on rank 0: every call that touches the cache or runs the model is sent to the
    workers first (inputs without their sequence objects), then run here."""

    def __init__(self, runner: Any, group: TPGroup) -> None:
        self.runner = runner
        self.group = group

    def prepare_inputs(self, sched: Any, block_manager: Any) -> StepInputs:
        return self.runner.prepare_inputs(sched, block_manager)

    @torch.inference_mode()
    def execute(self, sched: Any, block_manager: Any) -> tuple[torch.Tensor, list[Any]]:
        inputs = self.runner.prepare_inputs(sched, block_manager)
        moves = (sched.blocks_to_swap_out, sched.blocks_to_swap_in, sched.block_copies)
        self.group.send("execute_inputs", moves, dataclasses.replace(inputs, sample_seqs=[]))
        return self.runner.execute_inputs(moves, inputs), inputs.sample_seqs

    def run_decode_steps(self, steps: list[StepInputs]) -> tuple[torch.Tensor, torch.Tensor]:
        self.group.send("run_decode_steps", [dataclasses.replace(s, sample_seqs=[]) for s in steps])
        return self.runner.run_decode_steps(steps)

    def copy_blocks(self, copies: Any) -> None:
        self.group.send("copy_blocks", copies)
        self.runner.copy_blocks(copies)
