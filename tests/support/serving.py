"""Test helpers for the serving layer: a deterministic fake ``EngineCore`` and a uvicorn server in a thread.

The fake's output is a closed-form function of the prompt (``expected_token_ids``), so HTTP tests check against
that formula, not against the fake's own bookkeeping.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from collections.abc import Callable, Sequence

import httpx
import uvicorn

from server.chat_template import BUILTIN_CHAT_TEMPLATE
from server.engine_api import EngineCore, RequestDelta, SamplingParams, StepStats, Tokenizer, TokenLogprob

VOCAB_SIZE = 256


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes are the token ids; id 0 is EOS; the server's built-in chat template."""

    eos_token_ids = [0]
    chat_template = BUILTIN_CHAT_TEMPLATE

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")


def expected_token_ids(prompt_token_ids: Sequence[int], n: int, seed: int | None = None) -> list[int]:
    """The fake engine's output: lowercase letters from the prompt's sum, the position and the seed."""
    base = sum(prompt_token_ids) + (seed or 0)
    return [97 + (base + 7 * i) % 26 for i in range(n)]


def fake_logprob(token_id: int, position: int, num_top: int) -> TokenLogprob:
    """The fake engine's log-probabilities: ``-0.1 * (position + 2)`` for output token ``position`` (prompt tokens:
    position -1), and ``num_top`` alternatives ``97 + j`` with ``-0.5 * (j + 1)``."""
    return TokenLogprob(token_id, -0.1 * (position + 2), [(97 + j, -0.5 * (j + 1)) for j in range(num_top)])


@dataclasses.dataclass
class _Seq:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    rank: int = -1
    output: list[int] = dataclasses.field(default_factory=list)


class FakeEngine(EngineCore):
    """``num_ranks`` DP ranks of ``max_num_seqs`` slots each; one token per running request per step.

    Requests wait FIFO, join free slots between steps on the least-loaded rank, and leave on stop / length / abort.
    ``step_time`` sleeps per step; ``fail_at_step`` makes that step raise (a dead worker).
    """

    def __init__(
        self,
        num_ranks: int = 2,
        max_num_seqs: int = 4,
        max_model_len: int = 128,
        step_time: float = 0.002,
        fail_at_step: int | None = None,
    ) -> None:
        self.tokenizer = ByteTokenizer()
        self.vocab_size = VOCAB_SIZE
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.num_ranks = num_ranks
        self.step_time = step_time
        self.fail_at_step = fail_at_step
        self.waiting: list[_Seq] = []
        self.running: dict[str, _Seq] = {}
        self.finished_aborts: list[str] = []
        self._pending_aborts: list[str] = []
        self.num_steps = 0
        self.max_running = 0
        self.healthy = True
        self.shut_down = False

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if any(not 0 <= t < VOCAB_SIZE for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {VOCAB_SIZE})")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError("prompt + max_tokens over max_model_len")
        self.waiting.append(_Seq(request_id, list(prompt_token_ids), params))

    def abort_request(self, request_id: str) -> None:
        self._pending_aborts.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._pending_aborts)

    def is_healthy(self) -> bool:
        return self.healthy

    def shutdown(self) -> None:
        self.shut_down = True

    def rank_loads(self) -> list[int]:
        return [sum(1 for s in self.running.values() if s.rank == r) for r in range(self.num_ranks)]

    def step(self) -> list[RequestDelta]:
        self.num_steps += 1
        if self.fail_at_step is not None and self.num_steps >= self.fail_at_step:
            self.healthy = False
            raise RuntimeError("worker 1 died")
        deltas = []
        for rid in self._pending_aborts:
            self.waiting = [s for s in self.waiting if s.request_id != rid]
            seq = self.running.pop(rid, None)
            if seq is not None:
                self.finished_aborts.append(rid)
                deltas.append(RequestDelta(rid, [], "", "abort", None, len(seq.prompt), len(seq.output)))
        self._pending_aborts.clear()
        loads = self.rank_loads()
        while self.waiting and min(loads) < self.max_num_seqs:
            seq = self.waiting.pop(0)
            seq.rank = loads.index(min(loads))
            loads[seq.rank] += 1
            self.running[seq.request_id] = seq
        self.max_running = max(self.max_running, len(self.running))
        time.sleep(self.step_time)
        for rid, seq in list(self.running.items()):
            p = seq.params
            token = expected_token_ids(seq.prompt, len(seq.output) + 1, p.seed)[-1]
            seq.output.append(token)
            text = self.tokenizer.decode(seq.output)
            reason = None
            cut = [text.index(s) for s in p.stop_strings if s in text]
            if cut:
                text, reason = text[: min(cut)], "stop"
            elif p.stop_token_ids and token in p.stop_token_ids:
                reason = "stop"
            elif len(seq.output) >= p.max_tokens:
                reason = "length"
            if reason is not None:
                del self.running[rid]
            delta = RequestDelta(rid, [token], text, reason, None, len(seq.prompt), len(seq.output))
            if p.logprobs is not None:
                delta.logprobs = [fake_logprob(token, len(seq.output) - 1, p.logprobs)]
            if p.prompt_logprobs is not None and len(seq.output) == 1:
                top = p.prompt_logprobs
                delta.prompt_logprobs = [None] + [fake_logprob(t, -1, top) for t in seq.prompt[1:]]
            deltas.append(delta)
        return deltas

    def last_step_stats(self) -> StepStats:
        return StepStats(self.step_time, [1e-4, 2e-4], [3e-4], len(self.running), len(self.waiting))


def error_of(r: httpx.Response, status: int) -> dict:
    """The OpenAI-style error object of ``r``, after checking its status and the object's keys."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def wait_until(
    cond: Callable[[], object], timeout: float = 10.0, what: str = "condition not reached in time", poll: float = 0.005
) -> None:
    """Poll ``cond()`` every ``poll`` seconds until it is true; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(poll)


def greedy(prompt: list[int], max_tokens: int, **more: object) -> dict:
    """A completion request's body: greedy, ``max_tokens`` whatever EOS, the token ids returned."""
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **more,
    }


def stream_completion(url: str, body: dict, out: dict) -> None:
    """POST ``body`` to ``url``'s ``/v1/completions`` as a stream (SSE) and read it to the end (for a thread).

    ``out`` gets ``status``, ``tokens`` (how many token ids arrived; ``token_ids`` the ids, when the body asks
    for them), ``finish`` (the last finish reason), ``error``
    (an error event), ``done`` (``[DONE]`` was received) and ``broken`` (the ``httpx.HTTPError`` that cut the
    response, as a repr). ``out["first"]``, an Event (made if absent), is set at each chunk and at the end."""
    out.update(tokens=0, token_ids=[], finish=None, error=None, done=False, broken=None)
    first = out.setdefault("first", threading.Event())
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        out["error"] = event["error"]
                        continue
                    out["tokens"] += len(event["choices"][0]["token_ids"])
                    out["token_ids"] += event["choices"][0]["token_ids"]
                    out["finish"] = event["choices"][0]["finish_reason"] or out["finish"]
                    first.set()
    except httpx.HTTPError as e:  # the server closed the connection mid-body
        out["broken"] = repr(e)
    first.set()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class UvicornThread:
    """Serve an ASGI app with real uvicorn on a free loopback port in a thread; ``with`` stops it."""

    def __init__(self, app: object) -> None:
        # uvicorn serves on a socket bound here (port picked by the OS, never closed in between: no port race)
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self) -> UvicornThread:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
        self.socket.close()
