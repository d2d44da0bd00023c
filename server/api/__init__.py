"""The OpenAI-compatible HTTP layer: ``create_app(config, engine)`` gives the FastAPI app."""

from server.api.app import create_app

__all__ = ["create_app"]
