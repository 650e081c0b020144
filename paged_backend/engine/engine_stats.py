"""The engine's counters as one dict (``LLMEngine.stats``): blocks, queues, preemptions, the prefix cache, and
speculative decoding's proposals."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paged_backend.engine.llm_engine import LLMEngine


def engine_stats(engine: LLMEngine) -> dict[str, Any]:
    scheduler = engine.scheduler
    bm = scheduler.block_manager
    drafter = scheduler.drafter
    in_cache = {seq.seq_id: seq.num_computed_tokens for seq in scheduler.running}
    return {
        "num_kv_blocks": bm.num_blocks,
        "num_free_blocks": bm.num_free_blocks,
        "block_size": bm.block_size,
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting),
        "num_preemptions": scheduler.num_preemptions,
        "num_swapped_out": scheduler.num_swapped_out,
        "num_swapped": len(scheduler.swapped),
        "num_free_cpu_blocks": len(bm.cpu_free_block_ids),
        "num_cpu_blocks": bm.num_cpu_blocks,
        "num_chunked_prefill_steps": scheduler.num_chunked_prefill_steps,
        "num_cached_blocks": bm.num_cached_blocks,
        # prompt tokens served from the prefix cache / prompt tokens, over first admissions
        "prefix_cache_hit_rate": scheduler.num_prompt_tokens_cached / max(1, scheduler.num_prompt_tokens_admitted),
        "num_prompt_tokens_cached": scheduler.num_prompt_tokens_cached,
        "num_prompt_tokens_admitted": scheduler.num_prompt_tokens_admitted,  # the rate's denominator (to sum rates)
        "kv_waste_fraction": bm.kv_waste_fraction(in_cache),
        "num_prompt_tokens": engine.num_prompt_tokens,
        "num_generated_tokens": engine.num_generated_tokens,
        # speculative decoding (vLLM's spec_decode counters): rows with proposals, tokens proposed, tokens taken
        "spec_decode_num_drafts": 0 if drafter is None else drafter.num_drafts,
        "spec_decode_num_draft_tokens": 0 if drafter is None else drafter.num_draft_tokens,
        "spec_decode_num_accepted_tokens": 0 if drafter is None else drafter.num_accepted_tokens,
        "spec_decode_num_accepted_tokens_per_pos": [] if drafter is None else list(drafter.num_accepted_tokens_per_pos),
    }
