"""A tensor-parallel process group: rank 0 (the engine's process) and ``tensor_parallel_size - 1`` workers.

``TPGroup.start`` spawns the workers on free local ports (or as Ray tasks) and joins them in one process group: NCCL
on GPUs (rank r on ``cuda:r``), gloo on CPUs, for the forward's all-reduces (``all_reduce.py``), and beside it a
gloo group for small collectives. Rank 0 talks to the workers through ``Messages``: a pipe to each local worker, or
for Ray tasks, which may run on other machines, a broadcast over the gloo control group. A worker that dies is
noticed (on GPUs by a watcher thread that aborts the group, since NCCL would wait out its timeout), and the workers
never outlive the group, the engine or the interpreter.
"""

from __future__ import annotations

import logging
import pickle
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import ProcessGroup

from paged_backend.config import EngineConfig

logger = logging.getLogger(__name__)

_TIMEOUT = timedelta(seconds=300)

# A worker process's body: (rank, world_size, init_method, config, model_path, pipe or None).
WorkerMain = Callable[..., None]


class Closable(Protocol):
    def close(self) -> None: ...


class WorkerProcess(Protocol):
    """A worker rank as rank 0 watches it: a local process, or a Ray task behind the same methods."""

    @property
    def name(self) -> str: ...

    @property
    def exitcode(self) -> int | str | None: ...

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def kill(self) -> None: ...


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Messages:
    """Rank 0's calls to the workers: a pipe to each local worker, or for Ray tasks, which may run on other
    machines, a broadcast over the gloo control group (two collectives and pickling: far slower than a pipe)."""

    def __init__(self, control: ProcessGroup | None, pipes: list[Connection] | None) -> None:
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


def min_over_ranks(value: int, control: ProcessGroup | None) -> int:
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


def init_groups(init_method: str, rank: int, world_size: int, device: torch.device) -> ProcessGroup | None:
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


class TPGroup:
    """Rank 0's side of the group: the worker processes, its own device and the broadcast of each call to them."""

    def __init__(
        self,
        world_size: int,
        processes: Sequence[WorkerProcess],
        device: torch.device,
        control: ProcessGroup | None,
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
        self.all_reduces: list[Closable] = []  # rank 0's, closed before the group is destroyed
        self._finalizer = weakref.finalize(self, _shutdown, processes, messages, stop, self.all_reduces)

    @classmethod
    def start(cls, config: EngineConfig, model_path: str, worker_main: WorkerMain) -> TPGroup:
        """Start the workers (local processes, or Ray tasks for ``distributed_executor_backend="ray"``) running
        ``worker_main`` and join the groups; each worker then loads its shard while rank 0 loads its own."""
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group is already initialized in this process")
        world_size = config.parallel_config.tensor_parallel_size
        device = tp_device(config, 0)
        workers: Sequence[WorkerProcess]
        pipes = None
        if config.parallel_config.distributed_executor_backend == "ray":
            host, ray_workers = _start_ray_workers(config, model_path, world_size, device, worker_main)
            init_method = f"tcp://{host}:{_free_port()}"
            for worker in ray_workers:
                worker.start(init_method)
            workers = ray_workers
        else:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            context = mp.get_context("spawn")
            ends = [context.Pipe(duplex=False) for _ in range(1, world_size)]  # (worker's end, rank 0's end)
            pipes = [send for _, send in ends]
            processes = [
                context.Process(
                    target=worker_main,
                    args=(rank, world_size, init_method, config, model_path, receive),
                    name=f"paged-backend-tp-{rank}",
                    daemon=True,
                )
                for rank, (receive, _) in zip(range(1, world_size), ends)
            ]
            for process in processes:
                process.start()
            for receive, _ in ends:
                receive.close()  # the worker holds it now
            workers = processes
        control = init_groups(init_method, 0, world_size, device)
        backend = config.parallel_config.distributed_executor_backend
        logger.info(
            "tensor parallelism: %d ranks (%s), workers started by %s",
            world_size,
            "nccl" if device.type == "cuda" else "gloo",
            backend,
        )
        return cls(world_size, workers, device, control, Messages(control, pipes))

    def send(self, method: str, *args: Any) -> None:
        _check_alive(self.processes)
        self.messages.send((method, args))

    def raise_if_a_worker_died(self, failure: BaseException, wait_s: float = 3.0) -> None:
        """After a collective failed: if a worker died, raise that (naming it) from ``failure``, the transport's
        words for it. A worker on another node is known dead only once Ray has noticed, so this waits for that up
        to ``wait_s``; a failure with every worker alive returns, to be raised as it is."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                _check_alive(self.processes)
            except RuntimeError as dead:
                raise dead from failure
            if time.monotonic() >= deadline:
                return
            time.sleep(0.1)

    def min_over_ranks(self, value: int) -> int:
        return min_over_ranks(value, self.control)

    def close(self) -> None:
        self._finalizer()


def _check_alive(processes: Sequence[WorkerProcess]) -> None:
    for process in processes:
        if not process.is_alive():
            raise RuntimeError(f"tensor-parallel worker {process.name} died (exit code {process.exitcode})")


def _watch(processes: Sequence[WorkerProcess], stop: threading.Event) -> None:
    while not stop.wait(1.0):
        try:
            _check_alive(processes)
        except RuntimeError as exc:
            if stop.is_set():
                return
            logger.error("%s: aborting the process group", exc)
            dist.distributed_c10d._abort_process_group()
            return


def _shutdown(
    processes: Sequence[WorkerProcess], messages: Messages, stop: threading.Event, all_reduces: list[Closable]
) -> None:
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

    def __init__(
        self,
        rank: int,
        world_size: int,
        config: EngineConfig,
        model_path: str,
        device: torch.device,
        worker_main: WorkerMain,
    ) -> None:
        self.rank, self.world_size, self.config, self.model_path = rank, world_size, config, model_path
        self.worker_main = worker_main
        self.device = device
        self.name = f"paged-backend-tp-{rank}"
        self.ref: Any = None

    def start(self, init_method: str) -> None:
        import ray

        # A rank reserves what it computes on: a GPU, or on a CPU-only cluster one CPU, so Ray places the ranks
        # where there is room for them (on another node when this one's CPUs are taken).
        on_gpu = self.device.type == "cuda"
        task = ray.remote(num_cpus=0 if on_gpu else 1, num_gpus=1 if on_gpu else 0)(self.worker_main)
        task = task.options(name=self.name, max_retries=0)  # a rank run again would join no group: report it dead
        args = (self.rank, self.world_size, init_method, self.config, self.model_path)
        self.ref = task.remote(*args)  # type: ignore[call-arg]  # ray's stubs do not see the function's arguments

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
    config: EngineConfig, model_path: str, world_size: int, device: torch.device, worker_main: WorkerMain
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
    return host, [RayWorker(rank, world_size, config, model_path, device, worker_main) for rank in range(1, world_size)]
