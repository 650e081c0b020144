"""CUDA graphs for decode-only steps, and for speculative decoding's verifying steps.

A decode step is a few milliseconds of GPU work spread over hundreds of small kernel launches, so launching it
from Python costs more than running it. We capture the whole forward once per bucket size (padding a batch up to
the next bucket) over static input buffers, then each decode step copies its inputs in (two host-to-device
copies) and replays. Every bucket shares one memory pool; larger buckets are captured first. A runner with
``q_len`` > 1 holds rows of exactly that many tokens (a verifying step, its rows padded: verify_inputs.py) and
returns every token's logits.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

import torch

from paged_backend.kernels.compile_ahead import compiling_ahead
from paged_backend.worker.attention import AttentionMetadata
from paged_backend.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)

ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Buckets 1, 2, 4, 8, then multiples of 16, up to the first that holds ``max_num_seqs``. The bucket of 1 costs
    a second compiled graph (dynamo specialises a dimension of size 1), made at capture; without it a lone
    sequence (one chat) decodes padded to two rows, and kernels whose cost grows with rows (the AWQ GEMV) pay for
    the padding."""
    sizes = [1, 2, 4, 8] + list(range(16, max(max_num_seqs, 16) + 16, 16))
    return [s for s in sizes if s < max_num_seqs] + [next(s for s in sizes if s >= max_num_seqs)]


def fits_verify_graph(inputs: StepInputs, max_size: int, q_len: int) -> bool:
    """Every row ``q_len`` tokens and every token's logits asked for (verify_inputs.pad_rows makes such steps)."""
    num_seqs, num_tokens = inputs.num_seqs, inputs.num_tokens
    return (
        num_tokens == num_seqs * q_len
        and num_seqs <= max_size
        and inputs.logits_indices.shape[0] == num_tokens
        and bool(torch.equal(inputs.cu_seqlens_q.long(), torch.arange(0, num_tokens + 1, q_len)))
    )


def fits_decode_graph(inputs: StepInputs, max_size: int) -> bool:
    """One token per sequence and every sequence samples (a one-token prefill chunk that is not its prompt's
    end has the first property, not the second), in a batch no larger than the largest bucket. Read from the
    tensors alone: tensor-parallel workers get the inputs without their sequences and must decide alike."""
    num_seqs = inputs.num_seqs
    return inputs.decode_only and inputs.logits_indices.shape[0] == num_seqs and num_seqs <= max_size


def capture_buckets(
    sizes: list[int],
    run: Callable[[int], torch.Tensor],
    device: torch.device,
    prepare: Callable[[int], None] = lambda size: None,
) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, torch.Tensor]]:
    """``run(size)`` captured for every size, largest first, into one memory pool (after ``prepare(size)`` and a
    warm-up run that compiles kernels and settles the allocator): the graphs and their outputs. A first pass,
    its outputs thrown away, compiles the kernels that take part in ``kernels/compile_ahead.py`` (the int4 ones)
    for every size side by side; it stops after the largest size where none of them runs (one forward more)."""
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, torch.Tensor] = {}
    with compiling_ahead(device) as ahead:
        for size in sorted(sizes, reverse=True):
            prepare(size)
            run(size)
            if not ahead.compiles:
                break
    pool = torch.cuda.graph_pool_handle()
    torch.cuda.synchronize(device)
    # An engine dropped earlier in this process may still be garbage in a reference cycle: collected during a
    # capture, its graphs' reset is an operation a capturing stream refuses, and the capture fails.
    gc.collect()
    gc.disable()
    try:
        for size in sorted(sizes, reverse=True):
            prepare(size)
            run(size)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs[size] = run(size)
            graphs[size] = graph
    finally:
        gc.enable()
    torch.cuda.synchronize(device)
    return graphs, outputs


def keep_agreed(holder: object, names: list[str], agree: Callable[[int], int]) -> None:
    """Drop the graph runners (attributes ``names`` of ``holder``) that some rank of a tensor-parallel group lacks
    (its capture failed): one rank replaying a padded bucket while another runs the step eagerly would all-reduce
    tensors of different sizes. ``agree`` is the minimum over the ranks; every rank calls it once per name."""
    for name in names:
        ours = getattr(holder, name) is not None
        if agree(int(ours)) == 0 and ours:
            logger.warning("CUDA graphs (%s) dropped: another rank could not capture them", name)
            setattr(holder, name, None)


class CUDAGraphRunner:
    def __init__(
        self,
        forward: ForwardFn,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
        num_staging: int = 1,
        batch_invariant: bool = False,
        q_len: int = 1,
    ) -> None:
        self.forward = forward
        self.batch_invariant = batch_invariant  # the attention's fixed-order configuration (AttentionMetadata.exact)
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        self.max_size = self.sizes[-1]
        self.q_len = q_len
        n = self.max_size * q_len  # tokens
        # Rows: input_ids, positions, slot_mapping (a column a token), context_lens (a column a sequence, the
        # first ones); one copy moves them all. Steps launched back to back without a host sync (multi-step
        # decoding) each need their own pinned buffer: an asynchronous copy reads it only when the GPU gets there.
        self.staging = torch.zeros(num_staging, 4, n, dtype=torch.long, pin_memory=device.type == "cuda")
        # when each buffer's last copy has run: a buffer is written again only after it (any order of use is safe)
        self.copied = [torch.cuda.Event() for _ in range(num_staging)] if device.type == "cuda" else []
        self.static_ints = torch.zeros(4, n, dtype=torch.long, device=device)
        self.static_ints[2].fill_(-1)
        self.padding_column = torch.tensor([[0], [0], [-1], [0]])  # [4, 1]: see run()
        self.static_tables = torch.zeros(self.max_size, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(0, n + 1, q_len, dtype=torch.int32, device=device)  # q_len tokens each
        self.logits_indices = torch.arange(n, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _run(self, size: int) -> torch.Tensor:  # [size * q_len, V]
        tokens = size * self.q_len
        ids, pos, slots = self.static_ints[:3, :tokens]
        metadata = AttentionMetadata(
            slot_mapping=slots,
            block_tables=self.static_tables[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            context_lens=self.static_ints[3, :size],
            exact=self.batch_invariant,
        )
        return self.forward(ids, pos, metadata, self.logits_indices[:tokens])

    def capture(self) -> None:
        """Capture every bucket, largest first. Inputs are all padding: no cache slot is read or written."""
        start = time.perf_counter()
        self.graphs, self.outputs = capture_buckets(self.sizes, self._run, self.device)
        logger.info(
            "captured %d CUDA graphs (batch sizes %s) in %.1f s",
            len(self.sizes),
            self.sizes,
            time.perf_counter() - start,
        )

    def can_run(self, inputs: StepInputs) -> bool:
        if self.q_len > 1:
            return bool(self.graphs) and fits_verify_graph(inputs, self.max_size, self.q_len)
        return bool(self.graphs) and fits_decode_graph(inputs, self.max_size)

    def run(
        self,
        inputs: StepInputs,
        input_ids: torch.Tensor | None = None,
        staging_index: int = 0,
        first_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Replay the bucket that holds the batch; returns ``[B, V]``, a view valid until the next replay.
        ``input_ids`` [B] on the device replaces ``inputs.input_ids`` (one token a row), ``first_ids`` [B] each
        row's first token (rows of ``q_len``); steps launched without a host sync in between must use different
        ``staging_index`` values."""
        b, t = inputs.num_seqs, inputs.num_tokens
        size = next(s for s in self.sizes if s >= b)
        staging = self.staging[staging_index]
        if self.copied:
            self.copied[staging_index].synchronize()
        # Rows b..size are padding sequences: token 0 at position 0, slot -1 (no write), context 0 (no read).
        staging[0, :t] = inputs.input_ids
        staging[1, :t] = inputs.positions
        staging[2, :t] = inputs.slot_mapping
        staging[3, :b] = inputs.context_lens
        staging[:, t : size * self.q_len] = self.padding_column
        staging[3, b:size] = 0
        self.static_ints.copy_(staging, non_blocking=True)  # whole and contiguous: a true async copy
        if self.copied:
            self.copied[staging_index].record()
        if input_ids is not None:
            self.static_ints[0, :b].copy_(input_ids)
        if first_ids is not None:
            self.static_ints[0, : b * self.q_len : self.q_len].copy_(first_ids)
        width = inputs.block_tables.shape[1]
        self.static_tables[:b, :width].copy_(inputs.block_tables, non_blocking=True)
        self.graphs[size].replay()
        return self.outputs[size][:t]

    def run_rows(
        self,
        ids: torch.Tensor,  # [B * q_len] on the device, as positions and slots
        positions: torch.Tensor,
        slots: torch.Tensor,
        context_lens: torch.Tensor,  # [B]
        tables: torch.Tensor,  # [B, W] int32
    ) -> torch.Tensor:
        """``run`` for rows of ``q_len`` tokens whose inputs are on the device already (a lookup round's,
        worker/lookup_round.py): copied into the static buffers on the device, no host tensor read."""
        b, t = context_lens.shape[0], ids.shape[0]
        size = next(s for s in self.sizes if s >= b)
        self.static_ints[:3, :t].copy_(torch.stack([ids, positions, slots]))
        self.static_ints[3, :b].copy_(context_lens)
        if size > b:  # padding sequences, as in ``run`` (filled on the device: no host copy waits for it)
            self.static_ints[:2, t : size * self.q_len] = 0
            self.static_ints[2, t : size * self.q_len] = -1
            self.static_ints[3, b:size] = 0
        self.static_tables[:b, : tables.shape[1]].copy_(tables)
        self.graphs[size].replay()
        return self.outputs[size][:t]
