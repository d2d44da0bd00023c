"""Sampling on the workers: temperature / top-k / top-p / penalties, per request, and structured output."""
