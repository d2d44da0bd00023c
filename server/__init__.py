"""The serving layer: EP decode runtime, offline ``LLM`` API and the OpenAI-compatible HTTP server."""
