"""A fuzz run of the server's own OpenAPI schema (schemathesis): no input, valid or not, gets a 5xx."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from paged_backend import LLM  # noqa: E402
from paged_backend.entrypoints.openai.api_server import build_app  # noqa: E402
from paged_backend.entrypoints.openai.cli_args import ServerArgs  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def api(tokenizer):
    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, num_kv_blocks=256, max_model_len=64)
    return schemathesis.openapi.from_asgi("/openapi.json", build_app(llm, ServerArgs(model="tiny")))


schema = schemathesis.pytest.from_fixture("api")


@schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_server_error(case) -> None:
    if isinstance(case.body, dict):
        case.body["model"] = "tiny"  # past the 404 for an unknown model, into the handlers
    case.call_and_validate(checks=[not_a_server_error])
