"""A bounded schemathesis run against the served ``/openapi.json`` (real uvicorn on loopback, fake engine): every
operation with generated bodies, valid and invalid, answers without a 5xx, and errors keep OpenAI's shape."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from server.api import create_app
from server.config import build_config
from tests.support.serving import FakeEngine, UvicornThread

EXAMPLES_PER_OPERATION = 20


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(num_ranks=2, max_num_seqs=4, max_model_len=128, step_time=0.0005)
    with UvicornThread(create_app(build_config({"max-tokens-limit": 32}), engine)) as srv:
        yield srv


def test_openapi_schema_lists_the_endpoints(server):
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/models/{model_id}",
        "/tokenize",
        "/detokenize",
    ):
        assert path in paths
    assert "swagger-ui" in httpx.get(server.url + "/docs").text


def test_no_generated_request_gets_a_5xx(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for operation in operations:

            @settings(
                max_examples=EXAMPLES_PER_OPERATION,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy())
            def check(case: schemathesis.Case) -> None:
                kwargs = case.as_transport_kwargs(base_url=server.url)
                r = client.request(
                    kwargs["method"],
                    kwargs["url"],
                    headers=kwargs.get("headers"),
                    params=kwargs.get("params"),
                    json=kwargs.get("json"),
                    content=kwargs.get("data"),
                )
                assert r.status_code < 500, (case.method, case.path, case.body, r.text[:300])
                if r.status_code >= 400:
                    assert set(r.json()["error"]) == {"message", "type", "param", "code"}

            check()


def test_docs_behind_the_api_key_and_disable_docs():
    config = build_config({"api-key": "sekret"})
    with UvicornThread(create_app(config, FakeEngine())) as srv, httpx.Client(base_url=srv.url) as c:
        for method, path in [
            ("GET", "/openapi.json"),
            ("GET", "/docs"),
            ("POST", "/tokenize"),
            ("POST", "/detokenize"),
            ("GET", "/v1/models/x"),
        ]:
            r = c.request(method, path, json={"prompt": "x", "tokens": [1]})
            assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        auth = {"Authorization": "Bearer sekret"}
        assert c.get("/openapi.json", headers=auth).json()["info"]["title"] == "deep_ep_npu server"
    with UvicornThread(create_app(build_config({"disable-docs": True}), FakeEngine())) as srv:
        for path in ("/openapi.json", "/docs"):
            r = httpx.get(srv.url + path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert httpx.post(srv.url + "/tokenize", json={"prompt": "ab"}).json()["tokens"] == [97, 98]
