"""lm-eval's model ``paged-backend``: EleutherAI's evaluation harness on the engine, in the caller's process.
Install with the ``[lm-eval]`` extra. From the shell (lm-eval's own CLI, with this model registered)::

    python -m paged_backend.integrations.lm_eval run --model paged-backend \\
        --model_args pretrained=meta-llama/Llama-3.1-8B,dtype=bfloat16 --tasks hellaswag

and from Python, on an ``LLM`` already built (or any of its engine arguments in ``model_args``)::

    lm_eval.simple_evaluate(model=PagedBackendLM(llm=llm), tasks=["hellaswag"])

Requests are encoded and windowed as lm-eval's HF backend does (the tokenizer's own special tokens; contexts
left-truncated to ``max_length``; rolling windows of ``max_length`` tokens), so the numbers compare with
``--model hf`` on the same checkpoint. A loglikelihood is the sum of the continuation's prompt logprobs
(``prompt_logprobs=0, max_tokens=0``: each token's logprob and rank; greedy when every rank is 1); a generation is
decoded from the engine's tokens and cut at the task's stop strings as the HF backend cuts its own. Every request
of a call goes to the engine at once: it batches them itself, so lm-eval's ``batch_size`` changes nothing here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from paged_backend.entrypoints.llm import LLM
from paged_backend.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
LoglikelihoodRequest = tuple[tuple[str, str] | None, list[int], list[int]]  # (cache key, context, continuation)
SCORE = SamplingParams(prompt_logprobs=0, max_tokens=0)
_GENERATION_FIELDS = {"temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty"}


def available_device(device: str) -> str:
    """``device`` if this machine has it, else ``"auto"`` with a warning: lm-eval passes ``cuda:0`` by default,
    and its own ``hf`` backend falls back the same way (to CUDA where there is one, else the CPU)."""
    import torch

    name, _, number = device.partition(":")
    if name != "cuda" or not (number == "" or number.isdigit()):
        return device  # the engine's config names what it accepts
    if torch.cuda.is_available() and int(number or 0) < torch.cuda.device_count():
        return device
    logger.warning("device %r is not available on this machine: running where the engine finds one", device)
    return "auto"


@register_model("paged-backend", "paged_backend")
class PagedBackendLM(TemplateLM):
    """``llm=`` an engine to run on, or ``pretrained=`` a path or hub id with engine arguments (``dtype``,
    ``max_model_len``, ...). ``max_length``: tokens of context a request sees (default: the engine's
    ``max_model_len`` less one, as the last scored token is fed too); ``max_gen_toks``: a generation's default
    length; ``add_bos_token``: force the BOS token on or off (default: the tokenizer's own choice)."""

    def __init__(
        self,
        pretrained: str | None = None,
        llm: LLM | None = None,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
        device: str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        super().__init__()
        if device:
            engine_kwargs["device"] = available_device(device)
        if llm is None:
            if pretrained is None:
                raise ValueError("give llm (an LLM) or pretrained (a path or hub id)")
            llm = LLM(pretrained, **engine_kwargs)
        elif pretrained is not None or engine_kwargs:
            raise ValueError(f"with llm=, give no pretrained= and no engine arguments (got {sorted(engine_kwargs)})")
        tokenizer = llm.get_tokenizer()
        if tokenizer is None:
            raise ValueError("lm-eval needs a tokenizer: build the LLM with tokenizer=...")
        limit = llm.llm_engine.max_model_len - 1
        if max_length is not None and not 0 < max_length <= limit:
            raise ValueError(
                f"max_length must be in [1, {limit}] (the engine's max_model_len less one), got {max_length}"
            )
        self.llm, self.tokenizer = llm, tokenizer
        self.max_length = max_length or limit
        self.max_gen_toks, self.add_bos_token = max_gen_toks, add_bos_token

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context stands for: BOS, else EOS (as the HF backend)."""
        bos = self.tokenizer.bos_token_id
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        if add_special_tokens is None:
            bos = self.tokenizer.bos_token
            add_special_tokens = self.add_bos_token if self.add_bos_token is not None else True
            if bos is not None and string.startswith(bos):
                add_special_tokens = False  # the string holds its BOS already
        return list(self.tokenizer.encode(string, add_special_tokens=add_special_tokens))

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        )

    def _loglikelihood_tokens(
        self, requests: Sequence[LoglikelihoodRequest], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """Each continuation's summed logprob given its context, and whether greedy decoding would produce it."""
        prompts = []
        for _, context, continuation in requests:
            if not 0 < len(continuation) <= self.max_length:
                raise ValueError(f"a continuation must have 1 to max_length={self.max_length} tokens")
            prompts.append((context + continuation)[-(self.max_length + 1) :])
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], SCORE, use_tqdm=not disable_tqdm)
        results = []
        for (cache_key, _, continuation), prompt, out in zip(requests, prompts, outs):
            entries = out.prompt_logprobs
            assert entries is not None, "prompt_logprobs were asked for"
            scored = []
            for entry, token in zip(entries[len(prompt) - len(continuation) :], continuation):
                assert entry is not None, "only the first prompt token has no entry, and it is context"
                scored.append(entry[token])
            answer = (sum(lp.logprob for lp in scored), all(lp.rank == 1 for lp in scored))
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, answer)
            results.append(answer)
        return results

    def loglikelihood_rolling(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[float]:
        """A document's loglikelihood over disjoint windows of ``max_length`` tokens; every window at once."""
        windows: list[LoglikelihoodRequest] = []
        owners: list[int] = []
        for i, (text,) in enumerate(request.args for request in requests):
            tokens = self.tok_encode(text)
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, context_len=1),
            ):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (value, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[owner] += value
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[str]:
        """Each context continued (greedy unless the task samples) until a stop string, EOS or ``max_gen_toks``."""
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        prompts, params, stops = [], [], []
        for context, gen_kwargs in (request.args for request in requests):
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            do_sample = bool(kwargs.pop("do_sample", False))
            if kwargs.get("num_beams", 1) == 1:  # beam search is not run here; one beam is plain decoding
                kwargs.pop("num_beams", None)
            unknown = set(kwargs) - _GENERATION_FIELDS
            if unknown:
                raise ValueError(
                    f"generation_kwargs {sorted(unknown)} are not supported: use {sorted(_GENERATION_FIELDS)}"
                )
            if do_sample is False:
                kwargs["temperature"] = 0.0
            if not 0 < max_gen_toks < self.max_length:
                raise ValueError(f"max_gen_toks must be in [1, max_length={self.max_length}), got {max_gen_toks}")
            prompts.append({"prompt_token_ids": self.tok_encode(context)[-(self.max_length - max_gen_toks) :]})
            params.append(SamplingParams(max_tokens=max_gen_toks, stop=until, **kwargs))
            stops.append(until)
        outs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)
        results = []
        for request, out, until in zip(requests, outs, stops):
            text = self.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
            text = postprocess_generated_text(text, until, None)
            self.cache_hook.add_partial("generate_until", request.args, text)
            results.append(text)
        return results


if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
