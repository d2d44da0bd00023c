"""DeepEP's ``Config``: the normal-mode kernels' tuning (SMs, chunk sizes) with DeepEP's checks and buffer size hints.
Here the rows move by the engine's transports, so a Config changes no result and no speed; it is checked as DeepEP
checks it, and its hints are DeepEP's numbers (for code that sizes ``num_nvl_bytes`` / ``num_rdma_bytes`` by them)."""

from __future__ import annotations

import dataclasses

NUM_MAX_NVL_PEERS = 8  # DeepEP's ranks per NVLink domain (a host)
NUM_MAX_TOPK = NUM_MAX_SCALES = 128  # DeepEP's assumptions in the size hints
SOURCE_META_BYTES = 8


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclasses.dataclass
class Config:
    """DeepEP's ``Config(num_sms, num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens,
    num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens)``; raises ValueError where DeepEP asserts
    (the RDMA receive chunk is rounded up to a multiple of the send chunk, as DeepEP does)."""

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if field.name == "num_sms" else 1):
                raise ValueError(
                    f"{field.name}: must be an int >= {0 if field.name == 'num_sms' else 1}, got {value!r}"
                )
        if self.num_max_nvl_chunked_send_tokens >= self.num_max_nvl_chunked_recv_tokens:
            raise ValueError("num_max_nvl_chunked_send_tokens: must be < num_max_nvl_chunked_recv_tokens")
        send = self.num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = _align(self.num_max_rdma_chunked_recv_tokens, send)
        if send >= self.num_max_rdma_chunked_recv_tokens or send > self.num_max_rdma_chunked_recv_tokens // 2:
            raise ValueError("num_max_rdma_chunked_send_tokens: must be <= num_max_rdma_chunked_recv_tokens / 2")

    def _shape(self, num_ranks: int) -> tuple[int, int, int]:
        if not (num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0):
            raise ValueError(f"num_ranks: {num_ranks} must be < {NUM_MAX_NVL_PEERS} or a multiple of it")
        if num_ranks > NUM_MAX_NVL_PEERS and self.num_sms % 2:
            raise ValueError(f"num_sms: {self.num_sms} must be even for more than {NUM_MAX_NVL_PEERS} ranks")
        num_rdma = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
        return num_rdma, min(num_ranks, NUM_MAX_NVL_PEERS), self.num_sms // 2

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's NVLink buffer bytes for rows of ``hidden_bytes`` among ``num_ranks`` (its formula)."""
        num_rdma, num_nvl, channels = self._shape(num_ranks)
        per = channels * num_nvl
        recv = self.num_max_nvl_chunked_recv_tokens
        per_token = hidden_bytes + SOURCE_META_BYTES + NUM_MAX_TOPK * (8 + 4) + NUM_MAX_SCALES * 4
        return _align(per * (2 * num_rdma + 3) * 4 + per * recv * per_token, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's RDMA buffer bytes (0 within one NVLink domain, ``num_ranks <= 8``)."""
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        num_rdma, _, channels = self._shape(num_ranks)
        per, recv = channels * num_rdma, self.num_max_rdma_chunked_recv_tokens
        per_token = hidden_bytes + SOURCE_META_BYTES + NUM_MAX_TOPK * (8 + 4) + NUM_MAX_SCALES * 4 + 16
        return _align(per * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4 + per * recv * per_token * 2, 128)


CONFIGS = {  # num_ranks: DeepEP's (dispatch, combine) Config words after num_sms
    2: ((24, 256, 6, 128), (10, 256, 6, 128)),
    4: ((6, 256, 6, 128), (9, 256, 6, 128)),
    8: ((6, 256, 6, 128), (4, 256, 6, 128)),
    16: ((36, 288, 20, 128), (4, 288, 12, 128)),
    24: ((32, 288, 8, 128), (1, 288, 8, 128)),
    32: ((32, 288, 8, 128), (1, 288, 8, 128)),
    48: ((32, 288, 8, 128), (1, 288, 8, 128)),
    64: ((32, 288, 8, 128), (1, 288, 8, 128)),
    96: ((20, 480, 12, 128), (1, 480, 8, 128)),
    128: ((20, 560, 12, 128), (1, 560, 8, 128)),
    144: ((32, 720, 12, 128), (2, 720, 8, 128)),
    160: ((28, 720, 12, 128), (2, 720, 8, 128)),
}
DISPATCH_CONFIGS = {r: dispatch for r, (dispatch, _) in CONFIGS.items()}
COMBINE_CONFIGS = {r: combine for r, (_, combine) in CONFIGS.items()}


def recommended(table: dict[int, tuple[int, int, int, int]], num_sms: int, num_ranks: int) -> Config:
    """DeepEP's recommended config for ``num_ranks`` (its table; other rank counts raise ValueError, as it asserts)."""
    if num_ranks not in table:
        raise ValueError(
            f"num_ranks: unsupported number of EP ranks {num_ranks}, DeepEP's configs have {sorted(table)}"
        )
    return Config(num_sms, *table[num_ranks])
