"""Safe to expose: loopback by default, the API key (command line, YAML or environment; probes optionally behind it),
body / prompt / max_tokens caps, the workers' rendezvous and control channel never on a public interface, and only
plain built-in values from the HTTP side reaching what is pickled to the workers."""

from __future__ import annotations

import dataclasses
import os

import httpx
import pytest

from server.api import create_app
from server.cli import parse_config
from server.config import API_KEY_ENV, build_config
from server.engine_api import SamplingParams
from tests.support.serving import FakeEngine, UvicornThread, error_of
from tests.support.tiny_moe import real_server

KEY = {"Authorization": "Bearer s3cret"}


def test_loopback_by_default_and_host_to_expose() -> None:
    assert build_config({}).host == "127.0.0.1"
    assert parse_config(["--config", "configs/default.yaml"]).host == "127.0.0.1"
    assert parse_config(["--host", "0.0.0.0"]).host == "0.0.0.0"


def test_api_key_from_environment_below_yaml_and_command_line(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert parse_config([]).api_key is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert parse_config([]).api_key == "from-env"
    path = tmp_path / "c.yaml"
    path.write_text("api-key: from-yaml\n")
    assert parse_config(["--config", str(path)]).api_key == "from-yaml"
    assert parse_config(["--config", str(path), "--api-key", "from-cli"]).api_key == "from-cli"
    monkeypatch.setenv(API_KEY_ENV, "")  # empty means unset
    assert parse_config([]).api_key is None


@pytest.mark.parametrize("probes_need_key", [False, True])
def test_api_key_on_v1_and_optionally_on_probes(probes_need_key: bool) -> None:
    config = build_config({"api-key": "s3cret", "api-key-health": probes_need_key, "api-key-metrics": probes_need_key})
    with UvicornThread(create_app(config, FakeEngine())) as srv, httpx.Client(base_url=srv.url) as c:
        bad = [
            {},
            {"Authorization": "Bearer s3cre"},
            {"Authorization": "Bearer s3cret2"},
            {"Authorization": "s3cret"},
            {"Authorization": "Basic s3cret"},
            {"Authorization": b"Bearer \xe9\xff"},
        ]
        for headers in bad:
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
                err = error_of(c.request(method, path, headers=headers, json={"prompt": "x"}), 401)
                assert err["code"] == "invalid_api_key"
        assert c.get("/v1/models", headers={"Authorization": "bearer s3cret"}).status_code == 200
        ok = c.post("/v1/completions", headers=KEY, json={"prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        for path in ("/health", "/metrics", "/version"):
            assert c.get(path).status_code == (401 if probes_need_key else 200), path
            assert c.get(path, headers=KEY).status_code == 200, path


def test_body_prompt_and_max_tokens_caps() -> None:
    config = build_config({"max-request-bytes": 4096, "max-prompt-tokens": 8, "max-tokens-limit": 5})
    with UvicornThread(create_app(config, FakeEngine())) as srv, httpx.Client(base_url=srv.url) as c:

        def chunked(n: int):  # noqa: ANN202 - no Content-Length: the limit must hold while the body streams in
            yield b'{"prompt": "'
            for _ in range(n):
                yield b"x" * 1024
            yield b'"}'

        for body in (b'{"prompt": "' + b"x" * 5000 + b'"}', chunked(8)):
            r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert error_of(r, 413)["code"] == "request_too_large"
        err = error_of(c.post("/v1/completions", json={"prompt": "x" * 9}), 400)
        assert (err["param"], err["code"]) == ("prompt", "context_length_exceeded") and "limit of 8" in err["message"]
        err = error_of(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}), 400)
        assert err["param"] == "messages"  # the chat template alone is over 8 tokens
        assert error_of(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 6}), 400)["param"] == "max_tokens"
        ok = c.post("/v1/completions", json={"prompt": "x" * 8, "max_tokens": 5})
        assert ok.status_code == 200 and ok.json()["usage"] == {
            "prompt_tokens": 8,
            "completion_tokens": 5,
            "total_tokens": 13,
        }
        assert c.get("/health").status_code == 200


class _Recording(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.added: list[tuple[list[int], SamplingParams]] = []

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.added.append((prompt_token_ids, params))
        super().add_request(request_id, prompt_token_ids, params)


def _plain(value: object) -> bool:
    if isinstance(value, list):
        return type(value) is list and all(_plain(v) for v in value)
    return type(value) in (int, float, str, bool, type(None))


def test_only_plain_values_reach_the_engine() -> None:
    """What the driver pickles to the workers is built from request fields; they must be exact built-in types (no
    str/int subclasses or other objects carried over from parsing)."""
    engine = _Recording()
    body = {
        "prompt": [1, 2, 3],
        "max_tokens": 3,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 4,
        "seed": 7,
        "stop": ["zz", "q"],
        "stop_token_ids": [9],
        "ignore_eos": True,
    }
    with UvicornThread(create_app(build_config({}), engine)) as srv, httpx.Client(base_url=srv.url) as c:
        assert c.post("/v1/completions", json=body).status_code == 200
        assert (
            c.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stop": "x"},
            ).status_code
            == 200
        )
    assert len(engine.added) == 2
    for prompt, params in engine.added:
        assert _plain(prompt) and type(params) is SamplingParams
        for field in dataclasses.fields(params):
            assert _plain(getattr(params, field.name)), (field.name, getattr(params, field.name))


def _listening_sockets() -> dict[int, str]:
    """``{socket inode: "address:port"}`` of every listening TCP socket on this host."""
    out = {}
    for name in ("tcp", "tcp6"):
        with open(f"/proc/net/{name}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A":  # TCP_LISTEN
                    continue
                addr, port = cols[1].split(":")
                if len(addr) == 8:
                    host = ".".join(str(int(addr[i : i + 2], 16)) for i in (6, 4, 2, 0))
                else:
                    host = "::1" if addr == "00000000000000000000000001000000" else f"[{addr}]"
                out[int(cols[9])] = f"{host}:{int(port, 16)}"
    return out


def _sockets_of(pid: int, listening: dict[int, str]) -> list[str]:
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inode = int(target[8:-1])
            if inode in listening:
                found.append(listening[inode])
    return found


def test_workers_listen_on_loopback_only() -> None:
    """The rendezvous store and gloo's sockets of the EP workers are on 127.0.0.1 (torch's default store listens on
    every interface); the driver listens only where uvicorn was told to (loopback here)."""
    with real_server() as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})  # the groups are connected
        assert r.status_code == 200
        listening = _listening_sockets()
        worker_sockets = [s for pid in srv.worker_pids for s in _sockets_of(pid, listening)]
        assert worker_sockets, "rank 0 serves the rendezvous store: it must listen somewhere"
        assert all(s.startswith(("127.0.0.1:", "::1:")) for s in worker_sockets), worker_sockets
        driver_sockets = _sockets_of(os.getpid(), listening)
        assert f"127.0.0.1:{srv.port}" in driver_sockets
        assert all(s.startswith(("127.0.0.1:", "::1:")) for s in driver_sockets), driver_sockets
