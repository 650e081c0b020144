"""A fuzz run of the server's own OpenAPI schema (schemathesis): no input, valid or not, gets a 5xx.

Schemathesis is driven through its public Hypothesis strategies (``operation.as_strategy``) under a plain
``@given``, not through its pytest integration (``from_fixture`` / ``parametrize``): that integration renames
pytest's test items through a private attribute (``Function._nodeid``) that current pytest no longer has, so it
breaks with each pytest release while the strategies do not depend on pytest at all.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from paged_backend import LLM  # noqa: E402
from paged_backend.entrypoints.openai.api_server import build_app  # noqa: E402
from paged_backend.entrypoints.openai.cli_args import ServerArgs  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402

# Every operation of the schema (test_every_operation_is_fuzzed keeps this list complete). Negative data exists
# only where a request has a body or parameters to get wrong.
GETS = ["GET /health", "GET /metrics", "GET /v1/models"]
POSTS = ["POST /v1/completions", "POST /v1/chat/completions"]
RUNS = [(label, GenerationMode.POSITIVE) for label in GETS + POSTS] + [
    (label, GenerationMode.NEGATIVE) for label in POSTS
]


@pytest.fixture
def schema(tokenizer):
    """A fresh server a test: the app's lifespan stops its engine loop, and schemathesis ends every ASGI app's
    lifespan when a test ends."""
    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, num_kv_blocks=256, max_model_len=64)
    return schemathesis.openapi.from_asgi("/openapi.json", build_app(llm, ServerArgs(model="tiny")))


def test_every_operation_is_fuzzed(schema) -> None:
    assert sorted(op.ok().label for op in schema.get_all_operations()) == sorted(GETS + POSTS)


@pytest.mark.parametrize(("label", "mode"), RUNS, ids=[f"{label}-{mode.value}" for label, mode in RUNS])
def test_no_request_gets_a_server_error(schema, label: str, mode: GenerationMode) -> None:
    operation = schema.find_operation_by_label(label)
    assert operation is not None, label

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    def no_server_error(case) -> None:
        if isinstance(case.body, dict):
            case.body["model"] = "tiny"  # past the 404 for an unknown model, into the handlers
        case.call_and_validate(checks=[not_a_server_error])

    no_server_error()
