"""What the server needs of what it serves — one ``LLM`` on its engine loop, or ``DataParallelLLM``'s replicas —
read the same way for both (``served``), so the handlers never know which runs under them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from paged_backend.outputs import RequestOutput
from paged_backend.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from paged_backend.entrypoints.data_parallel import DataParallelLLM
    from paged_backend.entrypoints.llm import LLM
    from paged_backend.entrypoints.openai.cli_args import ServerArgs
    from paged_backend.entrypoints.openai.metrics import ServerMetrics
    from paged_backend.lora.request import LoRARequest
    from paged_backend.structured_output.grammar_budget import GrammarService

Handle = TypeVar("Handle")


class ServingLoop(Protocol[Handle]):
    """The engine loop's calls the handlers make (``EngineLoop``, and ``ReplicaSet`` over replicas): ``add``
    queues requests all or none and gives a handle for each, ``stream`` yields a request's outputs from its handle
    (only the final one when it was added with ``stream=False``)."""

    grammars: GrammarService | None

    @property
    def alive(self) -> bool: ...

    async def add(
        self,
        requests: list[tuple[str, Any]],
        params: SamplingParams | list[SamplingParams],
        stream: bool = True,
        **add_kwargs: Any,
    ) -> list[Handle]: ...

    def stream(
        self, request_id: str, handle: Handle, deadline: float | None = None
    ) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    async def stats(self) -> dict[str, Any]: ...

    def shutdown(self, wait: bool = True) -> None: ...


@dataclass(frozen=True)
class Served:
    """The served model's limits, its tokenizer, the loop requests go through, and how to check an adapter."""

    tokenizer: PreTrainedTokenizerBase | None
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    loop: ServingLoop[Any]
    check_lora: Callable[[LoRARequest], None]
    data_parallel: bool  # /health lists the replicas


def served(llm: LLM | DataParallelLLM, args: ServerArgs, metrics: ServerMetrics) -> Served:
    """Start serving ``llm``: its engine loop (one engine; output grammars capped and compiled under the
    server's budget) or its replica set (replicas apply the budget they were started with)."""
    from paged_backend.entrypoints.llm import LLM

    if not isinstance(llm, LLM):
        facts, replica_set = llm.facts, llm.replica_set
        replica_set.on_output, replica_set.on_abort = metrics.observe, metrics.forget
        return Served(
            llm.get_tokenizer(),
            facts.max_model_len,
            facts.vocab_size,
            facts.max_num_seqs,
            replica_set,
            llm.check_lora,
            data_parallel=True,
        )
    from paged_backend.structured_output.grammar_budget import GrammarService

    engine = llm.llm_engine
    loop = llm.start_engine_loop(
        max_waiting_requests=args.max_waiting_requests, on_output=metrics.observe, on_abort=metrics.forget
    )
    # output grammars: capped, then compiled in worker processes under a time budget (killed when abandoned)
    loop.grammars = GrammarService(args.grammar_budget, engine.input_processor.grammar_compiler)

    def check_lora(lora: LoRARequest) -> None:
        if engine.lora_manager is None:
            raise ValueError("--lora-modules needs --enable-lora")
        engine.lora_manager.get(lora)

    return Served(
        llm.get_tokenizer(),
        engine.max_model_len,
        engine.vocab_size,
        engine.config.scheduler_config.max_num_seqs,
        loop,
        check_lora,
        data_parallel=False,
    )
