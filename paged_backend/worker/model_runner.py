"""Runs one scheduled step — a single ``[1, T]`` forward of the user's HF model, or a multi-step round of greedy
decode forwards — and samples the tokens of the sequences that sample (``execute_model``).

On CUDA (unless ``enforce_eager``) the decoder layer is compiled once (dynamic token and sequence dimensions; our
attention and cache write stay opaque custom ops; ``worker/compile.py``; with ``batch_invariant`` its sibling
projections are only packed: ``worker/invariant_siblings.py``) and decode steps replay CUDA graphs, as do steps
with prompt tokens up to a few hundred (``worker/mixed_graphs.py``). The compile's warm-up has several sequences,
tokens and logit rows: a dimension of size 1 would make dynamo specialise on it (the CUDA graph bucket of 1 gets a
second graph of its own).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence

import torch
from torch._dynamo.backends.registry import CompilerFn
from transformers import PreTrainedModel

from paged_backend.core.scheduler_output import ModelRunnerOutput, ScheduledBatch, SchedulerOutput
from paged_backend.core.sequence import Sequence as Seq
from paged_backend.lora.manager import LoRAManager
from paged_backend.model_structure import find_decoder_layers
from paged_backend.worker import batch_invariant as invariance
from paged_backend.worker.async_output import (
    AsyncModelRunnerOutput,
    DeferredOutput,
    PendingRound,
    StepCopies,
    last_steps_begin,
)
from paged_backend.worker.attention import AttentionMetadata, PagedAttentionSwitch
from paged_backend.worker.cache_engine import CacheEngine
from paged_backend.worker.compile import RegionalCompile
from paged_backend.worker.cuda_graphs import CUDAGraphRunner, keep_agreed
from paged_backend.worker.fuse_linears import PackingBackend
from paged_backend.worker.hf_forward import hf_forward, takes_logits_to_keep
from paged_backend.worker.invariant_siblings import SiblingProducts, packed_siblings
from paged_backend.worker.lookup_graphs import LookupGraphs
from paged_backend.worker.lookup_round import LookupRounds
from paged_backend.worker.mixed_graphs import MixedGraphRunner, mixed_capture_sizes
from paged_backend.worker.sampler import RoundBias, Sampler
from paged_backend.worker.step_inputs import (
    EmbedsPieces,
    StepInputs,
    build_step_inputs,
    pad_step_inputs,
    prompt_embeds_pieces,
    queued_copy,
    round_steps,
    warmup_inputs,
)
from paged_backend.worker.step_sampler import sample_step
from paged_backend.worker.structured_output import RoundGrammars
from paged_backend.worker.verify_inputs import pad_rows
from paged_backend.worker.weights import WeightAddresses

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: PreTrainedModel,
        cache_engine: CacheEngine,
        device: torch.device,
        enforce_eager: bool = True,
        batch_invariant: bool = False,
        max_num_seqs: int = 256,
        max_model_len: int = 2048,
        num_scheduler_steps: int = 1,
        lora_manager: LoRAManager | None = None,
        seed: int = 0,
        calculate_kv_scales: bool = False,
        logprobs_mode: str = "raw_logprobs",
        verify_shape: tuple[int, int] | None = None,  # speculative decoding: (tokens a row, rows) of its graphs
        lookup_ngrams: tuple[int, int] | None = None,  # prompt lookup's n-gram sizes, for its rounds' graphs
        max_num_batched_tokens: int = 0,  # steps with prompt tokens replay graphs up to this many (0: none)
        agree: Callable[[int], int] | None = None,  # tensor parallelism: the minimum of a value over the ranks
    ) -> None:
        self.model = model
        if batch_invariant:
            invariance.check_batch_invariant_supported(model, device)
        self.batch_invariant = batch_invariant
        self.rms_norms = invariance.invariant_rms_norms(model, device) if batch_invariant else []
        self.cache_engine, self.device, self.lora_manager = cache_engine, device, lora_manager
        self.sampler = Sampler(device, seed, logprobs_mode == "raw_logprobs", batch_invariant)
        self.block_size = cache_engine.block_size
        self.switch = PagedAttentionSwitch(model, cache_engine.kv_caches, cache_engine.kv_scales)
        self.keeps_logits = takes_logits_to_keep(model)
        # (input_ids [T], positions [T], metadata, logits_indices [N], prompt_embeds) -> [N, V]
        self._model_forward: Callable[..., torch.Tensor] = functools.partial(hf_forward, model, self.keeps_logits)
        self.regions: RegionalCompile | None = None
        self.graphs: CUDAGraphRunner | None = None
        self.verify_graphs: CUDAGraphRunner | None = None  # steps whose rows are short: verifying ones
        self.mixed_graphs: MixedGraphRunner | None = None  # steps with prompt tokens, up to a few hundred
        self.mixed_sizes = mixed_capture_sizes(max_num_batched_tokens)
        self.verify_shape, self.lookup_ngrams, self.agree = verify_shape, lookup_ngrams, agree
        self.lookup_graphs: LookupGraphs | None = None  # the rest of a lookup round's step, around verify_graphs'
        self.weights: WeightAddresses | None = None
        self._recapture = False  # sleep() dropped CUDA graphs that wake_up() captures again
        self._last_round: tuple[torch.Tensor, list[int]] | None = None  # its tokens [K, B] and rows' steps
        self._unread: DeferredOutput | None = None  # the last single step, until it is sampled
        self.lookup_rounds = LookupRounds()  # its rows' state on the device, for the round queued behind
        self._round_parity = 0  # which half of the graphs' staging buffers the last round used
        self.calibrate_kv_scales = False  # the warm-ups below never calibrate
        self._graph_shape = (max_num_seqs, max(2, math.ceil(max_model_len / self.block_size)), num_scheduler_steps)
        self.siblings: SiblingProducts | None = None  # batch_invariant's packed sibling projections
        if device.type == "cuda" and not enforce_eager:
            self.compile()
        if batch_invariant and self.siblings is None:  # groups an earlier engine packed: the trainer's forward,
            self.siblings = packed_siblings(model) or None  # finding them too, must compute them alike
        cache_engine.swap_space.caches()  # pinned while the layer compiled: host allocations must not meet a capture
        if device.type == "cuda" and not enforce_eager:
            self.capture_graphs()
        # After the warm-ups: the first real step (a prefill: nothing decodes before one) sets the fp8 scales.
        self.calibrate_kv_scales = calculate_kv_scales and cache_engine.kv_scales is not None
        self.record_weights()

    def capture_graphs(self) -> None:
        """Capture the CUDA graphs (they read the KV cache and the weights at today's addresses): decode steps',
        verifying steps', steps with prompt tokens'."""
        max_num_seqs, width, num_scheduler_steps = self._graph_shape
        forward, invariant = self._model_forward, self.batch_invariant
        with torch.inference_mode():  # static buffers must be inference tensors, like every step's inputs
            # two rounds' worth of staging buffers: see run_decode_steps
            self.graphs = CUDAGraphRunner(forward, max_num_seqs, width, self.device, 2 * num_scheduler_steps, invariant)
            if self.verify_shape is not None:
                q_len, rows = self.verify_shape
                self.verify_graphs = CUDAGraphRunner(forward, rows, width, self.device, 1, invariant, q_len)
                if self.lookup_ngrams is not None:
                    self.lookup_graphs = LookupGraphs(
                        self.verify_graphs, self.lookup_ngrams, self.block_size, self.sampler.greedy
                    )
            if self.mixed_sizes:
                rows = self.graphs.max_size
                self.mixed_graphs = MixedGraphRunner(forward, self.mixed_sizes, rows, width, self.device, invariant)
        names = ["graphs", "verify_graphs", "mixed_graphs", "lookup_graphs"]  # the steady state's first
        for name in names:
            runner = getattr(self, name)
            try:
                if runner is not None:
                    with torch.inference_mode(), self.switch, self._compiled(), self._invariant():
                        runner.capture()
            except Exception as exc:  # noqa: BLE001 - steps still run, without graphs
                logger.warning("CUDA graph capture (%s) failed (%s: %s); those steps run eagerly", name,
                               type(exc).__name__, exc)  # fmt: skip
                setattr(self, name, None)
        if self.agree is not None:
            keep_agreed(self, names, self.agree)

    def sleep(self) -> None:
        """Free the KV cache and the CUDA graphs (and their memory pools); the weights are the user's and stay."""
        self._recapture = self._has_graphs()
        self.graphs, self.verify_graphs, self.mixed_graphs, self.lookup_graphs = None, None, None, None
        self.cache_engine.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """Allocate the KV cache again and, where there were CUDA graphs, capture them anew (new addresses)."""
        self.cache_engine.restore()
        if self._recapture:
            self.capture_graphs()
        self.record_weights()

    def record_weights(self) -> None:
        """Where the parameters are now, when packed projections or CUDA graphs will read them there."""
        packed = self.regions is not None or self.siblings is not None
        self.weights = WeightAddresses(self.model) if packed or self._has_graphs() else None

    def _has_graphs(self) -> bool:
        return any(runner is not None for runner in (self.graphs, self.verify_graphs, self.mixed_graphs))

    # ------------------------------------------------------------------ set-up
    def compile(self, backend: str | CompilerFn = "inductor") -> None:
        """Compile the decoder layer on a generic warm-up batch. If that fails, steps run eagerly (still with
        CUDA graphs on a GPU)."""
        layers = find_decoder_layers(self.model)
        if layers is None:
            logger.warning("no repeated decoder layers found in %s: running eagerly", type(self.model).__name__)
            return
        start = time.perf_counter()
        try:
            with torch.inference_mode():  # inputs made here are inference tensors, like every step's
                # A first dynamo-only trace packs sibling projections (fuse_linears.py), then the real compile.
                packer = PackingBackend(list(layers))
                self.regions = RegionalCompile(layers, packer)
                self.run(warmup_inputs())
                packer.finish()
                if self.batch_invariant:  # inductor's fused reductions pick their own splits: layers stay eager
                    self.regions, self.siblings = None, SiblingProducts(packer.packed.values())
                    logger.info("%d groups of sibling projections packed for batch_invariant", len(self.siblings))
                    self.record_weights()
                    return
                self.regions = RegionalCompile(layers, backend)
                self.run(warmup_inputs())
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if self.regions.num_graphs == 0:  # dynamo gave up (e.g. a recompile limit) and ran eagerly
                raise RuntimeError("dynamo produced no graph for the decoder layer")
        except Exception as exc:  # noqa: BLE001 - any compiler failure falls back to the eager forward
            logger.warning("torch.compile failed (%s: %s); running the model eagerly", type(exc).__name__, exc)
            self.regions = None
            return
        regions, seconds = self.regions, time.perf_counter() - start
        logger.info(
            "compiled %s into %d graph(s) shared by %d layers (%d groups of sibling projections fused) in %.1f s",
            *(type(layers[0]).__name__, regions.num_graphs, len(layers), regions.num_fused_groups, seconds),
        )
        self.record_weights()

    def _compiled(self) -> contextlib.AbstractContextManager[object]:
        return self.regions if self.regions is not None else contextlib.nullcontext()

    def _invariant(self) -> contextlib.AbstractContextManager[object]:
        plain = not self.batch_invariant or self.regions is not None  # compile()'s packing trace sees plain linears
        return contextlib.nullcontext() if plain else invariance.BatchInvariantMode(self.rms_norms, self.siblings)

    # ------------------------------------------------------------------ the step
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output).get_output()

    @torch.inference_mode()
    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        """The step's cache moves, its forward (or round of forwards), then sampling. A multi-step round is only
        queued: its tokens are read by ``get_output``, after the next round may have been queued behind it. A
        tensor-parallel rank other than 0 gets the batch without its sequences: it runs the forwards and samples
        nothing."""
        batch, before = scheduler_output.batch, self._unread
        if self._unread is not None:  # its logits may be a graph's buffer, which this step's replay overwrites
            self._unread.keep()
            self._unread = None
        if self.weights is not None:
            self.weights.check()
        self.cache_engine.swap_out(batch.blocks_to_swap_out)  # before the freed blocks are written again
        self.cache_engine.swap_in(batch.blocks_to_swap_in)
        self.cache_engine.copy_blocks(batch.blocks_to_copy)
        for prompt_kv, table in scheduler_output.kv_imports:  # a request's own KV of its first tokens
            self.cache_engine.write_tokens(prompt_kv, table, self.model.dtype)
        if batch.lookup_round is not None:  # proposals looked up on the device (worker/lookup_round.py)
            self._last_round = None
            return self.lookup_rounds.launch(self, batch)
        inputs = build_step_inputs(batch, self.block_size)
        if batch.num_steps is None:
            self._last_round = None
            first = None  # a verifying step chained to the one before (core/spec_chain.py): its rows' first tokens
            if batch.first_from is not None:
                if before is None:
                    raise RuntimeError("a chained verifying step, but no single step before it is unread")
                first = before.greedy_rows(batch.first_from)
            self._unread = self._execute_step(inputs, scheduler_output, first)
            return self._unread
        seqs = scheduler_output.sampling_seqs
        first = self._round_inputs(batch.prev_rows)
        with self._lora_step(batch, [1] * batch.num_seqs, scheduler_output.seqs):
            grammars = RoundGrammars.of(seqs, batch.num_steps, self.device)
            bias = RoundBias.of(seqs, self.device)
            steps = round_steps(inputs, batch.num_steps, self.block_size, pin=self.device.type == "cuda")
            tokens, logprobs, last_steps, copies = self.run_decode_steps(steps, grammars, first, bias)
        self._last_round = (tokens, batch.num_steps)
        return PendingRound(
            tokens, logprobs, batch.num_steps, grammars, sampling=bool(seqs), last_steps=last_steps, copies=copies
        )

    def _round_inputs(self, prev_rows: list[int] | None) -> torch.Tensor | None:
        """A round queued behind the previous one starts from the last token each of its rows sampled there."""
        if prev_rows is None:
            return None
        if self._last_round is None:
            raise RuntimeError("a round that continues the previous round, but the previous step was no round")
        tokens, num_steps = self._last_round
        last_step, rows = torch.tensor([num_steps[row] - 1 for row in prev_rows]), torch.tensor(prev_rows)
        return tokens[queued_copy(last_step, self.device), queued_copy(rows, self.device)]

    def _execute_step(
        self, inputs: StepInputs, scheduler_output: SchedulerOutput, first: torch.Tensor | None = None
    ) -> DeferredOutput:
        """A single step: its forward, queued; sampling on the host when its output is read. ``first`` [B] on the
        device replaces each row's first token."""
        batch = scheduler_output.batch
        embeds = prompt_embeds_pieces(scheduler_output)
        with self._lora_step(batch, batch.num_scheduled_tokens, scheduler_output.seqs):
            graphs = not batch.prompt_logprob_rows and not embeds
            logits = self.run(inputs, use_graphs=graphs, prompt_embeds=embeds, first_ids=first)
        sample = functools.partial(
            sample_step, self.sampler, scheduler_output=scheduler_output, pin=self.device.type == "cuda"
        )
        return DeferredOutput(sample, logits)

    def _lora_step(
        self, batch: ScheduledBatch, tokens_per_seq: Sequence[int], seqs: list[Seq]
    ) -> contextlib.AbstractContextManager[None]:
        """The step's adapters placed for the forwards inside (``LoRAManager.step``)."""
        if self.lora_manager is None:
            return contextlib.nullcontext()
        adapters = [seq.request.lora_adapter for seq in seqs] if seqs else None
        return self.lora_manager.step(adapters, batch.lora_requests, tokens_per_seq)

    def run(
        self,
        inputs: StepInputs,
        input_ids: torch.Tensor | None = None,
        staging_index: int = 0,
        use_graphs: bool = True,
        prompt_embeds: EmbedsPieces = (),
        first_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One step; returns ``[N, V]``. ``input_ids`` [T] on the device replaces ``inputs.input_ids``
        (multi-step decoding feeds the previous step's sampled tokens without a trip to the host); steps queued
        without a host sync between them use different ``staging_index`` values (the graphs' pinned buffers).
        ``use_graphs=False`` when the logits wanted are not one per row, last token each (prompt logprobs), or
        when ``prompt_embeds`` replace some tokens' embeddings: a graph returns exactly those logits from token ids.
        ``first_ids`` [B] on the device replaces each row's first token."""
        if use_graphs and self.graphs is not None and self.graphs.can_run(inputs):
            with self.switch:  # [B, V]: every decode sequence samples
                return self.graphs.run(inputs, input_ids if first_ids is None else first_ids, staging_index)
        verify = self.verify_graphs
        if use_graphs and verify is not None and input_ids is None and not self.calibrate_kv_scales:
            padded = pad_rows(inputs, verify.q_len, self.block_size, self._graph_shape[1])
            if padded is not None and verify.can_run(padded[0]):
                with self.switch:  # every token's logits, of which the step's
                    return verify.run(padded[0], first_ids=first_ids)[queued_copy(padded[1], self.device)]
        mixed = self.mixed_graphs
        if use_graphs and mixed is not None and input_ids is None and first_ids is None:
            if mixed.can_run(inputs) and not self.calibrate_kv_scales:
                with self.switch:
                    return mixed.run(inputs)
        n = inputs.logits_indices.shape[0]
        if self.regions is not None:
            short = inputs.num_seqs < 2 or inputs.num_tokens < 2
            inputs = pad_step_inputs(inputs, 1 if short else 0, min_logits=2, min_width=2)
        d = inputs.to(self.device, exact=self.batch_invariant)
        if input_ids is not None:
            d.input_ids = torch.cat([input_ids, d.input_ids[input_ids.shape[0] :]])  # keeps any padding token
        if first_ids is not None:  # each row starts at cu_seqlens_q (padding rows come after the step's own)
            d.input_ids = d.input_ids.index_copy(0, d.metadata.cu_seqlens_q[: first_ids.shape[0]].long(), first_ids)
        return self.forward_device(d.input_ids, d.positions, d.metadata, d.logits_indices, prompt_embeds)[:n]

    def forward_device(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
        prompt_embeds: EmbedsPieces = (),
    ) -> torch.Tensor:
        """The forward, without CUDA graphs, of inputs already on the device."""
        calibrate = self.calibrate_kv_scales
        # The calibrating step runs eagerly: compiled code would keep the flag it was traced with.
        with self.switch, self.switch.calibrating() if calibrate else self._compiled(), self._invariant():
            logits = self._model_forward(input_ids, positions, metadata, logits_indices, prompt_embeds)
        self.calibrate_kv_scales = False  # set once the step's forward went through (a failed one calibrates again)
        return logits

    def run_decode_steps(
        self,
        steps: list[StepInputs],
        grammars: RoundGrammars | None = None,
        first_input_ids: torch.Tensor | None = None,
        bias: RoundBias | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None, StepCopies | None]:
        """Greedy decode steps back to back, each fed the previous one's tokens on the device (the first fed
        ``first_input_ids`` [B] on the device, when given). Returns the sampled tokens and their logprobs,
        ``[K, B]`` each, and on a GPU an event recorded where the last ``LAST_STEPS`` forwards begin
        (``PendingRound.wait_for_last_steps``) and each step's tokens copied to the host behind it (``StepCopies``:
        a stream reads them step by step). No host sync, except that rows under a grammar wait for the
        previous step's tokens (while the device runs the next forward) to mask each step. Two rounds may be
        queued at once: they take turns on the CUDA graphs' pinned staging buffers."""
        tokens, logprobs = [], []
        previous = first_input_ids
        self._round_parity ^= 1
        first_staging = self._round_parity * self._graph_shape[2]  # num_scheduler_steps buffers each
        last_steps = None
        streamable = self.device.type == "cuda" and grammars is None  # a grammar's round is read whole
        copies = StepCopies(len(steps), steps[0].num_seqs) if streamable else None
        for k, inputs in enumerate(steps):
            if k == last_steps_begin(len(steps)) and self.device.type == "cuda":
                last_steps = torch.cuda.Event()
                last_steps.record(torch.cuda.current_stream(self.device))
            logits = self.run(inputs, previous, first_staging + k)
            if bias is not None:
                bias.apply(logits)
            if grammars is not None:
                grammars.apply(k, logits)
            token, logprob = self.sampler.greedy(logits)  # [B], [B]
            if grammars is not None:
                grammars.sampled(token)
            tokens.append(token)
            logprobs.append(logprob)
            if copies is not None:
                copies.add(token, logprob)
            previous = token
        return torch.stack(tokens), torch.stack(logprobs), last_steps, copies
