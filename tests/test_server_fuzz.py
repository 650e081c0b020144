"""Schemathesis against the server's own OpenAPI schema, every check, valid and invalid data, every operation:
nothing may fail. A failure is a server error, a response the schema does not document (status, media type,
headers, body), a schema-valid request refused or a schema-invalid one accepted, an API key not enforced, or a
method the schema does not list answered without 405 and ``Allow``.

It runs schemathesis' own engine (what ``schemathesis run`` runs: the coverage phase's boundary values, missing
fields and undeclared methods, then the fuzzing phase's Hypothesis cases), not its pytest plugin, which renames
test items through a pytest-private attribute. ``PAGED_BACKEND_FUZZ_EXAMPLES`` sets the fuzzing phase's
examples per operation and mode (default 15: about 1,000 cases in 10 s, a CI-sized run; 400 gives about 4,100),
``PAGED_BACKEND_FUZZ_SEED`` its seed (default 0).

Checks that cannot apply here, each configured rather than dropped:
- ``positive_data_acceptance`` stays on, but a schema-valid body that breaks a rule between fields may get a
  400, when it names that rule's field (``CROSS_FIELD_RULES``). JSON Schema states bounds of one field; these
  tie two together (``best_of`` >= ``n``, ``min_tokens`` <= ``max_tokens``, a prompt's *token* count plus
  ``max_tokens`` within ``max_model_len``), so no schema can promise them.
- ``use_after_free``, ``ensure_resource_availability`` and ``object_level_authorization`` are on, and pass
  vacuously: the API creates no resources and has one identity (the API key).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import pytest

from paged_backend.chat_template import OWN_ARGUMENTS, SPECIAL_TOKENS

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")

from schemathesis.config import SchemathesisConfig  # noqa: E402
from schemathesis.engine import Status, events, from_schema  # noqa: E402

from paged_backend import LLM  # noqa: E402
from paged_backend.entrypoints.openai.api_server import build_app  # noqa: E402
from paged_backend.entrypoints.openai.cli_args import ServerArgs  # noqa: E402
from paged_backend.sampling_params import SAMPLING_EPS  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402

logger = logging.getLogger(__name__)
KEY, NAME, MAX_MODEL_LEN = "fuzz-key", "tiny", 64
VOCAB = 512  # the tiny tokenizer's
EXAMPLES = int(os.environ.get("PAGED_BACKEND_FUZZ_EXAMPLES", "15"))
SEED = int(os.environ.get("PAGED_BACKEND_FUZZ_SEED", "0"))
OPERATIONS = [
    "GET /health",
    "GET /metrics",
    "GET /v1/models",
    "GET /v1/models/{model_id}",
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "POST /v1/responses",
    "POST /v1/messages",
    "POST /tokenize",
    "POST /detokenize",
]


def make_app(tokenizer) -> Any:
    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, num_kv_blocks=2048, max_model_len=MAX_MODEL_LEN)
    return build_app(llm, ServerArgs(model="/models/tiny", served_model_name=NAME, api_key=KEY))


# ------------------------------------------------------------------ rules between fields
Body = dict[str, Any]


def _max_tokens(body: Body, chat: bool) -> int | None:
    """The ``max_tokens`` the request asked for (chat: ``max_completion_tokens`` first), completions' default."""
    asked = body.get("max_completion_tokens") or body.get("max_tokens") if chat else body.get("max_tokens")
    return asked if asked is not None or chat else 16


def _text_of(value: Any) -> Any:
    """A message field as the server gives it to the template: content parts joined by newlines."""
    return "\n".join(part["text"] for part in value) if isinstance(value, list) else value


@dataclass
class PromptLengths:
    """Token counts of a request's prompts, as the server computes them (its tokenizer and chat template)."""

    tokenizer: Any
    template: str | None = None
    _cache: dict[str, list[int]] = field(default_factory=dict)

    def __call__(self, body: Body, chat: bool) -> list[int]:
        if chat:
            messages = [
                {k: _text_of(v) if k == "content" else v for k, v in m.items() if v is not None}
                for m in body["messages"]
            ]
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, chat_template=self.template
            )
            return [len(self.tokenizer(text, add_special_tokens=False).input_ids)]
        prompt = body["prompt"]
        if isinstance(prompt, str) or (prompt and not isinstance(prompt[0], str | list)):
            prompt = [prompt]  # one prompt: text or token ids
        return [len(p) if isinstance(p, list) else len(self.tokenizer(p).input_ids) for p in prompt]


def cross_field_params(body: Body, chat: bool, lengths: PromptLengths) -> set[str | None]:
    """The ``param`` of each rule between fields that ``body`` breaks: a 400 naming one of them is right."""
    n, best_of = body.get("n", 1), body.get("best_of")
    greedy = body.get("temperature", 1.0) < SAMPLING_EPS
    max_tokens = _max_tokens(body, chat)
    longest = max(lengths(body, chat))
    broken: set[str | None] = set()
    if best_of is not None and (best_of < n or (best_of > n and greedy)):
        broken.add("best_of")
    if body.get("seed") is not None and body["seed"] > 2**63 - (best_of or n):
        broken.add("seed")
    if body.get("stream_options") is not None and body.get("stream") is not True:
        broken.add("stream_options")
    if chat and body.get("top_logprobs") and body.get("logprobs") is not True:
        broken.add("top_logprobs")
    if chat and None not in (body.get("max_tokens"), body.get("max_completion_tokens")):
        if body["max_tokens"] != body["max_completion_tokens"]:
            broken.add("max_completion_tokens")
    if max_tokens is not None and longest + max_tokens > MAX_MODEL_LEN:
        broken.add("max_tokens")
    scored = body.get("prompt_logprobs") is not None or (body.get("echo") and body.get("logprobs") is not None)
    if max_tokens == 0 and not (scored and not chat):
        broken.add("max_tokens")  # 0 scores a prompt: only with echo and logprobs, or prompt_logprobs
    effective_max = max_tokens if max_tokens is not None else max(1, MAX_MODEL_LEN - longest)
    if body.get("min_tokens", 0) > effective_max:
        broken.add("min_tokens")
    # Whether a schema, regex or grammar compiles is the grammar engine's to judge: a 400 names the request's field.
    formats = (
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    )
    if logit_bias_past_vocab(body):
        broken.add("logit_bias")
    if chat and (OWN_ARGUMENTS | SPECIAL_TOKENS) & set(body.get("chat_template_kwargs") or {}):
        broken.add("chat_template_kwargs")  # what the server itself passes to the template
    asked = {name for name in formats if body.get(name) not in (None, {"type": "text"})}
    if chat:  # completions ignore tools and tool_choice (unknown fields there, as in vLLM)
        tools, choice = body.get("tools") or [], body.get("tool_choice")
        named = isinstance(choice, dict)
        if not tools and choice not in (None, "none"):
            broken.add("tool_choice")  # a choice without tools
        if tools and choice in (None, "auto"):
            broken.add("tool_choice")  # "auto" needs --enable-auto-tool-choice, which this server lacks
        if tools and named and choice["function"]["name"] not in {t["function"]["name"] for t in tools}:
            broken.add("tool_choice")
        if tools and (choice == "required" or named):
            asked.add("tool_choice")  # a grammar too: its parameters' schema may not compile
    if asked:
        broken.update(asked if len(asked) == 1 else {*formats, "tool_choice"})
        if "structured_outputs" in broken:  # its own fields' errors name the field within it
            broken.update(f"structured_outputs.{k}" for k in ("json", "regex", "choice", "grammar", "json_object"))
    if longest > MAX_MODEL_LEN:
        # the engine's own length check names no field (see the report: input_processor's FieldError)
        broken.update({"messages", "prompt", None} if chat else {"prompt", None})
    return broken


def responses_params(body: Body, lengths: PromptLengths) -> set[str | None]:
    """The rules a Responses body breaks: those of the chat request it runs (its fields named as the Responses
    API names them), and its own (no stored response to continue; a json_schema format needs name and schema)."""
    from paged_backend.entrypoints.openai.responses_api import ResponsesRequest
    from paged_backend.entrypoints.openai.serving_responses import _FIELDS

    try:
        chat = ResponsesRequest.model_validate(body).chat_request()
    except ValueError:  # previous_response_id, or a json_schema format without its name or schema
        return {"previous_response_id", "text"}
    if logit_bias_past_vocab(chat):
        return {"logit_bias"}
    return {_FIELDS.get(p or "", p) for p in cross_field_params(chat, True, lengths)}


def messages_rule(body: Body, message: str, lengths: PromptLengths) -> bool:
    """Whether an Anthropic error (which has no ``param``: its message starts with the field) names a rule of the
    chat request the Messages body runs, as Anthropic's fields name them."""
    from paged_backend.entrypoints.openai.anthropic_api import MessagesRequest
    from paged_backend.entrypoints.openai.serving_messages import _FIELDS

    try:
        chat = MessagesRequest.model_validate(body).chat_request()
    except ValueError:  # an integer sent as a float (see not_an_int): schema-valid, refused as OpenAI's API does
        return True
    if logit_bias_past_vocab(chat):
        return True
    broken = {_FIELDS.get(p or "", p) for p in cross_field_params(chat, True, lengths)}
    return any(p is None or message.startswith(f"{p}") for p in broken)


def logit_bias_past_vocab(body: Body) -> bool:
    """A ``logit_bias`` token id past the vocabulary: the schema bounds its keys by their digits only."""
    return any(int(token) >= VOCAB for token in body.get("logit_bias") or {})


def not_an_int(body: Body, param: str | None) -> bool:
    """Whether the value ``param`` names is an integer field's value that OpenAI refuses, though schemathesis
    generates it as valid: a float with no fraction (JSON Schema's ``integer`` admits ``5.0``; OpenAI's API, and
    this server, answer 400), or an int past 2**63 (schemathesis computes boundary values near int64's end in
    doubles, which round past the schema's own ``exclusiveMaximum``)."""
    value: Any = body
    for part in (param or "").split("."):
        key: Any = int(part) if isinstance(value, list) and part.isdigit() else part
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError):
            return False
    if isinstance(value, float):
        return value.is_integer()
    return isinstance(value, int) and value >= 2**63


# ------------------------------------------------------------------ the run
@dataclass
class Report:
    cases: int = 0
    statuses: dict[tuple[str, int], int] = field(default_factory=dict)
    checks: set[str] = field(default_factory=set)
    failures: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def merge(self, other: Report) -> None:
        self.cases += other.cases
        for key, count in other.statuses.items():
            self.statuses[key] = self.statuses.get(key, 0) + count
        self.checks |= other.checks
        self.failures += other.failures
        self.errors += other.errors


def fuzz(app: Any, examples: int, mode: str, seed: int = 0) -> Report:
    """One engine run in one generation mode (``positive`` or ``negative``): with ``all``, the fuzzing phase
    draws nearly every example from the positive side."""
    config = SchemathesisConfig.from_dict(
        {
            "seed": seed,
            "headers": {"Authorization": f"Bearer {KEY}"},
            "generation": {"max-examples": examples, "mode": mode},
            "continue-on-failure": True,
            "checks": {"enabled": True},
        }
    )
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=config)
    server = app.state.server
    lengths = PromptLengths(server.tokenizer, server.chat_template)

    @schema.hook
    def map_case(_: Any, case: Any) -> Any:
        """Past the 404 for an unknown model, into the handlers: a generated name is rarely the served one (a
        name that is not a string is the case's invalid part, and stays)."""
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            case.body["model"] = NAME
        if case.path_parameters and isinstance(case.path_parameters.get("model_id"), str):
            case.path_parameters["model_id"] = NAME
        return case

    @schema.hook
    def filter_failure(_: Any, failure: Any, case: Any, response: Any) -> bool:
        """Keep every failure but a schema-valid body refused, with its field named, for what no schema states:
        a rule between fields, or an integer sent as a float."""
        if type(failure).__name__ != "RejectedPositiveData" or response.status_code != 400:
            return True
        if case.operation.path == "/v1/messages":  # Anthropic's error body: no param, the field leads the message
            return not messages_rule(case.body, response.json()["error"]["message"], lengths)
        param = response.json()["error"]["param"]
        if not_an_int(case.body, param):
            return False
        if case.operation.path == "/tokenize":  # a text too long for max_model_len is refused, as a prompt is
            return not (param in ("prompt", "messages") and max(lengths(case.body, "messages" in case.body)) > 64)
        if case.operation.path == "/detokenize":  # ids past the vocabulary: the schema bounds ids by int64 only
            return not (param == "tokens" and any(t >= server.llm.llm_engine.vocab_size for t in case.body["tokens"]))
        if case.operation.path == "/v1/responses":
            return param not in responses_params(case.body, lengths)
        chat = case.operation.path == "/v1/chat/completions"
        return param not in cross_field_params(case.body, chat, lengths)

    report = Report()
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            _record(report, event)
        elif isinstance(event, events.NonFatalError | events.FatalError):
            report.errors.append(str(getattr(event, "info", event)))
    return report


def _record(report: Report, event: Any) -> None:
    recorder = event.recorder
    report.cases += len(recorder.cases)
    for interaction in recorder.interactions.values():
        if interaction.response is not None:
            key = (event.label or "stateful", interaction.response.status_code)  # a stateful scenario has none
            report.statuses[key] = report.statuses.get(key, 0) + 1
    for case_id, checks in recorder.checks.items():
        for check in checks:
            report.checks.add(check.name)
            if check.status == Status.FAILURE:
                case = recorder.cases[case_id].value
                failure = check.failure_info.failure if check.failure_info else None
                interaction = recorder.interactions.get(case_id)
                answer = "" if interaction is None or interaction.response is None else interaction.response.content
                report.failures.append(
                    f"{check.name}: {case.method} {case.path} {case.body!r:.1000}\n-> {answer[:300]!r}\n{failure}"
                )


# ------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def report(tokenizer) -> Report:
    result = Report()
    for mode in ("positive", "negative"):  # a fresh server each: a run ends the app's lifespan, which stops it
        result.merge(fuzz(make_app(tokenizer), EXAMPLES, mode, SEED))
    statuses = sorted(result.statuses.items())
    logger.info("%d cases, %d failures; statuses %s", result.cases, len(result.failures), statuses)
    return result


def test_every_operation_is_fuzzed(tokenizer) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", make_app(tokenizer))
    assert sorted(op.ok().label for op in schema.get_all_operations()) == sorted(OPERATIONS)


def test_fuzzing_finds_nothing(report: Report) -> None:
    assert not report.errors, report.errors
    assert not report.failures, f"{len(report.failures)} failures:\n\n" + "\n\n".join(report.failures[:20])


def test_every_check_ran_and_every_operation_answered_both_ways(report: Report) -> None:
    """A run that never reached a handler (all 400s) or never sent invalid data would pass vacuously."""
    for check in ("not_a_server_error", "positive_data_acceptance", "negative_data_rejection", "ignored_auth"):
        assert check in report.checks, sorted(report.checks)
    for check in ("status_code_conformance", "response_schema_conformance", "unsupported_method"):
        assert check in report.checks, sorted(report.checks)
    for operation in OPERATIONS:
        assert any(200 <= s < 300 for (op, s) in report.statuses if op == operation), (operation, report.statuses)
        assert (operation, 405) in report.statuses, (operation, report.statuses)  # an undeclared method
    for operation in OPERATIONS[2:]:
        assert (operation, 401) in report.statuses, operation  # without the key
    for operation in (op for op in OPERATIONS if op.startswith("POST")):  # a body, or a field, that is invalid
        assert (operation, 400) in report.statuses, operation
    assert report.cases >= 20 * len(OPERATIONS), report.cases
