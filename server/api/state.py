"""What the routes share: the config, the async engine, the tokenizer and the metrics of one app."""

from __future__ import annotations

import dataclasses
import logging

from pydantic import BaseModel

from server.api.protocol import unknown_fields
from server.async_engine import AsyncEngine
from server.chat_template import ChatTemplate
from server.config import ServerConfig
from server.engine_api import Tokenizer
from server.metrics import Metrics
from server.structured.compiler import GrammarCache

logger = logging.getLogger("server.api")


@dataclasses.dataclass
class ServingState:
    config: ServerConfig
    engine: AsyncEngine
    tokenizer: Tokenizer
    metrics: Metrics
    grammars: GrammarCache  # structured output: grammars compiled for the served tokenizer
    model_name: str
    max_model_len: int
    vocab_size: int | None = None  # None: unknown (token ids are then checked by the engine only)
    chat: ChatTemplate | None = None  # the chat template; None: chat requests are refused with chat_refusal
    chat_refusal: str = ""
    generation_defaults: dict = dataclasses.field(default_factory=dict)  # sampling defaults (generation_config.json)
    warned_fields: set[str] = dataclasses.field(default_factory=set)

    def warn_unknown_fields(self, req: BaseModel) -> None:
        """Log a warning for each request field this server does not know, once per field name (it is ignored)."""
        for name in unknown_fields(req):
            if name not in self.warned_fields:
                self.warned_fields.add(name)
                logger.warning("ignoring the unknown request field %r (this warning is logged once per field)", name)
