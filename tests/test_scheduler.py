"""The scheduler alone, with a ``BlockManager`` and no model: the executor is played by hand-made
``ModelRunnerOutput``s, so each decision (admission, chunking, preemption, rounds, forks, prefix hits) is checked
on its own."""

from __future__ import annotations

import itertools

from paged_backend.config import EngineConfig
from paged_backend.core.block_manager import BlockManager
from paged_backend.core.scheduler import Scheduler
from paged_backend.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from paged_backend.core.sequence import Request, Sequence, SequenceStatus
from paged_backend.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


def make_scheduler(num_blocks: int = 32, num_cpu_blocks: int = 0, **kwargs: object) -> Scheduler:
    kwargs = {"block_size": BS, "max_model_len": 64, "num_scheduler_steps": 1, **kwargs}
    config = EngineConfig.from_kwargs("none", **kwargs).resolve(None)
    prefix = bool(kwargs.get("enable_prefix_caching", True))
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=prefix, num_cpu_blocks=num_cpu_blocks)
    return Scheduler(config, bm)


def add(scheduler: Scheduler, prompt: list[int], **params: object) -> Request:
    sampling = SamplingParams(**{"temperature": 0, "max_tokens": 8, **params})  # type: ignore[arg-type]
    request = Request(str(next(_ids)), None, list(prompt), sampling, eos_token_ids=frozenset({0}))
    for index in range(sampling.best_of):
        seq_id = next(_ids)
        request.seqs.append(Sequence(seq_id, index, request, list(prompt), len(prompt), seq_id))
    scheduler.add_request(request)
    return request


def run(scheduler: Scheduler, token: int = 7) -> SchedulerOutput:
    """One step whose every sampling row draws ``token`` (each round step too)."""
    output = scheduler.schedule()
    steps = output.batch.num_steps
    rows = [[token] * (steps[i] if steps else 1) for i in range(len(output.sampling_seqs))]
    runner_output = ModelRunnerOutput(rows, [[-1.0] * len(r) for r in rows])
    scheduler.update_from_output(output, runner_output)
    return output


def used_blocks(scheduler: Scheduler) -> int:
    return scheduler.block_manager.num_used_blocks


def test_admission_counts_prompt_blocks_not_max_tokens() -> None:
    """Four prompts of 8 tokens take 2 blocks each: all fit in 10 blocks although each may write 1,000 tokens."""
    scheduler = make_scheduler(num_blocks=10, max_model_len=1024)
    for _ in range(4):
        add(scheduler, list(range(1, 9)), max_tokens=1000)
    output = scheduler.schedule()
    assert len(output.seqs) == 4 and output.batch.num_scheduled_tokens == [8, 8, 8, 8]
    assert used_blocks(scheduler) == 8
    assert output.batch.sampling_rows == [0, 1, 2, 3]


def test_chunked_prefill_respects_the_token_budget_and_samples_at_the_end() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = add(scheduler, list(range(1, 21)))
    chunks, samples = [], []
    while request.seqs[0].num_output_tokens == 0:
        output = run(scheduler)
        chunks.append(output.batch.num_scheduled_tokens)
        samples.append(output.batch.sampling_rows)
    assert chunks == [[8], [8], [4]] and samples == [[], [], [0]]
    assert scheduler.num_chunked_prefill_steps == 2
    assert request.seqs[0].num_computed_tokens == 20 and request.seqs[0].token_ids[-1] == 7


def test_long_prefill_token_threshold_caps_each_prompt_chunk() -> None:
    """Beside a decode, two new prompts go in chunks of at most 5 tokens each, within the step's budget; decodes
    (one token) are never cut."""
    scheduler = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=5)
    decoding = add(scheduler, [1, 2, 3], max_tokens=20)
    assert run(scheduler).batch.num_scheduled_tokens == [3]  # 3 <= 5: one chunk
    add(scheduler, list(range(1, 13)))
    add(scheduler, list(range(20, 27)))
    chunks = []
    for _ in range(3):
        output = run(scheduler)
        assert output.seqs[0] is decoding.seqs[0]
        chunks.append(output.batch.num_scheduled_tokens)
    assert chunks == [[1, 5, 5], [1, 5, 2], [1, 1, 2]]  # the short prompt now decodes, before the long one


def test_decodes_go_before_prefills_in_a_shared_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=6)
    first = add(scheduler, [1, 2, 3])
    run(scheduler)  # prefill and first token
    add(scheduler, list(range(1, 13)))
    output = scheduler.schedule()
    assert output.seqs[0] is first.seqs[0] and output.batch.num_scheduled_tokens == [1, 5]


def test_out_of_blocks_preempts_the_newest_request_by_recompute() -> None:
    scheduler = make_scheduler(num_blocks=4, max_model_len=32)
    old = add(scheduler, [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=20)
    new = add(scheduler, [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=20)
    run(scheduler)  # both prefill: 2 blocks each, the cache is full
    assert used_blocks(scheduler) == 4
    run(scheduler)  # both would write their 9th token in a third block: the newest is preempted
    assert scheduler.num_preemptions == 1 and scheduler.num_swapped_out == 0
    assert new.seqs[0].status is SequenceStatus.WAITING and new.seqs[0].num_computed_tokens == 0
    assert old.seqs[0].status is SequenceStatus.RUNNING and scheduler.waiting[0] is new.seqs[0]


def test_preemption_swaps_when_there_is_swap_space_and_swaps_back_first() -> None:
    scheduler = make_scheduler(num_blocks=4, num_cpu_blocks=8, max_model_len=32)
    old = add(scheduler, [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=20)
    new = add(scheduler, [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=20)
    run(scheduler)
    output = run(scheduler)
    assert scheduler.num_swapped_out == 1 and new.seqs[0].status is SequenceStatus.SWAPPED
    assert len(output.batch.blocks_to_swap_out) == 2  # its two blocks go to CPU before they are reused
    while old.seqs[0].status is SequenceStatus.RUNNING:
        run(scheduler, token=0 if old.seqs[0].num_output_tokens >= 3 else 7)  # the old one stops (EOS)
    output = run(scheduler)
    assert new.seqs[0].status is SequenceStatus.RUNNING and output.batch.blocks_to_swap_in


def test_greedy_decodes_run_in_rounds_bounded_by_max_tokens() -> None:
    scheduler = make_scheduler(num_scheduler_steps=4)
    short = add(scheduler, [1, 2, 3], max_tokens=3)
    long = add(scheduler, [4, 5, 6], max_tokens=9)
    run(scheduler)  # prefill: the first token goes out alone
    output = run(scheduler)
    assert output.batch.num_steps == [2, 4]  # the short one has 2 tokens left
    assert short.seqs[0].status is SequenceStatus.FINISHED_LENGTH and short.seqs[0].num_output_tokens == 3
    assert long.seqs[0].num_output_tokens == 5 and long.seqs[0].num_computed_tokens == 3 + 4
    sampled = add(scheduler, [7, 8], temperature=1.0)
    run(scheduler)  # its prefill
    assert run(scheduler).batch.num_steps is None  # a sampling request keeps the batch to single steps
    assert sampled.seqs[0].num_output_tokens == 2


def test_samples_fork_from_the_first_one_after_its_prefill() -> None:
    scheduler = make_scheduler()
    request = add(scheduler, [1, 2, 3, 4, 5, 6], n=3, temperature=1.0)
    output = scheduler.schedule()
    assert output.seqs == [request.seqs[0]] and output.sampling_seqs == request.seqs
    assert output.fork_parents == [0, 0]  # the two others draw from the first one's logits row
    rows = [[5], [6], [7]]
    scheduler.update_from_output(output, ModelRunnerOutput(rows, [[-1.0]] * 3))
    tables = [scheduler.block_manager.get_block_table(s.seq_id) for s in request.seqs]
    assert tables[0] == tables[1] == tables[2] and used_blocks(scheduler) == 2  # shared by reference
    assert [s.output_token_ids for s in request.seqs] == [[5], [6], [7]]
    output = run(scheduler)
    assert len(output.seqs) == 3 and len(output.batch.blocks_to_copy) == 2  # copy-on-write of the partial block
    assert used_blocks(scheduler) == 4


def test_prefix_cache_hits_skip_the_cached_blocks() -> None:
    scheduler = make_scheduler()
    prompt = list(range(1, 11))  # 2 full blocks and 2 tokens
    first = add(scheduler, prompt, max_tokens=1)
    run(scheduler)
    assert first.seqs[0].status is SequenceStatus.FINISHED_LENGTH
    second = add(scheduler, prompt + [11], max_tokens=1)
    output = scheduler.schedule()
    assert output.batch.num_computed_tokens == [8] and output.batch.num_scheduled_tokens == [3]
    assert second.seqs[0].num_cached_prompt_tokens == 8
    assert scheduler.num_prompt_tokens_cached / scheduler.num_prompt_tokens_admitted == 8 / 21


def test_a_stop_string_cut_takes_back_round_tokens_and_frees_the_blocks() -> None:
    scheduler = make_scheduler(num_scheduler_steps=4)
    request = add(scheduler, [1, 2, 3], max_tokens=20)
    run(scheduler)
    run(scheduler)  # a round of 4
    seq = request.seqs[0]
    assert seq.num_output_tokens == 5
    scheduler.finish_seq(seq, SequenceStatus.FINISHED_STOPPED, "stop", num_tokens=3 + 2)
    assert seq.output_token_ids == [7, 7] and seq.stop_reason == "stop" and seq.num_computed_tokens == 4
    assert used_blocks(scheduler) == 0 and not scheduler.has_unfinished_seqs()


def _swap_in_step() -> tuple[Scheduler, Request, SchedulerOutput]:
    """The swap test's scenario up to the step that swaps ``new`` back in (not run)."""
    scheduler = make_scheduler(num_blocks=4, num_cpu_blocks=8, max_model_len=32)
    old = add(scheduler, [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=20)
    new = add(scheduler, [11, 12, 13, 14, 15, 16, 17, 18], max_tokens=20)
    run(scheduler)
    run(scheduler)
    while old.seqs[0].status is SequenceStatus.RUNNING:
        run(scheduler, token=0 if old.seqs[0].num_output_tokens >= 3 else 7)
    output = scheduler.schedule()
    assert output.batch.blocks_to_swap_in and output.swapped_seqs == new.seqs
    return scheduler, new, output


def test_a_failed_swap_in_offers_none_of_its_blocks_to_the_prefix_cache() -> None:
    """Swapped out, a sequence's blocks left the prefix cache; the step swapping them back failed before its
    copies ran: aborting it must not register the blocks it was to fill (the default would: they look computed)."""
    for cache_blocks, registered in ((False, 0), (True, 2)):
        scheduler, new, output = _swap_in_step()
        before = scheduler.block_manager.num_cached_blocks
        scheduler.finish_seq(new.seqs[0], SequenceStatus.FINISHED_ABORTED, cache_blocks=cache_blocks)
        assert scheduler.block_manager.num_cached_blocks - before == registered


def test_a_request_to_retry_alone_gets_steps_of_its_own_then_rejoins() -> None:
    scheduler = make_scheduler()
    first, second, third = (add(scheduler, [i, i + 1, i + 2], max_tokens=6) for i in (1, 20, 40))
    run(scheduler)
    scheduler.retry_alone(second)
    assert second.seqs[0].status is SequenceStatus.WAITING and second.seqs[0].num_computed_tokens == 0
    assert [s.request for s in run(scheduler).seqs] == [second]  # its own step, the others wait it out
    assert {s.request for s in run(scheduler).seqs} == {first, second, third}  # it sampled: together again
    assert not scheduler.run_alone
