"""``DecodeEngine``: the :class:`~server.runtime.engine.EPEngine` of a decode instance
(``--disaggregation-mode decode``, any ``ep_size``, elastic and EPLB included).

A request (it must carry a bootstrap room) first waits for its prefill instance (:class:`~server.disagg.fetch.Fetch`
asks that instance's bootstrap server, in a thread). Once the answer is in, the least-loaded rank with a free slot
gives it blocks for its whole prompt - its own prefix cache first: only the tokens after a prefix hit are pulled,
the rest of the prompt's KV moves - and its worker reads that KV from the prefill worker's registered cache straight
into those blocks (:class:`~server.disagg.transfer.KVPull`, before the step's forward). The prefill's first token
is delivered at once, and the next step decodes it: the decode instance computes no prompt token. A failed pull
ends the request with an error naming the prefill instance (its blocks leave the prefix cache); an aborted request
closes its bootstrap connection, which frees the prefill side's blocks.
"""

from __future__ import annotations

import collections
import queue
import threading
from typing import Any

from server.disagg.fetch import Fetch
from server.disagg.transfer import KVPull
from server.engine_api import KVTransferParams, KVTransferStat, RequestDelta, SamplingParams, TokenLogprob
from server.runtime.engine import EPEngine
from server.runtime.engine_config import EngineConfig
from server.runtime.kv_layout import kv_layout
from server.runtime.scheduling.plan import StepResult
from server.runtime.scheduling.request import Request, apply_token

IDLE_WAIT_S = 0.02  # with nothing to step, how long step() waits for a prefill instance's answer


def _logprob(data: dict | None) -> TokenLogprob | None:
    if data is None:
        return None
    return TokenLogprob(int(data["token_id"]), float(data["logprob"]), [(int(t), float(p)) for t, p in data["top"]])


class DecodeEngine(EPEngine):
    """A decode instance's engine."""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.layout = kv_layout(self.config, self.model_config)
        self.name = f"decode instance on {self.config.kv_transfer_host} (EP {self.ep_size})"
        self._fetching: dict[str, tuple[Request, Fetch]] = {}  # waiting for the prefill side (or for blocks)
        self._answers: queue.SimpleQueue[tuple[str, dict | str]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._ready: collections.deque[tuple[Request, Fetch, dict]] = collections.deque()  # answered, need blocks
        self._pulling: dict[int, tuple[str, Fetch, int, int]] = {}  # seq id -> (request id, fetch, rank, tokens)
        self._received: list[KVTransferStat] = []

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        transfer: KVTransferParams | None = None,
    ) -> None:
        if transfer is None:
            raise ValueError(
                "bootstrap_room: a decode instance (--disaggregation-mode decode) serves only requests "
                "that carry bootstrap fields; send them through python -m server.router"
            )
        if request_id in self._fetching:
            raise ValueError(f"request_id={request_id!r} is already running")
        req = self._new_request(request_id, prompt_token_ids, params)
        fetch = Fetch(
            request_id,
            transfer.bootstrap_host,
            transfer.bootstrap_port,
            transfer.bootstrap_room,
            self.layout,
            self.name,
            list(prompt_token_ids),
            self.config.disaggregation_timeout_s,
            self._answers,
            self._wakeup,
        )
        self._fetching[request_id] = (req, fetch)

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or bool(self._fetching) or any(s.pulls for s in self.schedulers)

    def step(self) -> list[RequestDelta]:
        deltas = self._abort_fetching() + self._take_answers()
        if not self._requests and not self._inflight and not self._ready and self._fetching:
            self._wakeup.wait(IDLE_WAIT_S)  # nothing to step: wait for an answer rather than spin
            deltas += self._take_answers()
        deltas += super().step()
        self._stats.kv_transfers, self._received = self._received, []
        return deltas

    def _abort_fetching(self) -> list[RequestDelta]:
        deltas = []
        for request_id in [r for r in self._aborts if r in self._fetching]:
            self._aborts.remove(request_id)
            req, fetch = self._fetching.pop(request_id)
            fetch.cancel()
            self._ready = collections.deque(entry for entry in self._ready if entry[0] is not req)
            req.finish_reason = "abort"
            deltas.append(RequestDelta(request_id, [], "", "abort", None, req.prompt_len, 0))
        return deltas

    def _take_answers(self) -> list[RequestDelta]:
        """Move the prefill instances' answers in: errors end their requests; the others get blocks and pulls."""
        self._wakeup.clear()
        deltas = []
        while True:
            try:
                request_id, answer = self._answers.get_nowait()
            except queue.Empty:
                break
            if request_id not in self._fetching:  # aborted meanwhile
                continue
            req, fetch = self._fetching[request_id]
            if isinstance(answer, str):
                del self._fetching[request_id]
                req.finish_reason = "error"
                deltas.append(RequestDelta(request_id, [], "", "error", answer, req.prompt_len, 0))
            else:
                self._ready.append((req, fetch, answer))
        return deltas + self._admit_ready()

    def _admit_ready(self) -> list[RequestDelta]:
        deltas = []
        while self._ready:
            req, fetch, info = self._ready[0]
            placed = self._place(req)
            if placed is None:
                break  # no rank has a slot and the blocks: wait (FIFO)
            rank, num_cached = placed
            self._ready.popleft()
            del self._fetching[req.request_id]
            sched, prompt_len = self.schedulers[rank], req.prompt_len
            prompt_logprobs = info["prompt_logprobs"]
            delta = apply_token(
                req,
                int(info["first_token"]),
                self.max_model_len,
                _logprob(info["logprob"]),
                None if prompt_logprobs is None else [_logprob(p) for p in prompt_logprobs],
            )
            deltas.append(delta)
            if delta.finish_reason is not None:  # done at its first token: nothing to pull
                sched.remove(req)
                fetch.finish(0, 0)
                continue
            req.num_computed = prompt_len
            self._requests[req.request_id] = (rank, req)
            sched.pulls.append(
                KVPull(
                    req.seq_id,
                    f"{info['source']} (worker {info['worker']})",
                    info["segment"],
                    info["bases"],
                    info["block_bytes"],
                    info["blocks"],
                    list(req.table.blocks),
                    num_cached,
                    prompt_len,
                    req.token_ids[:prompt_len],
                    int(info["first_token"]),
                )
            )
            self._pulling[req.seq_id] = (req.request_id, fetch, rank, prompt_len - num_cached)
        return deltas

    def _place(self, req: Request) -> tuple[int, int] | None:
        """Admit ``req`` on the least-loaded live rank that has a slot and the blocks (the longest cached prefix
        first among equals): ``(rank, prompt tokens found cached)``, or None."""
        scheds = self.schedulers
        live = [r for r in range(self.ep_size) if r not in self.workers.lost]
        for rank in sorted(
            live, key=lambda r: (len(scheds[r].running), -len(scheds[r].kv.match_prefix(req.token_ids)[0]))
        ):
            num_cached = scheds[rank].admit_transferred(req)
            if num_cached is not None:
                return rank, num_cached
        return None

    def _apply_results(self, sampling: list[list[Request]], results: list[StepResult | None]) -> list[RequestDelta]:
        deltas = []
        for rank, result in enumerate(results):
            if result is None:  # a lost rank (elastic): its pulls will not come back
                for seq_id in [s for s, entry in self._pulling.items() if entry[2] == rank]:
                    self._pulling.pop(seq_id)[1].cancel()
                continue
            for pulled in result.pulls:
                request_id, fetch, _, tokens = self._pulling.pop(pulled.seq_id)
                if pulled.error is None:
                    fetch.finish(tokens, pulled.num_bytes)
                    self._received.append(KVTransferStat("recv", tokens, pulled.num_bytes, pulled.seconds))
                    continue
                fetch.cancel()
                entry = self._requests.pop(request_id, None)
                if entry is None:
                    continue
                rank_of, req = entry
                self.schedulers[rank_of].kv.forget(req.table)  # its blocks never got their KV
                req.finish_reason, req.num_computed = "error", 0
                delta = RequestDelta(
                    request_id, [], req.detokenizer.text, "error", pulled.error, req.prompt_len, req.num_output
                )
                self._end(rank_of, req, delta)
                deltas.append(delta)
        return deltas + super()._apply_results(sampling, results)

    def disaggregation_info(self) -> dict:
        return {"mode": "decode", "transfer_backend": self.config.transfer_backend}

    def shutdown(self) -> None:
        for _, fetch in getattr(self, "_fetching", {}).values():
            fetch.cancel()
        super().shutdown()
