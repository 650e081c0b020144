"""The server's request surface, in process (FastAPI's TestClient): strict types, bounds stated in the schema,
``param`` on every 400, lone surrogates, the API key before the body, finite logprobs, the served model's name,
and an OpenAPI schema that documents what the server answers."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from paged_backend import LLM  # noqa: E402
from paged_backend.entrypoints.openai import auth  # noqa: E402
from paged_backend.entrypoints.openai.api_server import build_app  # noqa: E402
from paged_backend.entrypoints.openai.cli_args import ServerArgs  # noqa: E402
from paged_backend.entrypoints.openai.errors import SafeJSONResponse  # noqa: E402
from paged_backend.entrypoints.openai.logprobs import chat_logprobs, completion_logprobs, finite  # noqa: E402
from paged_backend.outputs import CompletionOutput, Logprob  # noqa: E402
from tests.conftest import before_each_step, tiny_model  # noqa: E402

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL_PATH = "/srv/models/tiny-llama"  # never read: the model object is passed in; only its name matters
NAME = "tiny-llama"
MAX_MODEL_LEN = 64


def make_llm(tokenizer) -> LLM:
    return LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, num_kv_blocks=256, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def llm(tokenizer) -> LLM:
    return make_llm(tokenizer)


@pytest.fixture(scope="module")
def client(llm):
    with TestClient(build_app(llm, ServerArgs(model=MODEL_PATH, api_key=KEY))) as test_client:
        yield test_client


def post(client, path: str, body: object, headers: dict[str, str] | None = None):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=content, headers={**AUTH, "Content-Type": "application/json", **(headers or {})})


def error_of(response, status: int = 400) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert error["code"] == status
    return error


def completion(**fields: object) -> dict:
    return {"model": NAME, "prompt": "a b", "max_tokens": 2, **fields}


def chat(**fields: object) -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


# ------------------------------------------------------------------ strict types, bounds, param
@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", "5"), ("max_tokens", True), ("max_tokens", 5.0), ("stream", "yes"), ("n", 1.0), ("echo", 1)],
)
def test_no_lax_coercion(client, field: str, value: object) -> None:
    error = error_of(post(client, "/v1/completions", completion(**{field: value})))
    assert error["param"] == field and error["type"] == "invalid_request_error"


def test_an_int_is_a_valid_float(client) -> None:
    response = post(client, "/v1/completions", completion(temperature=0, top_p=1, presence_penalty=0))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("body", "param", "text"),
    [
        (completion(stream_options={"include_usage": True}), "stream_options", "only be defined when `stream=True`"),
        (completion(stream=False, stream_options={}), "stream_options", "stream=True"),
        (chat(top_logprobs=2), "top_logprobs", "logprobs: true"),
        (chat(max_tokens=3, max_completion_tokens=4), "max_completion_tokens", "not both"),
        (completion(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
        (completion(stop=""), "stop", "at least 1 character"),
        (completion(n=129), "n", "128"),
        (completion(best_of=129), "best_of", "128"),
        (completion(prompt=["x"] * 2049), "prompt", "2048"),
        (completion(prompt=[[5]] * 2049), "prompt", "2048"),
        (completion(prompt=[]), "prompt", "must be a string"),
        (completion(prompt=[[5], [6, 7.0]]), "prompt.1.1", "valid integer"),
        (chat(messages=[{"role": "user", "content": 5}]), "messages.0.content", "valid string"),
        (chat(messages=[{"role": "robot", "content": "x"}]), "messages.0.role", "'user'"),
        (chat(messages=[{"content": "x"}]), "messages.0.role", "required"),
        (chat(messages=[{"role": "user", "content": "x", "mood": 1}]), "messages.0.mood", "Extra inputs"),
        (completion(temperature=float("inf")), "temperature", "finite"),
        (completion(min_tokens=5, max_tokens=2), "min_tokens", "min_tokens must be <= max_tokens"),  # FieldError
        (completion(temperature=0, n=1, best_of=2), "best_of", "greedy"),  # FieldError
        (completion(seed=2**63 - 1, best_of=2, n=2), "seed", "seed"),  # FieldError
    ],
)
def test_each_invalid_field_is_a_400_naming_it(client, body: dict, param: str, text: str) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    # json.dumps writes inf as Infinity, which Python's JSON reader (FastAPI's) accepts
    error = error_of(post(client, path, body))
    assert error["param"] == param and text in error["message"], error


def test_top_logprobs_0_needs_no_logprobs(client) -> None:
    assert post(client, "/v1/chat/completions", chat(top_logprobs=0)).status_code == 200


def test_invalid_json_names_no_field(client) -> None:
    error = error_of(post(client, "/v1/completions", b'{"model": "x", prompt'))
    assert error["param"] is None and error["message"].startswith("the request body is not valid JSON")
    for body in (b"[1, 2]", b'"text"', b""):
        error = error_of(post(client, "/v1/completions", body))
        assert error["param"] is None and "must be a JSON object" in error["message"]


def test_method_not_allowed_keeps_allow(client) -> None:
    response = client.delete("/v1/completions", headers=AUTH)
    error = error_of(response, 405)
    assert response.headers["allow"] == "POST" and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b'{"model": "tiny-llama", "prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", b'{"model": "tiny-llama", "prompt": ["ok", "\\udfff"]}', "prompt.1"),
        ("/v1/completions", b'{"model": "tiny-\\ud800", "prompt": "x"}', "model"),
        ("/v1/completions", b'{"model": "tiny-llama", "prompt": "x", "stop": ["\\ud83d"]}', "stop.0"),
        ("/v1/completions", b'{"model": "tiny-llama", "prompt": "x", "user": "\\udc00"}', "user"),
        ("/v1/chat/completions", b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\ud800"}]}',
         "messages.0.content"),
        ("/v1/chat/completions", b'{"model": "tiny-llama", "messages": [{"role": "user", "name": "\\ud800"}]}',
         "messages.0.name"),
        ("/v1/completions", b'{"model": "tiny-llama", "prompt": "x", "\\ud800": 1}', None),
    ],
)  # fmt: skip
def test_lone_surrogates_are_a_400_never_a_500(client, path: str, body: bytes, param: str | None) -> None:
    response = post(client, path, body)
    error = error_of(response)
    assert error["param"] == param, error
    assert "surrogate" in error["message"]
    response.content.decode("utf-8")  # the answer itself is valid UTF-8 (the surrogate did not go into it)


def test_a_surrogate_pair_is_text(client) -> None:
    body = b'{"model": "tiny-llama", "prompt": "\\ud83d\\ude00", "max_tokens": 1}'
    assert post(client, "/v1/completions", body).status_code == 200


def test_json_responses_encode_any_text() -> None:
    rendered = SafeJSONResponse({"error": {"message": "bad key \ud800!"}}).body
    assert json.loads(rendered) == {"error": {"message": "bad key \ufffd!"}}
    with pytest.raises(ValueError):
        SafeJSONResponse({"logprob": math.nan})  # non-finite floats stay refused: they are not JSON


# ------------------------------------------------------------------ the API key
def test_no_key_is_a_401_before_the_body_is_read(client) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
        response = client.post("/v1/completions", content=b"{not json", headers=headers)
        error = error_of(response, 401)  # not the 400 that parsing the body would give
        assert response.headers["www-authenticate"] == "Bearer" and error["type"] == "authentication_error"
    response = client.get("/v1/no-such-path")  # nor whether a path exists
    assert response.status_code == 401


def test_the_scheme_is_case_insensitive(client) -> None:
    for scheme in ("bearer", "BEARER", "Bearer"):
        assert client.get("/v1/models", headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200


def test_two_authorization_headers_are_refused(client) -> None:
    headers = [("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer other")]
    assert client.get("/v1/models", headers=headers).status_code == 401


def test_health_metrics_and_the_schema_stay_open(client) -> None:
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    assert client.get("/openapi.json").status_code == 200


def test_the_key_is_compared_in_constant_time(client, monkeypatch) -> None:
    calls = []

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return a == b

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    assert client.get("/v1/models", headers=AUTH).status_code == 200
    assert calls == [(KEY.encode(), KEY.encode())]


def test_bearer_token_parsing() -> None:
    assert auth.bearer_token(b"Bearer abc") == b"abc"
    assert auth.bearer_token(b"bEaReR   abc ") == b"abc"
    assert auth.bearer_token(b"Bearer") is None
    assert auth.bearer_token(b"Token abc") is None
    assert auth.bearer_token(None) is None


# ------------------------------------------------------------------ the served model's name
def test_a_local_path_is_served_by_its_folder_name() -> None:
    assert ServerArgs(model="/srv/models/tiny-llama/").model_name == "tiny-llama"
    assert ServerArgs(model="./models/x").model_name == "x"
    assert ServerArgs(model="meta-llama/Llama-3-8B").model_name == "meta-llama/Llama-3-8B"  # a hub id
    assert ServerArgs(model="/srv/m", served_model_name="name").model_name == "name"


def test_the_path_is_an_alias_and_never_shown(client) -> None:
    models = client.get("/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == [NAME]
    assert post(client, "/v1/completions", completion(model=MODEL_PATH)).status_code == 200
    assert MODEL_PATH not in client.get("/metrics").text and f'model_name="{NAME}"' in client.get("/metrics").text
    assert error_of(post(client, "/v1/completions", completion(model="other")), 404)["param"] == "model"


# ------------------------------------------------------------------ logprobs
def test_finite() -> None:
    assert finite(-math.inf) == -9999.0 and finite(math.nan) == -9999.0 and finite(-1e6) == -9999.0
    assert finite(math.inf) == 0.0 and finite(-0.5) == -0.5


def _output(entries: list[dict[int, Logprob]], token_ids: list[int]) -> CompletionOutput:
    return CompletionOutput(0, "", token_ids, 0.0, entries)


def test_chat_top_logprobs_are_exactly_the_top_n_by_rank() -> None:
    decode = lambda ids: f"<{ids[0]}>"  # noqa: E731
    # token 7 sampled at rank 2 (among the top 3); token 9 sampled at rank 40 (not among them)
    top = {1: Logprob(-0.1, 1, "a"), 7: Logprob(-1.0, 2, "b"), 3: Logprob(-2.0, 3, "c")}
    entries = [top, {9: Logprob(-9.0, 40, "z"), **{t: lp for t, lp in top.items() if t != 7}, 4: Logprob(-1.5, 2)}]
    content = chat_logprobs(_output(entries, [7, 9]), decode, 3)["content"]
    assert [e["token"] for e in content] == ["b", "z"]
    assert [[t["token"] for t in e["top_logprobs"]] for e in content] == [["a", "b", "c"], ["a", "<4>", "c"]]
    assert [len(e["top_logprobs"]) for e in chat_logprobs(_output(entries, [7, 9]), decode, 2)["content"]] == [2, 2]
    assert chat_logprobs(_output(entries, [7, 9]), decode, 0)["content"][0]["top_logprobs"] == []


def test_every_logprob_sent_is_finite() -> None:
    entries = [{5: Logprob(-math.inf, 1, "x"), 6: Logprob(math.nan, 2, "y")}]
    chat = chat_logprobs(_output(entries, [5]), str, 2)["content"][0]
    assert chat["logprob"] == -9999.0 and [t["logprob"] for t in chat["top_logprobs"]] == [-9999.0, -9999.0]
    whole = completion_logprobs(_output(entries, [5]), str)
    assert whole["token_logprobs"] == [-9999.0] and whole["top_logprobs"] == [{"x": -9999.0, "y": -9999.0}]
    json.dumps(whole, allow_nan=False)


def test_streamed_logprobs_continue_the_offsets() -> None:
    entries = [{5: Logprob(-0.5, 1, "ab")}, {6: Logprob(-0.25, 1, "c")}]
    second = completion_logprobs(_output(entries, [5, 6]), str, start=1, offset=2)
    assert second == {"tokens": ["c"], "token_logprobs": [-0.25], "top_logprobs": [{"c": -0.25}], "text_offset": [2]}


def test_filtered_tokens_in_a_response_are_finite(client) -> None:
    """A grammar that allows one token leaves the others' logprobs -inf: a response shows them as -9999.0."""
    one_token = {"structured_outputs": {"choice": ["a"]}}
    response = post(client, "/v1/completions", completion(logprobs=3, max_tokens=3, **one_token))
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    values = [v for top in logprobs["top_logprobs"] for v in top.values()]
    assert -9999.0 in values and all(math.isfinite(v) for v in values)
    body = chat(logprobs=True, top_logprobs=3, max_tokens=3, stream=True, **one_token)
    text = post(client, "/v1/chat/completions", body).text
    assert "Infinity" not in text and "NaN" not in text
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    tops = [t for e in events for c in e["choices"] if c["logprobs"] for x in c["logprobs"]["content"]
            for t in x["top_logprobs"]]  # fmt: skip
    assert tops and -9999.0 in [t["logprob"] for t in tops]


def test_chat_top_logprobs_count_in_a_response(client) -> None:
    body = chat(logprobs=True, top_logprobs=3, max_tokens=4, temperature=0)
    content = post(client, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    assert [len(e["top_logprobs"]) for e in content] == [3] * 4
    # greedy: the chosen token is the most likely one, first in its list
    assert all(e["top_logprobs"][0]["token"] == e["token"] for e in content)


# ------------------------------------------------------------------ a request the engine failed
def _fail_next_step(llm: LLM, monkeypatch) -> None:
    failed = []

    def once(scheduler_output) -> None:
        if not failed:
            failed.append(True)
            raise ValueError("a bad value in the step")

    before_each_step(llm.llm_engine.executor, once, monkeypatch)


def test_a_failed_request_is_an_openai_500_and_the_server_goes_on(tokenizer, monkeypatch) -> None:
    llm = make_llm(tokenizer)
    with TestClient(build_app(llm, ServerArgs(model="tiny"))) as test_client:
        _fail_next_step(llm, monkeypatch)
        body = {"model": "tiny", "prompt": "a b", "max_tokens": 2}
        error = error_of(post(test_client, "/v1/completions", body), 500)
        assert error["type"] == "internal_server_error" and "a bad value" in error["message"]
        assert post(test_client, "/v1/completions", body).status_code == 200


def test_a_failed_stream_ends_with_an_error_event(tokenizer, monkeypatch) -> None:
    llm = make_llm(tokenizer)
    with TestClient(build_app(llm, ServerArgs(model="tiny"))) as test_client:
        _fail_next_step(llm, monkeypatch)
        body = {"model": "tiny", "prompt": "a b", "max_tokens": 2, "stream": True}
        response = post(test_client, "/v1/completions", body)
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["type"] == "internal_server_error"


# ------------------------------------------------------------------ the OpenAPI schema
@pytest.fixture(scope="module")
def schema(client) -> dict:
    return client.get("/openapi.json").json()


def test_schema_documents_every_error_and_no_422(schema) -> None:
    text = json.dumps(schema)
    assert '"422"' not in text and "HTTPValidationError" not in text
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert sorted(responses) == ["200", "400", "401", "404", "413", "429", "500", "503"]
        for status in ("400", "401", "404", "413", "429", "500", "503"):
            ref = responses[status]["content"]["application/json"]["schema"]["$ref"]
            assert ref == "#/components/schemas/ErrorResponse"
        assert responses["401"]["headers"]["WWW-Authenticate"]["required"] is True
        assert sorted(responses["200"]["content"]) == ["application/json", "text/event-stream"]
        assert schema["paths"][path]["post"]["security"] == [{"APIKey": []}]
    assert list(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert "security" not in schema["paths"]["/health"]["get"]
    assert schema["components"]["securitySchemes"]["APIKey"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "the server's --api-key",
    }


def test_schema_states_the_models_bounds(schema, llm) -> None:
    request = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    token_ids = next(b for b in request["prompt"]["oneOf"] if b.get("items", {}).get("type") == "integer")
    assert token_ids["items"]["maximum"] == llm.llm_engine.vocab_size - 1
    max_tokens = next(b for b in request["max_tokens"]["anyOf"] if b.get("type") == "integer")
    assert max_tokens["maximum"] == MAX_MODEL_LEN - 1
    assert request["n"]["maximum"] == 128 and request["stop"]["anyOf"][0]["oneOf"][1]["maxItems"] == 4
    prompts = next(b for b in request["prompt"]["oneOf"] if b.get("items", {}).get("type") == "string")
    assert prompts["maxItems"] == 2048


def test_schema_without_a_key_has_no_401(tokenizer) -> None:
    app = build_app(make_llm(tokenizer), ServerArgs(model="tiny"))
    schema = app.openapi()
    assert "401" not in schema["paths"]["/v1/completions"]["post"]["responses"]
    assert "securitySchemes" not in schema["components"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (completion(prompt=[5] * (MAX_MODEL_LEN + 1), max_tokens=None), "prompt"),
        (completion(prompt=[10**6]), "prompt"),
        (completion(stop_token_ids=[10**6]), "stop_token_ids"),
    ],
)
def test_the_engines_refusals_name_their_field(client, body: dict, param: str) -> None:
    assert error_of(post(client, "/v1/completions", body))["param"] == param
