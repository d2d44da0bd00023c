"""What the routes share: the config, the async engine, the tokenizer and the metrics of one app."""

from __future__ import annotations

import dataclasses

from server.async_engine import AsyncEngine
from server.config import ServerConfig
from server.engine_api import Tokenizer
from server.metrics import Metrics


@dataclasses.dataclass
class ServingState:
    config: ServerConfig
    engine: AsyncEngine
    tokenizer: Tokenizer
    metrics: Metrics
    model_name: str
    max_model_len: int
