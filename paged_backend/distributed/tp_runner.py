"""Tensor parallelism over ``torch.distributed``: rank 0 (the engine's process) schedules, every rank runs its
shard of the model.

``TPGroup.start`` spawns ``tensor_parallel_size - 1`` worker processes on free local ports (or Ray tasks) and
joins them in one process group: NCCL on GPUs (rank r on ``cuda:r``), gloo on CPUs, for the forward's
all-reduces (``all_reduce.py``), and beside it a gloo group for small collectives. Each rank loads only its
slices (``shard_loader.py``); rowwise layers all-reduce their outputs, so every rank ends a forward with the full
logits. ``TPModelRunner`` stands in for rank 0's ``ModelRunner``: each cache move and forward is sent to the
workers (``Messages``: a pipe to each local worker, a gloo broadcast to Ray tasks; numpy arrays and lists, no
sequences, and a multi-step round as its first step's inputs) before it runs here, and the collectives inside the
forward keep the ranks in step. The workers also profile memory, compile and capture CUDA graphs in step with
rank 0, since each of those runs forwards. Rank 0 alone samples: every rank holds the same logits, so multi-step
decoding's on-device argmax agrees.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing.process
import pickle
import socket
import threading
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from paged_backend.config import EngineConfig
from paged_backend.distributed.all_reduce import TPAllReduce
from paged_backend.model_loader.sharded import load_shard
from paged_backend.model_loader.tp_plan import head_layout
from paged_backend.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)

_TIMEOUT = timedelta(seconds=300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Bytes of the largest hidden states one forward all-reduces through symmetric memory; larger ones use NCCL.
_MAX_CUSTOM_ALL_REDUCE_BYTES = 128 * 2**20


def load_rank(config: EngineConfig, model_path: str, rank: int, device: torch.device) -> Any:
    """Rank ``rank``'s shard with its all-reduce set up (collective: every rank calls this at the same point)."""
    all_reduce = TPAllReduce(use_custom=not config.parallel_config.disable_custom_all_reduce)
    model = load_shard(config, model_path, rank, device, all_reduce)
    hidden = model.config.get_text_config().hidden_size
    max_numel = min(config.max_tokens_per_forward * hidden, _MAX_CUSTOM_ALL_REDUCE_BYTES // model.dtype.itemsize)
    all_reduce.setup(device, model.dtype, max_numel)
    model.tp_all_reduce = all_reduce  # which implementation runs: for logs and benchmarks
    return model


class Messages:
    """Rank 0's calls to the workers: a pipe to each local worker (tens of µs a message), or for Ray tasks, which
    may run on other machines, a broadcast over the gloo control group (~2 ms: two collectives and pickling)."""

    def __init__(self, control: Any, pipes: list[Any] | None) -> None:
        self.control, self.pipes = control, pipes

    def send(self, message: tuple[str, tuple[Any, ...]]) -> None:
        if self.pipes is None:
            dist.broadcast_object_list([message], src=0, group=self.control)
            return
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for pipe in self.pipes:
            pipe.send_bytes(data)

    def receive(self) -> tuple[str, tuple[Any, ...]]:
        if self.pipes is None:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=self.control)
            return box[0]
        return pickle.loads(self.pipes[0].recv_bytes())


def min_over_ranks(value: int, control: Any) -> int:
    tensor = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=control)
    return int(tensor.item())


def tp_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank ``rank``'s device: ``cuda:rank`` (``cuda:0`` in a Ray task, which sees its own GPU only) or the CPU."""
    name = config.device_config.device
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if name not in ("auto", "cuda"):
        raise ValueError(
            f"device must be 'auto', 'cuda' or 'cpu' with tensor_parallel_size > 1 (rank r runs on cuda:r), "
            f"got {name!r}"
        )
    if config.parallel_config.distributed_executor_backend == "ray" and rank > 0:
        return torch.device("cuda", 0)
    world_size = config.parallel_config.tensor_parallel_size
    if rank == 0 and config.parallel_config.distributed_executor_backend == "mp":
        if torch.cuda.device_count() < world_size:
            raise ValueError(
                f"tensor_parallel_size={world_size} needs {world_size} GPUs, this machine has "
                f"{torch.cuda.device_count()}"
            )
    return torch.device("cuda", rank)


def _init_groups(init_method: str, rank: int, world_size: int, device: torch.device) -> Any:
    """Join the default group (NCCL on a GPU, gloo on the CPU) and return the gloo group for control messages
    (None: the default group, already gloo)."""
    if device.type != "cuda":
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=_TIMEOUT)
        return None
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=init_method, rank=rank, world_size=world_size, timeout=_TIMEOUT, device_id=device
    )
    return dist.new_group(backend="gloo", timeout=_TIMEOUT)


def local_kv_spec(model: Any, world_size: int) -> Any:
    """The KV cache shape of one rank: its share of the KV heads (one when they are replicated)."""
    from paged_backend.worker.cache_engine import KVCacheSpec

    spec = KVCacheSpec.from_config(model.config, model.dtype)
    return dataclasses.replace(
        spec, num_kv_heads=head_layout(model.config.get_text_config(), world_size).local_kv_heads
    )


class TPWorker:
    """A worker rank: its shard and, once rank 0 has sized the cache, its cache and runner. Each method is a
    message rank 0 broadcasts."""

    def __init__(self, model: Any, device: torch.device, world_size: int, control: Any) -> None:
        self.model, self.device, self.world_size, self.control = model, device, world_size, control
        self.runner: Any = None
        self.lora: Any = None  # this rank's LoRAManager, with enable_lora

    def _lora_manager(self, config: EngineConfig) -> Any:
        """This rank's LoRA slots, made (like rank 0's) before the memory profile, so that they count."""
        if config.lora_config.enable_lora and self.lora is None:
            from paged_backend.lora.manager import LoRAManager, lora_slot_tokens

            tokens = lora_slot_tokens(config)
            self.lora = LoRAManager(self.model, config.lora_config, self.device, self.model.dtype, tokens)
        return self.lora

    def profile_num_blocks(self, config: EngineConfig, block_bytes: int) -> None:
        from paged_backend.worker.profiler import gpu_blocks_that_fit

        lora = self._lora_manager(config)
        if lora is not None:  # as rank 0: every token's LoRA delta computed
            lora.profile_step()
        try:
            num_blocks = gpu_blocks_that_fit(self.model, config, self.device, block_bytes)
        finally:
            if lora is not None:
                lora.clear_step()
        min_over_ranks(num_blocks, self.control)

    def init_cache(self, config: EngineConfig, num_blocks: int, num_cpu_blocks: int) -> None:
        from paged_backend.worker.cache_engine import CacheEngine
        from paged_backend.worker.model_runner import ModelRunner

        self._lora_manager(config)
        spec = local_kv_spec(self.model, self.world_size)
        cache_engine = CacheEngine(spec, num_blocks, config.block_size, self.device, num_cpu_blocks)
        self.runner = ModelRunner(
            self.model,
            cache_engine,
            self.device,
            enforce_eager=config.device_config.enforce_eager,
            max_num_seqs=config.scheduler_config.max_num_seqs,
            max_model_len=config.max_model_len,
            num_scheduler_steps=config.scheduler_config.num_scheduler_steps,
        )

    def execute_inputs(self, moves: Any, wire: tuple[Any, ...], lora: Any = None) -> None:
        with self._lora_step(lora):
            self.runner.execute_inputs(moves, StepInputs.from_wire(wire))

    def run_decode_round(self, wire: tuple[Any, ...], num_steps: Any, block_size: int, lora: Any = None) -> None:
        with self._lora_step(lora):
            self.runner.run_decode_round(StepInputs.from_wire(wire), num_steps, block_size)

    @contextlib.contextmanager
    def _lora_step(self, wire: Any) -> Iterator[None]:
        """Rank 0's adapter placements and token slots (``LoRAManager.step_wire``) for the forwards inside."""
        if wire is None:
            yield
            return
        self.lora.apply_step(wire)
        try:
            yield
        finally:
            self.lora.clear_step()

    def copy_blocks(self, copies: Any) -> None:
        self.runner.copy_blocks(copies)


def _worker_main(
    rank: int, world_size: int, init_method: str, config: EngineConfig, model_path: str, pipe: Any = None
) -> None:
    """A worker process: join the groups, load its shard, then run what rank 0 sends (through ``pipe``, or
    broadcast over the control group) until told to stop."""
    device = tp_device(config, rank)
    control = _init_groups(init_method, rank, world_size, device)
    messages = Messages(control, None if pipe is None else [pipe])
    model = None
    failed = False
    try:
        model = load_rank(config, model_path, rank, device)
        worker = TPWorker(model, device, world_size, control)
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
        if model is not None and not failed:
            model.tp_all_reduce.close()
        if failed:
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()


class TPGroup:
    """Rank 0's side of the group: the worker processes, its own device and the broadcast of each call to them."""

    def __init__(
        self,
        world_size: int,
        processes: list[multiprocessing.process.BaseProcess],
        device: torch.device,
        control: Any,
        messages: Messages,
    ) -> None:
        self.world_size = world_size
        self.processes = processes
        self.device = device
        self.control = control
        self.messages = messages
        stop = threading.Event()
        if device.type == "cuda":
            # NCCL does not notice a dead peer: its collectives would wait out the timeout. A watcher aborts the
            # group as soon as a worker has died, so that rank 0's pending step fails within a second or two.
            threading.Thread(target=_watch, args=(processes, stop), name="paged-backend-tp-watch", daemon=True).start()
        # Workers never outlive the engine or the interpreter: stopped on close, collection or exit.
        self.all_reduces: list[TPAllReduce] = []  # rank 0's, closed before the group is destroyed
        self._finalizer = weakref.finalize(self, _shutdown, processes, messages, stop, self.all_reduces)

    @classmethod
    def start(cls, config: EngineConfig, model_path: str) -> TPGroup:
        """Start the workers (local processes, or Ray tasks for ``distributed_executor_backend="ray"``) and join
        the groups; each worker then loads its shard while rank 0 loads its own (``load``)."""
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group is already initialized in this process")
        world_size = config.parallel_config.tensor_parallel_size
        device = tp_device(config, 0)
        if config.parallel_config.distributed_executor_backend == "ray":
            host, workers = _start_ray_workers(config, model_path, world_size, device)
        else:
            host = "127.0.0.1"
            workers = []
        init_method = f"tcp://{host}:{_free_port()}"
        pipes = None
        if not workers:
            context = mp.get_context("spawn")
            ends = [context.Pipe(duplex=False) for _ in range(1, world_size)]  # (worker's end, rank 0's end)
            pipes = [send for _, send in ends]
            workers = [
                context.Process(
                    target=_worker_main,
                    args=(rank, world_size, init_method, config, model_path, receive),
                    name=f"paged-backend-tp-{rank}",
                    daemon=True,
                )
                for rank, (receive, _) in zip(range(1, world_size), ends)
            ]
            for process in workers:
                process.start()
            for receive, _ in ends:
                receive.close()  # the worker holds it now
        else:
            for worker in workers:
                worker.start(init_method)
        control = _init_groups(init_method, 0, world_size, device)
        backend = config.parallel_config.distributed_executor_backend
        logger.info(
            "tensor parallelism: %d ranks (%s), workers started by %s",
            world_size,
            "nccl" if device.type == "cuda" else "gloo",
            backend,
        )
        return cls(world_size, workers, device, control, Messages(control, pipes))

    def load(self, config: EngineConfig, model_path: str) -> Any:
        """Rank 0's shard of the model, on rank 0's device."""
        model = load_rank(config, model_path, 0, self.device)
        self.all_reduces.append(model.tp_all_reduce)
        return model

    def send(self, method: str, *args: Any) -> None:
        _check_alive(self.processes)
        self.messages.send((method, args))

    def min_over_ranks(self, value: int) -> int:
        return min_over_ranks(value, self.control)

    def close(self) -> None:
        self._finalizer()


def _check_alive(processes: list[Any]) -> None:
    for process in processes:
        if not process.is_alive():
            raise RuntimeError(f"tensor-parallel worker {process.name} died (exit code {process.exitcode})")


def _watch(processes: list[Any], stop: threading.Event) -> None:
    while not stop.wait(1.0):
        try:
            _check_alive(processes)
        except RuntimeError as exc:
            if stop.is_set():
                return
            logger.error("%s: aborting the process group", exc)
            dist.distributed_c10d._abort_process_group()
            return


def _shutdown(processes: list[Any], messages: Messages, stop: threading.Event, all_reduces: list[TPAllReduce]) -> None:
    """Tell the workers to stop, wait for them (killing any that hang or are half dead), drop rank 0's registered
    all-reduce buffer, leave the group."""
    stop.set()
    try:
        _check_alive(processes)
        messages.send(("shutdown", ()))
    except Exception:  # noqa: BLE001 - a dead worker: the rest are killed below
        logger.debug("could not tell the workers to stop", exc_info=True)
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
    for all_reduce in all_reduces:
        all_reduce.close()
    if dist.is_initialized():
        dist.destroy_process_group()


class RayWorker:
    """One rank as a Ray task on the cluster, with the process-like handle the group uses (is_alive, join, kill)."""

    def __init__(self, rank: int, world_size: int, config: EngineConfig, model_path: str, device: torch.device) -> None:
        self.rank, self.world_size, self.config, self.model_path = rank, world_size, config, model_path
        self.device = device
        self.name = f"paged-backend-tp-{rank}"
        self.ref: Any = None

    def start(self, init_method: str) -> None:
        import ray

        num_gpus = 1 if self.device.type == "cuda" else 0
        task = ray.remote(num_cpus=0, num_gpus=num_gpus)(_worker_main).options(name=self.name)
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


def _start_ray_workers(
    config: EngineConfig, model_path: str, world_size: int, device: torch.device
) -> tuple[str, list[RayWorker]]:
    """Ray tasks for ranks 1..N-1 on the running cluster (``ray start --head`` on one node, ``ray start --address``
    on the others; or a local instance started here); rank 0's address is this node's IP."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError("distributed_executor_backend='ray' needs Ray: pip install ray") from exc
    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True, include_dashboard=False)
    host = ray.util.get_node_ip_address()
    return host, [RayWorker(rank, world_size, config, model_path, device) for rank in range(1, world_size)]


class TPModelRunner:
    """``ModelRunner``'s interface on rank 0: every call that touches the cache or runs the model is sent to the
    workers first (inputs without their sequence objects), then run here."""

    def __init__(self, runner: Any, group: TPGroup, lora: Any = None) -> None:
        self.runner = runner
        self.group = group
        self.lora = lora  # rank 0's LoRAManager: each step's placements travel with the step

    def _lora_wire(self) -> Any:
        return None if self.lora is None else self.lora.step_wire

    def prepare_inputs(self, sched: Any, block_manager: Any) -> StepInputs:
        return self.runner.prepare_inputs(sched, block_manager)

    @torch.inference_mode()
    def execute(self, sched: Any, block_manager: Any) -> tuple[torch.Tensor, list[Any]]:
        inputs = self.runner.prepare_inputs(sched, block_manager)
        moves = (sched.blocks_to_swap_out, sched.blocks_to_swap_in, sched.block_copies)
        self.group.send("execute_inputs", moves, inputs.to_wire(), self._lora_wire())
        return self.runner.execute_inputs(moves, inputs), inputs.sample_seqs

    def run_decode_round(
        self, inputs: StepInputs, num_steps: Any, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A multi-step round goes out as its first step's inputs: each worker derives the others, as rank 0 does."""
        self.group.send("run_decode_round", inputs.to_wire(), num_steps, block_size, self._lora_wire())
        return self.runner.run_decode_round(inputs, num_steps, block_size)

    def copy_blocks(self, copies: Any) -> None:
        if not copies:  # nothing to copy: no broadcast (each costs a round trip to every worker)
            return
        self.group.send("copy_blocks", copies)
        self.runner.copy_blocks(copies)
