"""``PrefillEngine``: the :class:`~server.runtime.engine.EPEngine` of a prefill instance
(``--disaggregation-mode prefill``).

Each request (it must carry a bootstrap room) runs to its first token only; then its KV blocks stay held, their
prefix-cache entries registered, and the bootstrap server (:mod:`server.disagg.bootstrap`) hands their location and
the first token to the decode instance that asks for the room. The blocks are freed when the decode side says it
has pulled them, when its connection closes (it died or gave up), or after ``disaggregation_timeout_s`` unclaimed;
the frees happen on the engine thread, at the next step. A request that ends without a token (an error, an abort)
fails its room, so the decode side learns why at once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from server.disagg.bootstrap import BootstrapServer
from server.engine_api import KVTransferParams, KVTransferStat, RequestDelta, SamplingParams
from server.runtime.engine import EPEngine
from server.runtime.engine_config import EngineConfig
from server.runtime.kv_layout import kv_layout
from server.runtime.scheduling.block_manager import BlockTable
from server.runtime.scheduling.request import Request


class PrefillEngine(EPEngine):
    """A prefill instance's engine; :attr:`bootstrap` is its bootstrap server (``bootstrap.port``)."""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        cfg = self.config
        try:
            self.bootstrap = BootstrapServer(
                cfg.kv_transfer_host,
                cfg.bootstrap_port,
                kv_layout(cfg, self.model_config),
                cfg.disaggregation_timeout_s,
            )
        except OSError as e:
            self.shutdown()
            raise ValueError(
                f"disaggregation-bootstrap-port: cannot listen on {cfg.kv_transfer_host}:"
                f"{cfg.bootstrap_port} ({e.strerror or e})"
            ) from None
        self._rooms: dict[str, str] = {}  # request id -> bootstrap room, until the request ends
        self._parked: dict[str, tuple[int, BlockTable]] = {}  # room -> (rank, blocks held for the decode side)
        self._sent: list[KVTransferStat] = []

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        transfer: KVTransferParams | None = None,
    ) -> None:
        if transfer is None:
            raise ValueError(
                "bootstrap_room: a prefill instance (--disaggregation-mode prefill) serves only requests "
                "that carry bootstrap fields; send them through python -m server.router"
            )
        super().add_request(request_id, prompt_token_ids, dataclasses.replace(params, max_tokens=1))
        self._rooms[request_id] = transfer.bootstrap_room

    def _end(self, rank: int, req: Request, delta: RequestDelta) -> None:
        room = self._rooms.pop(req.request_id, None)
        if room is None:
            return super()._end(rank, req, delta)
        if not delta.new_token_ids:  # an error or an abort: nothing to hand over
            super()._end(rank, req, delta)
            self.bootstrap.fail(room, delta.error or f"it ended with finish_reason {delta.finish_reason!r}")
            return
        self.schedulers[rank].remove(req, free_blocks=False)
        self._parked[room] = (rank, req.table)
        info = self.workers.infos[rank]
        self.bootstrap.park(
            room,
            {
                "first_token": delta.new_token_ids[0],
                "logprob": None if not delta.logprobs else dataclasses.asdict(delta.logprobs[0]),
                "prompt_logprobs": None
                if delta.prompt_logprobs is None
                else [None if p is None else dataclasses.asdict(p) for p in delta.prompt_logprobs],
                "prompt_ids": req.token_ids[: req.prompt_len],
                "worker": rank,
                "segment": info.kv_segment,
                "bases": info.kv_bases,
                "block_bytes": info.kv_block_bytes,
                "blocks": list(req.table.blocks),
            },
        )

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or self.bootstrap.has_released()

    def step(self) -> list[RequestDelta]:
        for released in self.bootstrap.take_released():
            rank, table = self._parked.pop(released.room)
            self.schedulers[rank].kv.free(table)
            if released.why == "done" and released.tokens:
                self._sent.append(KVTransferStat("send", released.tokens, released.num_bytes, released.seconds))
        deltas = super().step()
        self._stats.kv_transfers, self._sent = self._sent, []
        return deltas

    def disaggregation_info(self) -> dict:
        return {
            "mode": "prefill",
            "bootstrap_host": self.bootstrap.host,
            "bootstrap_port": self.bootstrap.port,
            "transfer_backend": self.config.transfer_backend,
        }

    @property
    def num_parked(self) -> int:
        """Requests whose blocks wait for their decode instance."""
        return len(self._parked)

    def shutdown(self) -> None:
        bootstrap = getattr(self, "bootstrap", None)
        if bootstrap is not None:
            bootstrap.close()
        super().shutdown()
